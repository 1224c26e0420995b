"""The Experts interface: the GEMM half of a FusedMoEKernel.

An Experts class implements the math and nothing else: what it supports is written in its kernel
spec (docs/design.md, "One source of truth"), so it never checks platforms, keys or shapes itself.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from moe_registry.core.vocab import ActivationFn, ActivationFormat
from moe_registry.formats.weights import ExpertWeights


@dataclass(frozen=True)
class ExpertsConfig:
    """How the layer is computed, beyond its weights."""

    activation: ActivationFn = "silu"
    apply_router_weight_on_input: bool = False
    activation_format: ActivationFormat = "standard"
    # the experts the router picks among, where more than these hold (expert parallelism: every
    # rank's); kernels that estimate the routing from the token count (the Triton decode GEMV's
    # range) use it; None: these experts
    routed_experts: int | None = None


class Experts(abc.ABC):
    """Computes sum_k w_k · down(act(gate(x)) * up(x)) over each token's top-k experts.

    ``apply`` takes hidden states [M, H] (float16/bfloat16/float32), ``topk_weights`` [M, k]
    float32 and ``topk_ids`` [M, k] (int32 or int64) and returns [M, H] in the hidden dtype.
    It must not synchronise with the host (CUDA graphs) and must not mutate its inputs.
    """

    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        self.weights = weights
        self.config = config

    @abc.abstractmethod
    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output for every token, already weighted and summed over top-k."""

    def apply_batched(self, hidden: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """Batched format: ``hidden`` [E, T, H] with ``expert_num_tokens`` [E] valid rows per
        expert; returns [E, T, H] without router weights (finalize applies them). Kernels whose
        spec lists the batched format implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the batched activation format")
