"""The oracle's report: chosen kernel, other eligible ones, rejected ones with reasons, and the
scheme-detection trace; rendered as aligned text, JSON and Markdown."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from moe_registry.checks import Check

if TYPE_CHECKING:
    from moe_registry.match import SchemeVerdict
    from moe_registry.oracle import Situation


@dataclass(frozen=True)
class KernelVerdict:
    """One candidate kernel and every check run on it."""

    kernel: str
    eligible: bool
    checks: tuple[Check, ...]

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True)
class Report:
    """Everything the oracle decided for one layer, and why."""

    situation: Situation
    schemes: tuple[SchemeVerdict, ...]
    scheme: SchemeVerdict | None
    excluded_note: str | None = None
    kernels: tuple[KernelVerdict, ...] = ()
    chosen: str | None = None
    notes: tuple[str, ...] = ()
    overrides: tuple[str, ...] = field(default=())

    def with_kernels(self, kernels: tuple[KernelVerdict, ...], chosen: str | None,
                     notes: tuple[str, ...]) -> Report:
        return replace(self, kernels=kernels, chosen=chosen, notes=notes)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        s = self.situation
        rt = s.runtime
        shape = rt.shape
        return {
            "model": s.model, "family": s.family, "layer": s.layer, "quant_source": s.quant_source,
            "runtime": {
                "platform": str(rt.platform), "device_name": rt.platform.name, "dtype": rt.dtype,
                "tp": rt.parallel.tp, "ep": rt.parallel.ep, "dp": rt.parallel.dp,
                "all2all": rt.parallel.all2all, "max_tokens": rt.max_tokens,
                "shape": None if shape is None else {
                    "num_experts": shape.num_experts, "top_k": shape.top_k, "hidden": shape.hidden,
                    "intermediate": shape.intermediate, "activation": shape.activation,
                    "has_bias": shape.has_bias},
            },
            "scheme": None if self.scheme is None else {
                "name": self.scheme.scheme, "weight_key": str(self.scheme.weight_key),
                "activation_key": str(self.scheme.activation_key),
                "bindings": dict(self.scheme.bindings), "features": dict(self.scheme.features),
                "scope": self.scheme.scope_note},
            "excluded": self.excluded_note,
            "chosen_kernel": self.chosen,
            "eligible_kernels": [k.kernel for k in self.kernels if k.eligible],
            "kernels": [{"kernel": k.kernel, "eligible": k.eligible, "chosen": k.kernel == self.chosen,
                         "checks": [c.to_dict() for c in k.checks]} for k in self.kernels],
            "schemes": [{"scheme": v.scheme, "matched": v.matched, "excluded": v.excluded,
                         "checks": [c.to_dict() for c in v.checks]} for v in self.schemes],
            "notes": list(self.notes), "spec_overrides": list(self.overrides),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    # ------------------------------------------------------------ text

    def _header(self) -> list[tuple[str, str]]:
        s = self.situation
        rt = s.runtime
        p = rt.parallel
        rows = []
        if s.model:
            layer = f", layer {s.layer}" if s.layer is not None else ""
            rows.append(("model", f"{s.model} ({s.family or 'unknown family'}{layer})"))
        plat = str(rt.platform) + (f" ({rt.platform.name})" if rt.platform.name else "")
        rows.append(("runtime", f"{plat}, {rt.dtype}, tp={p.tp} ep={p.ep} dp={p.dp} all2all={p.all2all}"))
        if rt.shape is not None:
            sh = rt.shape
            local = rt.local_shape()
            assert local is not None
            rows.append(("shape", f"{sh.num_experts} experts (local {local.num_experts}), top-{sh.top_k}, "
                                  f"hidden {sh.hidden}, intermediate {sh.intermediate} "
                                  f"(per rank {local.intermediate}), {sh.activation}"
                                  + (", expert bias" if sh.has_bias else "")))
        rows.append(("config", s.quant_source))
        return rows

    def to_text(self) -> str:
        lines = []
        head = self._header()
        if self.scheme is not None:
            v = self.scheme
            head += [("scheme", v.scheme), ("weight", str(v.weight_key)), ("activation", str(v.activation_key))]
            if v.bindings:
                head.append(("bindings", ", ".join(f"{k}={val}" for k, val in v.bindings.items())))
            if v.scope_note:
                head.append(("scope", v.scope_note))
        else:
            head.append(("scheme", "none matched"))
        if self.excluded_note:
            head.append(("excluded", self.excluded_note))
        if self.scheme is not None:
            head.append(("kernel", self.chosen or "none eligible"))
        width = max(len(k) for k, _ in head)
        lines += [f"{k.ljust(width)}  {val}" for k, val in head]
        for note in self.notes:
            lines.append(f"{'note'.ljust(width)}  {note}")
        for o in self.overrides:
            lines.append(f"{'override'.ljust(width)}  {o}")
        if self.kernels:
            lines += ["", "kernels, in the scheme's order of preference:"]
            kw = max(len(k.kernel) for k in self.kernels)
            for k in self.kernels:
                status = "chosen" if k.kernel == self.chosen else ("eligible" if k.eligible else "rejected")
                mark = "+" if k.eligible else "-"
                first = k.failures[0].message if k.failures else "all constraints met"
                lines.append(f"  {mark} {k.kernel.ljust(kw)}  {status:<8}  {first}")
                for extra in k.failures[1:]:
                    lines.append(f"    {''.ljust(kw)}  {'':<8}  {extra.message}")
        turned_down = [v for v in self.schemes if self.scheme is None or v.scheme != self.scheme.scheme]
        if turned_down:
            lines += ["", "schemes turned down:"]
            sw = max(len(v.scheme) for v in turned_down)
            for v in turned_down:
                msg = v.failures[0].message if v.failures else "not matched"
                if v.excluded:
                    msg = f"matches, but {v.scope_note} (layer left unquantized)"
                lines.append(f"  - {v.scheme.ljust(sw)}  {msg}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        lines = ["| | |", "| --- | --- |"]
        rows = self._header()
        if self.scheme is not None:
            rows += [("scheme", f"`{self.scheme.scheme}`"), ("weight", f"`{self.scheme.weight_key}`"),
                     ("activation", f"`{self.scheme.activation_key}`")]
        rows.append(("kernel", f"`{self.chosen}`" if self.chosen else "none"))
        lines += [f"| {k} | {v} |" for k, v in rows]
        for note in self.notes + ((self.excluded_note,) if self.excluded_note else ()):
            lines.append(f"| note | {note} |")
        if self.kernels:
            lines += ["", "| kernel | status | reasons |", "| --- | --- | --- |"]
            for k in self.kernels:
                status = "chosen" if k.kernel == self.chosen else ("eligible" if k.eligible else "rejected")
                why = "<br>".join(c.message for c in k.failures) or "all constraints met"
                lines.append(f"| `{k.kernel}` | {status} | {why} |")
        lines += ["", "| scheme | matched | first reason |", "| --- | --- | --- |"]
        for v in self.schemes:
            why = v.failures[0].message if v.failures else "matched"
            lines.append(f"| `{v.scheme}` | {'yes' if v.matched else 'no'} | {why} |")
        return "\n".join(lines)
