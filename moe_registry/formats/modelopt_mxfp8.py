"""ModelOpt MXFP8 checkpoints -> ``nk``.

Per projection: weight float8_e4m3fn [out, in]; weight_scale uint8 [out, in/32], each an E8M0
exponent (value 2^(e − 127)) shared by 32 input elements. 255 is E8M0's NaN and is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.formats.assemble import Namer, ProjectionPart, assemble
from moe_registry.formats.checks import check_e8m0_codes, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_modelopt_mxfp8"]


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight", name("weight"))
    scale = require(tensors, "weight_scale", name("weight_scale"))
    check_e8m0_codes(scale, name("weight_scale"))
    return ProjectionPart(weight=weight, scale=scale.to(torch.uint8))


def convert_modelopt_mxfp8(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """MXFP8 (fp8e4m3 with an E8M0 scale per 32 inputs) to ``nk``."""
    return assemble(experts, ctx, _projection)
