"""FP8 block-scaled checkpoints (DeepSeek-V3) -> ``nk``.

Per projection: weight float8_e4m3fn [out, in]; weight_scale_inv float32 [ceil(out/128),
ceil(in/128)], the multiplier of each 128x128 block (despite the name, value = fp8 · scale_inv).
Fusing gate and up along N concatenates their block rows, which is only exact when the
intermediate size is a multiple of the block's rows; otherwise one block would straddle both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.core.errors import CheckpointError
from moe_registry.formats.assemble import (
    Namer,
    ProjectionPart,
    assemble,
    expect_weight_type,
    layout_scale_dtype,
)
from moe_registry.formats.checks import cast_scales, check_scales, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_fp8_block"]


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight", name("weight"))
    scale = require(tensors, "weight_scale_inv", name("weight_scale_inv"))
    check_scales(scale, name("weight_scale_inv"))
    return ProjectionPart(
        weight=weight,
        scale=cast_scales(scale, layout_scale_dtype(ctx.weight_key), name("weight_scale_inv")),
    )


def _check_fusable(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> None:
    rows = ctx.weight_key.scale.group.rows if ctx.weight_key.scale is not None else -1
    if rows <= 1:
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
    expect_weight_type(ctx, "fp8-block", "fp8e4m3")
    _check_fusable(experts, ctx)
    return assemble(experts, ctx, _projection)
