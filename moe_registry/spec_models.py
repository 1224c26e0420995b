"""The spec language: pydantic models for scheme, kernel and model-family specs.

Everything read from a spec file is validated here (``extra="forbid"``: a typo is an error, not a
silently ignored field). The models are pure data; meaning is given to them by the oracle.
``moe-registry schema`` prints their JSON Schema for editors.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moe_registry.expr import ExprError, parse_expr
from moe_registry.keys import SCALAR_TYPES

Dtype = Literal["float16", "bfloat16", "float32"]
ActivationFn = Literal["silu", "gelu", "swigluoai"]
ActivationFormat = Literal["standard", "batched"]
Feature = Literal["bias", "zero_point", "act_order", "router_weight_on_input"]
Device = Literal["cpu", "cuda", "rocm", "xpu"]
ShapeDim = Literal["hidden", "intermediate", "experts", "top_k", "tokens"]
NAME_RE = r"^[a-z0-9][a-z0-9._-]*$"


class Strict(BaseModel):
    """Base of every spec model: unknown fields are errors and values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


# ---------------------------------------------------------------- scheme specs


class Range(Strict):
    """An inclusive numeric range; either end may be left open."""

    min: float | None = None
    max: float | None = None


class FieldRule(Strict):
    """A test on one ``quantization_config`` field (the mapping key is its dotted path).

    ``default`` is used when the field (and all ``aliases``) are absent; with no default an absent
    field fails every test except ``present: false``.
    """

    equals: Any = None
    one_of: list[Any] | None = None
    range: Range | None = None
    present: bool | None = None
    default: Any = None
    aliases: list[str] = Field(default_factory=list)
    case: Literal["sensitive", "insensitive"] = "sensitive"

    @model_validator(mode="after")
    def _one_test(self) -> FieldRule:
        tests = [self.equals is not None, self.one_of is not None, self.range is not None,
                 self.present is not None]
        if sum(tests) != 1:
            raise ValueError("a detect rule needs exactly one of equals, one_of, range, present")
        return self


class DetectSpec(Strict):
    """All ``fields`` must pass, and (when given) at least one of the ``any_of`` alternatives.

    In YAML it is written flat: field paths map to rules, plus an optional ``any_of`` list.
    """

    fields: dict[str, FieldRule] = Field(default_factory=dict)
    any_of: list[dict[str, FieldRule]] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fields" not in data:
            rest = {k: v for k, v in data.items() if k != "any_of"}
            return {"fields": rest, "any_of": data.get("any_of", [])}
        return data

    @model_validator(mode="after")
    def _not_empty(self) -> DetectSpec:
        if not self.fields and not self.any_of:
            raise ValueError("detect needs at least one rule")
        return self


class BindRule(Strict):
    """A value taken from the config (or a constant) for use as ``$name`` in the rest of the spec."""

    from_: str | None = Field(default=None, alias="from")
    aliases: list[str] = Field(default_factory=list)
    value: Any = None
    default: Any = None
    one_of: list[Any] | None = None
    map: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _source(self) -> BindRule:
        if (self.from_ is None) == (self.value is None):
            raise ValueError("a binding needs exactly one of 'from' (a config field) or 'value'")
        return self


class ScopeRule(Strict):
    """How a per-layer section of the config applies to the MoE expert layers.

    ``exclude``: a list (or mapping keys) of module patterns; a match means the layer is not
    quantized. ``override``: a mapping pattern → config; a match replaces the subtree at
    ``into`` (merged over it; the top level when ``into`` is absent). ``only``: when the listed
    patterns exist and none matches, the layer is not quantized (ModelOpt MIXED_PRECISION lists
    only its quantized layers). The first rule that applies wins, in the order written.
    """

    kind: Literal["exclude", "override", "only"]
    from_: str = Field(alias="from")
    match: Literal["substring", "component", "glob", "regex", "exact", "type", "gptq-dynamic",
                   "ct-target"]
    into: str | None = None
    types: list[str] = Field(default_factory=list)


class TensorSpec(Strict):
    """One checkpoint tensor of an expert projection: dtype(s) and symbolic shape."""

    dtype: str | list[str]
    shape: list[int | str]
    optional: bool = False

    @field_validator("shape")
    @classmethod
    def _shape(cls, shape: list[int | str]) -> list[int | str]:
        for dim in shape:
            try:
                parse_expr(dim)
            except ExprError as err:
                raise ValueError(str(err)) from None
        return shape

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str | list[str]) -> str | list[str]:
        known = {"int32", "int8", "uint8", "int64", "float16", "bfloat16", "float32",
                 "float8_e4m3fn", "float8_e8m0fnu"}
        for d in [dtype] if isinstance(dtype, str) else dtype:
            if d not in known:
                raise ValueError(f"unknown tensor dtype {d!r}; known: {', '.join(sorted(known))}")
        return dtype

    @property
    def dtypes(self) -> list[str]:
        return [self.dtype] if isinstance(self.dtype, str) else list(self.dtype)


class CheckpointSpec(Strict):
    """What a checkpoint holds per expert projection, and the format converter that reads it."""

    format: str
    tensors: dict[str, TensorSpec]


class SchemeSpec(Strict):
    """A named quantization recipe as it appears in checkpoints."""

    scheme: str = Field(pattern=NAME_RE)
    summary: str
    detect: DetectSpec
    scope: list[ScopeRule] = Field(default_factory=list)
    bind: dict[str, BindRule] = Field(default_factory=dict)
    weight: str
    activation: str
    features: dict[Feature, bool | str] = Field(default_factory=dict)
    checkpoint: CheckpointSpec
    kernels: list[str] = Field(min_length=1)
    tolerance: dict[Dtype, float] = Field(default_factory=lambda: {"float16": 1e-2, "bfloat16": 2e-2,
                                                                    "float32": 1e-2})


# ---------------------------------------------------------------- kernel specs

_CAP_RE = re.compile(r"^\s*(>=|<=|>|<|==)\s*(\d+)\.(\d+)\s*$")


class PlatformSpec(Strict):
    """A device kind and, for GPUs, a capability range such as ``">=8.0,<10.0"``."""

    device: Device
    capability: str | None = None

    @field_validator("capability")
    @classmethod
    def _capability(cls, text: str | None) -> str | None:
        if text is not None:
            for part in text.split(","):
                if not _CAP_RE.match(part):
                    raise ValueError(f"bad capability range {text!r}; write e.g. '>=8.0' or '>=8.0,<10.0'")
        return text

    def capability_bounds(self) -> list[tuple[str, tuple[int, int]]]:
        """The range as (operator, (major, minor)) pairs."""
        out = []
        for part in (self.capability or "").split(","):
            m = _CAP_RE.match(part)
            if m:
                out.append((m.group(1), (int(m.group(2)), int(m.group(3)))))
        return out


class KeyPattern(Strict):
    """Accepted (weight key, activation key) pairs; ``*`` matches any run of characters of the
    canonical key string, so ``uint4 scale:float16:group(*):static zp:group`` accepts any group."""

    weight: str | list[str]
    activation: str | list[str]

    @field_validator("weight", "activation")
    @classmethod
    def _patterns(cls, value: str | list[str]) -> str | list[str]:
        for pattern in [value] if isinstance(value, str) else value:
            head = pattern.split()[0] if pattern.split() else ""
            if head != "*" and head != "unquantized" and head not in SCALAR_TYPES:
                raise ValueError(f"key pattern {pattern!r} must start with a scalar type, "
                                 "'unquantized' or '*'")
            for token in pattern.split()[1:]:
                name = token.partition(":")[0]
                if name not in ("scale", "zp", "scale2", "*"):
                    raise ValueError(f"unknown token {token!r} in key pattern {pattern!r}")
        return value

    def weights(self) -> list[str]:
        return [self.weight] if isinstance(self.weight, str) else list(self.weight)

    def activations(self) -> list[str]:
        return [self.activation] if isinstance(self.activation, str) else list(self.activation)


class ShapeLimit(Strict):
    """Limits on one MoE dimension; values may be expressions over the scheme's $bindings."""

    multiple_of: int | str | None = None
    min: int | str | None = None
    max: int | str | None = None

    @field_validator("multiple_of", "min", "max")
    @classmethod
    def _expr(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            try:
                parse_expr(value)
            except ExprError as err:
                raise ValueError(str(err)) from None
        return value


class ParallelSpec(Strict):
    """Which parallel modes the kernel runs under."""

    tp: bool = True
    ep: bool = False
    dp: bool = True
    all2all: list[str] = Field(default_factory=lambda: ["none"])


class KernelSpec(Strict):
    """An experts implementation and everything it supports (DESIGN rule 1: written only here)."""

    kernel: str = Field(pattern=NAME_RE)
    summary: str
    impl: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    platforms: list[PlatformSpec] = Field(min_length=1)
    requires_packages: list[str] = Field(default_factory=list)
    dtypes: list[Dtype] = Field(min_length=1)
    keys: list[KeyPattern] = Field(min_length=1)
    activations: list[ActivationFn] = Field(min_length=1)
    activation_formats: list[ActivationFormat] = Field(default_factory=lambda: ["standard"])
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    shapes: dict[ShapeDim, ShapeLimit] = Field(default_factory=dict)
    features: list[Feature] = Field(default_factory=list)
    layout: str = "nk"


# ---------------------------------------------------------------- model-family specs


class FieldRef(Strict):
    """Where a value sits in ``config.json``: the first present of ``from`` names, else default."""

    from_: list[str] = Field(default_factory=list, alias="from")
    default: Any = None

    @model_validator(mode="before")
    @classmethod
    def _short(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"from": [data]}
        if isinstance(data, list):
            return {"from": data}
        if isinstance(data, dict) and isinstance(data.get("from"), str):
            return {**data, "from": [data["from"]]}
        return data


class FamilyMatch(Strict):
    """How to recognise a family: any listed model_type or architecture."""

    model_type: list[str] = Field(default_factory=list)
    architectures: list[str] = Field(default_factory=list)


class MoELayers(Strict):
    """Which decoder layers are MoE: from ``first_dense`` on, every ``step``-th, minus ``skip``."""

    first_dense: FieldRef | None = None
    step: FieldRef | None = None
    skip: FieldRef | None = None


class Naming(Strict):
    """How checkpoints name a MoE layer's tensors; ``{layer}`` and ``{expert}`` are filled in."""

    layer: str = "model.layers.{layer}"
    router: str
    correction_bias: str | None = None
    expert: str
    projections: dict[Literal["gate", "up", "down"], str]

    @model_validator(mode="after")
    def _placeholders(self) -> Naming:
        if "{layer}" not in self.layer:
            raise ValueError("naming.layer must contain {layer}")
        if "{expert}" not in self.expert:
            raise ValueError("naming.expert must contain {expert}")
        if set(self.projections) != {"gate", "up", "down"}:
            raise ValueError("naming.projections needs gate, up and down")
        return self


class ModelFamilySpec(Strict):
    """How a model family's config.json names MoE fields and how its checkpoints name tensors."""

    family: str = Field(pattern=NAME_RE)
    summary: str
    match: FamilyMatch
    config_root: list[str] = Field(default_factory=list)
    fields: dict[Literal["num_experts", "top_k", "hidden", "intermediate", "num_layers",
                         "activation", "has_bias"], FieldRef]
    moe_layers: MoELayers = Field(default_factory=MoELayers)
    routing: dict[Literal["scoring", "renormalize", "num_expert_group", "topk_group",
                          "routed_scaling_factor"], FieldRef] = Field(default_factory=dict)
    naming: Naming

    @field_validator("fields")
    @classmethod
    def _required(cls, fields: dict[str, FieldRef]) -> dict[str, FieldRef]:
        missing = {"num_experts", "top_k", "hidden", "intermediate", "num_layers"} - set(fields)
        if missing:
            raise ValueError(f"fields is missing {', '.join(sorted(missing))}")
        return fields


SPEC_KINDS: dict[str, type[Strict]] = {
    "scheme": SchemeSpec, "kernel": KernelSpec, "family": ModelFamilySpec,
}


__all__ = ["SPEC_KINDS", "SchemeSpec", "KernelSpec", "ModelFamilySpec"]
