"""A model's MoE block as an nn.Module: the family's router and the built fused experts, ready to call on
hidden states (``load_layer``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe_registry.core.errors import CheckpointError
from moe_registry.layer.build import DTYPES, LayerBuild, build
from moe_registry.layer.routing import Routing, route


class MoELayer(torch.nn.Module):
    """A model's MoE block: router (as the family's config describes it) + fused experts."""

    def __init__(self, layer: LayerBuild) -> None:
        super().__init__()
        tensors = layer.router_tensors
        if tensors.router is None:
            raise CheckpointError(f"{tensors.names.router}: missing (the router is needed to route tokens; "
                                  "pass topk_ids/topk_weights to the kernel instead)")
        self.build = layer.built
        self.kernel = layer.built.kernel
        dev = layer.built.kernel.experts.weights.device
        self.register_buffer("router_weight", tensors.router.to(dev, torch.float32))
        bias = tensors.correction_bias
        self.register_buffer("correction_bias", None if bias is None else bias.to(dev, torch.float32))
        rb = tensors.router_bias
        self.register_buffer("router_bias", None if rb is None else rb.to(dev, torch.float32))
        self.top_k = layer.model.shape.top_k
        self.routing_params = dict(layer.model.routing)
        self.dtype = DTYPES[layer.built.report.situation.runtime.dtype]  # what the kernel computes in

    def route(self, hidden: torch.Tensor) -> Routing:
        """Which experts each token goes to, with what weight, as the family's router computes it (scores in
        float32): ``hidden`` [tokens, hidden] or [batch, seq, hidden] of any float dtype; a Routing whose
        ``topk_ids``/``topk_weights`` are [tokens, top_k] (batch and seq flattened)."""
        hidden = self._tokens(hidden)
        logits = hidden.float() @ self.router_weight.t()
        if self.router_bias is not None:
            logits = logits + self.router_bias
        return route(logits, self.top_k, self.routing_params, self.correction_bias)

    def _tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` as [tokens, hidden]; refused in one line unless floating point with the layer's hidden size."""
        size = self.router_weight.shape[1]
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
            raise ValueError(f"hidden states must be a floating-point tensor [tokens, {size}] or [batch, seq, "
                             f"{size}], got {getattr(hidden, 'dtype', type(hidden).__name__)}")
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != size:
            raise ValueError(f"hidden states must be [tokens, {size}] or [batch, seq, {size}], got shape "
                             f"{list(hidden.shape)}")
        return hidden.reshape(-1, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for ``hidden`` [tokens, hidden] or [batch, seq, hidden] (as transformers'
        MoE blocks take it), in ``hidden``'s shape and dtype; computed in the layer's dtype (the report's
        runtime dtype), so a float32 input to a float16 layer is rounded to float16 first."""
        x = self._tokens(hidden)
        r = self.route(x)
        out = self.kernel(x.to(self.dtype), r.topk_weights, r.topk_ids)
        return out.to(hidden.dtype).reshape(hidden.shape)


def load_layer(model_dir: str | Path, layer: int | None = None, device: str | torch.device | None = None,
               **kwargs: Any) -> MoELayer:
    """One MoE layer of a checkpoint as an nn.Module (router + fused experts), ready to call. With ``ep=N`` (> 1),
    call it in each of N ranks of a torch.distributed process group: the module holds the rank's share of the
    experts (read alone from the checkpoint) and is called with the rank's own tokens (at most ``max_tokens``);
    ``all2all`` defaults to the one backend implemented (``layer.all2all.DEFAULT_BACKEND``)."""
    if (kwargs.get("ep") or 1) > 1 and kwargs.get("all2all") is None:
        from moe_registry.layer.all2all import DEFAULT_BACKEND

        kwargs = {**kwargs, "all2all": DEFAULT_BACKEND}
    return MoELayer(build(model_dir, layer=layer, device=device, **kwargs))
