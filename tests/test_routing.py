"""Routing: softmax top-k, DeepSeek grouped top-k (checked against a per-token loop), given ids."""

from __future__ import annotations

import pytest
import torch

from moe_registry.layer.routing import Routing, from_given, grouped_topk, softmax_topk


def logits(m: int, e: int, seed: int) -> torch.Tensor:
    return torch.randn(m, e, generator=torch.Generator().manual_seed(seed))


def naive_grouped(row: torch.Tensor, top_k, groups, topk_group, scoring, bias, renorm, factor):
    """One token, straight from the DeepSeek description, in float64 Python."""
    r = row.double()
    scores = torch.softmax(r, -1) if scoring == "softmax" else torch.sigmoid(r)
    sel = scores + bias.double() if bias is not None else scores
    per = r.numel() // groups
    group_score = []
    for g in range(groups):
        chunk = sorted(sel[g * per:(g + 1) * per].tolist(), reverse=True)
        group_score.append(chunk[0] + chunk[1] if bias is not None else chunk[0])
    keep = sorted(range(groups), key=lambda g: -group_score[g])[:topk_group]
    cands = [x for g in keep for x in range(g * per, (g + 1) * per)]
    ids = sorted(cands, key=lambda x: -float(sel[x]))[:top_k]
    w = torch.tensor([float(scores[x]) for x in ids], dtype=torch.float64)
    if renorm:
        w = w / w.sum()
    return ids, w * factor


def test_softmax_topk_renormalized_and_not():
    x = logits(10, 8, 0)
    probs = torch.softmax(x, -1)
    r = softmax_topk(x, 3, renormalize=False)
    assert r.topk_ids.dtype == torch.int32 and r.topk_weights.dtype == torch.float32
    assert r.topk_ids.tolist() == probs.topk(3, -1).indices.tolist()
    torch.testing.assert_close(r.topk_weights, probs.gather(1, r.topk_ids.long()))
    rn = softmax_topk(x.to(torch.bfloat16), 3, renormalize=True)
    torch.testing.assert_close(rn.topk_weights.sum(-1), torch.ones(10))
    assert rn.top_k == 3


@pytest.mark.parametrize("scoring,use_bias,renorm,factor", [
    ("sigmoid", True, True, 2.5),  # DeepSeek-V3
    ("softmax", False, False, 1.0),  # DeepSeek-V2
    ("sigmoid", False, True, 1.0),
])
def test_grouped_topk_matches_per_token_loop(scoring, use_bias, renorm, factor):
    m, e, groups, topk_group, top_k = 16, 32, 8, 3, 4
    x = logits(m, e, 1)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(2)) * 0.5 if use_bias else None
    r = grouped_topk(x, top_k, groups, topk_group, scoring, bias, renorm, factor)
    for t in range(m):
        ids, w = naive_grouped(x[t], top_k, groups, topk_group, scoring, bias, renorm, factor)
        assert r.topk_ids[t].tolist() == ids
        torch.testing.assert_close(r.topk_weights[t].double(), w, rtol=1e-6, atol=1e-7)


def test_correction_bias_steers_selection_not_weights():
    x = logits(4, 16, 3)
    bias = torch.zeros(16)
    bias[5] = 100.0
    r = grouped_topk(x, 2, 4, 2, "sigmoid", bias, renormalize=False)
    assert bool((r.topk_ids == 5).any(dim=1).all())
    picked = r.topk_weights[r.topk_ids == 5]
    torch.testing.assert_close(picked, torch.sigmoid(x[:, 5]))


def test_grouped_topk_restricts_to_chosen_groups():
    x = torch.full((1, 8), -5.0)
    x[0, 0], x[0, 1], x[0, 4], x[0, 5] = 3.0, 0.5, 2.0, 1.9  # group 1 has the best pair, group 0 the best one
    r = grouped_topk(x, 2, 2, 1, "sigmoid", torch.zeros(8))
    assert sorted(r.topk_ids[0].tolist()) == [4, 5]
    r = grouped_topk(x, 2, 2, 1, "sigmoid")
    assert sorted(r.topk_ids[0].tolist()) == [0, 1]


@pytest.mark.parametrize("kwargs,msg", [
    ({"num_expert_group": 3}, "do not split into num_expert_group = 3"),
    ({"topk_group": 5}, r"topk_group must be in \[1, 4\], got 5"),
    ({"top_k": 9, "topk_group": 2}, "top_k = 9 exceeds the 8 experts"),
    ({"scoring": "relu"}, "scoring must be 'softmax' or 'sigmoid'"),
    ({"correction_bias": torch.zeros(3)}, r"correction_bias must be \[16\]"),
])
def test_grouped_topk_errors(kwargs, msg):
    args = {"top_k": 2, "num_expert_group": 4, "topk_group": 2, **kwargs}
    with pytest.raises(ValueError, match=msg):
        grouped_topk(logits(2, 16, 4), **args)


def test_softmax_topk_errors():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\]"):
        softmax_topk(logits(2, 8, 5), 9, True)
    with pytest.raises(ValueError, match="must be \\[M, E\\]"):
        softmax_topk(torch.randn(8), 2, True)


def test_from_given_casts_and_validates():
    ids = torch.tensor([[0, 3], [2, 1]])
    w = torch.tensor([[0.7, 0.3], [0.4, 0.6]], dtype=torch.float16)
    r = from_given(ids, w, num_experts=4)
    assert r.topk_ids.dtype == torch.int32 and r.topk_weights.dtype == torch.float32
    assert r.topk_ids.tolist() == ids.tolist()
    assert ids.dtype == torch.int64 and w.dtype == torch.float16  # inputs untouched
    with pytest.raises(ValueError, match=r"must be in \[0, 3\), got values in \[0, 3\]"):
        from_given(ids, w, num_experts=3)
    with pytest.raises(ValueError, match="topk_ids must be an integer tensor"):
        from_given(ids.float(), w)
    with pytest.raises(ValueError, match="topk_weights must be floating point"):
        from_given(ids, ids)
    with pytest.raises(ValueError, match=r"both be \[M, k\], got \(2, 2\) and \(2, 1\)"):
        from_given(ids, w[:, :1])


def test_routing_value_checks_dtypes():
    with pytest.raises(ValueError, match="topk_ids must be int32, got torch.int64"):
        Routing(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        Routing(torch.ones(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32))


def mistral4_router_f64(logits, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """transformers 5.23 Mistral4TopkRouter.forward (modeling_mistral4.py), re-written in float64 from the
    logits on: softmax scores, a group scored by the sum of its top-2 scores (no correction bias), the
    other groups' scores set to 0, top-k, kept scores renormalised (+1e-20) and scaled."""
    scores = logits.double().softmax(-1)
    m, e = scores.shape
    group_scores = scores.view(m, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    scores_for_choice = scores.masked_fill(~score_mask.bool(), 0.0)
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_indices, topk_weights * routed_scaling_factor


@pytest.mark.parametrize("groups,topk_group,top_k,norm,factor", [(8, 3, 4, True, 1.0), (4, 1, 2, False, 2.0),
                                                                  (1, 1, 4, True, 1.0)])
def test_group_score_top2_sum_matches_mistral4_router(groups, topk_group, top_k, norm, factor):
    """Mistral 4 / Large 4: softmax, no bias, group score = top-2 sum (max would pick other groups)."""
    x = logits(64, 32, 7) * 3
    ref_ids, ref_w = mistral4_router_f64(x, top_k, groups, topk_group, norm, factor)
    r = grouped_topk(x, top_k, groups, topk_group, "softmax", None, norm, factor, group_score="top2_sum")
    order = torch.argsort(ref_ids, dim=-1)
    ref_ids, ref_w = ref_ids.gather(1, order), ref_w.gather(1, order)
    got_order = torch.argsort(r.topk_ids.long(), dim=-1)
    assert r.topk_ids.long().gather(1, got_order).tolist() == ref_ids.tolist()
    err = (r.topk_weights.double().gather(1, got_order) - ref_w).norm() / ref_w.norm()
    assert err < 1e-6
    if groups > 1:  # the word matters: group max picks different experts for some tokens on this data
        by_max = grouped_topk(x, top_k, groups, topk_group, "softmax", None, norm, factor)
        assert by_max.topk_ids.sort(-1).values.tolist() != r.topk_ids.sort(-1).values.tolist()


def test_group_score_errors_and_default():
    x = logits(4, 16, 8)
    with pytest.raises(ValueError, match="group_score must be 'max' or 'top2_sum', got 'mean'"):
        grouped_topk(x, 2, 4, 2, group_score="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_score top2_sum needs at least 2 experts per group, got 1"):
        grouped_topk(x, 2, 16, 2, group_score="top2_sum")
    bias = torch.randn(16, generator=torch.Generator().manual_seed(9))
    default = grouped_topk(x, 2, 4, 2, "sigmoid", bias)
    explicit = grouped_topk(x, 2, 4, 2, "sigmoid", bias, group_score="top2_sum")
    assert default.topk_ids.tolist() == explicit.topk_ids.tolist()
