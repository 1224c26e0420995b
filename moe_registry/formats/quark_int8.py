"""Quark INT8 (and compressed-tensors int8 W8A8) checkpoints -> ``nk``.

Per projection: weight int8 [out, in]; weight_scale per-channel ([out] or [out, 1]) or per-tensor
([] or [1]) in bf16/fp16/fp32 (Quark 0.13 writes bf16 [out] per channel and fp32 [] per tensor,
compressed-tensors bf16 [out, 1]); optional input_scale [] (static per-tensor activation scale).
Quark also writes int8 weight_zero_point / input_zero_point tensors; the scheme specs declare them
with ``all_equal: 0``, so the loader has checked them before this converter runs and they are not
read here. Every scale is widened to float32 here, exactly, whatever dtype the checkpoint holds.
Weight scales are stored expanded as float32 [N, 1], so a per-tensor gate and up keep their own
scales after fusion. Static activation scales are collapsed over gate/up and experts by max, the
one scale the fused kernel can apply; they are read only when the bound activation key is static
(a dynamic scheme computes its own per-token scales and ignores any stored ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_registry.formats.assemble import assemble, scaled_projection
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_quark_int8"]


def convert_quark_int8(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """INT8 weights with per-channel or per-tensor scales (static or dynamic activations) to ``nk``."""
    return assemble(experts, ctx, scaled_projection)
