"""The spec language: pydantic models for scheme, kernel and model-family specs.

Everything read from a spec file is validated here (``extra="forbid"``: a typo is an error, not a
silently ignored field). The models are pure data; meaning is given to them by the oracle.
``moe-registry schema`` prints their JSON Schema for editors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from moe_registry.core.guards import check_number, check_template
from moe_registry.core.keys import SCALAR_TYPES
from moe_registry.core.vocab import (
    ActivationFn,
    ActivationFormat,
    Device,
    Dtype,
    Feature,
    KernelAll2All,
    Role,
    ShapeDim,
)
from moe_registry.spec.expr import ExprError, parse_limit, parse_shape_dim

NAME_RE = r"^[a-z0-9][a-z0-9._-]*$"


class Strict(BaseModel):
    """Base of every spec model: unknown fields are errors and values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @property
    def fields_set(self) -> frozenset[str]:
        """The fields the spec file wrote (as the runtime view records them)."""
        return frozenset(self.model_fields_set)


# ---------------------------------------------------------------- scheme specs


class Range(Strict):
    """An inclusive numeric range; either end may be left open."""

    min: float | None = Field(default=None, description="smallest accepted value, inclusive; absent: no lower bound")
    max: float | None = Field(default=None, description="largest accepted value, inclusive; absent: no upper bound")


class FieldRule(Strict):
    """A test on one ``quantization_config`` field (the mapping key is its dotted path).

    ``default`` is used when the field (and all ``aliases``) are absent; with no default an absent
    field fails every test except ``present: false``.
    """

    equals: Any = Field(default=None, description=(
        "the field must have exactly this value; `equals: null` (written) tests that it is null"))
    one_of: list[Any] | None = Field(default=None, description="the field must have one of these values")
    range: Range | None = Field(default=None, description="the field must be a number within this inclusive range")
    present: bool | None = Field(default=None, description=(
        "true: the field (or an alias) must be there, whatever its value; false: it must be absent"))
    default: Any = Field(default=None, description=(
        "the value tested when the field and all aliases are absent (`default: null` written: absent means null, "
        "as the producer's own config model defaults it); absent: a missing field fails the test"))
    aliases: list[str] = Field(default_factory=list, description=(
        "other names of the same field, tried in order after the mapping key (e.g. AWQ's w_bit for bits)"))
    case: Literal["sensitive", "insensitive"] = Field(default="sensitive", description=(
        "insensitive: strings are compared ignoring case (quant_method gptq vs GPTQ); default sensitive"))

    @property
    def has_equals(self) -> bool:
        """``equals`` was written, ``equals: null`` included (compressed-tensors' ``input_activations: null``)."""
        return "equals" in self.fields_set

    @property
    def has_default(self) -> bool:
        """``default`` was written, ``default: null`` included: an absent field stands for null, as
        compressed-tensors' pydantic models default an absent ``input_activations`` to None."""
        return "default" in self.fields_set

    @model_validator(mode="after")
    def _one_test(self) -> FieldRule:
        tests = [self.has_equals, self.one_of is not None, self.range is not None,
                 self.present is not None]
        if sum(tests) != 1:
            raise ValueError("a detect rule needs exactly one of equals, one_of, range, present")
        return self


class DetectSpec(Strict):
    """All ``fields`` must pass, and (when given) at least one of the ``any_of`` alternatives.

    In YAML it is written flat: field paths map to rules, plus an optional ``any_of`` list.
    """

    fields: dict[str, FieldRule] = Field(default_factory=dict, description=(
        "quantization_config field (a dotted path into nested objects) → the test it must pass; written flat "
        "in YAML, beside any_of"))
    any_of: list[dict[str, FieldRule]] = Field(default_factory=list, description=(
        "alternative rule sets, tried in order; at least one must pass entirely (empty: no alternatives)"))

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

    from_: str | None = Field(default=None, alias="from", description=(
        "the (scoped) quantization_config field to read, a dotted path; excludes value"))
    aliases: list[str] = Field(default_factory=list, description="other names of that field, tried in order after from")
    value: Any = Field(default=None, description="a constant instead of a config field; excludes from")
    default: Any = Field(default=None, description=(
        "used when the field and its aliases are absent or null; absent: the field is required"))
    one_of: list[Any] | None = Field(default=None, description=(
        "the values accepted (after map); another value fails detection, naming the field and the value seen"))
    map: dict[str, Any] | None = Field(default=None, description=(
        "config value (as a string) → the value bound; a value not listed fails detection"))

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

    kind: Literal["exclude", "override", "only"] = Field(description=(
        "exclude: a match is not quantized; override: a match's config replaces the subtree at into; "
        "only: when the patterns exist and none matches, the layer is not quantized"))
    from_: str = Field(alias="from", description=(
        "the quantization_config section holding the patterns, a dotted path (e.g. ignore, dynamic)"))
    match: Literal["substring", "component", "glob", "regex", "exact", "type", "gptq-dynamic",
                   "ct-target", "ct-group"] = Field(description=(
        "how a pattern is matched against a module name: substring, component (whole dotted parts), glob, "
        "regex, exact (the name or a parent module), type (the pattern is a module type listed in types), "
        "gptq-dynamic (GPTQ's +:/-: regexes), ct-target (compressed-tensors' targets: a module name, a class "
        "name listed in types, or re: regexes over the name), ct-group (for override: the compressed-tensors "
        "config group, whatever its name, whose targets match as ct-target; it replaces the subtree at into)"))
    into: str | None = Field(default=None, description=(
        "for override: the dotted path of the subtree the matched config is merged over; absent: the top level"))
    types: list[str] = Field(default_factory=list, description=(
        "for match: type and ct-target, the module type names the expert projections have (e.g. Linear, "
        "torch.nn.Linear)"))
    claims: bool = Field(default=True, description=(
        "for only: a layer the patterns leave out marks the config as this scheme's own even when its detect "
        "rules fail (ModelOpt MIXED_PRECISION names the algorithm per layer); false: only when they pass "
        "(compressed-tensors targets, where every CT scheme has the rule)"))


def _check_shape(shape: Any) -> None:
    for dim in shape if isinstance(shape, list) else []:
        try:
            parse_shape_dim(dim)
        except ExprError as err:
            raise ValueError(str(err)) from None


class StackedTensor(Strict):
    """Where a checkpoint may keep a per-projection tensor once per layer instead, stacked over experts, beside
    per-expert weights: transformers 5 saves its FP8Experts (fused experts) with the weights split per expert
    but the scales as the module holds them (``experts.gate_up_proj_scale_inv`` [E, ...]). A layer that holds
    the stacked tensor of any declared tensor is read this way for all that declare one."""

    name: str = Field(description=(
        "its name under the layer's experts module (the family's naming.expert without .{expert}), {part} the "
        "fused projection, gate_up or down: e.g. '{part}_proj_scale_inv' (mlp.experts.gate_up_proj_scale_inv)"))
    shape: list[int | str] | None = Field(default=None, description=(
        "one expert's slice (stored [E, *shape]), in/out the fused projection's sizes (gate_up: out = 2 x "
        "intermediate); absent: the tensor's own shape. Gate and up are its halves along the first dimension "
        "that grows with out; when none does (one per-tensor scale for gate_up), gate and up share the slice"))

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        # no '.': the name sits directly under the experts module, where a dotted one would read as an expert
        if name.count("{part}") != 1 or re.fullmatch(r"\w+", name.replace("{part}", "part")) is None:
            raise ValueError(f"stacked name {name!r}: wanted one {{part}} among letters, digits and _, "
                             "e.g. '{part}_proj_scale_inv'")
        return name

    @field_validator("shape", mode="before")  # before: pydantic would turn `true` into 1
    @classmethod
    def _shape(cls, shape: list[int | str] | None) -> list[int | str] | None:
        _check_shape(shape)
        return shape


class TensorSpec(Strict):
    """One checkpoint tensor of an expert projection: dtype(s) and symbolic shape."""

    dtype: str | list[str] = Field(description=(
        "the torch dtype stored (e.g. int32, float16), or a list of those accepted"))
    shape: list[int | str] = Field(description=(
        "one entry per dimension: an integer or an expression over in, out and $bindings, e.g. in / 8, "
        "\"groups(in, $group)\""))
    optional: bool = Field(default=False, description=(
        "true: the tensor may be absent from the checkpoint (e.g. GPTQ's g_idx); default false: it is required"))
    all_equal: int | float | None = Field(
        default=None,
        description="every element must equal this value, checked when the layer is loaded (a different value "
                    "is an error naming the tensor, the value seen and this one). For tensors a producer writes "
                    "but the scheme fixes, e.g. Quark's all-zero weight_zero_point in a symmetric scheme.")
    stacked: StackedTensor | None = Field(default=None, description=(
        "where a checkpoint may store it stacked over experts instead, under the layer's experts module (the "
        "scales of transformers' FP8Experts); absent: per expert only"))

    @field_validator("shape", mode="before")  # before: pydantic would turn `true` into 1
    @classmethod
    def _shape(cls, shape: list[int | str]) -> list[int | str]:
        _check_shape(shape)
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

    format: str = Field(description="a format spec's name: its converters read these tensors into kernel layouts")
    tensors: dict[str, TensorSpec] = Field(description=(
        "tensor name suffix under each expert projection → its dtype and shape (in/out are the projection's sizes)"))
    fused_names: str | None = Field(default=None, description=(
        "how a fused family's checkpoint (naming.fused) stores these tensors: each stacked over experts as "
        "[E, *shape] (out first, gate and up in the family's gate_up_order) under the fused tensor's name with "
        "this template appended, {tensor} the declared name, e.g. '_{tensor}' (gpt-oss MXFP4: "
        "gate_up_proj_blocks); absent: only a single 'weight' tensor, read in the family's layout"))

    @field_validator("fused_names")
    @classmethod
    def _fused_names(cls, template: str | None) -> str | None:
        if template is not None and (template.count("{tensor}") != 1 or re.fullmatch(r"[\w.{}]+", template) is None
                                     or template.replace("{tensor}", "").count("{") + template.count("}") != 1):
            raise ValueError(f"fused_names {template!r}: wanted one {{tensor}} among letters, digits, _ and ., "
                             "e.g. '_{tensor}'")
        return template


class EmulationSpec(Strict):
    """Activations the kernels run instead of the checkpoint's (weight-only emulation of a W4A4-style
    scheme on hardware without its dot), said out loud: explain prints both keys and the reason."""

    activation: str = Field(description=(
        "the activation QuantKey every kernel of the scheme runs instead of the scheme's activation key, "
        "e.g. unquantized: 16-bit activations, weights dequantised in the kernel"))
    reason: str = Field(min_length=1, description=(
        "why the checkpoint's activation key is not run, in one line (explain prints it), e.g. no FP4 "
        "tensor-core dot before Blackwell"))


class SchemeSpec(Strict):
    """A named quantization recipe as it appears in checkpoints."""

    scheme: str = Field(pattern=NAME_RE, description=(
        "the scheme's name (lowercase, digits, . _ -), unique among schemes"))
    summary: str = Field(description="one line: the producer, the weight and activation formats")
    detect: DetectSpec = Field(description=(
        "tests on the (per-layer scoped) quantization_config that recognise the scheme; all must pass"))
    scope: list[ScopeRule] = Field(default_factory=list, description=(
        "per-layer exclusions and overrides, applied in order before detect (empty: the config applies as is)"))
    bind: dict[str, BindRule] = Field(default_factory=dict, description=(
        "name → a value from the config (or a constant), usable as $name in weight, activation, features "
        "and tensor shapes"))
    weight: str = Field(description=(
        "the weights' QuantKey in its one-line form, e.g. uint4 scale:float16:group($group):static zp:group"))
    activation: str = Field(description=(
        "the activations' QuantKey in its one-line form, e.g. int8 scale:float32:token:dynamic, or unquantized"))
    features: dict[Feature, bool | str] = Field(default_factory=dict, description=(
        "optional layer parts the kernel must handle → true/false or a $binding that evaluates to one "
        "(e.g. act_order: $act_order); absent: not needed"))
    emulation: EmulationSpec | None = Field(default=None, description=(
        "the kernels run other activations than the checkpoint declares (activation), and why: the run key is "
        "matched against kernels, converted to and tested; explain reports both; absent: activation is run"))
    checkpoint: CheckpointSpec = Field(description="the checkpoint format and the tensors each expert projection holds")
    kernels: list[str] = Field(min_length=1, description="kernel specs' names that may run it, in order of preference")
    tolerance: dict[Dtype, float] = Field(default_factory=lambda: {"float16": 1e-2, "bfloat16": 2e-2,
                                                                    "float32": 1e-2}, description=(
        "compute dtype → the largest relative error against the reference that conformance and run accept, "
        "in (0, 1]; "
        "default float16 1e-2, bfloat16 2e-2, float32 1e-2"))

    @property
    def run_activation(self) -> str:
        """The activation key template the kernels run: emulation.activation when the scheme emulates."""
        return self.emulation.activation if self.emulation is not None else self.activation

    @field_validator("tolerance")
    @classmethod
    def _tolerance(cls, tolerance: dict[str, float]) -> dict[str, float]:
        for dtype, value in tolerance.items():  # inf/NaN/-1 would pass or fail every run
            check_number(value, f"tolerance.{dtype}", lo=0, lo_open=True, hi=1, error=ValueError)
        return tolerance


# ---------------------------------------------------------------- kernel specs

_CAP_RE = re.compile(r"^\s*(>=|<=|>|<|==)\s*(\d+)\.(\d+)\s*$")


class PlatformSpec(Strict):
    """A device kind and, for GPUs, a capability range such as ``">=8.0,<10.0"``."""

    device: Device = Field(description="the device kind: cpu, cuda, rocm or xpu")
    capability: str | None = Field(default=None, description=(
        "GPU compute capability range, comma-separated bounds such as \">=8.0,<10.0\"; absent: any"))
    cpu_features: list[str] = Field(default_factory=list, description=(
        "for cpu: the instruction-set extensions the kernel's build needs, as Linux /proc/cpuinfo names them "
        "(e.g. [avx2, fma]); a CPU without one of them does not take the kernel; empty: any CPU"))

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


def check_key_patterns(patterns: list[str]) -> None:
    """A key pattern starts with a scalar type, 'unquantized' or '*', then scale/zp/scale2 tokens or '*'."""
    for pattern in patterns:
        head = pattern.split()[0] if pattern.split() else ""
        if head != "*" and head != "unquantized" and head not in SCALAR_TYPES:
            raise ValueError(f"key pattern {pattern!r} must start with a scalar type, 'unquantized' or '*'")
        for token in pattern.split()[1:]:
            name = token.partition(":")[0]
            if name not in ("scale", "zp", "scale2", "*"):
                raise ValueError(f"unknown token {token!r} in key pattern {pattern!r}")


class ComputeSpec(Strict):
    """The dtype a kernel's GEMMs compute in where it is narrower than the activation dtype asked (torch's
    CPU int4 op is fast only on bfloat16 inputs), said out loud: explain and run name both and the reason."""

    dtypes: dict[Dtype, Dtype] = Field(min_length=1, description=(
        "activation dtype asked → the dtype the GEMMs compute in, e.g. {float16: bfloat16}"))
    reason: str = Field(min_length=1, description="why, in one line (explain prints it)")

    @field_validator("dtypes")
    @classmethod
    def _narrower(cls, dtypes: dict[str, str]) -> dict[str, str]:
        same = [asked for asked, runs in dtypes.items() if asked == runs]
        if same:
            raise ValueError(f"{', '.join(same)} maps to itself: list only the dtypes computed in another one")
        return dtypes


class KeyPattern(Strict):
    """Accepted (weight key, activation key) pairs; ``*`` matches any run of characters of the
    canonical key string, so ``uint4 scale:float16:group(*):static zp:group`` accepts any group."""

    weight: str | list[str] | None = Field(default=None, description=(
        "accepted weight key pattern(s), a canonical key string where * matches any run of characters"))
    activation: str | list[str] | None = Field(default=None, description=(
        "activation key pattern(s) accepted with those weights, e.g. unquantized"))
    keyset: str | None = Field(default=None, pattern=NAME_RE, description=(
        "instead of weight and activation: a keyset spec's name; its patterns are put here at load"))
    platforms: list[PlatformSpec] = Field(default_factory=list, description=(
        "the platforms these key pairs run on, narrowing the kernel's own (e.g. fp8 tensor-core dots: "
        "[{device: cuda, capability: \">=8.9\"}]); empty: wherever the kernel runs"))
    emulation: EmulationSpec | None = Field(default=None, description=(
        "these pairs run other activations than the scheme binds (e.g. fp8 weights on a GPU without an fp8 "
        "dot: unquantized, weights dequantised in registers), and why: the build runs that key and explain "
        "says so; absent: the bound activation key is run"))
    compute: ComputeSpec | None = Field(default=None, description=(
        "on these pairs the GEMMs compute in another dtype than the activation dtype asked, and why "
        "(explain and run say so); absent: they compute in the asked dtype or wider"))
    tolerance: dict[Dtype, float] | None = Field(default=None, description=(
        "compute dtype -> the largest relative error against the scheme's reference these pairs reach where the "
        "kernel computes other numbers than the reference (its emulation: e.g. activations quantised to 8 bits), "
        "in (0, 1]; conformance holds the kernel to it; where it exceeds the scheme's tolerance for the dtype "
        "asked, the oracle passes the kernel over for a later one (--prefer restores it); absent: the scheme's"))

    @model_validator(mode="after")
    def _one_form(self) -> KeyPattern:
        if self.keyset is not None and (self.weight is not None or self.activation is not None
                                        or self.platforms or self.emulation or self.compute or self.tolerance):
            raise ValueError("give either keyset or weight and activation (and platforms, emulation, compute, "
                             "tolerance), not both")
        if self.keyset is None and (self.weight is None or self.activation is None):
            raise ValueError("needs weight and activation (or a keyset)")
        return self

    @field_validator("tolerance")
    @classmethod
    def _tolerance(cls, tolerance: dict[str, float] | None) -> dict[str, float] | None:
        for dtype, value in (tolerance or {}).items():
            check_number(value, f"tolerance.{dtype}", lo=0, lo_open=True, hi=1, error=ValueError)
        return tolerance

    @field_validator("weight", "activation")
    @classmethod
    def _patterns(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_key_patterns([] if value is None else [value] if isinstance(value, str) else value)
        return value

    def weights(self) -> list[str]:
        return [self.weight] if isinstance(self.weight, str) else list(self.weight or [])

    def activations(self) -> list[str]:
        return [self.activation] if isinstance(self.activation, str) else list(self.activation or [])


class ShapeLimit(Strict):
    """Limits on one MoE dimension; values may be expressions over the scheme's $bindings."""

    multiple_of: int | str | None = Field(default=None, description=(
        "the dimension must be a multiple of this (an integer or an expression); absent: any"))
    min: int | str | None = Field(default=None, description="smallest accepted size, inclusive; absent: no lower bound")
    max: int | str | None = Field(default=None, description="largest accepted size, inclusive; absent: no upper bound")

    @field_validator("multiple_of", "min", "max", mode="before")  # before: `true` would become 1
    @classmethod
    def _expr(cls, value: int | str | None, info: ValidationInfo) -> int | str | None:
        if value is not None:
            try:
                parse_limit(value, str(info.field_name))
            except ExprError as err:
                raise ValueError(str(err)) from None
        return value


class ParallelSpec(Strict):
    """Which parallel modes the kernel runs under."""

    tp: bool = Field(default=True, description="runs under tensor parallelism (tp > 1); default true")
    ep: bool = Field(default=False, description="runs under expert parallelism (ep > 1); default false")
    dp: bool = Field(default=True, description="runs under data parallelism (dp > 1); default true")
    all2all: list[KernelAll2All] = Field(default_factory=lambda: ["none"], description=(
        "expert-parallel dispatch backends it works with (vLLM's names); default [none]"))


class KernelSpec(Strict):
    """An experts implementation and all it supports (written only here: docs/design.md, "One source of truth")."""

    kernel: str = Field(pattern=NAME_RE, description=(
        "the kernel's name (lowercase, digits, . _ -), as scheme specs list it in kernels"))
    summary: str = Field(description="one line: the implementation and the schemes it runs")
    impl: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description=(
        "module:Class of the Experts implementation, in moe_registry_kernels or (user specs) a package "
        "inside the declaring spec dir; imported only when a layer is built"))
    linear_impl: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description=(
        "module:Class of its one-projection form (a Linear): a model's dense linears stored in a scheme it runs "
        "(attention, shared experts, dense MLPs) run on it, packed, under the same keys, dtypes and platforms; "
        "absent: such linears are dequantized once at load"))
    platforms: list[PlatformSpec] = Field(min_length=1, description="the devices (and capability ranges) it runs on")
    requires_packages: list[str] = Field(default_factory=list, description=(
        "Python packages that must be installed on the target (e.g. triton); empty: none"))
    requires_commands: list[str] = Field(default_factory=list, description=(
        "programs that must be on the target's PATH (e.g. c++ and ninja for a kernel compiled on first use); "
        "empty: none"))
    dtypes: list[Dtype] = Field(min_length=1, description="the compute (activation) dtypes it supports")
    keys: list[KeyPattern] = Field(min_length=1, description=(
        "accepted (weight, activation) key patterns, or {keyset: name} references to shared ones"))
    activations: list[ActivationFn] = Field(min_length=1, description="the expert activation functions it implements")
    activation_formats: list[ActivationFormat] = Field(default_factory=lambda: ["standard"], description=(
        "how tokens reach it: standard ([tokens, hidden] plus routing) or batched (per expert); default [standard]"))
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description=(
        "the parallel modes it runs under; default tp and dp, no ep"))
    shapes: dict[ShapeDim, ShapeLimit] = Field(default_factory=dict, description=(
        "dimension (hidden, intermediate, experts, top_k, tokens) → limits on its size; empty: no limits"))
    features: list[Feature] = Field(default_factory=list, description=(
        "optional layer parts it handles (bias, zero_point, act_order, router_weight_on_input); empty: none"))
    layout: str = Field(default="nk", description=(
        "the weight layout it reads, produced by a format spec's converter; default nk"))
    slow_path: str | None = Field(default=None, min_length=1, description=(
        "present: the kernel is a yardstick, not a fast path, and this line says what makes it slow; explain "
        "and run say so when the scheme's order falls to it, with why each faster kernel did not take the layer"))

    def key_patterns(self) -> list[KeyPattern]:
        """The accepted (weight, activation) patterns; key set references are expanded at load."""
        refs = [k.keyset for k in self.keys if k.keyset is not None]
        assert not refs, f"kernel {self.kernel}: key sets {refs} were not expanded (load it through the loader)"
        return list(self.keys)


class KeySetSpec(Strict):
    """Named (weight, activation) key patterns that several kernel specs accept, written once."""

    keyset: str = Field(pattern=NAME_RE, description="the name kernel specs use: keys: [{keyset: <name>}]")
    summary: str = Field(description="one line: which kernels share it and why")
    keys: list[KeyPattern] = Field(min_length=1, description="the patterns, as in a kernel spec's keys")


# ---------------------------------------------------------------- model-family specs


class FieldRef(Strict):
    """Where a value sits in ``config.json``: the first present of ``from`` names, else default."""

    from_: list[str] = Field(default_factory=list, alias="from", description=(
        "config.json names (dotted paths allowed), tried in order in the top level and each config_root; "
        "a bare name or list is short for this"))
    default: Any = Field(default=None, description=(
        "the value when no name is present (or all are null); absent: the field is required"))
    length: bool = Field(default=False, description=(
        "the value is the length of the named per-layer list or string (Nemotron-H's layers_block_type or "
        "hybrid_override_pattern, where transformers writes no num_hidden_layers)"))
    per_layer: bool = Field(default=False, description=(
        "the value may also be a list with one entry per layer, each layer reading its own (HunYuan-MoE's "
        "moe_topk and num_experts, which transformers indexes by layer); absent: one value for every layer"))

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

    model_type: list[str] = Field(default_factory=list, description=(
        "config.json model_type values of the family (the top level or a sub-config's)"))
    architectures: list[str] = Field(default_factory=list, description=(
        "config.json architectures entries of the family, e.g. MixtralForCausalLM"))


class PerLayer(Strict):
    """A per-layer list (or string, one character a layer) in config.json whose entries say which
    layers are MoE: ``mlp_layer_types: [dense, sparse, ...]``, ``hybrid_override_pattern: "M-ME*"``."""

    from_: list[str] = Field(alias="from", min_length=1, description="config names of the per-layer list")
    moe: list[Any] = Field(min_length=1, description="entries that mark a MoE layer, e.g. [sparse] or [E]")

    @model_validator(mode="before")
    @classmethod
    def _short(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("from"), str):
            return {**data, "from": [data["from"]]}
        return data


class MoELayers(Strict):
    """Which decoder layers are MoE. ``indices`` (an explicit list) or ``per_layer`` (a per-layer list)
    decide alone when the config has them; otherwise a layer i is MoE when ``first_dense <= i <= last``,
    ``(i + 1 - offset) % step == 0`` and i is not in ``skip``."""

    first_dense: FieldRef | None = Field(default=None, description="layers below this index are dense")
    last: FieldRef | None = Field(default=None, description="last MoE layer index, inclusive (-1: the last layer)")
    step: FieldRef | None = Field(default=None, description="every step-th layer is MoE (interleave step, "
                                  "decoder_sparse_step, moe_layer_interval)")
    offset: int = Field(default=0, description="shifts the step: (i + 1 - offset) % step == 0; offset 1 makes "
                        "layer 0 the first MoE layer of each step (DeepSeek's layer_idx % moe_layer_freq == 0)")
    skip: FieldRef | None = Field(default=None, description="a list of layer indices that are dense")
    indices: FieldRef | None = Field(default=None, description="an explicit list of MoE layer indices")
    per_layer: PerLayer | None = Field(default=None, description="a per-layer list marking the MoE layers")


FusedDim = Literal["E", "in", "out", "E*in", "E*out"]
# The dimension orders a fused expert tensor may have: 3-D [E, ...] or 2-D with the experts stacked along rows.
FUSED_LAYOUTS = (("E", "in", "out"), ("E", "out", "in"), ("E*out", "in"), ("E*in", "out"))


def _check_layout(layout: tuple[str, ...], where: str) -> None:
    if tuple(layout) not in FUSED_LAYOUTS:
        wanted = " or ".join(f"[{', '.join(lay)}]" for lay in FUSED_LAYOUTS)
        raise ValueError(f"{where} {list(layout)}: wanted {wanted}")


class FusedExperts(Strict):
    """Every expert of a layer in a few stacked tensors (gpt-oss, Llama 4, DBRX as transformers saves them),
    named relative to ``naming.layer``. ``layout`` orders the dimensions: ``[E, in, out]`` is read as
    ``x @ W[e]`` (gpt-oss, Llama 4), ``[E, out, in]`` as ``F.linear(x, W[e])`` (or a list of both,
    tried in order, when producers disagree); the 2-D forms ``[E*out, in]`` / ``[E*in, out]`` stack the
    experts' rows (DBRX: expert e is rows [e*n, (e+1)*n)). Gate and up are one ``gate_up`` tensor whose
    ``out`` dimension is 2 x intermediate, gate and up either ``concatenated`` (gate first) or
    ``interleaved`` (gate at even, up at odd positions: gpt-oss), or two tensors ``gate`` and ``up``
    (DBRX's w1 and v1). Biases are [E, out] beside a ``gate_up`` and ``down``."""

    gate_up: str | None = Field(default=None, description=(
        "fused gate and up projections, [E, hidden, 2*intermediate] in layout order"))
    gate: str | None = Field(default=None, description="gate projection of every expert, when gate and up are "
                             "stored apart (DBRX's w1); needs up, excludes gate_up")
    up: str | None = Field(default=None, description="up projection of every expert beside gate (DBRX's v1)")
    down: str = Field(description="down projection of every expert, [E, intermediate, hidden] in layout order")
    layout: list[tuple[FusedDim, ...]] = Field(min_length=1, description=(
        "dimension order of the tensors: [E, in, out], [E, out, in], or 2-D with the experts stacked along "
        "the rows, [E*out, in] or [E*in, out] (DBRX); a list of such orders accepts each (the first that "
        "every tensor's shape fits is used: producers disagree, e.g. the Hub's Qwen3-VL-MoE [E, in, out] and "
        "transformers 5 save_pretrained's [E, out, in])"))
    down_layout: tuple[FusedDim, ...] | None = Field(default=None, description=(
        "the down tensor's own dimension order when it differs from the gate/up tensors' (DBRX: w1/v1 "
        "[E*out, in], w2 [E*in, out]); absent: down follows layout"))
    gate_up_order: Literal["concatenated", "interleaved"] = Field(
        default="concatenated", description="how gate and up share the out dimension of gate_up")
    gate_up_bias: str | None = Field(default=None, description="[E, 2*intermediate] bias, same gate/up order")
    down_bias: str | None = Field(default=None, description="[E, hidden] bias of the down projection")

    @field_validator("layout", mode="before")
    @classmethod
    def _one_or_many(cls, layout: Any) -> Any:
        if isinstance(layout, (list, tuple)) and layout and all(isinstance(d, str) for d in layout):
            return [layout]
        return layout

    @field_validator("layout")
    @classmethod
    def _layout(cls, layouts: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
        for layout in layouts:
            _check_layout(layout, "fused.layout")
        if len(set(layouts)) != len(layouts):
            raise ValueError("fused.layout lists the same order twice")
        return layouts

    @field_validator("down_layout")
    @classmethod
    def _down_layout(cls, layout: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if layout is not None:
            _check_layout(layout, "fused.down_layout")
        return layout

    @model_validator(mode="after")
    def _gate_up_or_apart(self) -> FusedExperts:
        if (self.gate_up is None) == (self.gate is None and self.up is None) or (self.gate is None) != (
                self.up is None):
            raise ValueError("fused needs gate_up (gate and up in one tensor) or both gate and up, not both forms")
        if self.gate_up is None and self.gate_up_bias is not None:
            raise ValueError("fused.gate_up_bias needs fused.gate_up")
        return self

    @property
    def layouts(self) -> tuple[tuple[str, ...], ...]:
        """The accepted dimension orders, in the order they are tried."""
        return tuple(tuple(lay) for lay in self.layout)

    @property
    def gate_up_names(self) -> tuple[str, ...]:
        """The tensor(s) holding gate and up: (gate_up,) or (gate, up)."""
        return (self.gate_up,) if self.gate_up is not None else (self.gate, self.up)  # type: ignore[return-value]


class ExpertNaming(Strict):
    """Another producer's names for a per-expert layer (router, expert prefix, projections), under the
    same ``naming.layer``; e.g. GPTQModel's ``mlp.experts.{expert}.gate_proj`` for Mixtral."""

    router: str = Field(description="the router module, relative to naming.layer (its weight is <router>.weight)")
    expert: str = Field(description="one expert's module, relative to naming.layer, with {expert}")
    projections: dict[Role, str] = Field(
        description="the gate, up and down projections' module names under the expert")

    @model_validator(mode="after")
    def _placeholders(self) -> ExpertNaming:
        check_template(self.expert, ("expert",), "naming.alternatives[].expert")
        if "{expert}" not in self.expert:
            raise ValueError("naming.alternatives[].expert must contain {expert}")
        if set(self.projections) != {"gate", "up", "down"}:
            raise ValueError("naming.alternatives[].projections needs gate, up and down")
        return self


class Naming(Strict):
    """How checkpoints name a MoE layer's tensors; ``{layer}`` and ``{expert}`` are filled in.

    Experts are named one by one (``expert`` + ``projections``), ``fused`` as 3-D tensors, or both
    when producers differ (the checkpoint decides: fused when its ``gate_up`` tensor is there).
    The router's weight is ``<router>.weight``; a ``<router>.bias`` beside it is added to the logits."""

    layer: str = Field(default="model.layers.{layer}", description=(
        "prefix of one decoder layer's tensors, with {layer}; default model.layers.{layer}"))
    layer_alternatives: list[str] = Field(default_factory=list, description=(
        "other prefixes of one decoder layer, with {layer}, tried in order when the checkpoint holds no tensor "
        "under naming.layer (a text-only checkpoint of a multimodal family: model.layers.{layer}). Scope rules in "
        "a quantization config are matched against naming.layer's module names only"))
    router: str = Field(description="the router module, relative to naming.layer (its weight is <router>.weight)")
    correction_bias: str | None = Field(default=None, description=(
        "the router's per-expert selection bias tensor, relative to naming.layer; absent: none"))
    expert: str | None = Field(default=None, description=(
        "one expert's module, relative to naming.layer, with {expert}; needs projections"))
    projections: dict[Role, str] | None = Field(default=None, description=(
        "the gate, up and down projections' module names under the expert"))
    fused: FusedExperts | None = Field(default=None, description=(
        "the experts as a few stacked tensors instead of (or beside) expert + projections"))
    alternatives: list[ExpertNaming] = Field(default_factory=list, description=(
        "other producers' per-expert names for the same layer (router, expert, projections), tried in order "
        "after expert + projections: the checkpoint decides, by the first naming whose first expert's "
        "tensors or router it holds. Scope rules in a quantization config (ignore, dynamic) are matched "
        "against the primary naming's module names only"))

    @model_validator(mode="after")
    def _placeholders(self) -> Naming:
        check_template(self.layer, ("layer",), "naming.layer")  # no {layer.__class__}: format reads attributes
        if self.expert is not None:
            check_template(self.expert, ("expert",), "naming.expert")
        if "{layer}" not in self.layer:
            raise ValueError("naming.layer must contain {layer}")
        for alt in self.layer_alternatives:
            check_template(alt, ("layer",), "naming.layer_alternatives[]")
            if "{layer}" not in alt:
                raise ValueError("naming.layer_alternatives[] must contain {layer}")
        if self.fused is not None and self.expert is None and self.projections is None:
            return self
        if self.expert is None or self.projections is None:
            raise ValueError("naming needs expert + projections (one tensor per expert), fused (3-D tensors) "
                             "or both")
        if "{expert}" not in self.expert:
            raise ValueError("naming.expert must contain {expert}")
        if set(self.projections) != {"gate", "up", "down"}:
            raise ValueError("naming.projections needs gate, up and down")
        return self

    def modules(self, layer: int, experts: Iterable[int]) -> tuple[str, ...]:
        """Module names of ``experts``' projections in ``layer``, as quantization configs name them:
        per expert when the family names experts so, else the two fused 3-D tensors (which hold every
        expert). One form only, so scope rules written for it see one consistent layer."""
        prefix = self.layer.format(layer=layer)
        if self.expert is None or self.projections is None:
            assert self.fused is not None
            return tuple(f"{prefix}.{t}" for t in (*self.fused.gate_up_names, self.fused.down))
        return tuple(f"{prefix}.{self.expert.format(expert=e)}.{self.projections[p]}"
                     for e in experts for p in ("gate", "up", "down"))


class ConfigClass(Strict):
    """The transformers config class a family's model types are read with, and the defaults it gives the
    fields a config.json leaves out: an absent field takes the value transformers would run with, and
    explain names the class it came from."""

    model_types: list[str] = Field(min_length=1, description=(
        "the family's model_type values (or architectures) transformers reads with this class; for a model "
        "whose MoE fields sit in a sub-config (text_config), the sub-config's class"))
    defaults: dict[str, Any] = Field(default_factory=dict, description=(
        "config.json field (a name a fields or routing entry reads, dotted into sub-objects) → the class's "
        "default, as transformers' own class sets it; tests build the class and compare"))


FieldName = Literal["num_experts", "top_k", "hidden", "intermediate", "num_layers", "activation", "has_bias",
                    "shared_experts", "shared_intermediate", "gated", "latent_size", "zero_experts", "mtp_layers"]
RoutingWord = Literal["scoring", "renormalize", "num_expert_group", "topk_group", "routed_scaling_factor",
                      "correction_bias", "group_score", "router_weight_on_input", "shared_expert_gate"]


class ModelFamilySpec(Strict):
    """How a model family's config.json names MoE fields and how its checkpoints name tensors."""

    family: str = Field(pattern=NAME_RE, description=(
        "the family's name (lowercase, digits, . _ -), unique among families"))
    summary: str = Field(description="one line: the models and what sets their MoE layers apart")
    match: FamilyMatch = Field(description="the config.json model_type or architectures that select this family")
    config_root: list[str] = Field(default_factory=list, description=(
        "sub-configs also searched for fields, after the top level (e.g. text_config); empty: the top level only"))
    fields: dict[FieldName, FieldRef] = Field(description=(
        "where the MoE shape sits in config.json (a name may be a dotted path into a sub-object, e.g. "
        "ffn_config.moe_num_experts): num_experts, top_k, hidden, intermediate (one routed expert's), num_layers, "
        "activation, has_bias, and the shared experts beside the routed ones: shared_experts (how many; 0 or "
        "absent: none) and shared_intermediate (one shared expert's size). Expert forms the kernels here do not "
        "run, reported by explain and refused by run: gated (false: act(up) experts without a gate projection, "
        "Nemotron-H), latent_size (the experts run in a latent space of this width between two projections, "
        "Nemotron-H's moe_latent_size; absent or null: none), zero_experts (how many zero-compute identity "
        "experts the router scores beside the routed ones, LongCat's zero_expert_num). mtp_layers: the "
        "multi-token-prediction layers a checkpoint may ship after the decoder's, numbered on from num_layers "
        "(DeepSeek-V3's num_nextn_predict_layers: layer 61 of a 61-layer config), which transformers' model "
        "does not load and whole.load_model leaves unloaded; absent: none"))
    moe_layers: MoELayers = Field(default_factory=MoELayers, description=(
        "which decoder layers are MoE; default every layer"))
    config_classes: dict[str, ConfigClass] = Field(default_factory=dict, description=(
        "transformers config class name (e.g. DeepseekV3Config) → the model types it reads and its defaults. "
        "A field the config leaves out takes the class's default before the entry's own default, so that "
        "family members whose classes default differently (DeepseekV3Config's routed_scaling_factor 2.5, "
        "Glm4MoeConfig's 1.0) each run as transformers runs them; empty: only the entries' defaults"))
    routing: dict[RoutingWord, FieldRef] = Field(default_factory=dict, description=(
        "how the router picks and weighs experts, as the family's modeling code fixes it: scoring "
        "(softmax, sigmoid; other words name routings no kernel here reproduces, e.g. sparsemixer, "
        "softmax_topk_logits), renormalize, num_expert_group/topk_group (grouped top-k), "
        "routed_scaling_factor, correction_bias (a per-expert bias added to the scores for selection only), "
        "group_score (how grouped top-k scores a group: max, its best score, or top2_sum, the sum of its two "
        "best scores, biased ones when there is a correction bias; default top2_sum with a correction bias, "
        "else max). renormalize may be a number p: the kept weights are divided by their p-norm (DBRX's "
        "moe_normalize_expert_weights); 1 is renormalising to sum 1, other p are not run here. "
        "router_weight_on_input: the router weight scales the expert's input, not its output (Llama 4; top-1). "
        "shared_expert_gate: a sigmoid of one learnt logit per token scales the shared experts' output "
        "(Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE); absent: false. explain shows each value with where it came from: "
        "the config field, the config class's default (config_classes), or the entry's default"))
    requires: dict[str, FieldRule] = Field(default_factory=dict, description=(
        "config.json fields (a dotted path, looked up in each config_root) whose value the modeling code "
        "uses but the kernels here fix, each a detect-style test: e.g. gpt-oss's swiglu_limit: {equals: 7.0, "
        "default: 7.0} (the swigluoai kernels clamp at 7). A config failing one is reported not runnable by "
        "explain and refused by run, naming the field, the value seen and the value wanted"))
    naming: Naming = Field(description="how checkpoints name a MoE layer's router and expert tensors")
    experts_call: Literal["contract", "scaled_rows"] = Field(default="contract", description=(
        "how transformers' MoE block calls its experts module, which a whole model's experts replace: contract, "
        "transformers' experts contract (hidden_states, top_k_index, top_k_weights); scaled_rows, one tensor "
        "[experts x tokens, hidden] holding every token's hidden state once per expert, scaled by its router "
        "score there (zero where the token is not routed), whose output rows the block adds up over the experts "
        "(Llama 4's Llama4TextMoe). whole.load_model finds the experts modules of the model by this form"))

    @field_validator("fields")
    @classmethod
    def _required(cls, fields: dict[str, FieldRef]) -> dict[str, FieldRef]:
        missing = {"num_experts", "top_k", "hidden", "intermediate", "num_layers"} - set(fields)
        if missing:
            raise ValueError(f"fields is missing {', '.join(sorted(missing))}")
        return fields

    @model_validator(mode="after")
    def _config_classes(self) -> ModelFamilySpec:
        names = set(self.match.model_type) | set(self.match.architectures)
        read = {n for ref in (*self.fields.values(), *self.routing.values()) for n in ref.from_}
        seen: dict[str, str] = {}
        for cls_name, cls in self.config_classes.items():
            if re.fullmatch(r"[A-Za-z_]\w*", cls_name) is None:
                raise ValueError(f"config_classes: {cls_name!r} is not a class name")
            for mt in cls.model_types:
                if mt not in names:
                    raise ValueError(f"config_classes.{cls_name}: {mt!r} is not in match (model_type or "
                                     "architectures)")
                if mt in seen:
                    raise ValueError(f"config_classes: {mt!r} is read by both {seen[mt]} and {cls_name}")
                seen[mt] = cls_name
            unread = sorted(set(cls.defaults) - read)
            if unread:
                raise ValueError(f"config_classes.{cls_name}.defaults: {', '.join(unread)} is read by no fields "
                                 "or routing entry")
        return self


# ---------------------------------------------------------------- format specs

IMPL_RE = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class ConverterSpec(Strict):
    """One function turning the format's tensors into one kernel layout."""

    layout: str = Field(pattern=NAME_RE, description="the kernel layout it produces (kernel specs name it in "
                                                     "`layout`; `nk` is documented in moe_registry/formats/weights.py)")
    impl: str = Field(pattern=IMPL_RE, description=(
        "module:function, in moe_registry.formats or (user specs) a package inside the declaring spec dir; "
        "imported only when a layer is built"))


class FormatSpec(Strict):
    """A checkpoint format: how a scheme's tensors are laid out on disk, and the converters that read
    it into kernel layouts (found by (format, layout), never chosen by an ``if``)."""

    format: str = Field(pattern=NAME_RE, description="the name scheme specs give in checkpoint.format")
    summary: str = Field(description="one line: what the producer writes")
    converters: list[ConverterSpec] = Field(min_length=1, description="one per kernel layout it can produce")
    holds: list[str] = Field(default_factory=lambda: ["*"], min_length=1, description=(
        "the weight keys the format can hold, as key patterns (* any run of characters), e.g. "
        "\"e2m1 scale:e8m0:group(32):*\" (default: any); a scheme binding the format to another key is "
        "refused before its converter runs"))

    @field_validator("holds")
    @classmethod
    def _holds(cls, holds: list[str]) -> list[str]:
        check_key_patterns(holds)
        return holds

    @field_validator("converters")
    @classmethod
    def _one_per_layout(cls, converters: list[ConverterSpec]) -> list[ConverterSpec]:
        layouts = [c.layout for c in converters]
        if len(set(layouts)) != len(layouts):
            raise ValueError("two converters for one layout; the choice would be ambiguous")
        return converters


SPEC_KINDS: dict[str, type[Strict]] = {
    "scheme": SchemeSpec, "kernel": KernelSpec, "family": ModelFamilySpec, "format": FormatSpec,
    "keyset": KeySetSpec,
}


__all__ = ["SPEC_KINDS", "SchemeSpec", "KernelSpec", "ModelFamilySpec", "FormatSpec", "KeySetSpec"]
