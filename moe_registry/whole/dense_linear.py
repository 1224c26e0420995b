"""A quantized non-expert linear (attention, shared experts, dense MLPs): the checkpoint's tensors of one linear go
in as a one-expert projection of the scheme the oracle chose for that decoder layer, through the same format
converter the experts take. Where the layer's kernel has a one-projection form (its spec's ``linear_impl``) the
linear runs on it, packed (:class:`RegistryLinear` takes the place of transformers' ``nn.Linear``); elsewhere it
is dequantised once to the float weight [out, in] transformers' ``nn.Linear`` holds, and its activations run
unquantized (the load report says which)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe_registry.core.errors import CheckpointError, MoERegistryError
from moe_registry.formats import get_converter
from moe_registry.formats.registry import ONE_PROJECTION, ConvertContext
from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.linear import Linear
from moe_registry.oracle.contract import Report
from moe_registry.spec.loader import Registry

DENSE_LAYOUT = "nk"  # the layout the reference dequantiser and the kernels' one-projection forms read


def convert_linear(registry: Registry, report: Report, tensors: Mapping[str, torch.Tensor],
                   module: str) -> ExpertWeights:
    """``module``'s checkpoint ``tensors`` (suffix -> tensor) converted as the scheme of ``report`` stores one
    projection: a one-expert layer whose ``w2`` is the linear (``ONE_PROJECTION``: nothing fused, so a block
    scale grid may end in a partial block, as DeepSeek-V3's 576-row kv_a_proj_with_mqa does)."""
    assert report.scheme is not None
    scheme = registry.scheme(report.scheme.scheme)
    ctx = ConvertContext(report.scheme.weight_key, report.scheme.activation_key,  # type: ignore[arg-type]
                         torch.float32, dict(report.scheme.bindings),
                         tensor_name=lambda e, role, t: f"{module}.{t}", roles=ONE_PROJECTION)
    try:
        convert = get_converter(scheme.checkpoint.format, DENSE_LAYOUT, registry)
        return convert([{"down": tensors}], ctx)
    except (MoERegistryError, KeyError, ValueError) as err:
        raise CheckpointError(f"{module}: its tensors ({', '.join(sorted(tensors))}) are not stored as scheme "
                              f"{scheme.scheme} stores them: {err}") from None


def dequantize_linear(weights: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [out, in] in ``dtype`` of a linear converted by :func:`convert_linear`."""
    from moe_registry_kernels.dequant import dequantize

    return dequantize(weights.w2, weights.weight_key, dtype=torch.float32)[0].to(dtype)


class RegistryLinear(torch.nn.Module):
    """Takes the place of transformers' ``nn.Linear`` for a quantized linear run on a kernel's one-projection form
    (``linear``, which holds the packed weight); ``bias`` is the checkpoint's, added in the input's dtype."""

    def __init__(self, linear: Linear, bias: torch.Tensor | None, in_features: int, out_features: int,
                 kernel: str, scheme: str) -> None:
        super().__init__()
        self.linear = linear  # not a parameter: the packed tensors stay the kernel's
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, out_features
        self.kernel, self.scheme = kernel, scheme

    @property
    def resident_bytes(self) -> int:
        return self.linear.resident_weight_bytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear.apply(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}, kernel={self.kernel}")
