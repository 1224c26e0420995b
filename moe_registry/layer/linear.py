"""The Linear interface: a kernel's one-projection form, y = x W^T, for a model's dense linears (attention,
shared experts, dense MLPs) stored in a scheme the kernel runs. A kernel spec names it as ``linear_impl``; like
an Experts class it implements the math only (its keys, dtypes and platforms are the kernel spec's)."""

from __future__ import annotations

import abc

import torch

from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ProjectionWeights


class Linear(abc.ABC):
    """One projection ``weights`` (the ``nk`` layout of a one-expert layer: weight [1, N, K'] and its scales)
    under the scheme's keys; ``apply`` takes x [M, K] (float16/bfloat16/float32) and returns [M, N] in x's
    dtype, without bias (the model's module adds its own)."""

    def __init__(self, weights: ProjectionWeights, weight_key: QuantKey, activation_key: QuantKey) -> None:
        self.weight_key = weight_key
        self.activation_key = activation_key

    @abc.abstractmethod
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the projection's weight: [M, N]."""

    @abc.abstractmethod
    def resident_weight_bytes(self) -> int:
        """Bytes of every tensor the projection holds in the kernel's layout."""
