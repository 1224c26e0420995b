"""FP8 block-scaled checkpoints (DeepSeek-V3) and FP8 per-tensor / per-channel checkpoints (AutoFP8,
ModelOpt FP8, compressed-tensors FP8 / FP8_DYNAMIC) -> ``nk``.

Per projection: weight float8_e4m3fn [out, in]; weight_scale_inv float32 [ceil(out/128),
ceil(in/128)], the multiplier of each 128x128 block (despite the name, value = fp8 · scale_inv).
Fusing gate and up along N concatenates their block rows, which is only exact when the
intermediate size is a multiple of the block's rows; otherwise one block would straddle both.

Per-tensor / per-channel (:func:`convert_fp8_scaled`): weight float8_e4m3fn [out, in]; weight_scale
[] / [1] (per tensor) or [out] / [out, 1] (per channel), float32 or bfloat16 (compressed-tensors),
the multiplier of the codes; optional input_scale [] / [1], the static activation scale. Weight
scales are widened to float32 (exact) and stored expanded as [N, 1], so a per-tensor gate and up
keep their own scales after fusion (vLLM requantises w13 to one scale instead). Static input scales
are read only when the bound activation key is static and collapse over gate/up and experts by max
(the one scale the fused kernel applies, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.core.errors import CheckpointError
from moe_registry.formats.assemble import (
    Namer,
    ProjectionPart,
    assemble,
    layout_scale_dtype,
    scaled_projection,
)
from moe_registry.formats.checks import cast_scales, check_scales, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_fp8_block", "convert_fp8_block_ct", "convert_fp8_scaled"]


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight", name("weight"))
    scale = require(tensors, "weight_scale_inv", name("weight_scale_inv"))
    check_scales(scale, name("weight_scale_inv"))
    return ProjectionPart(
        weight=weight,
        scale=cast_scales(scale, layout_scale_dtype(ctx.weight_key), name("weight_scale_inv")),
    )


def _projection_ct(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    """compressed-tensors FP8_BLOCK names the block multipliers weight_scale (DeepSeek: weight_scale_inv)."""
    return _projection({"weight": require(tensors, "weight", name("weight")),
                        "weight_scale_inv": require(tensors, "weight_scale", name("weight_scale"))},
                       lambda t: name("weight_scale") if t == "weight_scale_inv" else name(t), ctx)


def _check_fusable(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> None:
    rows = ctx.weight_key.scale.group.rows if ctx.weight_key.scale is not None else -1
    if rows <= 1 or "gate" not in ctx.roles:  # one projection: nothing is fused, a partial last block straddles nothing
        return
    for e, tensors in enumerate(experts):
        for role in ("gate", "up"):
            weight = tensors.get(role, {}).get("weight")
            if weight is not None and int(weight.shape[0]) % rows:
                raise CheckpointError(
                    f"{ctx.tensor_name(e, role, 'weight')}: {int(weight.shape[0])} output rows, not a "
                    f"multiple of the {rows}-row scale block; gate and up block scales cannot be fused "
                    f"into w13 (a block would straddle gate and up); expected intermediate size % {rows} == 0"
                )


def convert_fp8_block(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """fp8e4m3 weights with float32 block scales to ``nk``."""
    _check_fusable(experts, ctx)
    return assemble(experts, ctx, _projection)


def convert_fp8_block_ct(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """compressed-tensors FP8_BLOCK: as :func:`convert_fp8_block`, the scales named weight_scale."""
    _check_fusable(experts, ctx)
    return assemble(experts, ctx, _projection_ct)


def convert_fp8_scaled(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """fp8e4m3 weights with per-tensor or per-channel scales (static or dynamic fp8 activations) to ``nk``."""
    return assemble(experts, ctx, scaled_projection)
