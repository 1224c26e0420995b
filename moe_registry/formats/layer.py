"""One layer's checkpoint tensors through the converter: its experts converted, and the rule for what a
layer holds once for all its experts. A static activation scale (``input_scale``) is per expert in the
checkpoint but one value for the layer in every kernel (the largest, as vLLM takes it); an expert-parallel rank
that reads only its experts takes that largest over every expert's scale, so it quantizes activations exactly as
the single-process layer does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from moe_registry.checkpoint.read import LAYER_WIDE, LayerTensors
from moe_registry.core.errors import CheckpointError, MoERegistryError
from moe_registry.formats.registry import ConvertContext, Converter
from moe_registry.formats.stacked import experts_of, layer_wide_of
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights


def convert_layer(convert: Converter, tensors: LayerTensors, ctx: ConvertContext) -> ExpertWeights:
    """Convert the experts ``tensors`` holds. Read for a subset of them (an expert-parallel rank), messages
    name experts by their global ids, and the layer-wide ``input_scale`` (the largest over ALL experts in the
    single-process layer) is taken over every expert's checkpoint scale (:func:`layer_wide_of`), so each
    rank quantizes activations exactly as the single-process layer does."""
    ids = tensors.expert_ids
    if ids is None:
        return convert(experts_of(tensors), ctx)
    name = ctx.tensor_name
    weights = convert(experts_of(tensors), replace(ctx, tensor_name=lambda e, role, t: name(ids[e], role, t)))
    return replace(weights, w13=_layer_wide(weights.w13, tensors, ("gate", "up"), name),
                   w2=_layer_wide(weights.w2, tensors, ("down",), name))


def _layer_wide(proj: ProjectionWeights, tensors: LayerTensors, roles: tuple[str, ...],
                name: Any) -> ProjectionWeights:
    """``proj`` with its input_scale the largest over every expert's ``roles`` checkpoint scale (float32, as
    the converters take it). Checked: over this rank's experts it must be the converter's own value, so a
    converter that derives the scale otherwise fails here instead of giving ranks a wrong one."""
    if proj.input_scale is None:  # the converter keeps no static activation scale (e.g. weight-only runs)
        return proj
    assert tensors.expert_ids is not None
    found = {(e, r): t.to(torch.float32).reshape(()) for e, wide in enumerate(layer_wide_of(tensors)) for r in roles
             for key, t in wide.get(r, {}).items() if key in LAYER_WIDE}
    for (e, r), v in found.items():
        if not (float(v) > 0 and float(v) != float("inf")):
            raise CheckpointError(f"{name(e, r, 'input_scale')}: {float(v)}; expected a finite scale > 0")
    own = [v for (e, _), v in found.items() if e in tensors.expert_ids]
    if not own or not torch.equal(torch.stack(own).max().reshape(1), proj.input_scale.to(torch.float32)):
        raise MoERegistryError(f"expert parallelism: the converter's input_scale {proj.input_scale.tolist()} is not "
                               f"the largest checkpoint input_scale of this rank's experts; wanted the converter to "
                               f"take it as stored, so every rank can use the layer's largest")
    return replace(proj, input_scale=torch.stack(list(found.values())).max().reshape(1).to(proj.input_scale.dtype))
