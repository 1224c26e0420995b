"""MXFP4 checkpoints (gpt-oss; compressed-tensors mxfp4-pack-quantized) -> ``nk``, the codes kept
packed (the kernels read them).

Per projection (after the fused [E, ...] tensors are split per expert and gate/up): ``blocks``
uint8 [out, in/32, 16], 16 bytes of two e2m1 codes per group of 32 inputs, low nibble the even
input (transformers' ``convert_moe_packed_tensors`` reads ``blk & 0x0F`` into column 2j); ``scales``
uint8 [out, in/32], an E8M0 exponent per group (value 2^(e - 127); 255 is E8M0's NaN). The ``nk``
e2m1 layout is the same bytes as [out, in/2]. compressed-tensors stores those bytes as ``weight_packed``
[out, in/2] (pack_fp4_to_uint8: low nibble the even input) and the exponents as ``weight_scale``
[out, in/32] (compress_mx_scale: 127 + floor(log2 scale)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.formats.assemble import Namer, ProjectionPart, assemble
from moe_registry.formats.checks import check_e8m0_codes, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_mxfp4", "convert_compressed_tensors_mxfp4"]


def _part(codes: torch.Tensor, scales: torch.Tensor, scale_name: str) -> ProjectionPart:
    check_e8m0_codes(scales, scale_name)
    return ProjectionPart(weight=codes.reshape(int(codes.shape[0]), -1).contiguous(), scale=scales.contiguous())


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    return _part(require(tensors, "blocks", name("blocks")), require(tensors, "scales", name("scales")),
                 name("scales"))


def _ct_projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    return _part(require(tensors, "weight_packed", name("weight_packed")),
                 require(tensors, "weight_scale", name("weight_scale")), name("weight_scale"))


def convert_mxfp4(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """gpt-oss MXFP4 (blocks, scales) to ``nk``, codes still packed."""
    return assemble(experts, ctx, _projection)


def convert_compressed_tensors_mxfp4(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """compressed-tensors mxfp4-pack-quantized (weight_packed, weight_scale) to ``nk``, codes still packed."""
    return assemble(experts, ctx, _ct_projection)
