"""Rendering the oracle's report (chosen kernel, other eligible ones, rejected ones with reasons,
the scheme-detection trace) as aligned text, JSON and Markdown.

Text and Markdown read one row list (``rows``), so a new line in the report is one append there.
Turned-down schemes are many and mostly obvious: by default every format shows their count and
the nearest few (fewest failed checks); ``verbose`` shows them all.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any, Protocol

from moe_registry.core.checks import Check
from moe_registry.oracle.verdicts import Downgrade, KernelVerdict, LayerRun, SchemeVerdict, SelectedBy
from moe_registry.situation.values import RoutingValue, Situation


class ReportView(Protocol):
    """What rendering reads of a report (``oracle.contract.Report`` is one): named here, so this module needs
    the verdicts only and the report can print itself through it."""

    situation: Situation
    scheme: SchemeVerdict | None
    excluded_note: str | None
    kernels: tuple[KernelVerdict, ...]
    chosen: str | None
    selected_by: SelectedBy | None
    requested: str | None
    overrides: tuple[str, ...]
    unclaimed: str | None
    layers: tuple[LayerRun, ...]
    downgrades: tuple[Downgrade, ...]

    @property
    def notes(self) -> tuple[str, ...]: ...

    def turned_down(self) -> list[SchemeVerdict]: ...

    def shown_turned_down(self, verbose: bool) -> list[SchemeVerdict]: ...


TEXT_WIDTH = 100  # text output wraps reasons to stay within this many characters
DOWNGRADE_LABELS = {"compute-dtype": "compute", "slow-path": "slow path"}  # text rows; activation: "emulation"


def wrap(text: str, width: int, indent: int) -> list[str]:
    """``text`` cut at spaces into lines of at most ``width`` characters after an ``indent``
    (a single word longer than that, e.g. a path, stays whole)."""
    return textwrap.wrap(text, max(width - indent, 20), break_long_words=False, break_on_hyphens=False) or [""]


def _md(text: object) -> str:
    """A Markdown table cell: pipes escaped, line breaks as <br>."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")



def _status(report: ReportView, k: KernelVerdict) -> str:
    return "chosen" if k.kernel == report.chosen else ("eligible" if k.eligible else "rejected")

def _turned_down_reason(v: SchemeVerdict) -> str:
    if v.excluded:
        return f"matches, but {v.scope_note} (layer left unquantized)"
    return v.failures[0].message if v.failures else "not matched"

def head_rows(report: ReportView) -> list[tuple[str, str]]:
    """The report's head as (label, value) rows: situation, decision, notes, overrides."""
    s = report.situation
    rt = s.runtime
    p = rt.parallel
    rows = []
    if s.model:
        layer = f", layer {s.layer}" if s.layer is not None else ""
        if len(report.layers) > 1:
            layer += f" of {len(s.moe_layers)} MoE layers, which differ: see layers"
        elif report.layers:
            layer += f" of {len(s.moe_layers)} MoE layers, all alike"
        rows.append(("model", f"{s.model} ({s.family or 'unknown family'}{layer})"))
        rows += layer_rows(report)
    plat = platform_text(rt.platform)
    placement = f" placement={p.expert_placement}" if p.ep > 1 else ""
    rows.append(("runtime", f"{plat}, {rt.dtype}, tp={p.tp} ep={p.ep} dp={p.dp} all2all={p.all2all}{placement}"))
    if rt.shape is not None:
        sh = rt.shape
        local = rt.local_shape()
        assert local is not None
        rows.append(("shape", f"{sh.num_experts} experts (local {local.num_experts}), top-{sh.top_k}, "
                              f"hidden {sh.hidden}, intermediate {sh.intermediate} "
                              f"(per rank {local.intermediate}), {sh.activation}"
                              + (", expert bias" if sh.has_bias else "")))
        if sh.shared_experts:
            rows.append(("shared", f"{sh.shared_experts} x {sh.shared_intermediate} (dense MLP, not run here)"))
    rows += routing_rows(s.routing)
    rows += [("not run", why) for why in s.not_runnable]
    rows.append(("config", s.quant_source))
    if report.scheme is not None:
        v = report.scheme
        rows += [("scheme", v.scheme), ("weight", str(v.weight_key)), ("activation", str(v.activation_key))]
        rows += [("emulation", d.message) for d in report.downgrades if d.kind.value == "activation"]
        if v.bindings:
            rows.append(("bindings", ", ".join(f"{k}={val}" for k, val in v.bindings.items())))
        if v.scope_note:
            rows.append(("scope", v.scope_note))
    else:
        rows.append(("scheme", "none matched" + (f": {report.unclaimed}" if report.unclaimed else "")))
    if report.excluded_note:
        rows.append(("excluded", report.excluded_note))
    if report.scheme is not None:
        rows.append(("kernel", report.chosen or "none eligible"))
        rows += [(DOWNGRADE_LABELS[d.kind.value], d.message) for d in report.downgrades if d.kind.value != "activation"]
    rows += [("note", n) for n in report.notes]
    rows += [("override", o) for o in report.overrides]
    return rows

def _routing_text(v: RoutingValue, values: dict[str, Any]) -> str:
    """One routing value in words (without its source)."""
    w, x = v.word, v.value
    yes = "yes" if x else "no"
    if w == "group_score":
        how = {"max": "a group's best score", "top2_sum": "the sum of a group's best two scores"}.get(str(x), str(x))
        return f"group score {x} ({how}{', biased' if values.get('correction_bias') else ''})"
    if w == "renormalize" and not isinstance(x, bool):
        return f"renormalise by the {x}-norm of the kept weights"
    if w == "router_weight_on_input":
        return f"router weight on the {'input' if x else 'output'}"
    words = {"scoring": f"scoring {x}", "top_k": f"top-k {x}", "num_expert_group": f"expert groups {x}",
             "topk_group": f"group top-k {x}",
             "correction_bias": f"correction bias {yes}" + (" (added to the scores for selection only)" if x else ""),
             "renormalize": f"renormalise {yes}" + (" (the kept weights sum to 1)" if x else ""),
             "routed_scaling_factor": f"routed scaling factor {x}", "shared_experts": f"shared experts {x}",
             "shared_intermediate": f"shared expert size {x}",
             "shared_expert_gate": f"shared expert gate {yes}" + (" (sigmoid, per token)" if x else "")}
    return words.get(w, f"{w} {x}")


_ROUTING_ORDER = ("scoring", "top_k", "num_expert_group", "topk_group", "group_score", "correction_bias",
                  "renormalize", "routed_scaling_factor", "router_weight_on_input", "shared_experts",
                  "shared_intermediate", "shared_expert_gate")


def routing_rows(routing: tuple[RoutingValue, ...]) -> list[tuple[str, str]]:
    """The model's routing, one value a row with its source; grouped top-k only when there are groups,
    the shared experts' size and gate only when there are some."""
    values = {v.word: v.value for v in routing}
    hidden = set()
    if values.get("num_expert_group", 1) == 1:
        hidden |= {"num_expert_group", "topk_group", "group_score"}
    if not values.get("shared_experts"):  # the shape row says so already (no "shared" row)
        hidden |= {"shared_experts", "shared_intermediate", "shared_expert_gate"}
    rank = {w: i for i, w in enumerate(_ROUTING_ORDER)}
    shown = sorted((v for v in routing if v.word not in hidden), key=lambda v: rank.get(v.word, len(rank)))
    return [("routing" if i == 0 else "", f"{_routing_text(v, values)} [{v.source}]") for i, v in enumerate(shown)]

# the head's rows that describe the situation and the decision; every other row (not run, excluded, emulation,
# note, override, downgrades) says something differs from what was asked, and run prints it beside its summary
SITUATION_LABELS = frozenset({"model", "layers", "runtime", "shape", "shared", "routing", "config", "scheme", "weight",
                              "activation", "bindings", "scope", "kernel", ""})


def layer_rows(report: ReportView) -> list[tuple[str, str]]:
    """One row per run of alike MoE layers: ``layers 1-47  awq-w4a16  triton-fused-moe`` (and the rule that
    excluded a run); none when every layer is decided alike (the head says so)."""
    runs = report.layers
    if len(runs) < 2:
        return []
    sw = max(len(r.span) for r in runs)
    cw = max(len(r.scheme or "no scheme") for r in runs)
    return [("layers" if i == 0 else "",
             f"{r.span.ljust(sw)}  {(r.scheme or 'no scheme').ljust(cw)}  {r.kernel or 'no kernel'}"
             + (f" (excluded: {r.excluded})" if r.excluded else ""))
            for i, r in enumerate(runs)]


def platform_text(platform: Any) -> str:
    """``cuda:9.0 (NVIDIA H100 80GB HBM3)``; the device name only where it adds something (not ``cpu (cpu)``)."""
    name = platform.name
    return str(platform) + (f" ({name})" if name and name != str(platform) else "")


def summary_line(report: ReportView) -> str:
    """One line: scheme, kernel, platform and dtype, the layer and model (run prints it instead of the report)."""
    s = report.situation
    rt = s.runtime
    scheme = report.scheme.scheme if report.scheme is not None else "no scheme"
    where = f"layer {s.layer} of {s.model} ({s.family})" if s.layer is not None else str(s.model)
    p = rt.parallel
    parallel = "".join(f", {k}={v}" for k, v in (("tp", p.tp), ("ep", p.ep)) if v > 1)
    return (f"{scheme} on {report.chosen or 'no kernel'} ({platform_text(rt.platform)}, {rt.dtype}{parallel}), "
            f"{where}; --verbose prints the whole report")


def notice_rows(report: ReportView) -> list[tuple[str, str]]:
    """The head's rows that say what differs from what was asked (run prints them under its summary)."""
    return [(label, value) for label, value in head_rows(report) if label not in SITUATION_LABELS]

# ------------------------------------------------------------ JSON

def to_dict(report: ReportView, verbose: bool = False) -> dict[str, Any]:
    """Plain data. Without ``verbose`` the kernels' passed checks and all but the nearest
    turned-down schemes are left out (``schemes_turned_down`` counts them all)."""
    s = report.situation
    rt = s.runtime
    shape = rt.shape

    def checks(cs: tuple[Check, ...]) -> list[dict[str, Any]]:
        return [c.to_dict() for c in cs if verbose or not c.passed]

    shown = ([report.scheme] if report.scheme is not None else []) + report.shown_turned_down(verbose)
    return {
        "model": s.model, "family": s.family, "layer": s.layer, "quant_source": s.quant_source,
        "layers": [r.to_dict() for r in report.layers],
        "runtime": {
            "platform": str(rt.platform), "device_name": rt.platform.name, "dtype": rt.dtype,
            "tp": rt.parallel.tp, "ep": rt.parallel.ep, "dp": rt.parallel.dp,
            "all2all": rt.parallel.all2all, "expert_placement": rt.parallel.expert_placement,
            "max_tokens": rt.max_tokens,
            "shape": None if shape is None else {
                "num_experts": shape.num_experts, "top_k": shape.top_k, "hidden": shape.hidden,
                "intermediate": shape.intermediate, "activation": shape.activation,
                "has_bias": shape.has_bias},
        },
        "scheme": None if report.scheme is None else {
            "name": report.scheme.scheme, "weight_key": str(report.scheme.weight_key),
            "activation_key": str(report.scheme.activation_key),
            "checkpoint_activation_key": (None if report.scheme.checkpoint_activation_key is None
                                          else str(report.scheme.checkpoint_activation_key)),
            "emulation": report.scheme.emulation_note,
            "bindings": dict(report.scheme.bindings), "features": dict(report.scheme.features),
            "scope": report.scheme.scope_note},
        "excluded": report.excluded_note,
        "chosen_kernel": report.chosen,
        "selected_by": report.selected_by.value if report.selected_by else None, "requested": report.requested,
        "eligible_kernels": [k.kernel for k in report.kernels if k.eligible],
        "kernels": [{"kernel": k.kernel, "eligible": k.eligible, "chosen": k.kernel == report.chosen,
                     "checks": checks(k.checks)} for k in report.kernels],
        "schemes": [{"scheme": v.scheme, "matched": v.matched, "excluded": v.excluded,
                     "checks": checks(v.checks) if not v.matched else [c.to_dict() for c in v.checks]}
                    for v in shown],
        "schemes_turned_down": len(report.turned_down()), "unclaimed": report.unclaimed,
        "notes": list(report.notes), "downgrades": [d.to_dict() for d in report.downgrades],
        "spec_overrides": list(report.overrides),
        "not_runnable": list(s.not_runnable),
        "routing": {v.word: v.to_dict() for v in s.routing},
    }

def to_json(report: ReportView, verbose: bool = False, indent: int | None = None) -> str:
    return json.dumps(to_dict(report, verbose), indent=indent)

# ------------------------------------------------------------ text

def to_text(report: ReportView, verbose: bool = False, width: int = TEXT_WIDTH) -> str:
    """Aligned text, no line longer than ``width`` (except single words that are)."""
    rows = head_rows(report)
    lw = max(len(k) for k, _ in rows)
    lines = []
    for label, value in rows:
        for i, part in enumerate(wrap(value, width, lw + 2)):
            lines.append(f"{(label if i == 0 else '').ljust(lw)}  {part}".rstrip())
    if report.kernels:
        lines += ["", "kernels, in the scheme's order of preference:"]
        kw = max(len(k.kernel) for k in report.kernels)
        indent = 4 + kw + 2 + 8 + 2
        for k in report.kernels:
            mark = "+" if k.eligible else "-"
            reasons = [c.message for c in k.failures] or ["all constraints met"]
            first = True
            for reason in reasons:
                for part in wrap(reason, width, indent):
                    if first:
                        lines.append(f"  {mark} {k.kernel.ljust(kw)}  {_status(report, k):<8}  {part}")
                        first = False
                    else:
                        lines.append(f"{''.ljust(indent)}{part}")
    rest = report.turned_down()
    if rest:
        shown = report.shown_turned_down(verbose)
        more = "" if len(shown) == len(rest) else f"; the {len(shown)} nearest shown, --verbose lists all"
        if not shown:
            more = "; none claims this quant_method, --verbose lists all"
        lines += ["", f"schemes turned down ({len(rest)}{more}){':' if shown else ''}"]
        sw = max((len(v.scheme) for v in shown), default=0)
        indent = 4 + sw + 2
        for v in shown:
            for i, part in enumerate(wrap(_turned_down_reason(v), width, indent)):
                lines.append(f"  - {v.scheme.ljust(sw)}  {part}" if i == 0 else f"{''.ljust(indent)}{part}")
    return "\n".join(lines)

# ------------------------------------------------------------ Markdown

def to_markdown(report: ReportView, verbose: bool = False) -> str:
    """Markdown tables; every cell escaped so a ``|`` in a reason cannot break a table."""
    code = {"scheme", "weight", "activation", "kernel"}
    lines = ["| | |", "| --- | --- |"]
    for k, v in head_rows(report):
        cell = f"`{_md(v)}`" if k in code and v not in ("none matched", "none eligible") else _md(v)
        lines.append(f"| {k} | {cell} |")
    if report.kernels:
        lines += ["", "| kernel | status | reasons |", "| --- | --- | --- |"]
        for k in report.kernels:
            why = "<br>".join(_md(c.message) for c in k.failures) or "all constraints met"
            lines.append(f"| `{_md(k.kernel)}` | {_status(report, k)} | {why} |")
    rest = report.turned_down()
    shown = report.shown_turned_down(verbose)
    lines += ["", "| scheme | matched | first reason |", "| --- | --- | --- |"]
    if report.scheme is not None:
        lines.append(f"| `{_md(report.scheme.scheme)}` | yes | matched |")
    for v in shown:
        lines.append(f"| `{_md(v.scheme)}` | no | {_md(_turned_down_reason(v))} |")
    if len(shown) < len(rest):
        lines += ["", f"{len(rest) - len(shown)} more schemes turned down (`--verbose` lists them)."]
    return "\n".join(lines)
