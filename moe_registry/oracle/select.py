"""The oracle: the one generic engine that turns a situation into a decision with its reasons.

detect scheme (exactly one must match) → bind QuantKeys → test every candidate kernel's declared
constraints → pick by the scheme's preference order (``prefer`` falls back, ``pin`` fails hard).
It imports no kernel code and needs no GPU; building the chosen kernel is in build.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from moe_registry.core.checks import Reason, failed
from moe_registry.core.errors import SelectionError
from moe_registry.oracle.contract import Report
from moe_registry.oracle.detect import detect_scheme
from moe_registry.oracle.downgrades import derive, faithful_first
from moe_registry.oracle.predicates import kernel_checks
from moe_registry.oracle.verdicts import METHOD_FIELD, KernelVerdict, LayerRun, SchemeVerdict, SelectedBy
from moe_registry.situation.describe import expert_modules
from moe_registry.situation.values import Situation
from moe_registry.spec.loader import Registry

EXCLUDED_SCHEME = "unquantized"




def detect(registry: Registry, situation: Situation) -> tuple[SchemeVerdict | None, tuple[SchemeVerdict, ...],
                                                            str | None]:
    """Every scheme's verdict, the one that matched (or None), and a note when the layer was
    excluded from quantization by a scope rule."""
    verdicts = tuple(detect_scheme(loaded.spec, situation.quant_config, situation.modules)
                     for loaded in registry.schemes.values())
    matched = [v for v in verdicts if v.matched]
    if len(matched) > 1:
        names = ", ".join(v.scheme for v in matched)
        raise SelectionError(f"{situation.quant_source}: matches several schemes ({names}); "
                             "their detect rules overlap — make one of them stricter")
    if matched:
        return matched[0], verdicts, None
    excluded = [v for v in verdicts if v.excluded]
    if excluded and EXCLUDED_SCHEME in registry.schemes:
        plain = detect_scheme(registry.scheme(EXCLUDED_SCHEME), None, situation.modules)
        note = f"{excluded[0].scheme} checkpoint, but this layer is excluded: {excluded[0].scope_note}"
        return plain, verdicts, note
    return None, verdicts, None


def select_model(registry: Registry, situation: Situation, *, prefer: str | None = None,
                 pin: str | None = None, raise_on_failure: bool = True) -> Report:
    """``select`` for a whole model (explain). A model whose MoE
    layers are not all decided alike (an excluded layer, GPTQ ``dynamic``, mixed precision) is reported on
    the first layer of its largest run of alike layers; every run is in ``Report.layers`` (one run where all are
    alike: the plan covers the whole model either way); a layer the situation names (``--layer``) is reported
    alone."""
    if len(situation.moe_layers) > 1 and not situation.layer_asked and situation.family in registry.families:
        runs = layer_runs(registry, situation, prefer=prefer, pin=pin)
        if len(runs) == 1:
            return replace(select(registry, situation, prefer=prefer, pin=pin, raise_on_failure=raise_on_failure),
                           layers=runs)
        if len(runs) > 1:
            shown = max(runs, key=lambda r: r.count).first  # max keeps the first of equal runs
            one = _for_layer(registry, situation, shown)
            try:
                report = select(registry, one, prefer=prefer, pin=pin, raise_on_failure=raise_on_failure)
            except SelectionError as err:  # the refusal's report tells of every layer too
                if err.report is not None:  # type: ignore[attr-defined]
                    err.report = replace(err.report, layers=runs)  # type: ignore[attr-defined]
                raise
            return replace(report, layers=runs)
    return select(registry, situation, prefer=prefer, pin=pin, raise_on_failure=raise_on_failure)


def _for_layer(registry: Registry, situation: Situation, layer: int) -> Situation:
    family = registry.families[situation.family or ""].spec
    assert situation.runtime.shape is not None
    return replace(situation, layer=layer, modules=expert_modules(family, layer, situation.runtime.shape.num_experts))


def layer_runs(registry: Registry, situation: Situation, *, prefer: str | None = None,
               pin: str | None = None) -> tuple[LayerRun, ...]:
    """Every MoE layer's decision, consecutive alike layers as one run (same scheme and bindings, kernel, and
    exclusion rule)."""
    runs: list[tuple[Any, LayerRun]] = []
    for layer in situation.moe_layers:
        one = _for_layer(registry, situation, layer)
        report = select(registry, one, prefer=prefer, pin=pin, raise_on_failure=False)
        scheme = report.scheme.scheme if report.scheme is not None else None
        excluded = report.excluded_note
        for module in one.modules:  # the rule, not this layer's module names
            excluded = excluded.replace(module, "its experts") if excluded else excluded
        key = (scheme, tuple(sorted((report.scheme.bindings if report.scheme else {}).items())), report.chosen,
               excluded)
        if runs and runs[-1][0] == key:
            last = runs[-1][1]
            runs[-1] = (key, replace(last, last=layer, count=last.count + 1))
        else:
            runs.append((key, LayerRun(layer, layer, scheme, report.chosen, excluded)))
    return tuple(run for _, run in runs)


def select(registry: Registry, situation: Situation, *, prefer: str | None = None,
           pin: str | None = None, raise_on_failure: bool = True) -> Report:
    """Decide scheme and kernel for the one layer ``situation`` names; the report explains every decision.

    Raises SelectionError (carrying the report) when no scheme or no kernel fits, or when the
    pinned kernel does not fit, unless ``raise_on_failure`` is false.
    """
    scheme_v, verdicts, excluded_note = detect(registry, situation)
    base = Report(situation=situation, schemes=verdicts, scheme=scheme_v, excluded_note=excluded_note,
                  overrides=_overrides(registry))
    if scheme_v is None:
        unclaimed = unclaimed_method(registry, situation)
        if unclaimed is not None:
            base = replace(base, unclaimed=unclaimed)
        if raise_on_failure:
            why = unclaimed or claimants_refusal(situation, verdicts) or "no scheme matches this config"
            raise SelectionError(f"{situation.quant_source}: {why}", base)
        return base
    scheme = registry.scheme(scheme_v.scheme)
    assert scheme_v.weight_key is not None and scheme_v.activation_key is not None
    candidates = list(scheme.kernels)
    for extra in (pin, prefer):
        if extra is not None and extra not in candidates:
            candidates.append(extra)
    verdicts_k = []
    for name in candidates:
        if name not in registry.kernels:
            known = ", ".join(sorted(registry.kernels))
            verdicts_k.append(KernelVerdict(name, False, (failed(
                Reason.NOT_LISTED, "kernel", f"unknown kernel {name!r}; known: {known}"),)))
            continue
        checks = kernel_checks(registry.kernel(name), situation.runtime, scheme_v.weight_key,
                               scheme_v.activation_key, scheme_v.bindings, scheme_v.features,
                               scheme.checkpoint.format, registry.converters)
        if name not in scheme.kernels:
            checks = (failed(Reason.NOT_LISTED, "kernels", f"scheme {scheme.scheme} does not list "
                             f"{name} (it lists {', '.join(scheme.kernels)})"),) + checks
        verdicts_k.append(KernelVerdict(name, all(c.passed for c in checks), checks))
    eligible = [v.kernel for v in verdicts_k if v.eligible]
    by_order = faithful_first(registry, eligible, scheme_v.weight_key, scheme_v.activation_key, situation.runtime,
                              scheme.tolerance)
    if pin is not None:
        report = derive(base.with_kernels(tuple(verdicts_k), pin if pin in eligible else None, SelectedBy.PIN, pin),
                        registry)
        if report.chosen is None:
            if raise_on_failure:
                reasons = "; ".join(c.message for c in report.verdict(pin).failures)  # type: ignore[union-attr]
                raise SelectionError(f"pinned kernel {pin} cannot run this: {reasons}", report)
            return report
    elif prefer is not None:
        report = (base.with_kernels(tuple(verdicts_k), prefer, SelectedBy.PREFER, prefer) if prefer in eligible
                  else base.with_kernels(tuple(verdicts_k), by_order, SelectedBy.FALLBACK, prefer))
    else:
        report = base.with_kernels(tuple(verdicts_k), by_order, SelectedBy.PREFERENCE, None)
    if pin is None:
        report = derive(report, registry)
    chosen = report.chosen
    if situation.not_runnable and raise_on_failure:  # the kernels fit the shape, not the model's experts
        raise SelectionError(f"{situation.model}: family {situation.family}: not run here: "
                             f"{'; '.join(situation.not_runnable)}", report)
    if chosen is None and raise_on_failure:
        raise SelectionError(f"no kernel of scheme {scheme.scheme} can run on {situation.runtime.platform}: "
                             + "; ".join(f"{v.kernel}: {v.failures[0].message}" for v in verdicts_k), report)
    return report


def claimed_methods(registry: Registry) -> set[str]:
    """Every ``quant_method`` some scheme's detect rules accept (lower case)."""
    out: set[str] = set()
    for loaded in registry.schemes.values():
        detect = loaded.spec.detect
        for rules in (detect.fields, *detect.any_of):
            rule = rules.get(METHOD_FIELD)
            if rule is not None:
                values = [rule.equals] if rule.has_equals else list(rule.one_of or [])
                out |= {str(v).lower() for v in values}
    return out


def unclaimed_method(registry: Registry, situation: Situation) -> str | None:
    """The refusal for a config whose ``quant_method`` no scheme spec claims (HQQ, bitsandbytes, ...): then the
    other schemes' near misses are not near at all, and the method is what to name."""
    config = situation.quant_config
    method = config.get(METHOD_FIELD) if config is not None else None
    claimed = claimed_methods(registry)
    if not isinstance(method, str) or method.lower() in claimed:
        return None
    return (f"quant_method {method!r}: no scheme spec claims it, so nothing here runs it (the specs claim "
            f"{', '.join(sorted(claimed))}; a scheme spec for it, with --spec-dir, would)")


def claimants_refusal(situation: Situation, verdicts: Sequence[SchemeVerdict]) -> str | None:
    """The refusal for a config whose quant_method some scheme claims although none matches (another packing,
    bit width or symmetry of a known method): it names the method and what its nearest claimant wanted, which
    is the line a user can act on, rather than the nearest miss of an unrelated method."""
    config = situation.quant_config
    method = config.get(METHOD_FIELD) if config is not None else None
    claimants = sorted((v for v in verdicts if v.claims_method and not v.excluded),
                       key=lambda v: (len(v.failures), -len(v.checks), v.scheme))
    if not isinstance(method, str) or not claimants:
        return None
    nearest = claimants[0]
    more = len(claimants) - 1
    others = (f" ({more} other scheme{' claims' if more == 1 else 's claim'} it too, --verbose lists "
              f"{'it' if more == 1 else 'them'})") if more else ""
    return (f"quant_method {method!r}: no scheme matches this config; the nearest scheme claiming it, "
            f"{nearest.scheme}, turns it down: {' / '.join(c.message for c in nearest.failures)}{others}")


def _overrides(registry: Registry) -> tuple[str, ...]:
    out = []
    for kind, table in (("scheme", registry.schemes), ("kernel", registry.kernels), ("family", registry.families)):
        for name, loaded in table.items():
            if loaded.overrides:
                out.append(f"{kind} {name} from {loaded.path} overrides {loaded.overrides}")
            elif not loaded.builtin:
                out.append(f"{kind} {name} added by {loaded.path}")
    return tuple(out)
