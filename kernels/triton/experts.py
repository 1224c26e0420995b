"""The Experts classes the Triton kernel specs name: ``TritonExperts`` (standard activation format)
and ``TritonBatchedExperts`` (batched, expert parallelism).

They hold the weights as :class:`~moe_registry_kernels.triton.layout.TritonWeightLayout` packs them,
once, and call the layer's custom ops (:mod:`moe_registry_kernels.triton.layer`).
"""

import dataclasses

import torch

from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

from .layer import fused_experts, fused_experts_batched, run_fused_experts, run_fused_experts_batched
from .layout import TritonWeightLayout, mx_scale_codes
from .variant import variant_from_keys


class _TritonBase(Experts):
    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        super().__init__(weights, config)
        if weights.layout != "nk":
            raise ValueError(f"the Triton MoE kernel reads layout 'nk', got {weights.layout!r}")
        self.weight_key = str(weights.weight_key)
        self.activation_key = str(weights.activation_key)
        self.variant = variant_from_keys(self.weight_key, self.activation_key)  # raises early if unsupported
        self.layout = TritonWeightLayout(self.variant)
        t13, t2 = self.layout.pack(weights.w13), self.layout.pack(weights.w2)
        self._tensors = t13 + t2
        self.weights = dataclasses.replace(weights, w13=self.layout.keep(weights.w13, t13),
                                           w2=self.layout.keep(weights.w2, t2))
        # by keyword, absent for every other key: second-level weight scales (NVFP4), [E, N] float32,
        # and MX FP4 scales' code range (whether their tiles may fold, launch._e2m1_fold)
        self._options: dict[str, object] = {
            f"{name}_scale2": p.scale2.reshape(p.scale2.shape[0], -1).to(torch.float32).contiguous()
            for name, p in (("w13", weights.w13), ("w2", weights.w2)) if p.scale2 is not None}
        codes = mx_scale_codes(weights, self.variant)
        if codes is not None:
            self._options["mx_scale_codes"] = codes
        self._routed: dict[str, object] = {}  # the standard format's estimate of the routing (fused_experts)
        if config.routed_experts is not None:
            self._routed["routed_experts"] = config.routed_experts

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The standard format (the batched kernel's too, for callers that hold both formats)."""
        # the custom op only where torch.compile traces (its dispatch costs host time: layer.fused_experts)
        run = fused_experts if torch.compiler.is_compiling() else run_fused_experts
        return run(
            hidden, topk_weights, topk_ids, *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, self.config.apply_router_weight_on_input, **self._options, **self._routed)

    def unpacked_weights(self) -> ExpertWeights:
        """The weights the kernel holds, back in the ``nk`` layout (TritonWeightLayout.unpack): the
        converted weights' values without reading the checkpoint again."""
        half = len(self._tensors) // 2
        return dataclasses.replace(
            self.weights, w13=self.layout.unpack(self._tensors[:half], self.weights.w13.scale2),
            w2=self.layout.unpack(self._tensors[half:], self.weights.w2.scale2))


class TritonExperts(_TritonBase):
    """Standard activation format: hidden [M, H] with top-k routing."""


class TritonBatchedExperts(_TritonBase):
    """Batched activation format (expert parallelism): x [E, T, H] and expert_num_tokens [E]."""

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """[E, T, H] -> [E, T, H]: the first expert_num_tokens[e] rows of x[e] through expert e,
        rows past the count zero. No router weights (finalize applies them)."""
        run = fused_experts_batched if torch.compiler.is_compiling() else run_fused_experts_batched
        return run(
            x, expert_num_tokens.to(torch.int32), *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, **self._options)
