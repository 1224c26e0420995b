"""A quantized non-expert linear (attention, shared experts, dense MLPs) dequantised once at load, through the
same format converter and dequantiser the experts' kernels are checked against: the checkpoint's tensors of
one linear go in as a one-expert projection of the scheme the oracle chose for that decoder layer, and come
out as the float weight [out, in] transformers' ``nn.Linear`` holds. Activation quantisation is not applied
to these linears (the load report says so)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe_registry.core.errors import CheckpointError, MoERegistryError
from moe_registry.formats import get_converter
from moe_registry.formats.registry import ConvertContext
from moe_registry.oracle.contract import Report
from moe_registry.spec.loader import Registry

DENSE_LAYOUT = "nk"  # the layout the reference dequantiser reads


def dequantize_linear(registry: Registry, report: Report, tensors: Mapping[str, torch.Tensor], module: str,
                      dtype: torch.dtype) -> torch.Tensor:
    """``module``'s float weight [out, in] in ``dtype`` from its checkpoint ``tensors`` (suffix -> tensor),
    read as the scheme of ``report`` stores one projection."""
    from moe_registry_kernels.dequant import dequantize

    assert report.scheme is not None
    scheme = registry.scheme(report.scheme.scheme)
    ctx = ConvertContext(report.scheme.weight_key, report.scheme.activation_key,  # type: ignore[arg-type]
                         torch.float32, dict(report.scheme.bindings),
                         tensor_name=lambda e, role, t: f"{module}.{t}")
    try:
        convert = get_converter(scheme.checkpoint.format, DENSE_LAYOUT, registry)
        # one linear as the down projection of a one-expert layer (gate and up: the same tensors, unused)
        weights = convert([{"gate": tensors, "up": tensors, "down": tensors}], ctx)
    except (MoERegistryError, KeyError, ValueError) as err:
        raise CheckpointError(f"{module}: its tensors ({', '.join(sorted(tensors))}) are not stored as scheme "
                              f"{scheme.scheme} stores them: {err}") from None
    return dequantize(weights.w2, weights.weight_key, dtype=torch.float32)[0].to(dtype)
