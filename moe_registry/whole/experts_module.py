"""The module that takes the place of a transformers MoE block's routed experts: it holds one layer's
packed weights (converted once, in the chosen kernel's layout) and calls its FusedMoEKernel with
transformers' experts contract ``(hidden_states, top_k_index, top_k_weights)``.

The router stays transformers' own, so routing (top-k, scoring, correction bias, scaling) is exactly
transformers'. Ids ``>= num_experts`` are transformers' expert-parallel sentinel (another rank's expert):
such a pair adds nothing."""

from __future__ import annotations

import torch

from moe_registry.layer.modular import FusedMoEKernel
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.oracle.contract import Report


def drop_foreign(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and weights where every id ``>= num_experts`` has weight 0 and stands on an expert its row does not
    use yet, so the kernel's one-expert-once-per-row contract holds and the pair adds nothing."""
    foreign = top_k_index >= num_experts
    if not bool(foreign.any()):
        return top_k_index, top_k_weights
    rows = top_k_index.shape[0]
    used = torch.zeros(rows, num_experts + 1, dtype=torch.bool, device=top_k_index.device)
    used.scatter_(1, top_k_index.clamp(max=num_experts).long(), True)
    free = ~used[:, :num_experts]
    # the j-th foreign slot of a row takes the row's j-th free expert (a row has as many free experts as it has
    # foreign slots or more: its k slots hold fewer than k local experts)
    free_rank = torch.cumsum(free.long(), 1) - 1
    slot_rank = torch.cumsum(foreign.long(), 1) - 1
    order = torch.where(free, free_rank, num_experts).argsort(1)[:, :top_k_index.shape[1]]
    substitute = order.gather(1, slot_rank.clamp(min=0))
    ids = torch.where(foreign, substitute.to(top_k_index.dtype), top_k_index)
    return ids, torch.where(foreign, torch.zeros_like(top_k_weights), top_k_weights)


class RegistryExperts(torch.nn.Module):
    """One MoE layer's routed experts on the registry's kernel (``report`` says which scheme and kernel)."""

    def __init__(self, kernel: FusedMoEKernel, report: Report, layer: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.report = report
        self.layer = layer
        self.num_experts = kernel.num_experts
        self.hidden_dim = kernel.experts.weights.hidden_size
        self._is_expert_parallel = False

    @property
    def resident_bytes(self) -> int:
        """Bytes of every tensor storage the kernel holds (its packed weights, scales and any copies)."""
        return reachable_tensor_bytes(self.kernel)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        ids, weights = drop_foreign(top_k_index.reshape(hidden.shape[0], -1),
                                    top_k_weights.reshape(hidden.shape[0], -1), self.num_experts)
        out = self.kernel(hidden, weights.to(torch.float32), ids)
        return out.to(hidden_states.dtype).reshape(shape)

    def extra_repr(self) -> str:
        scheme = self.report.scheme.scheme if self.report.scheme else "?"
        return f"layer={self.layer}, experts={self.num_experts}, scheme={scheme}, kernel={self.report.chosen}"
