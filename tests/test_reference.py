"""The torch reference, the weight layouts and the activation-quantisation numerics.

ReferenceExperts (float32) is checked against a naive per-token float64 loop written here; the
layouts are checked on hand-made tensors, not only through quantize -> dequantize round trips.
"""

from __future__ import annotations

import math

import pytest
import torch
from moe_registry_kernels.activations import act_and_mul
from moe_registry_kernels.dequant import dequantize, unpack_int4
from moe_registry_kernels.quant_ref import (
    dequantize_activation,
    make_random_expert_weights,
    quantize_activation,
    quantize_weight_to_layout,
)
from moe_registry_kernels.reference import ReferenceExperts, reference_moe

from moe_registry.core.keys import parse_quant_key
from moe_registry.formats.weights import ProjectionWeights
from moe_registry.layer.experts import ExpertsConfig

UNQ = "unquantized"
AWQ = "uint4 scale:float16:group(128):static zp:group"
GPTQ4 = "uint4b8 scale:float16:group(128):static"
GPTQ8 = "uint8b128 scale:float16:group(128):static"
INT4 = "int4 scale:bfloat16:group(64):static"
INT8_CH = "int8 scale:float32:channel:static"
INT8_TOK = "int8 scale:float32:token:dynamic"
INT8_STATIC = "int8 scale:float32:tensor:static"
MX_W = "fp8e4m3 scale:e8m0:block(1x32):static"
MX_A = "fp8e4m3 scale:e8m0:block(1x32):dynamic"
FP8_BLOCK = "fp8e4m3 scale:float32:block(128x128):static"
FP8_G128 = "fp8e4m3 scale:float32:group(128):dynamic"
FP8_TENSOR = "fp8e4m3 scale:float32:tensor:static"

E, H, INTER, M, TOPK = 4, 256, 128, 12, 2


def K(text: str):
    return parse_quant_key(text)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    assert ref.norm() > 0, "reference is all zero: the test would prove nothing"
    return float((out.double() - ref).norm() / ref.norm())


# ---------------------------------------------------------------------------------------------
# naive float64 ground truth, written independently of kernels/


def naive_fake_quant(row: torch.Tensor, key_text: str, static: torch.Tensor | None) -> torch.Tensor:
    """One token's activation quantise+dequantise, straight from the formulas (float32 math)."""
    if key_text == UNQ:
        return row
    x = row.float()
    if key_text == INT8_TOK:
        s = max(float(x.abs().max()), 1e-10) / 127
        s = torch.tensor(s, dtype=torch.float32)
        return (torch.round(x / s).clamp(-128, 127) * s).double()
    if key_text == INT8_STATIC:
        s = static.float()
        return (torch.round(x / s).clamp(-128, 127) * s).double()
    if key_text == FP8_TENSOR:
        s = static.float()
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).double()
    out = torch.empty_like(x)
    size = 128 if key_text == FP8_G128 else 32
    for j in range(0, x.numel(), size):
        chunk = x[j:j + size]
        amax = float(chunk.abs().max())
        if key_text == FP8_G128:
            s = torch.tensor(max(amax, 1e-10), dtype=torch.float32) / 448
        else:
            e = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
            s = torch.tensor(2.0**e, dtype=torch.float32)
        out[j:j + size] = (chunk / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out.double()


def naive_act(g: torch.Tensor, u: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "silu":
        return g / (1 + torch.exp(-g)) * u
    if fn == "gelu":
        return 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u
    g = torch.clamp(g, max=7.0)
    u = torch.clamp(u, -7.0, 7.0)
    return (u + 1) * g / (1 + torch.exp(-1.702 * g))


def naive_moe(hidden, topk_weights, topk_ids, weights, akey: str, config: ExpertsConfig) -> torch.Tensor:
    w13 = dequantize(weights.w13, weights.weight_key, dtype=torch.float64)
    w2 = dequantize(weights.w2, weights.weight_key, dtype=torch.float64)
    b13, b2 = weights.w13.bias, weights.w2.bias
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for m in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e, wr = int(topk_ids[m, j]), float(topk_weights[m, j])
            x = hidden[m].double()
            if config.apply_router_weight_on_input:
                x = x * wr
            x = naive_fake_quant(x, akey, weights.w13.input_scale)
            h = w13[e] @ x + (0 if b13 is None else b13[e].double())
            a = naive_act(h[:INTER], h[INTER:], config.activation)
            a = naive_fake_quant(a, akey, weights.w2.input_scale)
            y = w2[e] @ a + (0 if b2 is None else b2[e].double())
            out[m] += y if config.apply_router_weight_on_input else wr * y
    return out


def routing(m: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, E, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# layouts by hand


def test_unpack_int4_low_nibble_is_even_k():
    packed = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert unpack_int4(packed).tolist() == [[1, 2, 0, 15]]


def test_dequantize_4bit_types_by_hand():
    # one expert, one row, K = 4, group 2: codes 1, 2, 15, 8
    packed = torch.tensor([[[0x21, 0x8F]]], dtype=torch.uint8)
    scale = torch.tensor([[[0.5, 2.0]]], dtype=torch.float16)
    zero = torch.tensor([[[1, 9]]], dtype=torch.uint8)
    b8 = dequantize(ProjectionWeights(packed, scale), K("uint4b8 scale:float16:group(2):static"))
    assert b8.tolist() == [[[(1 - 8) * 0.5, (2 - 8) * 0.5, (15 - 8) * 2.0, 0.0]]]
    s4 = dequantize(ProjectionWeights(packed, scale), K("int4 scale:float16:group(2):static"))
    assert s4.tolist() == [[[0.5, 1.0, -1 * 2.0, -8 * 2.0]]]
    zp = dequantize(ProjectionWeights(packed, scale, zero), K("uint4 scale:float16:group(2):static zp:group"))
    assert zp.tolist() == [[[0.0, 0.5, 6 * 2.0, -1 * 2.0]]]


def test_dequantize_8bit_fp8_and_e8m0_by_hand():
    u8 = torch.tensor([[[128, 130, 0]]], dtype=torch.uint8)
    ch = torch.tensor([[[0.25]]])
    out = dequantize(ProjectionWeights(u8, ch), K("uint8b128 scale:float32:channel:static"))
    assert out.tolist() == [[[0.0, 0.5, -32.0]]]
    f8 = torch.tensor([[[1.5, -2.0]]]).to(torch.float8_e4m3fn)
    e8 = torch.tensor([[[129]]], dtype=torch.uint8)  # 2**(129-127) = 4
    out = dequantize(ProjectionWeights(f8, e8), K("fp8e4m3 scale:e8m0:block(1x32):static"))
    assert out.tolist() == [[[6.0, -8.0]]]


def test_dequantize_block_scales_cover_ragged_edges():
    # N = 3, K = 5, block 2x2 -> scale [1, 2, 3]; every element 1.0 in fp8
    w = torch.ones(1, 3, 5).to(torch.float8_e4m3fn)
    s = torch.arange(1, 7, dtype=torch.float32).view(1, 2, 3)
    out = dequantize(ProjectionWeights(w, s), K("fp8e4m3 scale:float32:block(2x2):static"))
    want = [[1, 1, 2, 2, 3], [1, 1, 2, 2, 3], [4, 4, 5, 5, 6]]
    assert out[0].tolist() == want


def test_dequantize_undoes_act_order_perm():
    w = torch.tensor([[[10, 20, 30]]], dtype=torch.int8)
    perm = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # stored column j holds original perm[j]
    out = dequantize(ProjectionWeights(w, torch.ones(1, 1, 1), perm=perm), K(INT8_CH))
    assert out.tolist() == [[[20.0, 30.0, 10.0]]]


def test_dequantize_errors_say_what_is_missing():
    w = torch.zeros(1, 2, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="no scale"):
        dequantize(ProjectionWeights(w), K(INT8_CH))
    with pytest.raises(ValueError, match="entries along a dimension"):
        dequantize(ProjectionWeights(w, torch.ones(1, 2, 3)), K("int8 scale:float32:group(2):static"))
    with pytest.raises(ValueError, match="must be stored as torch.int8"):
        dequantize(ProjectionWeights(w.to(torch.uint8), torch.ones(1, 2, 1)), K(INT8_CH))


# ---------------------------------------------------------------------------------------------
# weight round trips

ROUND_TRIP = [  # key, bound on relative error for N(0, 1) weights
    (AWQ, 0.12),
    (GPTQ4, 0.13),
    (INT4, 0.13),
    (GPTQ8, 0.01),
    (INT8_CH, 0.01),
    (MX_W, 0.04),
    (FP8_BLOCK, 0.04),
    ("int8 scale:float32:tensor:static", 0.015),
    ("uint4 scale:float32:channel:static zp:group", 0.13),
]


@pytest.mark.parametrize("key_text,bound,act_order", [
    (k, b, ao) for k, b in ROUND_TRIP for ao in (False, True) if not ao or K(k).scale.group.rows == 1
])
def test_quantize_weight_round_trip(key_text, bound, act_order):
    key = K(key_text)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 256, 384, generator=gen)
    before = w.clone()
    proj = quantize_weight_to_layout(w, key, act_order=act_order, generator=gen)
    assert torch.equal(w, before)
    if act_order:
        assert proj.perm is not None and not torch.equal(proj.perm[0], torch.arange(384, dtype=torch.int32))
    err = rel(dequantize(proj, key), w)
    assert 0 < err < bound


def test_quantize_weight_rejects_what_it_cannot_store():
    w = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="needs a zero point"):
        quantize_weight_to_layout(w, K("uint8 scale:float16:group(4):static"))
    with pytest.raises(ValueError, match="act_order needs per-group"):
        quantize_weight_to_layout(w, K(FP8_BLOCK), act_order=True)


# ---------------------------------------------------------------------------------------------
# activation numerics


def test_int8_per_token_formula_and_half_even_rounding():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -3.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    qa = quantize_activation(x, K(INT8_TOK))
    assert qa.q.dtype == torch.int8 and qa.scale.shape == (2, 1)
    assert qa.q[0].tolist() == [127, 0, 2, 2, -4]  # scale 1.0: half to even
    assert qa.scale[1, 0].item() == pytest.approx(1e-10 / 127)
    assert qa.q[1].abs().sum() == 0


def test_int8_per_token_error_is_half_a_step():
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(2)) * 3
    qa = quantize_activation(x, K(INT8_TOK))
    torch.testing.assert_close(qa.scale[:, 0], x.abs().amax(1) / 127)
    err = (dequantize_activation(qa, K(INT8_TOK)) - x).abs()
    assert bool((err <= qa.scale * 0.5 + 1e-6).all())
    assert 0 < rel(dequantize_activation(qa, K(INT8_TOK)), x) < 0.01


def test_int8_static_clips_at_the_given_scale():
    x = torch.tensor([[1.0, -300.0, 300.0]])
    qa = quantize_activation(x, K(INT8_STATIC), torch.tensor([1.0]))
    assert qa.q.tolist() == [[1, -128, 127]]
    with pytest.raises(ValueError, match="static but no input_scale"):
        quantize_activation(x, K(INT8_STATIC))


def test_fp8_per_group_dynamic():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    qa = quantize_activation(x, K(FP8_G128))
    assert qa.q.dtype == torch.float8_e4m3fn and qa.scale.shape == (5, 3)
    torch.testing.assert_close(qa.scale[:, 2], x[:, 256:].abs().amax(1) / 448)
    assert float(qa.q.float().abs().amax()) == 448.0
    assert 0 < rel(dequantize_activation(qa, K(FP8_G128)), x) < 0.04


def test_mxfp8_shared_exponent():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = x[1, :32] / x[1, :32].abs().max() * 5.0  # amax 5 -> floor(log2 5) - 8 = -6
    qa = quantize_activation(x, K(MX_A))
    assert qa.scale.dtype == torch.uint8 and qa.scale.shape == (3, 3)
    assert int(qa.scale[0, 0]) == 0 and int(qa.scale[1, 0]) == 127 - 6
    deq = dequantize_activation(qa, K(MX_A))
    assert deq[0, :32].abs().sum() == 0
    assert 0 < rel(deq, x) < 0.04


def test_activation_quant_does_not_mutate_and_rejects_bad_keys():
    x = torch.randn(4, 64)
    before = x.clone()
    quantize_activation(x, K(MX_A))
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="unquantized key"):
        quantize_activation(x, K(UNQ))


# ---------------------------------------------------------------------------------------------
# activations


def test_act_and_mul_matches_formulas_including_swigluoai_clamps():
    h = torch.randn(6, 40, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 5
    g, u = h[:, :20], h[:, 20:]
    for fn in ("silu", "gelu", "swigluoai"):
        torch.testing.assert_close(act_and_mul(h, fn), naive_act(g, u, fn), rtol=1e-12, atol=1e-12)
    assert bool((g > 7).any() and (u.abs() > 7).any())  # the clamps were exercised
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        act_and_mul(h, "relu")


# ---------------------------------------------------------------------------------------------
# ReferenceExperts vs the naive loop

CASES = [  # weight key, activation key, act_order
    (UNQ, UNQ, False),
    (AWQ, UNQ, False),
    (GPTQ4, UNQ, True),
    (INT4, UNQ, False),
    (GPTQ8, UNQ, True),
    (INT8_CH, INT8_TOK, False),
    (INT8_CH, INT8_STATIC, False),
    (AWQ, INT8_TOK, False),  # W4A8
    (MX_W, MX_A, False),
    (FP8_BLOCK, FP8_G128, False),
    (FP8_TENSOR, FP8_TENSOR, False),
]


@pytest.mark.parametrize("wkey,akey,act_order", CASES)
def test_reference_matches_naive_loop(wkey, akey, act_order):
    weights = make_random_expert_weights(K(wkey), K(akey), num_experts=E, hidden=H, intermediate=INTER,
                                         dtype=torch.float32, bias=True, act_order=act_order, seed=7)
    hidden = torch.randn(M, H, generator=torch.Generator().manual_seed(8))
    tw, ti = routing(M, TOPK, 9)
    config = ExpertsConfig("silu")
    snapshot = [t.clone() for t in (hidden, tw, ti)]
    out = ReferenceExperts(weights, config).apply(hidden, tw, ti)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (hidden, tw, ti), strict=True))
    assert out.dtype == torch.float32 and out.shape == (M, H)
    want = naive_moe(hidden, tw, ti, weights, akey, config)
    assert rel(out, want) < (1e-5 if akey == UNQ else 1e-3)
    truth = reference_moe(hidden, tw, ti, weights, config)
    assert truth.dtype == torch.float64
    assert rel(truth, want) < (1e-12 if akey == UNQ else 1e-3)


@pytest.mark.parametrize("fn", ["silu", "gelu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_activation_fns_and_bias(fn, bias):
    weights = make_random_expert_weights(K(INT8_CH), K(INT8_TOK), num_experts=E, hidden=H, intermediate=INTER,
                                         dtype=torch.float32, bias=bias, act_order=False, seed=10)
    hidden = torch.randn(M, H, generator=torch.Generator().manual_seed(11)) * 3  # reach the swigluoai clamps
    tw, ti = routing(M, TOPK, 12)
    config = ExpertsConfig(fn)
    out = ReferenceExperts(weights, config).apply(hidden, tw, ti)
    assert rel(out, naive_moe(hidden, tw, ti, weights, INT8_TOK, config)) < 2e-3


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 8e-3), (torch.float16, 2e-3)])
def test_reference_half_precision_hidden(dtype, tol):
    weights = make_random_expert_weights(K(MX_W), K(MX_A), num_experts=E, hidden=H, intermediate=INTER,
                                         dtype=dtype, bias=False, act_order=False, seed=13)
    hidden = torch.randn(M, H, generator=torch.Generator().manual_seed(14)).to(dtype)
    tw, ti = routing(M, TOPK, 15)
    out = ReferenceExperts(weights, ExpertsConfig()).apply(hidden, tw, ti)
    assert out.dtype == dtype
    assert rel(out, naive_moe(hidden, tw, ti, weights, MX_A, ExpertsConfig())) < tol


def test_activation_quantisation_is_applied():
    """Same weights, int8 activations vs none: the outputs must differ by about int8's error."""
    a = make_random_expert_weights(K(INT8_CH), K(INT8_TOK), num_experts=E, hidden=H, intermediate=INTER,
                                   dtype=torch.float32, bias=False, act_order=False, seed=16)
    b = make_random_expert_weights(K(INT8_CH), K(UNQ), num_experts=E, hidden=H, intermediate=INTER,
                                   dtype=torch.float32, bias=False, act_order=False, seed=16)
    hidden = torch.randn(M, H, generator=torch.Generator().manual_seed(17))
    tw, ti = routing(M, TOPK, 18)
    diff = rel(ReferenceExperts(a, ExpertsConfig()).apply(hidden, tw, ti),
               ReferenceExperts(b, ExpertsConfig()).apply(hidden, tw, ti))
    assert 1e-3 < diff < 3e-2


def test_router_weight_on_input():
    weights = make_random_expert_weights(K(AWQ), K(INT8_TOK), num_experts=E, hidden=H, intermediate=INTER,
                                         dtype=torch.float32, bias=True, act_order=False, seed=19)
    hidden = torch.randn(M, H, generator=torch.Generator().manual_seed(20))
    config = ExpertsConfig(apply_router_weight_on_input=True)
    tw, ti = routing(M, 1, 21)
    tw = tw * 0.6  # not all ones, or applying it anywhere would look the same
    out = ReferenceExperts(weights, config).apply(hidden, tw, ti)
    assert rel(out, naive_moe(hidden, tw, ti, weights, INT8_TOK, config)) < 2e-3
    tw2, ti2 = routing(M, 2, 22)  # top-2 (Llama 4 at num_experts_per_tok 2): each pair's scaled input, summed
    tw2 = tw2 * torch.tensor([0.7, 0.4])
    out2 = ReferenceExperts(weights, config).apply(hidden, tw2, ti2)
    pairs = sum(naive_moe(hidden, tw2[:, k:k + 1], ti2[:, k:k + 1], weights, INT8_TOK, config) for k in range(2))
    assert rel(out2, pairs) < 2e-3


def test_reference_rejects_ids_out_of_range():
    weights = make_random_expert_weights(K(UNQ), K(UNQ), num_experts=E, hidden=H, intermediate=INTER,
                                         dtype=torch.float32, bias=False, act_order=False, seed=23)
    hidden = torch.randn(2, H)
    ids = torch.tensor([[0, E]], dtype=torch.int32).expand(2, 2)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 4\) or -1 \(a foreign expert\), "
                                         r"got values in \[0, 4\]"):
        ReferenceExperts(weights, ExpertsConfig()).apply(hidden, torch.full((2, 2), 0.5), ids)
    with pytest.raises(ValueError, match=r"got values in \[-2, 2\]"):
        ReferenceExperts(weights, ExpertsConfig()).apply(hidden, torch.full((2, 2), 0.5), ids - 2)


def test_reference_foreign_experts_add_nothing():
    """Id -1 (expert parallelism: another rank's expert) gives what a zero router weight gives."""
    weights = make_random_expert_weights(K(UNQ), K(UNQ), num_experts=E, hidden=H, intermediate=INTER,
                                         dtype=torch.float32, bias=True, act_order=False, seed=24)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(24))
    tw, ti = routing(3, 2, 24)
    foreign = ti.clone()
    foreign[0, 1] = -1
    foreign[2] = -1  # a token with no local expert: its row is zero
    zeroed = tw.clone()
    zeroed[0, 1] = 0
    zeroed[2] = 0
    experts = ReferenceExperts(weights, ExpertsConfig())
    out = experts.apply(hidden, tw, foreign)
    torch.testing.assert_close(out, experts.apply(hidden, zeroed, ti), rtol=0, atol=1e-6)
    assert torch.equal(out[2], torch.zeros(H)) and out[0].abs().min() > 0


def test_random_weights_static_input_scale():
    w = make_random_expert_weights(K(INT8_CH), K(INT8_STATIC), num_experts=2, hidden=64, intermediate=32,
                                   dtype=torch.float32, bias=False, act_order=False, seed=0)
    assert w.w13.input_scale.dtype == torch.float32 and w.w13.input_scale.shape == (1,)
    assert w.w2.input_scale is not None
    d = make_random_expert_weights(K(INT8_CH), K(INT8_TOK), num_experts=2, hidden=64, intermediate=32,
                                   dtype=torch.float32, bias=False, act_order=False, seed=0)
    assert d.w13.input_scale is None


def test_projection_weights_name_the_bulk_tensors_a_holder_copied():
    """not_held_in: codes, scales and zero points present here that the holder does not hold as these
    very tensors (a copy, a view elsewhere, or none); views of the same storage count as held."""
    p = ProjectionWeights(weight=torch.zeros(2, 4, 8, dtype=torch.uint8), scale=torch.ones(2, 4, 1),
                          zero=torch.zeros(2, 4, 1, dtype=torch.uint8), bias=torch.zeros(2, 4))
    assert p.not_held_in({"weight": p.weight.view(-1), "scale": p.scale, "zero": p.zero}) == []
    assert p.not_held_in({"weight": p.weight, "scale": p.scale.clone()}) == ["scale", "zero"]
    assert ProjectionWeights(weight=p.weight).not_held_in({"weight": p.weight}) == []
