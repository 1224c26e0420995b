"""Unquantized checkpoints -> ``nk``: weight [out, in] (bf16/fp16/fp32) cast to the activation
dtype the layer runs in, so the kernel never casts weights per call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.formats.assemble import Namer, ProjectionPart, assemble
from moe_registry.formats.checks import require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_unquantized"]


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    return ProjectionPart(weight=require(tensors, "weight", name("weight")).to(ctx.activation_dtype))


def convert_unquantized(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """Plain float weights to ``nk`` in ``ctx.activation_dtype``."""
    return assemble(experts, ctx, _projection)
