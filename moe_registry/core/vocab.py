"""The closed vocabulary every stage shares: activation dtypes, activation functions and formats,
kernel features, devices, shape dimensions and all2all backends. Specs validate against these
Literals, the runtime and CLI check flags against them, kernels and tools read them; a new word
is added here once (and, for all2all, only when code implements it: docs/design.md,
"Declared support is tested support")."""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["float16", "bfloat16", "float32"]
"""Activation dtypes a layer may run in."""

ActivationFn = Literal["silu", "gelu", "swigluoai"]
"""Gated activations over the fused gate/up projection (swigluoai: gpt-oss's clamped swiglu)."""

ActivationFormat = Literal["standard", "batched"]
"""How tokens reach the experts: one [tokens, hidden] tensor with routing, or [experts, max tokens,
hidden] per expert (what a batched all2all delivers)."""

Feature = Literal["bias", "zero_point", "act_order", "router_weight_on_input"]
"""Optional parts of a layer a kernel declares it handles."""

Device = Literal["cpu", "cuda", "rocm", "xpu"]
"""Device kinds a kernel spec may name (``xpu`` is accepted in specs; no shipped kernel runs there)."""

ShapeDim = Literal["hidden", "intermediate", "experts", "top_k", "tokens"]
"""Dimensions a kernel spec may limit."""

All2All = Literal["none", "naive", "allgather_reducescatter", "deepep_high_throughput", "pplx", "deepep_low_latency"]
"""Expert-parallel dispatch backends a situation may name (vLLM's names; ``none``: no EP dispatch).
A kernel spec claims only those this code implements (KernelAll2All)."""

KernelAll2All = Literal["none", "allgather_reducescatter"]
"""The all2all backends this code implements: the only ones a kernel spec may claim
(docs/design.md, "Declared support is tested support").
``none``: the layer moves no tokens (its caller hands each rank its experts' pairs);
``allgather_reducescatter``: moe_registry.layer.all2all.AllGatherReduceScatter over torch.distributed."""

ExpertPlacement = Literal["contiguous", "round_robin"]
"""Which rank owns which expert under expert parallelism (vLLM's ``--expert-placement-strategy``:
linear, round_robin): ``contiguous``, rank r holds experts [r*n, (r+1)*n); ``round_robin``, expert e
lives on rank e mod ep."""

Role = Literal["gate", "up", "down"]
"""An expert's projections."""

DTYPES: tuple[str, ...] = get_args(Dtype)
ACTIVATION_FNS: tuple[str, ...] = get_args(ActivationFn)
ACTIVATION_FORMATS: tuple[str, ...] = get_args(ActivationFormat)
FEATURES: tuple[str, ...] = get_args(Feature)
DEVICES: tuple[str, ...] = get_args(Device)
ALL2ALL_BACKENDS: tuple[str, ...] = get_args(All2All)
ALL2ALL_IMPLEMENTED: tuple[str, ...] = get_args(KernelAll2All)  # the rest are known names, not implemented here
EXPERT_PLACEMENTS: tuple[str, ...] = get_args(ExpertPlacement)
ROLES: tuple[str, ...] = get_args(Role)

ALL2ALL_DELIVERS: dict[str, tuple[str, ...]] = {
    "none": ("standard",), "naive": ("standard",), "allgather_reducescatter": ("standard", "batched"),
    "deepep_high_throughput": ("standard",), "pplx": ("batched",), "deepep_low_latency": ("batched",),
}
"""The activation formats each all2all backend can hand to the experts, the first a kernel takes winning."""
assert set(ALL2ALL_DELIVERS) == set(ALL2ALL_BACKENDS)
