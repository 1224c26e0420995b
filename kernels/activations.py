"""Gated activations over a fused gate/up projection: ``h[..., :I]`` is gate, ``h[..., I:]`` is up
(the w13 row order of :mod:`moe_registry.formats.weights`). Computed in h's dtype, so the float64 ground
truth stays float64."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["act_and_mul", "ACTIVATIONS", "SWIGLUOAI_ALPHA", "SWIGLUOAI_LIMIT"]

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def _silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gelu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU, not the tanh approximation."""
    return F.gelu(gate, approximate="none") * up


def _swigluoai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss: gate clamped above at 7, up to [-7, 7]; (up + 1) * gate * sigmoid(1.702 * gate)."""
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": _silu,
    "gelu": _gelu,
    "swigluoai": _swigluoai,
}


def act_and_mul(h: torch.Tensor, fn: str) -> torch.Tensor:
    """[..., 2I] -> [..., I]: fn(gate, up) with gate = h[..., :I], up = h[..., I:]. h is not modified."""
    try:
        op = ACTIVATIONS[fn]
    except KeyError:
        raise ValueError(f"unknown activation {fn!r}; known: {', '.join(ACTIVATIONS)}") from None
    if h.shape[-1] % 2:
        raise ValueError(f"act_and_mul wants an even last dimension (gate | up), got {h.shape[-1]}")
    i = h.shape[-1] // 2
    return op(h[..., :i], h[..., i:])
