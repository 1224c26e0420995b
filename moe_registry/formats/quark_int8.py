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

from collections.abc import Mapping, Sequence

import torch

from moe_registry.core.errors import CheckpointError
from moe_registry.formats.assemble import Namer, ProjectionPart, assemble
from moe_registry.formats.checks import check_scales, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_quark_int8"]


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight", name("weight"))
    ws = require(tensors, "weight_scale", name("weight_scale"))
    check_scales(ws, name("weight_scale"))
    n = int(weight.shape[0])
    if ws.numel() == 1:
        scale = ws.to(torch.float32).reshape(1, 1).expand(n, 1).clone()
    elif ws.numel() == n:
        scale = ws.to(torch.float32).reshape(n, 1)
    else:
        raise CheckpointError(
            f"{name('weight_scale')}: shape {list(ws.shape)} is neither per-tensor ([] or [1]) nor "
            f"per-channel ([{n}] or [{n}, 1]) for {name('weight')} of shape {list(weight.shape)}"
        )
    act = ctx.activation_key.scale
    input_scale = None
    if act is not None and not act.dynamic:
        s = require(tensors, "input_scale", name("input_scale"))
        check_scales(s, name("input_scale"))
        if s.numel() != 1:
            raise CheckpointError(
                f"{name('input_scale')}: shape {list(s.shape)}; expected one per-tensor scale ([] or [1])"
            )
        input_scale = s.to(torch.float32).reshape(())
    return ProjectionPart(weight=weight, scale=scale, input_scale=input_scale)


def convert_quark_int8(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """INT8 weights with per-channel or per-tensor scales (static or dynamic activations) to ``nk``."""
    return assemble(experts, ctx, _projection)
