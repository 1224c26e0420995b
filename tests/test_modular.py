"""FusedMoEKernel with local standard and batched prepare/finalize: same answers, clear errors."""

from __future__ import annotations

import pytest
import torch
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import ReferenceExperts, reference_moe

from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.modular import BatchedLocalPrepareFinalize, FusedMoEKernel, LocalPrepareFinalize
from moe_registry.layer.routing import softmax_topk

E, H, INTER, M = 6, 128, 64, 20

KEYS = [
    ("unquantized", "unquantized"),
    ("uint4 scale:float16:group(64):static zp:group", "int8 scale:float32:token:dynamic"),
    ("fp8e4m3 scale:e8m0:block(1x32):static", "fp8e4m3 scale:e8m0:block(1x32):dynamic"),
    ("int8 scale:float32:channel:static", "int8 scale:float32:tensor:static"),
]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert ref.norm() > 0
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def weights(wkey="unquantized", akey="unquantized", dtype=torch.float32, seed=0):
    return make_random_expert_weights(parse_quant_key(wkey), parse_quant_key(akey), num_experts=E, hidden=H,
                                      intermediate=INTER, dtype=dtype, bias=True, act_order=False, seed=seed)


def kernels(w, config: ExpertsConfig, max_tokens=None):
    std = FusedMoEKernel(LocalPrepareFinalize(), ReferenceExperts(w, config))
    bcfg = ExpertsConfig(config.activation, config.apply_router_weight_on_input, "batched")
    bat = FusedMoEKernel(BatchedLocalPrepareFinalize(E, max_tokens), ReferenceExperts(w, bcfg))
    return std, bat


def inputs(m=M, top_k=2, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, H, generator=gen).to(dtype)
    r = softmax_topk(torch.randn(m, E, generator=gen), top_k, renormalize=True)
    return hidden, r.topk_weights, r.topk_ids


@pytest.mark.parametrize("wkey,akey", KEYS)
def test_standard_and_batched_agree(wkey, akey):
    w = weights(wkey, akey)
    hidden, tw, ti = inputs()
    snapshot = [t.clone() for t in (hidden, tw, ti)]
    std, bat = kernels(w, ExpertsConfig("gelu"))
    a, b = std(hidden, tw, ti), bat(hidden, tw, ti)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, (hidden, tw, ti), strict=True))
    assert a.shape == b.shape == (M, H) and a.dtype == b.dtype == torch.float32
    truth = reference_moe(hidden, tw, ti, w, ExpertsConfig("gelu"))
    assert rel(a, truth) < 1e-3
    assert rel(b, a) < 1e-5


def test_batched_bfloat16_and_fixed_capacity():
    w = weights(dtype=torch.bfloat16)
    hidden, tw, ti = inputs(dtype=torch.bfloat16)
    std, bat = kernels(w, ExpertsConfig(), max_tokens=M)
    a, b = std(hidden, tw, ti), bat(hidden, tw, ti)
    assert b.dtype == torch.bfloat16
    assert rel(b, a) < 1e-2


def test_router_weight_on_input_both_formats():
    w = weights("int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic")
    hidden, _, ti = inputs(top_k=1)
    tw = torch.rand(M, 1, generator=torch.Generator().manual_seed(2)) + 0.2
    config = ExpertsConfig(apply_router_weight_on_input=True)
    std, bat = kernels(w, config)
    a, b = std(hidden, tw, ti), bat(hidden, tw, ti)
    truth = reference_moe(hidden, tw, ti, w, config)
    assert rel(a, truth) < 1e-3 and rel(b, truth) < 1e-3
    off = reference_moe(hidden, tw, ti, w, ExpertsConfig())
    assert rel(off, truth) > 1e-2  # where the weight is applied matters (bias, non-linearity)


def test_batched_prepare_groups_rows_per_expert():
    hidden, tw, ti = inputs(m=7, top_k=2)
    pf = BatchedLocalPrepareFinalize(E)
    p = pf.prepare(hidden, tw, ti)
    counts = torch.bincount(ti.reshape(-1).long(), minlength=E)
    assert p.expert_num_tokens.dtype == torch.int32 and p.expert_num_tokens.tolist() == counts.tolist()
    assert p.hidden.shape == (E, 7, H)
    for e in range(E):
        tokens = (ti == e).any(dim=1).nonzero().flatten()
        n = int(counts[e])
        assert torch.equal(p.hidden[e, :n], hidden[tokens])
        assert p.hidden[e, n:].abs().sum() == 0
    # finalize of the prepared rows themselves is the router-weighted sum of the token's copies
    out = pf.finalize(p.hidden, p)
    torch.testing.assert_close(out, hidden * tw.sum(1, keepdim=True))


def test_batched_capacity_overflow_message():
    hidden, tw, ti = inputs(m=8, top_k=1)
    ti = torch.zeros_like(ti)
    with pytest.raises(ValueError, match="received 8 tokens, more than max_tokens_per_expert = 4"):
        BatchedLocalPrepareFinalize(E, 4).prepare(hidden, tw, ti)


def test_format_mismatch_is_refused():
    w = weights()
    with pytest.raises(ValueError, match="produces the 'batched' activation format but ReferenceExperts is "
                                         "configured for 'standard'"):
        FusedMoEKernel(BatchedLocalPrepareFinalize(E), ReferenceExperts(w, ExpertsConfig()))
    with pytest.raises(ValueError, match="num_experts = 3 but the experts hold 6"):
        FusedMoEKernel(BatchedLocalPrepareFinalize(3),
                       ReferenceExperts(w, ExpertsConfig(activation_format="batched")))


@pytest.mark.parametrize("case,msg", [
    ("hidden_1d", r"hidden must be 2-D \[M, H\]"),
    ("hidden_int", "hidden dtype must be float16, bfloat16 or float32"),
    ("hidden_size", "hidden has H = 64 but the experts have hidden size 128"),
    ("ids_rows", r"topk_ids must be \[M=20, k\]"),
    ("weights_shape", r"topk_weights shape \(20, 1\) differs from topk_ids shape \(20, 2\)"),
    ("ids_float", "topk_ids must be int32 or int64"),
    ("weights_int", "topk_weights must be floating point .*, got torch.int32"),
    ("ids_range", r"topk_ids must be in \[0, 6\), got values in \[-1, 5\]"),
    ("ids_repeat", "repeats an expert within a token's row"),
])
def test_bad_inputs_are_named(case, msg):
    std, _ = kernels(weights(), ExpertsConfig())
    hidden, tw, ti = inputs()
    if case == "hidden_1d":
        hidden = hidden[0]
    elif case == "hidden_int":
        hidden = hidden.to(torch.int32)
    elif case == "hidden_size":
        hidden = hidden[:, :64]
    elif case == "ids_rows":
        ti = ti[:5]
    elif case == "weights_shape":
        tw = tw[:, :1]
    elif case == "ids_float":
        ti = ti.float()
    elif case == "weights_int":
        tw = tw.to(torch.int32)
    elif case == "ids_range":
        ti = ti.clone()
        ti[3, 0] = -1
    elif case == "ids_repeat":
        ti = ti.clone()
        ti[4, 1] = ti[4, 0]
    with pytest.raises(ValueError, match=msg):
        std(hidden, tw, ti)


def test_router_weight_on_input_at_top2_adds_each_experts_scaled_input_run():
    """transformers' Llama4TextMoe at top-k > 1: expert e runs on x * w_e, the k outputs add up."""
    std, _ = kernels(weights(), ExpertsConfig(apply_router_weight_on_input=True))
    hidden, tw, ti = inputs()
    tw = tw * torch.linspace(0.3, 1.1, tw.numel()).reshape(tw.shape)  # unequal, or any order would pass
    each = sum(std(hidden, tw[:, k:k + 1].contiguous(), ti[:, k:k + 1].contiguous()).double() for k in range(2))
    out = std(hidden, tw, ti)
    assert out.shape == hidden.shape
    assert float((out.double() - each).norm() / each.norm()) < 1e-6


def test_empty_batch():
    std, bat = kernels(weights(), ExpertsConfig())
    hidden, tw, ti = inputs(m=0)
    assert std(hidden, tw, ti).shape == (0, H)
    assert bat(hidden, tw, ti).shape == (0, H)
