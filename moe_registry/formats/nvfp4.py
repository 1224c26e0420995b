"""NVFP4 checkpoints -> ``nk``, the codes kept packed (the kernels read them).

Per projection: packed e2m1 codes uint8 [out, in/2] (low nibble the even input: ModelOpt's
NVFP4QTensor packs ``q[..., 1::2] << 4 | q[..., 0::2]``, compressed-tensors' pack_fp4_to_uint8 alike),
float8_e4m3fn group scales [out, in/16] and one float32 global scale per projection, which the two
producers store inversely:

- ModelOpt (``weight``, ``weight_scale``, ``weight_scale_2``): value = code · (scale · weight_scale_2);
- compressed-tensors ``nvfp4-pack-quantized`` (``weight_packed``, ``weight_scale``,
  ``weight_global_scale``): value = code · (scale / weight_global_scale) (its dequantize divides).

Both become ``scale2`` [out, 1] float32 (the multiplier); compressed-tensors' global scale is
inverted once here. Bad scales are refused naming the tensor: an e4m3 NaN code (0x7f/0xff) at load (core.guards) and a
global scale that is zero, negative, NaN or infinite.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.core.errors import CheckpointError
from moe_registry.formats.assemble import Namer, ProjectionPart, assemble
from moe_registry.formats.checks import require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_modelopt_nvfp4", "convert_compressed_tensors_nvfp4"]


def _global_scale(value: torch.Tensor, full_name: str, out: int, invert: bool) -> torch.Tensor:
    """A per-projection float32 global scale, checked, as the multiplier expanded to [out, 1]."""
    v = value.reshape(-1).to(torch.float32)
    if v.numel() != 1:
        raise CheckpointError(f"{full_name}: {v.numel()} values; expected one global scale")
    x = float(v[0])
    if not (x > 0 and x != float("inf")):  # NaN fails x > 0 too
        raise CheckpointError(f"{full_name}: global scale {x}; expected a finite value > 0")
    mult = torch.reciprocal(v) if invert else v
    return mult.reshape(1, 1).expand(out, 1).contiguous()


def _input_scale(tensors: Mapping[str, torch.Tensor], name: str, full_name: str) -> None:
    """The static activation scale is the checkpoint's W4A4 half; the run emulates it away (16-bit
    activations), but a NaN or non-positive one is still a broken file."""
    if name in tensors:
        x = float(tensors[name].reshape(-1).float()[0])
        if not (x > 0 and x != float("inf")):
            raise CheckpointError(f"{full_name}: activation global scale {x}; expected a finite value > 0")


def _modelopt(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight", name("weight"))
    scale = require(tensors, "weight_scale", name("weight_scale")).contiguous()  # NaN codes: refused at load
    out = int(weight.shape[0])
    scale2 = _global_scale(require(tensors, "weight_scale_2", name("weight_scale_2")), name("weight_scale_2"), out,
                           invert=False)
    _input_scale(tensors, "input_scale", name("input_scale"))
    return ProjectionPart(weight=weight.contiguous(), scale=scale, scale2=scale2)


def _compressed_tensors(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    weight = require(tensors, "weight_packed", name("weight_packed"))
    scale = require(tensors, "weight_scale", name("weight_scale")).contiguous()  # NaN codes: refused at load
    out = int(weight.shape[0])
    scale2 = _global_scale(require(tensors, "weight_global_scale", name("weight_global_scale")),
                           name("weight_global_scale"), out, invert=True)
    _input_scale(tensors, "input_global_scale", name("input_global_scale"))
    return ProjectionPart(weight=weight.contiguous(), scale=scale, scale2=scale2)


def convert_modelopt_nvfp4(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """ModelOpt NVFP4 (weight, weight_scale, weight_scale_2) to ``nk``."""
    return assemble(experts, ctx, _modelopt)


def convert_compressed_tensors_nvfp4(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """compressed-tensors nvfp4-pack-quantized (weight_packed, weight_scale, weight_global_scale) to ``nk``."""
    return assemble(experts, ctx, _compressed_tensors)
