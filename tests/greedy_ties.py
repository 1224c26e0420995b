"""Two runs that sum the same experts in another order (two GPUs against one, in bfloat16): their logits within
BF16_BUDGET of each other, and their greedy tokens equal, or differing first where the reference's two best logits
are within bfloat16's budget of each other (a near tie, not a wrong model); the tokens after it follow another
sequence and are not compared."""

from __future__ import annotations

import torch

# bfloat16's budget for two runs' logits: rounding every activation, and a top-k pick that flips on a near tie,
# cost a few percent of a tiny random model's logits (its bfloat16 logits are up to 2.5% from its float32 ones on
# one process; transformers' all_to_all also rounds each pair's output to bfloat16 before its weighted sum); a
# wrong expert, row or rank costs O(1)
BF16_BUDGET = 5e-2
BF16_NEAR_TIE = 1.5e-2  # bfloat16's budget for two logits, relative to the logits' norm (as test_whole_model.py's)


def assert_same_greedy_up_to_near_ties(reference: torch.nn.Module, got: torch.Tensor, want: torch.Tensor,
                                       rank: int) -> None:
    """``got`` (a rank's tokens, on the CPU) against ``want`` (``reference``'s greedy tokens, on the CPU)."""
    if torch.equal(got, want):
        return
    row = int((got != want).any(dim=1).nonzero()[0])
    first = int((got[row] != want[row]).nonzero()[0])
    device = next(reference.parameters()).device
    with torch.no_grad():
        logits = reference(want[row:row + 1, :first].to(device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1]) / float(logits.norm())
    assert gap <= BF16_NEAR_TIE, (rank, row, first, gap, got.tolist(), want.tolist())
