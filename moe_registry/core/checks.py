"""What every check returns: a Check with a Reason from a closed set (docs/design.md, "Every decision explains
itself"). The oracle's predicates, the spec's field rules and the situation's readers all answer in it, so it
sits below them all. Programs switch on the reason codes (``--json``); people read ``message``, which names the
field, the value seen and the value wanted."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Reason(str, Enum):
    """Why a predicate passed or failed."""

    OK = "ok"
    # scheme detection
    FIELD_MISSING = "field-missing"
    FIELD_VALUE = "field-value"
    FIELD_PRESENT = "field-present"
    NO_ALTERNATIVE = "no-alternative"
    LAYER_EXCLUDED = "layer-excluded"
    LAYER_OVERRIDE = "layer-override"
    BIND_VALUE = "bind-value"
    BIND_MISSING = "bind-missing"
    # kernel constraints
    NOT_LISTED = "not-listed"
    PLATFORM = "platform"
    CAPABILITY = "capability"
    PACKAGE_MISSING = "package-missing"
    COMMAND_MISSING = "command-missing"
    DTYPE = "dtype"
    WEIGHT_KEY = "weight-key"
    ACTIVATION_KEY = "activation-key"
    ACTIVATION_FN = "activation-fn"
    ACTIVATION_FORMAT = "activation-format"
    PARALLEL = "parallel"
    ALL2ALL = "all2all"
    SHAPE_MULTIPLE = "shape-multiple"
    SHAPE_MIN = "shape-min"
    SHAPE_MAX = "shape-max"
    SHAPE_UNKNOWN = "shape-unknown"
    FEATURE = "feature"
    CONVERTER = "converter"


@dataclass(frozen=True)
class Check:
    """One predicate's verdict."""

    passed: bool
    reason: Reason
    field: str
    message: str
    seen: Any = None
    wanted: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason.value, "field": self.field,
                "message": self.message, "seen": plain(self.seen), "wanted": plain(self.wanted)}


def passed(field: str, message: str, seen: Any = None) -> Check:
    return Check(True, Reason.OK, field, message, seen)


def failed(reason: Reason, field: str, message: str, seen: Any = None, wanted: Any = None) -> Check:
    return Check(False, reason, field, message, seen, wanted)


def plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)
