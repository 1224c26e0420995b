"""AutoAWQ GEMM checkpoints -> ``nk``.

Per projection: qweight int32 [in, out/8], qzeros int32 [ceil(in/g), out/8], scales float16
[ceil(in/g), out]; value = (q - z) · s. AutoAWQ packs eight output columns per word in an
interleaved order: nibble i (bits 4i..4i+3) of word j holds output column 8j + ORDER[i] (vLLM reads
it back with the inverse, [0, 4, 1, 5, 2, 6, 3, 7]). Zero points are stored as-is (no offset).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.formats.assemble import (
    Namer,
    ProjectionPart,
    assemble,
    layout_scale_dtype,
)
from moe_registry.formats.bitpack import pack_nibbles, unpack_int32
from moe_registry.formats.checks import cast_scales, check_scales, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["AWQ_ORDER", "convert_awq_gemm"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble i of an AWQ word holds output column 8j + AWQ_ORDER[i]."""


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    qweight = require(tensors, "qweight", name("qweight"))
    qzeros = require(tensors, "qzeros", name("qzeros"))
    scales = require(tensors, "scales", name("scales"))
    check_scales(scales, name("scales"))
    codes = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER)  # [K, N]
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER)  # [G, N]; every nibble is a valid uint4
    return ProjectionPart(
        weight=pack_nibbles(codes.t()),
        scale=cast_scales(scales.t(), layout_scale_dtype(ctx.weight_key), name("scales")).contiguous(),
        zero=zeros.t().to(torch.uint8).contiguous(),
    )


def convert_awq_gemm(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """AutoAWQ GEMM (uint4 with per-group zero points) to ``nk``."""
    return assemble(experts, ctx, _projection)
