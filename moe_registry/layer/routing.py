"""Routing: which experts each token goes to and with what weight, as the one value every
FusedMoEKernel call takes. Scores are computed in float32 whatever the logits' dtype."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Routing", "route", "softmax_topk", "grouped_topk", "from_given", "correction_bias_note"]


@dataclass(frozen=True)
class Routing:
    """``topk_weights`` float32 [M, k] and ``topk_ids`` int32 [M, k] (checked on construction;
    values are not read, so building one never synchronises with the device)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    def __post_init__(self) -> None:
        w, ids = self.topk_weights, self.topk_ids
        if w.dtype != torch.float32:
            raise ValueError(f"topk_weights must be float32, got {w.dtype}")
        if ids.dtype != torch.int32:
            raise ValueError(f"topk_ids must be int32, got {ids.dtype}")
        if w.dim() != 2 or w.shape != ids.shape:
            raise ValueError(
                f"topk_weights and topk_ids must both be [M, k], got {tuple(w.shape)} and {tuple(ids.shape)}"
            )

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [M, E], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}] (the number of experts), got {top_k}")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts, keep the top k; ``renormalize`` makes the kept weights sum to 1."""
    _check_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids.to(torch.int32))


def grouped_topk(logits: torch.Tensor, top_k: int, num_expert_group: int, topk_group: int,
                 scoring: Literal["softmax", "sigmoid"] = "softmax",
                 correction_bias: torch.Tensor | None = None, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0,
                 group_score: Literal["max", "top2_sum"] | None = None) -> Routing:
    """Group-limited routing (DeepSeek-V2/V3, Mistral 4): pick ``topk_group`` of ``num_expert_group``
    expert groups, then the top k experts inside them.

    With ``correction_bias`` (DeepSeek-V3, sigmoid scores) the bias only steers selection: experts
    are ranked by biased score, but weights are the unbiased scores. ``group_score`` says how a group
    is scored from its (biased) scores: ``max``, its best one (DeepSeek-V2), or ``top2_sum``, the sum
    of its best two (DeepSeek-V3 with the bias, Mistral 4 without); None keeps the DeepSeek default,
    top2_sum with a correction bias and max without. Weights are renormalised to sum 1 (if asked),
    then multiplied by routed_scaling_factor.
    """
    _check_logits(logits, top_k)
    m, num_experts = logits.shape
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"{num_experts} experts do not split into num_expert_group = {num_expert_group} groups")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, {num_expert_group}], got {topk_group}")
    per_group = num_experts // num_expert_group
    if top_k > topk_group * per_group:
        raise ValueError(
            f"top_k = {top_k} exceeds the {topk_group * per_group} experts in topk_group = {topk_group} "
            f"groups of {per_group}"
        )
    if group_score is None:
        group_score = "top2_sum" if correction_bias is not None else "max"
    if group_score not in ("max", "top2_sum"):
        raise ValueError(f"group_score must be 'max' or 'top2_sum', got {group_score!r}")
    if group_score == "top2_sum" and per_group < 2:
        raise ValueError(f"group_score top2_sum needs at least 2 experts per group, got {per_group}")
    scores = torch.softmax(logits.float(), -1) if scoring == "softmax" else torch.sigmoid(logits.float())
    biased = scores
    if correction_bias is not None:
        if correction_bias.shape != (num_experts,):
            raise ValueError(f"correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")
        biased = scores + correction_bias.float()
    grouped = biased.view(m, num_expert_group, per_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if group_score == "top2_sum" else grouped.amax(-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(m, num_expert_group, per_group).reshape(m, num_experts)
    masked = biased.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(masked, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return Routing(weights.contiguous(), ids.to(torch.int32))


def route(logits: torch.Tensor, top_k: int, params: Mapping[str, Any],
          correction_bias: torch.Tensor | None = None) -> Routing:
    """The family's routing of router ``logits`` [M, E]: ``params`` are the model's routing values as the config
    reader resolved them (``scoring``, ``renormalize``, ``num_expert_group``, ``topk_group``, ``group_score``,
    ``routed_scaling_factor``); plain softmax top-k where none of grouping, another scoring, a correction bias or
    a scale applies, grouped top-k otherwise."""
    groups = int(params.get("num_expert_group", 1) or 1)
    scoring = str(params.get("scoring", "softmax"))
    renormalize = bool(params.get("renormalize", True))
    scale = float(params.get("routed_scaling_factor", 1.0))
    if groups > 1 or scoring != "softmax" or correction_bias is not None or scale != 1.0:
        return grouped_topk(logits, top_k, groups, int(params.get("topk_group", 1) or 1), scoring,  # type: ignore[arg-type]
                            correction_bias, renormalize, scale, params.get("group_score"))
    return softmax_topk(logits, top_k, renormalize)


def from_given(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int | None = None) -> Routing:
    """Routing from precomputed ids and weights: shapes and dtypes checked, cast to int32/float32.
    With ``num_experts`` the ids are range-checked too (this reads them on the host)."""
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be [M, k], got {tuple(topk_ids.shape)} "
            f"and {tuple(topk_weights.shape)}"
        )
    if num_experts is not None and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]")
    return Routing(topk_weights.to(torch.float32), topk_ids.to(torch.int32))


# the finest step of the scores (in [0, 1]) that selection may lose to the bias's float32 rounding and still be
# said to follow the router: coarser, and the note below says the scores are rounded away
_SCORE_STEP = 2.0 ** -10


def correction_bias_note(bias: torch.Tensor, name: str) -> str | None:
    """A note when a correction bias is so large that adding it to the scores in float32 (as transformers and the
    reference do) rounds the scores (in [0, 1]) to steps coarser than 2^-10: selection then follows the bias,
    and at steps of 1 or more every expert's score is lost, so the experts tie and the bias alone picks them.
    Legal (the checkpoint says so), so a note rather than an error; None for a bias of ordinary size."""
    largest = float(bias.detach().float().abs().max()) if bias.numel() else 0.0
    if not math.isfinite(largest) or largest == 0.0:
        return None
    step = 2.0 ** (math.floor(math.log2(largest)) - 23)  # float32 spacing at the bias's magnitude
    if step < _SCORE_STEP:
        return None
    lost = ("every expert's score is lost to it: the experts tie and the bias alone chooses them, the same for "
            "every token") if step >= 1.0 else "selection follows the bias more than the router"
    return (f"{name}: values up to {largest:.3g}; in float32 the router's scores (0..1) added to it round to "
            f"steps of {step:g}, so {lost}")
