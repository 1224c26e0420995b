"""The experts module for MoE blocks that call their experts with scaled rows (family spec ``experts_call:
scaled_rows``; Llama 4's ``Llama4TextMoe``): one tensor [experts x tokens, hidden] holding each token's hidden
state once per expert, multiplied by its router score there (sigmoid of a top-k logit, > 0) and zero where the
token is not routed; the block adds the output rows up over the experts.

The registry's kernels take each token's experts and rows instead: the routed experts are the token's nonzero
rows (the top-k of each row's largest magnitude), and each routed row, already scaled, runs as a top-1 pair of
weight 1 (the kernel's router-weight-on-input multiplies by that 1). The output goes back to the routed rows'
places, zeros elsewhere, so the block's sum over experts is transformers' own. Everything stays on the device:
no host read, so the call can be captured in a CUDA graph like the contract's."""

from __future__ import annotations

import torch

from moe_registry.whole.experts_module import RegistryExperts


class ScaledRowsExperts(RegistryExperts):
    """One MoE layer's routed experts on the registry's kernel, called with scaled rows (module docstring)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        hidden = hidden_states.shape[-1]
        rows = hidden_states.reshape(self.num_experts, -1, hidden)  # [E, T, H]
        tokens = torch.arange(rows.shape[1], device=rows.device)[:, None]
        # a routed row is the hidden state times a score > 0, an unrouted one is zero: the k largest per token
        ids = rows.abs().amax(-1).topk(self.top_k, dim=0).indices.T  # [T, k]
        picked = rows[ids, tokens].reshape(-1, hidden)  # [T*k, H]
        pair_ids = ids.reshape(-1, 1)
        ones = torch.ones(pair_ids.shape, dtype=torch.float32, device=rows.device)
        out = super().forward(picked, pair_ids, ones)
        full = torch.zeros_like(rows)
        full[ids, tokens] = out.reshape(ids.shape[0], self.top_k, hidden)
        return full.reshape(hidden_states.shape)
