"""compressed-tensors int4 checkpoints (W4A16 / W4A8) -> ``nk``, in the two formats it saves them.

'pack-quantized': weight_packed int32 [out, in/8], eight 4-bit values along the input per word, low
nibble first, each a signed int4 stored offset by +8 (so the codes are uint4b8); weight_scale
[out, in/g] (bf16/fp16); weight_shape [2] (the unpacked shape; redundant, ignored); optional
weight_zero_point, which must be all zero: only symmetric checkpoints are supported.

'int-quantized' with 4-bit weights (what llm-compressor 0.14 writes for its W4A8 preset): weight
int8 [out, in] holding the signed int4 values -8..7 unpacked, weight_scale as above.

Scales are cast to the dtype the bound weight key names (checkpoints hold bf16 or fp16): the
converter decides the cast, and refuses a value that the target dtype turns into zero or inf.
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
from moe_registry.formats.bitpack import pack_nibbles, unpack_int32
from moe_registry.formats.checks import cast_scales, check_scales, describe_bad, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_compressed_tensors_pack", "convert_compressed_tensors_int4"]


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    packed = require(tensors, "weight_packed", name("weight_packed"))
    scales = require(tensors, "weight_scale", name("weight_scale"))
    check_scales(scales, name("weight_scale"))
    zp = tensors.get("weight_zero_point")
    if zp is not None and bool((zp != 0).any()):
        raise CheckpointError(
            f"{name('weight_zero_point')}: asymmetric zero points: {describe_bad(zp, zp != 0, 'non-zero')}; "
            "expected all 0 (only symmetric pack-quantized checkpoints are supported)"
        )
    codes = unpack_int32(packed, 4, dim=1)  # [N, K] uint4b8 codes
    return ProjectionPart(
        weight=pack_nibbles(codes),
        scale=cast_scales(scales, layout_scale_dtype(ctx.weight_key), name("weight_scale")).contiguous(),
    )


INT4_MIN, INT4_MAX = -8, 7


def _int4_projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight", name("weight"))
    scales = require(tensors, "weight_scale", name("weight_scale"))
    check_scales(scales, name("weight_scale"))
    bad = (weight < INT4_MIN) | (weight > INT4_MAX)
    if bool(bad.any()):
        raise CheckpointError(f"{name('weight')}: {describe_bad(weight, bad, 'outside the int4 range')}; "
                              f"expected signed 4-bit values {INT4_MIN}..{INT4_MAX} stored in int8")
    codes = weight.to(torch.int16) - INT4_MIN  # uint4b8: value + 8
    return ProjectionPart(
        weight=pack_nibbles(codes),
        scale=cast_scales(scales, layout_scale_dtype(ctx.weight_key), name("weight_scale")).contiguous(),
    )


def convert_compressed_tensors_int4(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """Symmetric int4 values stored one per int8 (uint4b8 codes after +8, per-group scales) to ``nk``."""
    expect_weight_type(ctx, "compressed-tensors-int4", "uint4b8")
    return assemble(experts, ctx, _int4_projection)


def convert_compressed_tensors_pack(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """Symmetric int4 pack-quantized (uint4b8 codes, per-group scales) to ``nk``."""
    expect_weight_type(ctx, "compressed-tensors-pack", "uint4b8")
    return assemble(experts, ctx, _projection)
