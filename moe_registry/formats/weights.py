"""Converted expert weights in a kernel layout: the one structure every converter returns and
every Experts class reads.

Layout ``nk`` (the layout all shipped kernels take): every matrix is [E, N, K] with N the output
features and K the input features. ``w13`` stacks gate then up along N (N = 2·I, rows [0, I) are
gate, rows [I, 2I) up); ``w2`` is down, [E, H, I].

Per weight scalar type (``ExpertWeights.weight_key.dtype``):

- unquantized: ``weight`` in the activation dtype.
- 4-bit (uint4, uint4b8, int4): ``weight`` uint8 [E, N, K/2]; input element k sits in byte k//2,
  the low nibble for even k, the high nibble for odd k. Stored values are raw codes.
- int8: int8 [E, N, K]. uint8b128: uint8 [E, N, K] raw codes (value = code − 128).
- fp8e4m3: torch.float8_e4m3fn [E, N, K].
- e2m1 (FP4): uint8 [E, N, K/2] as the 4-bit integer types (low nibble: even k); each nibble is an
  e2m1 code (value table in ``moe_registry_kernels.fp4``).

``scale``: [E, N/rows, K/cols] rounded up, in the key's scale dtype (e8m0 as raw uint8 exponents,
value 2^(e−127)); per-channel and per-tensor weight scales are both stored expanded as [E, N, 1]
float32, which is exact and lets a per-tensor gate and up keep their own scales after fusion.
``zero``: uint8 [E, N, K/group] raw zero-point codes (value = (code − zero) · scale).
``perm``: act-order; int32 [E, K]; stored column j holds original input column perm[j], so groups
are contiguous in stored order (group of stored column j is j // group) and out = x[:, perm] @ Wᵀ.
fp8e4m3 group scales (NVFP4) are stored as torch.float8_e4m3fn.
``scale2``: a second-level (global) weight scale, float32 [E, N, 1] (per expert, expanded over rows as
per-tensor scales are, so gate and up keep their own); value = code value · scale · scale2.
``bias``: [E, N] float32. ``input_scale``: static activation scale, float32 [1] (the largest
over experts, as the checkpoint's per-expert scales are collapsed to one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_registry.core.keys import QuantKey

# the tensors whose bytes a layer's memory is: codes, scales, zero points
BULK_FIELDS = ("weight", "scale", "zero")


@dataclass(frozen=True)
class ProjectionWeights:
    """One fused projection (w13 or w2) of all experts, in a kernel layout."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    scale2: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ProjectionWeights:
        """These weights on ``device``: new tensors where they move, the same ones where they are
        already there (Tensor.to); this one is left as it is."""
        moved = {k: (None if v is None else v.to(device)) for k, v in self.__dict__.items()}
        return ProjectionWeights(**moved)

    def not_held_in(self, held: dict[str, torch.Tensor | None]) -> list[str]:
        """The BULK_FIELDS present here whose tensor ``held`` (by field) does not hold itself (the same
        storage): the ones a kernel copied (another layout, padding, a device copy)."""
        def same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
            return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        return [f for f in BULK_FIELDS if getattr(self, f) is not None and not same(getattr(self, f), held.get(f))]

    def with_stand_ins(self, *fields: str) -> ProjectionWeights:
        """A copy whose tensors ``fields`` (those present) are one-element stand-ins of the same shape,
        dtype and device: what a kernel that holds its own copy of them keeps, so the layer's shapes
        and keys stay readable without pinning the converted tensors twice."""
        def stand_in(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
        replaced = {f: stand_in(getattr(self, f)) for f in fields if getattr(self, f) is not None}
        return dataclasses.replace(self, **replaced)

    def subset(self, experts: torch.Tensor) -> ProjectionWeights:
        """The projection of ``experts`` (int64 global ids, in that order) alone: every per-expert tensor
        indexed along its first dimension; the layer-wide ``input_scale`` kept."""
        picked = {k: (v if v is None or k == "input_scale" else v.index_select(0, experts.to(v.device)))
                  for k, v in self.__dict__.items()}
        return ProjectionWeights(**picked)


@dataclass(frozen=True)
class ExpertWeights:
    """All experts of one MoE layer: w13 (gate+up) and w2 (down), with the keys they are in."""

    w13: ProjectionWeights
    w2: ProjectionWeights
    weight_key: QuantKey
    activation_key: QuantKey
    layout: str = "nk"

    @property
    def device(self) -> torch.device:
        return self.w13.weight.device

    @property
    def num_experts(self) -> int:
        return int(self.w13.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w2.weight.shape[1])

    @property
    def intermediate_size(self) -> int:
        return int(self.w13.weight.shape[1]) // 2

    def to(self, device: torch.device | str) -> ExpertWeights:
        return ExpertWeights(self.w13.to(device), self.w2.to(device), self.weight_key,
                             self.activation_key, self.layout)

    def subset(self, experts: torch.Tensor) -> ExpertWeights:
        """The weights of ``experts`` alone, in that order (the experts one expert-parallel rank holds)."""
        return ExpertWeights(self.w13.subset(experts), self.w2.subset(experts), self.weight_key,
                             self.activation_key, self.layout)
