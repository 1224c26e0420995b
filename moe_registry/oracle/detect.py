"""Scheme detection: per-layer scoping of a quantization_config, detect rules, and bindings.

This is half of the oracle (the other half, kernel predicates, is in predicates.py). It is
generic: every scheme is handled by the same code reading its spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_registry.core.checks import Check, Reason, failed, passed
from moe_registry.core.guards import same_value
from moe_registry.core.keys import parse_quant_key
from moe_registry.oracle.scope_index import gptq_dynamic_sign, pattern_index
from moe_registry.oracle.verdicts import SchemeVerdict
from moe_registry.spec.fields import MISSING, check_field, get_path
from moe_registry.spec.loader import fill_template
from moe_registry.spec.view import BindRule, SchemeSpec, ScopeRule

# ---------------------------------------------------------------- per-layer scope


@dataclass(frozen=True)
class ScopeOutcome:
    """The layer's effective config; ``excluded`` when a rule said the layer is not quantized."""

    config: Mapping[str, Any] | None
    excluded: bool = False
    note: str | None = None
    claimed: bool = False  # an `only` rule that claims excluded it: the config is this scheme's dialect


def _merge(base: Mapping[str, Any], into: str | None, value: Mapping[str, Any], *,
           replace: bool = False) -> dict[str, Any]:
    """``base`` with ``value`` merged over (``replace``: put in place of) the subtree at ``into``."""
    if into is None:
        return dict(value) if replace else {**base, **value}
    out = dict(base)
    head, _, rest = into.partition(".")
    sub = base.get(head)
    out[head] = _merge(sub if isinstance(sub, Mapping) else {}, rest or None, value, replace=replace)
    return out


def _ct_group(groups: Mapping[str, Any], module: str, types: Sequence[str]) -> str | None:
    """The compressed-tensors config group whose ``targets`` match ``module`` (its name is free: llm-compressor
    names groups after recipes as well as group_0, group_1 ...)."""
    for name, body in groups.items():
        targets = body.get("targets") if isinstance(body, Mapping) else None
        if isinstance(targets, list | str) and pattern_index(targets, "ct-target", types).first(module) is not None:
            return str(name)
    return None


def apply_scope(config: Mapping[str, Any] | None, rules: Sequence[ScopeRule],
                module: str) -> ScopeOutcome:
    """Apply the first matching scope rule for ``module`` (an expert projection's full name)."""
    if config is None:
        return ScopeOutcome(None)
    for rule in rules:
        source = get_path(config, rule.from_)
        if source is MISSING or source is None:
            continue
        if rule.kind in ("only", "exclude"):
            hit = pattern_index(source, rule.match, rule.types).first(module)
            if rule.kind == "only" and hit is None:
                return ScopeOutcome(None, True, f"{module} is not listed in {rule.from_}", claimed=rule.claims)
            if rule.kind == "exclude" and hit is not None:
                return ScopeOutcome(None, True, f"{rule.from_} entry {hit!r} matches {module}")
            continue
        if not isinstance(source, Mapping):
            continue
        if rule.match == "ct-group":
            group = _ct_group(source, module, rule.types)
            if group is None or rule.into is None or get_path(config, rule.into) is source.get(group):
                continue  # no group targets it, or it is already the one the detect rules read
            return ScopeOutcome(_merge(config, rule.into, source[group], replace=True), False,
                                f"{rule.from_} entry {group!r} targets {module} (read as {rule.into})")
        index = pattern_index(source, rule.match, rule.types)
        values = list(source.values())
        for i in index.matching(module):
            p, value = index.entries[i], values[i]
            if rule.match == "gptq-dynamic" and gptq_dynamic_sign(p, module) == "-":
                return ScopeOutcome(None, True, f"{rule.from_} entry {p!r} excludes {module}")
            if not isinstance(value, Mapping):
                continue
            where = rule.into or "the top level"
            return ScopeOutcome(_merge(config, rule.into, value), False,
                                f"{rule.from_} entry {p!r} applies to {module} (merged into {where})")
    return ScopeOutcome(config)


# ---------------------------------------------------------------- detection and binding




def _detect(config: Mapping[str, Any] | None, scheme: SchemeSpec) -> list[Check]:
    checks = [check_field(config, path, rule) for path, rule in scheme.detect.fields.items()]
    if scheme.detect.any_of:
        tried = []
        for alt in scheme.detect.any_of:
            alt_checks = [check_field(config, p, r) for p, r in alt.items()]
            if all(c.passed for c in alt_checks):
                checks += alt_checks
                break
            tried.append(next(c for c in alt_checks if not c.passed).message)
        else:
            checks.append(failed(Reason.NO_ALTERNATIVE, "any_of",
                                 "no alternative matched: " + " | ".join(tried)))
    return checks


def _bind(config: Mapping[str, Any] | None, name: str, rule: BindRule) -> tuple[Any, Check]:
    if rule.value is not None:
        return rule.value, passed(f"${name}", f"${name} = {rule.value!r}")
    value, used = MISSING, rule.from_ or ""
    for candidate in [rule.from_, *rule.aliases]:
        value = get_path(config, candidate or "")
        if value is not MISSING:
            used = candidate or ""
            break
    if value is MISSING or value is None:
        if rule.default is None:
            return None, failed(Reason.BIND_MISSING, used, f"{used} is missing (needed for ${name})")
        value = rule.default
    if rule.map is not None:
        if str(value) not in rule.map:
            return None, failed(Reason.BIND_VALUE, used, f"{used} = {value!r}; wanted one of "
                                + ", ".join(rule.map), seen=value, wanted=list(rule.map))
        value = rule.map[str(value)]
    if rule.one_of is not None and not any(same_value(value, v) for v in rule.one_of):  # 64.0 is not 64
        return None, failed(Reason.BIND_VALUE, used, f"{used} = {value!r}; wanted one of "
                            + ", ".join(repr(v) for v in rule.one_of), seen=value, wanted=rule.one_of)
    return value, passed(used, f"${name} = {value!r} (from {used})", seen=value)


def detect_scheme(scheme: SchemeSpec, config: Mapping[str, Any] | None,
                  modules: Sequence[str]) -> SchemeVerdict:
    """Scope the config to the layer's expert projections, test detect rules, bind values."""
    outcomes = [apply_scope(config, scheme.scope, m) for m in modules]
    first = outcomes[0] if outcomes else ScopeOutcome(config)
    if any(o.excluded != first.excluded or o.config != first.config for o in outcomes[1:]):
        notes = "; ".join(o.note or f"{m}: global config" for o, m in zip(outcomes, modules, strict=False))
        return SchemeVerdict(scheme.scheme, False, (failed(
            Reason.LAYER_OVERRIDE, "scope",
            f"the layer's projections are quantized differently ({notes}); a fused MoE needs one scheme"),))
    if first.excluded:
        checks = _detect(config, scheme)
        note = first.note or "excluded"
        checks.append(failed(Reason.LAYER_EXCLUDED, "scope", f"layer not quantized: {note}"))
        owned = first.claimed or all(c.passed for c in checks[:-1])
        return SchemeVerdict(scheme.scheme, False, tuple(checks), excluded=owned, scope_note=note)
    checks = _detect(first.config, scheme)
    if first.note:
        checks.insert(0, passed("scope", first.note))
    if not all(c.passed for c in checks):
        return SchemeVerdict(scheme.scheme, False, tuple(checks), scope_note=first.note)
    bindings: dict[str, Any] = {}
    for name, rule in scheme.bind.items():
        value, check = _bind(first.config, name, rule)
        checks.append(check)
        if check.passed:
            bindings[name] = value
    if not all(c.passed for c in checks):
        return SchemeVerdict(scheme.scheme, False, tuple(checks), scope_note=first.note)
    weight = parse_quant_key(fill_template(scheme.weight, bindings))
    activation = parse_quant_key(fill_template(scheme.run_activation, bindings))
    features = {name: (v if isinstance(v, bool) else fill_template(v, bindings) == "true")
                for name, v in scheme.features.items()}
    emulated = None if scheme.emulation is None else parse_quant_key(fill_template(scheme.activation, bindings))
    return SchemeVerdict(scheme.scheme, True, tuple(checks), False, first.note, bindings, weight,
                         activation, features, emulated, scheme.emulation.reason if scheme.emulation else None)
