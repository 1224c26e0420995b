"""The oracle's contract: what it decides for (Situation), what every check returns (Check with a
Reason from a closed set: docs/design.md, "Every decision explains itself"), the verdicts on
schemes and kernels, how the kernel was selected (SelectedBy) and the Report that holds it all.

The codes are closed sets: programs switch on them (``--json``); people read ``message``, which
names the field, the value seen and the value wanted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from moe_registry.core.keys import QuantKey
from moe_registry.oracle import render
from moe_registry.oracle.runtime import RuntimeConfig

NEAREST_SHOWN = 3  # turned-down schemes shown without --verbose
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


@dataclass(frozen=True)
class Report:
    """Everything the oracle decided for one layer, and why."""

    situation: Situation
    schemes: tuple[SchemeVerdict, ...]
    scheme: SchemeVerdict | None
    excluded_note: str | None = None
    kernels: tuple[KernelVerdict, ...] = ()
    chosen: str | None = None
    selected_by: SelectedBy | None = None  # None when no scheme matched
    requested: str | None = None  # the kernel named by pin or prefer
    overrides: tuple[str, ...] = field(default=())
    unclaimed: str | None = None  # no scheme matched: the config's quant_method is one no scheme spec claims
    layers: tuple[LayerRun, ...] = ()  # the model's MoE layers grouped, when they are not all decided alike
    downgrades: tuple[Downgrade, ...] = ()  # where what runs differs from what was asked (explain says each)
    # the activation key the chosen kernel runs, where its key pattern's emulation differs from the scheme's
    kernel_activation_key: QuantKey | None = None
    # why the scheme's first eligible kernel gave way to the chosen one (downgrades.faithful_first); None: the
    # narrower compute dtype, the rule's first reason
    passed_over: str | None = None

    def with_kernels(self, kernels: tuple[KernelVerdict, ...], chosen: str | None, selected_by: SelectedBy,
                     requested: str | None) -> Report:
        return replace(self, kernels=kernels, chosen=chosen, selected_by=selected_by, requested=requested)

    @property
    def run_activation_key(self) -> QuantKey | None:
        """The activation key the chosen kernel runs (and the weights are converted for)."""
        if self.kernel_activation_key is not None:
            return self.kernel_activation_key
        return self.scheme.activation_key if self.scheme is not None else None

    def verdict(self, kernel: str) -> KernelVerdict | None:
        return next((k for k in self.kernels if k.kernel == kernel), None)

    @property
    def notes(self) -> tuple[str, ...]:
        """The selection in words (derived from ``selected_by``; programs read that)."""
        asked = self.requested
        if self.selected_by is SelectedBy.PIN:
            return (f"pinned to {asked}",) if self.chosen == asked else (f"pinned kernel {asked} is not eligible",)
        if self.selected_by is SelectedBy.PREFER:
            return (f"preferred {asked}",)
        if self.selected_by is SelectedBy.PREFERENCE:
            first = next((k for k in self.kernels if k.eligible), None)
            if first is not None and first.kernel != self.chosen:  # downgrades.faithful_first
                why = self.passed_over or f"it computes {self.situation.runtime.dtype} in a narrower dtype"
                return (f"{first.kernel} passed over: {why}; {self.chosen} computes it as asked "
                        f"(--prefer {first.kernel} runs it)",)
            return ()
        if self.selected_by is SelectedBy.FALLBACK:
            v = self.verdict(asked or "")
            why = "; ".join(c.message for c in v.failures) if v else "unknown kernel"
            return (f"preferred {asked} is not eligible ({why}); fell back to {self.chosen or 'nothing'}",)
        return ()

    def turned_down(self) -> list[SchemeVerdict]:
        """Schemes that did not match, nearest first: excluded-by-scope ones, then those claiming the config's
        quant_method, then by fewest failed and most passed checks, then by name."""
        chosen = self.scheme.scheme if self.scheme is not None else None
        rest = [v for v in self.schemes if v.scheme != chosen]
        return sorted(rest, key=lambda v: (not v.excluded, not v.claims_method, len(v.failures), -len(v.checks),
                                           v.scheme))

    def shown_turned_down(self, verbose: bool) -> list[SchemeVerdict]:
        rest = self.turned_down()
        if verbose:
            return rest
        return [] if self.unclaimed else rest[:NEAREST_SHOWN]  # unclaimed: none of them is near

    # rendering lives in render.py; these keep the report's one public face
    def rows(self) -> list[tuple[str, str]]:
        return render.head_rows(self)

    def summary(self) -> str:
        return render.summary_line(self)

    def notice_rows(self) -> list[tuple[str, str]]:
        return render.notice_rows(self)

    def to_dict(self, verbose: bool = False) -> dict[str, Any]:
        return render.to_dict(self, verbose)

    def to_json(self, verbose: bool = False, indent: int | None = None) -> str:
        return render.to_json(self, verbose, indent)

    def to_text(self, verbose: bool = False, width: int = render.TEXT_WIDTH) -> str:
        return render.to_text(self, verbose, width)

    def to_markdown(self, verbose: bool = False) -> str:
        return render.to_markdown(self, verbose)
