"""compressed-tensors integer checkpoints (W4A16 / W8A16 / W4A8) -> ``nk``, in the two formats it saves them.

'pack-quantized' (compressed-tensors' PackedQuantizationCompressor): weight_packed int32
[out, in·bits/32], 32/bits values along the input per word, low bits first, each a signed value
stored offset by 2^(bits-1) (so symmetric codes are uint4b8 / uint8b128); weight_scale
[out, groups] (bf16/fp16; one column per channel); weight_shape [2] (the unpacked shape; redundant,
ignored). Asymmetric schemes (key uint4 / uint8 with zp:group) read weight_zero_point: signed zero
points packed the same way but along the OUTPUT, int32 [out·bits/32, groups]; offset like the
weights, each field is the layout's zero code. Symmetric schemes refuse a non-zero
weight_zero_point. Optional weight_g_idx int32 [in] (actorder 'group', written by
compressed-tensors before 0.19): columns are stored sorted by group, as GPTQ act-order is.

'int-quantized' with 4-bit weights (what llm-compressor 0.14 writes for its W4A8 preset): weight
int8 [out, in] holding the signed int4 values -8..7 unpacked, weight_scale as above.

Scales are cast to the dtype the bound weight key names (checkpoints hold bf16 or fp16): the
converter decides the cast, and refuses a value that the target dtype turns into zero or inf.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.checkpoint.values import describe_bad
from moe_registry.core.errors import CheckpointError
from moe_registry.formats.assemble import (
    Namer,
    ProjectionPart,
    assemble,
    group_size,
    layout_scale_dtype,
)
from moe_registry.formats.bitpack import nk_bytes, pack_nibbles, unpack_int32
from moe_registry.formats.checks import cast_scales, check_scales, require
from moe_registry.formats.gptq import act_order_perm
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_compressed_tensors_pack", "convert_compressed_tensors_int4"]


def _zero_points(tensors: Mapping[str, torch.Tensor], name: Namer, bits: int, n: int,
                 groups: int) -> torch.Tensor:
    """weight_zero_point packed along the output -> uint8 zero codes [N, groups]."""
    zp = require(tensors, "weight_zero_point", name("weight_zero_point"))
    per_word = 32 // bits
    want = (-(-n // per_word), groups)
    if zp.dtype != torch.int32 or tuple(zp.shape) != want:
        raise CheckpointError(
            f"{name('weight_zero_point')}: {str(zp.dtype).removeprefix('torch.')} {list(zp.shape)}; expected "
            f"int32 {list(want)} ({bits}-bit zero points packed {per_word} per word along the {n} outputs)")
    return unpack_int32(zp, bits, dim=0)[:n].to(torch.uint8).contiguous()


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    key = ctx.weight_key
    bits = key.dtype.bits
    packed = require(tensors, "weight_packed", name("weight_packed"))
    scales = require(tensors, "weight_scale", name("weight_scale"))
    check_scales(scales, name("weight_scale"))
    n, k = int(packed.shape[0]), int(packed.shape[1]) * 32 // bits  # codes offset by 2^(bits-1)
    zero = None
    if key.zero_point == "group":
        zero = _zero_points(tensors, name, bits, n, int(scales.shape[-1]))
    elif (zp := tensors.get("weight_zero_point")) is not None and bool((zp != 0).any()):
        raise CheckpointError(
            f"{name('weight_zero_point')}: asymmetric zero points: {describe_bad(zp, zp != 0, 'non-zero')}; "
            "expected all 0 (this scheme is symmetric: symmetric: false checkpoints bind a zp:group key)"
        )
    perm = None
    if "weight_g_idx" in tensors:
        perm = act_order_perm(tensors["weight_g_idx"], k, group_size(key, k), name("weight_g_idx"))
    if perm is None:
        weight = nk_bytes(packed, bits, dim=1)
    else:  # act order: the columns in group order
        codes = unpack_int32(packed, bits, dim=1)[:, perm]
        weight = pack_nibbles(codes) if bits == 4 else codes.to(torch.uint8).contiguous()
    return ProjectionPart(
        weight=weight,
        scale=cast_scales(scales, layout_scale_dtype(key), name("weight_scale")).contiguous(),
        zero=zero,
        perm=perm,
        perm_tensor=None if perm is None else "weight_g_idx",
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
    return assemble(experts, ctx, _int4_projection)


def convert_compressed_tensors_pack(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """pack-quantized 4/8-bit, symmetric (uint4b8 / uint8b128) or with zero points (uint4 / uint8
    zp:group), per group or channel, with or without weight_g_idx, to ``nk``."""
    return assemble(experts, ctx, _projection)
