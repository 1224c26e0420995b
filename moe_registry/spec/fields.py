"""How a spec's field rule reads a config: a dotted path (with aliases) looked up in a JSON object, and a
``FieldRule`` (equals / one_of / range / present, with a default and a case rule) tested against what is
there. Scheme detection, family ``requires`` and the situation's readers all read fields this way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_registry.core.checks import Check, Reason, failed, passed
from moe_registry.spec.view import FieldRule

MISSING = object()  # get_path's answer for a path the config does not have (None is a value)


def get_path(config: Mapping[str, Any] | None, path: str) -> Any:
    """``config['a']['b']`` for path ``a.b``; a key containing dots is also tried whole."""
    if config is None:
        return MISSING
    if path in config:
        return config[path]
    node: Any = config
    for part in path.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return MISSING
    return node


def _norm(value: Any, case: str) -> Any:
    if case == "insensitive" and isinstance(value, str):
        return value.lower()
    return value


def check_field(config: Mapping[str, Any] | None, path: str, rule: FieldRule) -> Check:
    """One detect rule against the config."""
    value, used = MISSING, path
    for candidate in [path, *rule.aliases]:
        value = get_path(config, candidate)
        if value is not MISSING:
            used = candidate
            break
    if rule.present is not None:
        if (value is not MISSING) == rule.present:
            return passed(used, f"{used} is {'present' if rule.present else 'absent'}")
        if rule.present:
            return failed(Reason.FIELD_MISSING, used, f"{used} is missing; wanted it present")
        return failed(Reason.FIELD_PRESENT, used, f"{used} = {_short(value)} is present; wanted it absent",
                      seen=value)
    defaulted = value is MISSING
    if defaulted:
        if not rule.has_default:
            wanted = rule.equals if rule.has_equals else rule.one_of
            return failed(Reason.FIELD_MISSING, path, f"{path} is missing; wanted {_wanted_text(rule)}",
                          wanted=wanted)
        value = rule.default
    seen = _norm(value, rule.case)
    note = " (default)" if defaulted else ""
    if rule.has_equals:
        ok = seen == _norm(rule.equals, rule.case)
    elif rule.one_of is not None:
        ok = seen in [_norm(v, rule.case) for v in rule.one_of]
    else:
        assert rule.range is not None
        ok = (isinstance(seen, int | float) and not isinstance(seen, bool)
              and (rule.range.min is None or seen >= rule.range.min)
              and (rule.range.max is None or seen <= rule.range.max))
    if ok:
        return passed(used, f"{used} = {value!r}{note}", seen=value)
    return failed(Reason.FIELD_VALUE, used, f"{used} = {_short(value)}{note}; wanted {_wanted_text(rule)}",
                  seen=value, wanted=rule.equals if rule.has_equals else rule.one_of)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a whole config section must not flood a reason."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " …" + text[-2:]


def _wanted_text(rule: FieldRule) -> str:
    if rule.has_equals:
        return repr(rule.equals)
    if rule.one_of is not None:
        return "one of " + ", ".join(repr(v) for v in rule.one_of)
    if rule.range is not None:
        return f"in [{rule.range.min}, {rule.range.max}]"
    return "present"
