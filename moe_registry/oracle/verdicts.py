"""The oracle's verdicts: what it decides for (Situation), what every check returns (Check with a
Reason from a closed set: docs/design.md, "Every decision explains itself"), the verdicts on
schemes and kernels, the downgrades, and how the kernel was selected (SelectedBy). The Report that
holds them is ``oracle.contract``'s; ``oracle.render`` reads these to print it.

The codes are closed sets: programs switch on them (``--json``); people read ``message``, which
names the field, the value seen and the value wanted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from moe_registry.core.keys import QuantKey
from moe_registry.oracle.runtime import RuntimeConfig

METHOD_FIELD = "quant_method"  # transformers' name for a quantization config's method (QuantizationConfigMixin)


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
                "message": self.message, "seen": _plain(self.seen), "wanted": _plain(self.wanted)}


def passed(field: str, message: str, seen: Any = None) -> Check:
    return Check(True, Reason.OK, field, message, seen)


def failed(reason: Reason, field: str, message: str, seen: Any = None, wanted: Any = None) -> Check:
    return Check(False, reason, field, message, seen, wanted)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


@dataclass(frozen=True)
class SchemeVerdict:
    """Detection of one scheme for one layer, with every check that decided it."""

    scheme: str
    matched: bool
    checks: tuple[Check, ...]
    excluded: bool = False
    scope_note: str | None = None
    bindings: Mapping[str, Any] = field(default_factory=dict)
    weight_key: QuantKey | None = None
    activation_key: QuantKey | None = None
    features: Mapping[str, bool] = field(default_factory=dict)
    # a scheme with emulation: activation_key is the key the kernels run, this the checkpoint's, and why
    checkpoint_activation_key: QuantKey | None = None
    emulation_reason: str | None = None

    @property
    def emulation_note(self) -> str | None:
        """One line saying which activations run instead of the checkpoint's, and why (None: no emulation)."""
        if self.checkpoint_activation_key is None or self.activation_key is None:
            return None
        run = ("in the 16-bit activation dtype (weight-only emulation)" if not self.activation_key.quantized
               else f"as {self.activation_key} (emulation)")
        return (f"the checkpoint's activations are {self.checkpoint_activation_key}; they run {run}: "
                f"{self.emulation_reason}")

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    @property
    def claims_method(self) -> bool:
        """Whether this scheme's detect rules accept the config's quant_method (it failed on other fields)."""
        return any(c.field == METHOD_FIELD and c.passed for c in self.checks)


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
class RoutingValue:
    """One routing value of the model and where it came from, so a reader can check it against the config:
    ``config`` (the field named), ``class-default`` (the field is absent: transformers' config class default),
    ``spec-default`` (absent or null, and no class default: the family spec's), ``fixed`` (not a config field:
    the family's modeling code fixes it, as the family spec records), ``none`` (the family spec has no such word:
    the modeling code has no such step, and the value is the one that means so)."""

    word: str
    value: Any
    origin: str
    field: str | None = None
    config_class: str | None = None
    family: str | None = None

    @property
    def source(self) -> str:
        """The origin in words, e.g. "absent: transformers' DeepseekV3Config default"."""
        if self.origin == "config":
            return f"config {self.field}"
        if self.origin == "class-default":
            return f"{self.field} absent: transformers' {self.config_class} default"
        if self.origin == "spec-default":
            return f"{self.field} absent or null: family {self.family} spec default"
        if self.origin == "fixed":
            return f"fixed by the modeling code: family {self.family} spec"
        return f"none in the modeling code: family {self.family} spec"

    def to_dict(self) -> dict[str, Any]:
        return {"value": _plain(self.value), "origin": self.origin, "field": self.field,
                "config_class": self.config_class, "source": self.source}


@dataclass(frozen=True)
class Situation:
    """What the oracle decides for: the layer's quantization config and module names, and the
    runtime. ``modules`` are the expert projections' full names (for per-layer scoping)."""

    quant_config: Mapping[str, Any] | None
    runtime: RuntimeConfig
    modules: tuple[str, ...] = ("model.layers.0.mlp.experts.0.gate_proj",)
    quant_source: str = "quantization_config"
    model: str | None = None
    family: str | None = None
    layer: int | None = None
    not_runnable: tuple[str, ...] = ()  # the model's experts in a form no kernel here runs (explain shows why)
    routing: tuple[RoutingValue, ...] = ()  # the model's routing with sources (explain shows it)
    moe_layers: tuple[int, ...] = ()  # every MoE layer of the model (explain reports them all, grouped)
    layer_asked: bool = False  # --layer / layer= named the layer: the report is that layer's alone


@dataclass(frozen=True)
class LayerRun:
    """Consecutive MoE layers the oracle decides alike: the same scheme (with the same bindings) on the same
    kernel, excluded from quantization by the same rule or not at all."""

    first: int
    last: int
    scheme: str | None
    kernel: str | None
    excluded: str | None = None  # the scope rule that left these layers unquantized
    count: int = 1

    @property
    def span(self) -> str:
        return f"layer {self.first}" if self.count == 1 else f"layers {self.first}-{self.last}"

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "count": self.count, "scheme": self.scheme,
                "kernel": self.kernel, "excluded": self.excluded}


class DowngradeKind(str, Enum):
    """What about the run differs from what the checkpoint or the user asked for."""

    ACTIVATION = "activation"  # the checkpoint's activation quantisation is not what runs
    COMPUTE_DTYPE = "compute-dtype"  # the GEMMs compute in a narrower dtype than the one asked
    SLOW_PATH = "slow-path"  # the scheme's order fell to a kernel its spec calls a slow path


@dataclass(frozen=True)
class Downgrade:
    """One place where what runs differs from what was asked, derived by the oracle from spec words
    (a scheme's or a key pattern's ``emulation``, a key pattern's ``compute``, a kernel's ``slow_path``)."""

    kind: DowngradeKind
    asked: str
    runs: str
    why: str
    message: str  # the line explain and run print

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "asked": self.asked, "runs": self.runs, "why": self.why,
                "message": self.message}


class SelectedBy(str, Enum):
    """How the chosen kernel (or the failure to choose one) came about."""

    PREFERENCE = "preference"  # the first eligible kernel in the scheme's order
    PIN = "pin"  # --kernel / pin=: that kernel or an error
    PREFER = "prefer"  # --prefer / prefer=: that kernel, being eligible
    FALLBACK = "fallback"  # --prefer named a kernel that is not eligible: the scheme's order decided
