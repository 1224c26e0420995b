"""The Triton MoE kernels on a CUDA GPU (``pytest -m gpu tests/test_triton_gpu.py``): realistic
shapes in bfloat16 and float16 for every scheme, the alignment and quantisation ops at scale,
CUDA graph capture and replay, and torch.compile(fullgraph=True). Timings are not tests:
tools/bench_decode.py and tools/bench.py report them.

Tolerances are relative errors against the float32 reference on the same device (see
tests/test_triton_interpreter.py for the float16 reasoning); bfloat16 keeps 8 mantissa bits
instead of 11, so each rounded intermediate costs 4x more: 1e-2 for 16-bit weights, 2e-2 for
integer weights, and 3e-2 for fp8 in either dtype.
"""

import contextlib
import dataclasses
import math

import pytest
import torch
from launch_spy import KwargSpy, LaunchSpy, without_and_with
from moe_registry_kernels import quant_ref
from moe_registry_kernels.reference import reference_moe, reference_moe_batched
from moe_registry_kernels.triton import activation_quant, chain, dequant_ptx, tile_config
from moe_registry_kernels.triton import align as alignment
from moe_registry_kernels.triton import gemm as triton_gemm
from moe_registry_kernels.triton import launch as triton_launch
from moe_registry_kernels.triton import layer as triton_layer
from moe_registry_kernels.triton import plan as triton_plan
from moe_registry_kernels.triton import variant as triton_variant
from moe_registry_kernels.triton.experts import TritonBatchedExperts, TritonExperts

from moe_registry.core.keys import parse_quant_key
from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.experts import ExpertsConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

UNQ = "unquantized"
INT8_TOKEN = "int8 scale:float32:token:dynamic"
INT8_STATIC = "int8 scale:float32:tensor:static"
MXFP8 = "fp8e4m3 scale:e8m0:block(1x32):static"
MXFP8_ACT = "fp8e4m3 scale:e8m0:block(1x32):dynamic"
FP8_GROUP_ACT = "fp8e4m3 scale:float32:group(128):dynamic"

# (weight key, activation key, kind) — kind picks the tolerance
SCHEMES = {
    "16bit": (UNQ, UNQ, "float"),
    "awq-g128": ("uint4 scale:float16:group(128):static zp:group", UNQ, "int"),
    "awq-g32": ("uint4 scale:float16:group(32):static zp:group", UNQ, "int"),
    "gptq4-g128": ("uint4b8 scale:float16:group(128):static", UNQ, "int"),
    "gptq4-g64": ("uint4b8 scale:float16:group(64):static", UNQ, "int"),
    "gptq4-channel": ("uint4b8 scale:float16:channel:static", UNQ, "int"),
    "gptq8-g128": ("uint8b128 scale:float16:group(128):static", UNQ, "int"),
    "int8-w8a16-channel": ("int8 scale:float16:channel:static", UNQ, "int"),
    "uint8-zp-g128": ("uint8 scale:float16:group(128):static zp:group", UNQ, "int"),
    "w8a8-int8-token": ("int8 scale:float32:channel:static", INT8_TOKEN, "int"),
    "w8a8-int8-static": ("int8 scale:float32:tensor:static", INT8_STATIC, "int"),
    "mxfp8-w8a16": (MXFP8, UNQ, "fp8"),
    "mxfp8": (MXFP8, MXFP8_ACT, "fp8"),
    "fp8-block": ("fp8e4m3 scale:float32:block(128x128):static", FP8_GROUP_ACT, "fp8"),
}
# activations with one scale per token or per tensor, which the GEMMs quantise themselves for
# one token (plan.SCALE_IN_GEMM); the dynamic fp8 ones from GEMM1's row-amax pieces for a few
ONE_TOKEN = {
    "fp8-tensor-dynamic": ("fp8e4m3 scale:float32:tensor:static", "fp8e4m3 scale:float32:tensor:dynamic", "fp8"),
    "fp8-token-dynamic": ("fp8e4m3 scale:float32:channel:static", "fp8e4m3 scale:float32:token:dynamic", "fp8"),
    "fp8-static": ("fp8e4m3 scale:float32:tensor:static", "fp8e4m3 scale:float32:tensor:static", "fp8"),
    "w4a8-int8-token": ("uint4b8 scale:float32:group(128):static", INT8_TOKEN, "int"),
}
# FP4 weights, dequantised in registers (fp4_dequant)
FP4 = {"mxfp4": ("e2m1 scale:e8m0:group(32):static", UNQ, "int"),
       "nvfp4": ("e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static", UNQ, "int")}
TOLERANCE = {
    (torch.float16, "float"): 5e-3, (torch.float16, "int"): 1e-2, (torch.float16, "fp8"): 3e-2,
    (torch.bfloat16, "float"): 1e-2, (torch.bfloat16, "int"): 2e-2, (torch.bfloat16, "fp8"): 3e-2,
}
# (experts, hidden, intermediate, top_k): a Mixtral-like layer and a Qwen-MoE-like one
SHAPES = {"e8": (8, 4096, 1024, 2), "e64": (64, 2048, 1408, 6)}
DEVICE = "cuda"


def _weights(scheme: str, e: int, h: int, i: int, dtype: torch.dtype, *, bias: bool = True,
             act_order: bool = False, seed: int = 0) -> ExpertWeights:
    """Random experts like quant_ref.make_random_expert_weights, but drawn and quantised on the
    GPU (the CPU takes minutes at these sizes); act-order goes through quant_ref on the CPU."""
    wk, ak, _ = (SCHEMES | ONE_TOKEN | FP4)[scheme]
    wkey, akey = parse_quant_key(wk), parse_quant_key(ak)
    if act_order:
        return quant_ref.make_random_expert_weights(
            wkey, akey, num_experts=e, hidden=h, intermediate=i, dtype=dtype, bias=bias,
            act_order=True, seed=seed).to(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen, device=DEVICE) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=gen, device=DEVICE) / math.sqrt(i)
    p13 = quant_ref.quantize_weight_to_layout(w13, wkey, dtype=dtype)
    p2 = quant_ref.quantize_weight_to_layout(w2, wkey, dtype=dtype)
    extra13, extra2 = {}, {}
    if akey.quantized and not akey.scale.dynamic:  # static scale covering |x| <= 6
        qmax = 127.0 if akey.dtype.name == "int8" else 448.0
        extra13["input_scale"] = torch.tensor([6.0 / qmax], device=DEVICE)
        extra2["input_scale"] = torch.tensor([6.0 / qmax], device=DEVICE)
    if bias:
        extra13["bias"] = 0.1 * torch.randn(e, 2 * i, generator=gen, device=DEVICE)
        extra2["bias"] = 0.1 * torch.randn(e, h, generator=gen, device=DEVICE)
    return ExpertWeights(dataclasses.replace(p13, **extra13), dataclasses.replace(p2, **extra2), wkey, akey)


def _routing(m: int, e: int, h: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(m, h, generator=gen, device=DEVICE).to(dtype)
    logits = torch.randn(m, e, generator=gen, device=DEVICE)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return hidden, topk_weights, topk_ids.to(torch.int32)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _tolerance(scheme: str, dtype: torch.dtype) -> float:
    return TOLERANCE[(dtype, (SCHEMES | ONE_TOKEN | FP4)[scheme][2])]


# ---------------------------------------------------------------------------------------------
# accuracy at realistic shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 64, 512])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_layer_matches_reference(scheme, shape, m, dtype):
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, dtype)
    config = ExpertsConfig(activation="silu")
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=m)
    out = TritonExperts(weights, config).apply(hidden, topk_weights, topk_ids)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, config, compute_dtype=torch.float32)
    err = _rel_err(out, ref)
    assert err < _tolerance(scheme, dtype), f"{scheme} {shape} M={m} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("scheme, m", [(name, 8) for name in SCHEMES]
                         + [(name, m) for name in ONE_TOKEN if name.startswith("fp8") for m in (8, 1)])
def test_swapped_operands_match_reference(scheme, m, split_k, dtype, monkeypatch):
    """The swapped-operand decode kernel (where the scheme allows it: fp8 weights with fp8
    activations on its fp8 dot, one token's input quantised by the GEMMs themselves) at a realistic
    shape; the launches are watched: GEMM1 whole, GEMM2 over a grid of ``split_k`` K pieces."""
    e, h, i, top_k = SHAPES[next(iter(SHAPES))]
    weights = _weights(scheme, e, h, i, dtype)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=3)
    swapped = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
               "SWAP_AB": True}
    launched = []
    for name in ("_fused_moe_kernel", "_fused_moe_swap_kernel"):
        monkeypatch.setattr(triton_launch, name, LaunchSpy(getattr(triton_launch, name), launched))
    with tile_config.config_override({**swapped, "SPLIT_K": 1}, {**swapped, "SPLIT_K": split_k}):
        out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert [grid[2] for grid in launched] == [1, split_k], f"{scheme}: launch grids {launched}"
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    err = _rel_err(out, ref)
    assert err < _tolerance(scheme, dtype), f"{scheme} swapped split {split_k} {dtype}: relative error {err:.2e}"



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", ["gptq4-g128", "gptq4-g64", "w4a8-int8-token"])
def test_group_dots_match_reference(scheme, shape, m, dtype, monkeypatch):
    """GROUP_DOTS decode tiles (one dot per weight group, BLOCK_K 256 and 512 spanning 2-8 groups,
    split-K for GEMM2) on the paired PTX path (W4A8: the codes' 16-bit dot; at M = 1 each GEMM
    quantising the token itself); the launches are watched: both GEMMs took them (the decode GEMV,
    which W4A8's few-token GEMMs otherwise take, off)."""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, dtype)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=m + 1)
    tile = {"BLOCK_M": 16, "BLOCK_N": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "GROUP_DOTS": True}
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "GROUP_DOTS", seen))
    with tile_config.config_override({**tile, "BLOCK_K": 256, "SPLIT_K": 1}, {**tile, "BLOCK_K": 512, "SPLIT_K": 2}):
        out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True]
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    err = _rel_err(out, ref)
    assert err < _tolerance(scheme, dtype), f"{scheme} {shape} M={m} {dtype} GROUP_DOTS: relative error {err:.2e}"


@pytest.mark.parametrize("m", [8, 512])
@pytest.mark.parametrize("tile", [(16, 64, True), (64, 128, False), (128, 128, False)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_block_scales_as_scalars_match_vectors(shape, tile, m, monkeypatch):
    """FP8 block-128 tiles taking their block scales as scalars (TILE_BLOCK_SCALE: each tile's weight rows,
    GEMM1's gate rows and up rows, in one block), swapped or plain, give the layer whose tiles load them as
    vectors to the rounding of one product, and the reference's numbers; the launches are watched."""
    e, h, i, top_k = SHAPES[shape]
    weights = _weights("fp8-block", e, h, i, torch.bfloat16)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, torch.bfloat16, seed=m + 5)
    block_m, block_n, swapped = tile
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
              "num_stages": 3, "SWAP_AB": swapped}
    kernel = "_fused_moe_swap_kernel" if swapped else "_fused_moe_kernel"
    seen: list = []
    monkeypatch.setattr(triton_launch, kernel, KwargSpy(getattr(triton_gemm, kernel), "TILE_BLOCK_SCALE", seen))
    experts = TritonExperts(weights, ExpertsConfig())
    with tile_config.config_override(config, config):
        scalars = experts.apply(hidden, topk_weights, topk_ids)
    monkeypatch.setattr(triton_launch, "_tile_block_scale", lambda *args: False)
    with tile_config.config_override(config, config):
        vectors = experts.apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True, False, False]
    assert _rel_err(scalars, vectors) < 2e-3, f"{shape} M={m} {tile}: {_rel_err(scalars, vectors):.2e} apart"
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    err = _rel_err(scalars, ref)
    assert err < _tolerance("fp8-block", torch.bfloat16), f"{shape} M={m} {tile}: relative error {err:.2e}"


@pytest.mark.parametrize("grouped", [False, True], ids=["per-weight", "group-dots"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", ["gptq4-g128", "awq-g128"])
def test_gemm2_input_in_halves_is_bit_equal(scheme, shape, m, dtype, grouped, monkeypatch):
    """GEMM2 tiles reading their input as GEMM1's epilogue stores it on request (INPUT_HALVES: each
    row's even columns, then its odd ones) on the paired PTX path give the layer whose GEMM2 splits
    its input in registers bit for bit, per-weight dots or one per group (BLOCK_K 512, split 4; AWQ's
    zero points keep per-weight dots there, GROUP_DOTS needing ZERO_SUMS, which reads the input in
    order); the launches are watched: GEMM1 stored halves and GEMM2 read them."""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, dtype)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=m + 3)
    tile = {"BLOCK_M": 16, "BLOCK_N": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SWAP_AB": False}
    tile2 = {**tile, "BLOCK_K": 512, "SPLIT_K": 4, "GROUP_DOTS": True} if grouped else {**tile, "BLOCK_K": 128}
    gemm1 = {**tile, "BLOCK_K": 128, "SPLIT_K": 1}
    plain, halves, seen = without_and_with(
        TritonExperts(weights, ExpertsConfig()), (hidden, topk_weights, topk_ids), (gemm1, tile2),
        (gemm1, {**tile2, "INPUT_HALVES": True}), "_fused_moe_kernel",
        lambda args, kwargs: (kwargs["INPUT_HALVES"], kwargs["HALVES_OUT"]), monkeypatch)
    assert seen == [(False, True), (True, False)]
    assert torch.equal(halves, plain), f"{scheme} {shape} M={m} {dtype}: {_rel_err(halves, plain):.2e} apart"
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    err = _rel_err(halves, ref)
    assert err < _tolerance(scheme, dtype), f"{scheme} {shape} M={m} {dtype} INPUT_HALVES: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme,grouped", [("uint8-zp-g128", False), ("awq-g128", False), ("awq-g32", False),
                                            ("awq-g128", True), ("gptq4-g128", False), ("gptq4-g128", True)])
def test_zero_sums_match_reference(scheme, grouped, shape, m, dtype, monkeypatch):
    """ZERO_SUMS decode tiles (zero points on the factored dot, taken off each row's result with
    the layer's per-group input sums) on the paired PTX path, a group spanning two K steps of
    GEMM1 (BLOCK_K 64 against 128-column groups; one K step per group for awq-g32) and GEMM2
    split; ``grouped``: one dot per group (GROUP_DOTS) over K tiles of 256 and 512 columns; the
    launches are watched: both GEMMs took them, and gave other numbers than the per-weight zero, no
    further from the float32 reference (the terms keep float32 accuracy: one TF32 product would
    not). One token's GEMMs sum their block's one row themselves. GPTQ's codes (a fixed zero) run
    bfloat16 dots on the raw codes, corrected the same way; in float16 their dots run on code - 8 as the
    plain tile's do and they take no terms: the two layers agree within 1e-3 (taken, the terms, 136 times
    each group's scale and input sum, would put them far apart; one dot per group compiles to a loop
    that does not give the plain tile's numbers bit for bit)."""
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, dtype)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=m + 2)
    tile = {"BLOCK_M": 16, "BLOCK_N": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SWAP_AB": False}
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
    outs = {}
    block_k = (256, 512) if grouped else (32, 32) if scheme == "awq-g32" else (64, 32)
    for zero_sums in (True, False):
        sums = ({"ZERO_SUMS": True} | ({"GROUP_DOTS": True} if grouped else {})) if zero_sums else {}
        with tile_config.config_override({**tile, **sums, "BLOCK_K": block_k[0], "SPLIT_K": 1},
                                        {**tile, **sums, "BLOCK_K": block_k[1], "SPLIT_K": 2}):
            outs[zero_sums] = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True, None, None]
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    err, per_weight = _rel_err(outs[True], ref), _rel_err(outs[False], ref)
    assert err < _tolerance(scheme, dtype), f"{scheme} {shape} M={m} {dtype} ZERO_SUMS: relative error {err:.2e}"
    assert err <= 1.1 * per_weight, f"{scheme} {shape} M={m} {dtype}: ZERO_SUMS {err:.2e}, per weight {per_weight:.2e}"
    if scheme.startswith("gptq") and dtype == torch.float16:
        assert _rel_err(outs[True], outs[False]) < 1e-3, f"{scheme} {shape} M={m}: float16 ZERO_SUMS took terms"
    else:
        assert not torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("m", [1, 2, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", [*ONE_TOKEN, "w8a8-int8-token", "w8a8-int8-static"])
def test_gemms_quantising_their_own_input_are_bit_equal(scheme, shape, m, monkeypatch):
    """Per-token and per-tensor activations at decode: the layer whose GEMMs quantise one token's
    input themselves (Markstein's reciprocal, the GPU's fp8 cast), or whose GEMM2 input is
    quantised from GEMM1's row-amax pieces, gives exactly the output of the layer whose
    quantisation kernels read whole rows, a pair routed to another rank's expert included; and
    it is near the reference. (The decode GEMV, which the int8 layers' few-token GEMMs otherwise
    take, whatever these switches say, is off.)"""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, torch.bfloat16)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, torch.bfloat16, seed=m)
    topk_ids[0, 0] = -1
    experts = TritonExperts(weights, ExpertsConfig())
    for switch in ("SCALE_IN_GEMM", "AMAX_PIECES"):
        monkeypatch.setattr(triton_plan, switch, False)
    want = experts.apply(hidden, topk_weights, topk_ids)
    for switch in ("SCALE_IN_GEMM", "AMAX_PIECES"):
        monkeypatch.setattr(triton_plan, switch, True)
    got = experts.apply(hidden, topk_weights, topk_ids)
    assert torch.equal(got, want), f"{scheme} {shape} M={m}: max |diff| {(got - want).abs().max().item():.3e}"
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    assert _rel_err(got, ref) < TOLERANCE[(torch.bfloat16, (SCHEMES | ONE_TOKEN)[scheme][2])]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", [*ONE_TOKEN, "w8a8-int8-token", "w8a8-int8-static"])
def test_gemm2_alone_quantising_one_token_is_bit_equal(scheme, shape, monkeypatch):
    """One token past GEMM1's weight budget (its input quantised by a launch) whose GEMM2 still
    quantises its own input (SCALE_IN_GEMM2_MAX_BYTES; dynamic fp8 on Mixtral-sized experts) gives
    exactly the output of the layer with both quantisation launches. (The decode GEMV, which the
    int8 layers' one-token GEMMs otherwise take, is off.)"""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, torch.bfloat16)
    hidden, topk_weights, topk_ids = _routing(1, e, h, top_k, torch.bfloat16, seed=1)
    experts = TritonExperts(weights, ExpertsConfig())
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM", False)
    want = experts.apply(hidden, topk_weights, topk_ids)
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM", True)
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM_MAX_BYTES", 0)
    quant = triton_variant.variant_from_keys(*(SCHEMES | ONE_TOKEN)[scheme][:2]).act_quant
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM2_MAX_BYTES", {quant: 1 << 62})
    got = experts.apply(hidden, topk_weights, topk_ids)
    assert torch.equal(got, want), f"{scheme} {shape}: max |diff| {(got - want).abs().max().item():.3e}"


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(FP4))
def test_fp4_tiles_with_the_unscale_in_their_scales_are_bit_equal(scheme, dtype, shape, m, monkeypatch):
    """FP4 tiles whose scales carry the codes' unscale (one paired multiply a weight pair, the PTX
    path, the layer's tile configs) give exactly the output of the two-multiply tiles, near the reference."""
    e, h, i, top_k = SHAPES[shape]
    weights = _weights(scheme, e, h, i, dtype)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=m)
    experts = TritonExperts(weights, ExpertsConfig())
    real, taken = triton_launch._e2m1_fold, []

    def spy(w, s, d):
        taken.append(real(w, s, d)["E2M1_FOLDED"])
        return real(w, s, d)

    monkeypatch.setattr(triton_launch, "_e2m1_fold", spy)
    got = experts.apply(hidden, topk_weights, topk_ids)
    monkeypatch.setattr(triton_launch, "_e2m1_fold", lambda w, s, d: {"E2M1_FOLDED": False, "E2M1_SHIFT": 0})
    want = experts.apply(hidden, topk_weights, topk_ids)
    assert taken == [True, True]
    assert torch.equal(got, want), f"{scheme} {shape} M={m}: max |diff| {(got - want).abs().max().item():.3e}"
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    assert _rel_err(got, ref) < TOLERANCE[(dtype, "int")]


@pytest.mark.parametrize("swap", ["tuned", "swapped", "swapped-bytes"])
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mx_fp8_tiles_with_folded_scales_are_bit_equal(dtype, shape, m, swap, monkeypatch):
    """MX fp8 weights through the PTX with folded scales (the layer's tile configs, or the swapped
    kernel's byte pairs, or its byte-wide load) give exactly the output of the float32 decode, near
    the reference."""
    e, h, i, top_k = SHAPES[shape]
    weights = _weights("mxfp8-w8a16", e, h, i, dtype)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, dtype, seed=m)
    experts = TritonExperts(weights, ExpertsConfig())
    real, taken = triton_launch._e4m3_folded, []

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
            "SPLIT_K": 1, "SWAP_AB": True}
    if swap == "swapped-bytes":
        monkeypatch.setattr(triton_launch, "_byte_pairs", lambda weight: False)
    with tile_config.config_override(tile, tile) if swap != "tuned" else contextlib.nullcontext():
        monkeypatch.setattr(triton_launch, "_e4m3_folded", spy)
        got = experts.apply(hidden, topk_weights, topk_ids)
        monkeypatch.setattr(triton_launch, "_e4m3_folded", lambda *args: False)
        want = experts.apply(hidden, topk_weights, topk_ids)
    assert taken == [True, True]
    assert torch.equal(got, want), f"{shape} M={m}: max |diff| {(got - want).abs().max().item():.3e}"
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    assert _rel_err(got, ref) < _tolerance("mxfp8-w8a16", dtype)


@pytest.mark.parametrize("amax", [1e-10, 3e-4, 0.7, 1.0, 13.0, 6e4])
@pytest.mark.parametrize("dot", ["fp8_outer", "int8"])
def test_codes_by_reciprocal_round_as_the_division(dot, amax):
    """The GEMM's own int8 / fp8 quantisation (Markstein's corrected reciprocal, no division, the GPU's fp8 cast)
    gives the codes of quant_ref's true division at every code and tie and one float32 step
    either side, past saturation, for tiny values and random ones, at scales from the floor up."""
    from quant_codes_probe import codes_at_scale_of

    got, want = codes_at_scale_of(amax, dot, DEVICE, hw_cast=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("scheme", ["gptq4-g128", "gptq8-g128", "awq-g32"])
def test_act_order(scheme):
    e, h, i, top_k = 8, 2048, 512, 2
    weights = _weights(scheme, e, h, i, torch.bfloat16, act_order=True)
    config = ExpertsConfig(activation="swigluoai")
    hidden, topk_weights, topk_ids = _routing(64, e, h, top_k, torch.bfloat16)
    out = TritonExperts(weights, config).apply(hidden, topk_weights, topk_ids)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, config, compute_dtype=torch.float32)
    assert _rel_err(out, ref) < _tolerance(scheme, torch.bfloat16)


@pytest.mark.parametrize("scheme", ["16bit", "awq-g128", "gptq4-g128", "gptq8-g128", "w8a8-int8-token",
                                    "w8a8-int8-static"])
def test_batched_matches_reference(scheme):
    e, h, i, _ = SHAPES["e8"]
    weights = _weights(scheme, e, h, i, torch.bfloat16)
    config = ExpertsConfig(activation="silu", activation_format="batched")
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    capacity = 96
    x = torch.randn(e, capacity, h, generator=gen, device=DEVICE).to(torch.bfloat16)
    counts = torch.tensor([5, 0, 96, 17, 1, 64, 33, 80], dtype=torch.int32, device=DEVICE)
    out = TritonBatchedExperts(weights, config).apply_batched(x, counts)
    ref = reference_moe_batched(x, counts, weights, config, compute_dtype=torch.float32)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0, 5:]) == 0
    assert _rel_err(out, ref) < _tolerance(scheme, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# ops at scale (real hardware division, rounding and fp8 conversion)


@pytest.mark.parametrize("m,top_k,num_experts,block_m", [(1, 8, 256, 16), (64, 8, 64, 16),
                                                         (4096, 8, 64, 64), (16384, 2, 8, 128)])
def test_align(m, top_k, num_experts, block_m):
    ids = torch.rand(m, num_experts, device=DEVICE).topk(top_k, dim=-1).indices.to(torch.int32)
    sorted_ids, expert_ids, num_post = torch.ops.moe_registry.moe_align_block_size(ids, num_experts, block_m)
    flat = ids.reshape(-1).long()
    total = int(num_post.item())
    head = sorted_ids[:total].long()
    real = head[head < flat.numel()]
    assert torch.equal(real.sort().values, torch.arange(flat.numel(), device=DEVICE))
    block_of = torch.arange(total, device=DEVICE) // block_m
    real_block = block_of[head < flat.numel()]
    assert torch.equal(flat[real], expert_ids[real_block].long())
    assert torch.all(sorted_ids[total:] == flat.numel()) and torch.all(expert_ids[total // block_m:] == -1)


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).int() if t.dtype in (torch.float8_e4m3fn, torch.uint8) else t.int()


@pytest.mark.parametrize("rows,cols", [(512, 4096), (2048, 1408), (1024, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("key", [INT8_TOKEN, INT8_STATIC, FP8_GROUP_ACT, MXFP8_ACT])
def test_quant_ops_bit_match_quant_ref(key, dtype, rows, cols):
    """Against quant_ref on the CPU: on CUDA, torch divides by a Python scalar as a multiply by
    its reciprocal, so quant_ref's ``amax / 127`` is not the true division it defines there.
    Decode rows (one a program), and prefill rows in several-row programs, 1408 columns in
    chunks that tile them, 14336 int8_token columns read twice."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = (torch.randn(rows, cols, generator=gen, device=DEVICE) * 2).to(dtype)
    x[0] = 0
    x[1, :64] *= 1e-4
    static = torch.tensor([0.03], device=DEVICE) if key == INT8_STATIC else None
    ref = quant_ref.quantize_activation(x.cpu(), parse_quant_key(key), None if static is None else static.cpu())
    if key == INT8_TOKEN:
        q, s = activation_quant.quant_int8_per_token(x)
    elif key == INT8_STATIC:
        q, s = activation_quant.quant_int8_per_token(x, static)
    elif key == FP8_GROUP_ACT:
        q, s = activation_quant.quant_fp8_per_group(x, 128)
    else:
        q, s = activation_quant.quant_mxfp8(x)
    got, want = _codes(q.cpu()), _codes(ref.q)
    bad = torch.nonzero(got != want)[:5].tolist()
    detail = [(r, c, x[r, c].item(), want[r, c].item(), got[r, c].item()) for r, c in bad]
    assert not bad, f"{int((got != want).sum())} codes differ; (row, col, x, want, got): {detail}"
    assert torch.equal(_codes(s.cpu()) if s.dtype == torch.uint8 else s.cpu(),
                       _codes(ref.scale) if s.dtype == torch.uint8 else ref.scale)


# ---------------------------------------------------------------------------------------------
# CUDA graphs and torch.compile


@pytest.mark.parametrize("top_k_and_m", [(6, 1), (6, 64), (6, 700), (1, 64)], ids=lambda v: f"top{v[0]}-M{v[1]}")
@pytest.mark.parametrize("scheme", ["16bit", "awq-g128", "w8a8-int8-token", "fp8-block"])
def test_foreign_experts_add_nothing(scheme, top_k_and_m, nan_filled_empty):
    """Pairs routed to -1 (another rank's expert) add nothing, on the one-token, one-launch and
    chunked alignment paths; fresh buffers are NaN-filled so a row never written but read shows."""
    top_k, m = top_k_and_m
    e, h, i, _ = SHAPES["e64"]
    weights = _weights(scheme, e, h, i, torch.bfloat16)
    hidden, topk_weights, topk_ids = _routing(m, e, h, top_k, torch.bfloat16, seed=7)
    foreign = torch.rand(topk_ids.shape, generator=torch.Generator().manual_seed(7)) < 0.3
    topk_ids[foreign.to(DEVICE)] = -1
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig(), compute_dtype=torch.float32)
    nan_filled_empty()
    out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    local = (topk_ids >= 0).any(1)
    assert not out.isnan().any()
    assert torch.equal(out[~local], torch.zeros_like(out[~local]))
    err = _rel_err(out[local], ref[local])
    assert err < _tolerance(scheme, torch.bfloat16), f"{scheme} top-{top_k} M={m}: relative error {err:.2e}"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cuda_graph_replay(scheme):
    """Capture apply once, then replay with new inputs copied into the captured buffers."""
    e, h, i, top_k = SHAPES["e8"]
    dtype = torch.bfloat16
    weights = _weights(scheme, e, h, i, dtype)
    experts = TritonExperts(weights, ExpertsConfig())
    static = _routing(16, e, h, top_k, dtype, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) off the capture
        experts.apply(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = experts.apply(*static)
    for seed in (2, 3):
        fresh = _routing(16, e, h, top_k, dtype, seed=seed)
        for buf, new in zip(static, fresh, strict=True):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_moe(*fresh, weights, ExpertsConfig(), compute_dtype=torch.float32)
        assert _rel_err(static_out, ref) < _tolerance(scheme, dtype)


@pytest.mark.parametrize("scheme", ["16bit", "awq-g128", "w8a8-int8-token", "fp8-block"])
@pytest.mark.parametrize("m", [4, 700])  # one-launch prologue; chunked alignment + quantise kernels
def test_dependent_launch_chain_matches_plain_launches(scheme, m, monkeypatch):
    """On Hopper the layer's kernels run as one programmatic-dependent-launch chain; eagerly and
    replayed in a CUDA graph it gives bit for bit what plain launches give."""
    assert chain.pdl_supported(torch.device(DEVICE)), "this GPU should run the chain with PDL"
    e, h, i, top_k = SHAPES["e64"]
    weights = _weights(scheme, e, h, i, torch.bfloat16)
    experts = TritonExperts(weights, ExpertsConfig())
    inputs = _routing(m, e, h, top_k, torch.bfloat16, seed=5)
    chained = experts.apply(*inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts.apply(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(triton_layer, "pdl_supported", lambda device: False)
    plain = experts.apply(*inputs)
    assert torch.equal(chained, plain) and torch.equal(captured, plain)


@pytest.mark.parametrize("shape,m", [("e8", 1), ("e8", 64), ("e64", 1), ("e64", 8), ("e64", 64), ("e64", 512)])
def test_amax_pieces_give_the_whole_row_quantisation_bit_for_bit(shape, m, monkeypatch):
    """GEMM1 leaves each per-token int8 intermediate row its amax in pieces and the quantisation
    runs in row chunks (from 1024 rows, several rows a program): eagerly and replayed in a CUDA
    graph, bit for bit what reading each whole row gives. (One token's GEMMs would quantise their
    input themselves, with no quantisation launch: SCALE_IN_GEMM is off here; the decode GEMV, which
    quantises GEMM2's input from whole rows, is off too.)"""
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM", False)
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    e, h, i, top_k = SHAPES[shape]
    weights = _weights("w8a8-int8-token", e, h, i, torch.bfloat16)
    experts = TritonExperts(weights, ExpertsConfig())
    inputs = _routing(m, e, h, top_k, torch.bfloat16, seed=7)
    pieces = []
    real = activation_quant.act_quant
    monkeypatch.setattr(triton_plan, "act_quant",
                        lambda *a, **k: pieces.append(k.get("amax_pieces") is not None) or real(*a, **k))
    chunked = experts.apply(*inputs)
    assert pieces[-1], "GEMM2's input was not quantised from amax pieces"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts.apply(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(triton_plan, "AMAX_PIECES", False)
    whole = experts.apply(*inputs)
    assert not pieces[-1]
    assert torch.equal(chunked, whole) and torch.equal(captured, whole)


@pytest.mark.parametrize("scheme", ["awq-g128", "w8a8-int8-token", "fp8-block"])
def test_torch_compile_fullgraph(scheme):
    e, h, i, top_k = SHAPES["e8"]
    weights = _weights(scheme, e, h, i, torch.bfloat16)
    experts = TritonExperts(weights, ExpertsConfig())

    def layer(hidden, topk_weights, topk_ids):
        return experts.apply(hidden * 1.5, topk_weights, topk_ids) + 1.0

    compiled = torch.compile(layer, fullgraph=True)
    inputs = _routing(8, e, h, top_k, torch.bfloat16)
    torch.testing.assert_close(compiled(*inputs), layer(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("pairs", [64, 512, 1024, 2048, 4096])
def test_align_one_launch_equals_the_chunked_path_at_scale(pairs):
    """Both alignment paths (one launch, one program per 32 pairs; chunked, three launches) give
    the same arrays for 128 experts, top-8 (their timings: tools/bench_decode.py)."""
    ids = torch.rand(pairs // 8, 128, device=DEVICE).topk(8, dim=-1).indices.to(torch.int32)
    one = alignment.align(ids, 128, 64, one_launch_max=1 << 20)
    chunked = alignment.align(ids, 128, 64, one_launch_max=0)
    assert all(torch.equal(x, y) for x, y in zip(one, chunked, strict=True)), f"the two paths differ at {pairs} pairs"


# ---------------------------------------------------------------------------------------------
# the PTX nibble dequantisation against the plain Triton one, bit for bit


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "codes"])
@pytest.mark.parametrize("signed", [False, True], ids=["offset", "signed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_nibble_asm_matches_plain_dequant(dtype, signed, scaled):
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(p_ptr, z_ptr, s_ptr, lo_ptr, hi_ptr, SIGNED: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr,
                SCALED: tl.constexpr):
        offs = tl.arange(0, 64)[:, None] * 32 + tl.arange(0, 32)[None, :]
        zero = dequant_ptx._offset_zero(tl.load(z_ptr + tl.arange(0, 64))[:, None], DT, True)
        scale = tl.load(s_ptr + tl.arange(0, 64))[:, None]
        low, high = dequant_ptx._dequant_nibbles(tl.load(p_ptr + offs), zero, scale, DT, SIGNED, ASM, SCALED)
        tl.store(lo_ptr + offs, low)
        tl.store(hi_ptr + offs, high)

    if not dequant_ptx._paired_halves(torch.device(DEVICE), dtype):
        pytest.skip("paired 16-bit arithmetic unavailable here")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    packed = torch.randint(0, 256, (64, 32), generator=gen, device=DEVICE, dtype=torch.uint8)
    zero = torch.randint(0, 16, (64,), generator=gen, device=DEVICE).float() if not signed else torch.full(
        (64,), 8.0, device=DEVICE)
    scale = (torch.rand(64, generator=gen, device=DEVICE) * 0.02 + 1e-3).to(dtype)
    outs = {}
    for asm in (False, True):
        low, high = torch.empty(64, 32, dtype=dtype, device=DEVICE), torch.empty(64, 32, dtype=dtype, device=DEVICE)
        dequant[(1,)](packed, zero, scale, low, high, SIGNED=signed, DT=tl.bfloat16 if dtype == torch.bfloat16
                      else tl.float16, ASM=asm, SCALED=scaled)
        outs[asm] = (low, high)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    # and the plain path is the textbook (code - zero) * scale, or code - zero unscaled
    codes_low = (packed & 0xF).float() if not signed else ((packed & 0xF) ^ 8).float()
    expect = ((codes_low - zero[:, None]) * (scale.float()[:, None] if scaled else 1.0)).to(dtype)
    assert torch.equal(outs[False][0], expect)


def test_nibbles_to_int8_asm_matches_plain():
    """W4A8's int8 dot operand: the PTX (four codes an instruction) and the plain Triton path give
    the same int8 values, code - 8, for every byte in every lane position."""
    import triton
    import triton.language as tl
    from moe_registry_kernels.triton.dequant_ptx import _nibbles_as_int8

    @triton.jit
    def unpack(p_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
        offs = tl.arange(0, 64)[:, None] * 32 + tl.arange(0, 32)[None, :]
        low, high = _nibbles_as_int8(tl.load(p_ptr + offs), ASM)
        tl.store(lo_ptr + offs, low)
        tl.store(hi_ptr + offs, high)

    packed = torch.arange(64 * 32, device=DEVICE).remainder(256).to(torch.uint8).view(64, 32)
    packed = packed[torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(DEVICE)]
    outs = {}
    for asm in (False, True):
        low, high = torch.empty(64, 32, dtype=torch.int8, device=DEVICE), torch.empty(64, 32, dtype=torch.int8,
                                                                                      device=DEVICE)
        unpack[(1,)](packed, low, high, ASM=asm)
        outs[asm] = (low, high)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    assert torch.equal(outs[False][0], ((packed & 0xF).to(torch.int16) - 8).to(torch.int8))
    assert torch.equal(outs[False][1], ((packed >> 4).to(torch.int16) - 8).to(torch.int8))


# ---------------------------------------------------------------------------------------------
# the PTX e2m1 (FP4) dequantisation against the plain Triton one and the code table, bit for bit


@pytest.mark.parametrize("folded", [False, True], ids=["two-multiplies", "folded"])
@pytest.mark.parametrize("scales", ["e8m0", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_e2m1_asm_matches_plain_dequant(dtype, scales, folded):
    """Every packed byte, in the decoders' register order. Folded: the scale arrives times 2^U / 2^shift
    (fp4_dequant's module note; MX codes in the fold's range, e4m3 with shift 8), and the tile holds the
    table value times the scale over 2^shift."""
    import triton
    import triton.language as tl
    from moe_registry_kernels.fp4 import e2m1_to_float
    from moe_registry_kernels.triton.fp4_dequant import _dequant_e2m1, e2m1_register_order

    @triton.jit
    def dequant(p_ptr, s_ptr, lo_ptr, hi_ptr, DT: tl.constexpr, ASM: tl.constexpr, FOLDED: tl.constexpr):
        offs = tl.arange(0, 64)[:, None] * 32 + tl.arange(0, 32)[None, :]
        scale = tl.load(s_ptr + tl.arange(0, 64))[:, None]
        low, high = _dequant_e2m1(tl.load(p_ptr + offs), scale, DT, ASM, FOLDED)
        tl.store(lo_ptr + offs, low)
        tl.store(hi_ptr + offs, high)

    if not dequant_ptx._paired_halves(torch.device(DEVICE), dtype):
        pytest.skip("paired 16-bit arithmetic unavailable here")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    packed = torch.arange(256, device=DEVICE, dtype=torch.uint8).repeat(8).view(64, 32)  # every byte, 8 times
    if scales == "e8m0":  # powers of two 2^-14 .. 2^9 (folded: to 2^1): float16's range for every code
        scale = torch.exp2(torch.randint(-14, 2 if folded else 10, (64,), generator=gen, device=DEVICE).float())
    else:  # e4m3 values, subnormals included
        scale = torch.randint(1, 127, (64,), generator=gen, device=DEVICE, dtype=torch.uint8).view(
            torch.float8_e4m3fn).float()
    shift = 8 if folded and scales == "e4m3" else 0
    unscale = (126 if dtype == torch.bfloat16 else 14) if folded else 0
    given = (scale * 2.0 ** (unscale - shift)).to(dtype)
    assert torch.equal(given.float(), scale * 2.0 ** (unscale - shift))
    outs = {}
    for asm in (False, True):
        low, high = torch.empty(64, 32, dtype=dtype, device=DEVICE), torch.empty(64, 32, dtype=dtype, device=DEVICE)
        dequant[(1,)](e2m1_register_order(packed), given, low, high,
                      DT=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, ASM=asm, FOLDED=folded)
        outs[asm] = (low, high)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    # and both are the code table times the scale, rounded once (over 2^shift: exact)
    for codes, got in (((packed & 0xF), outs[True][0]), ((packed >> 4), outs[True][1])):
        assert torch.equal(got.float() * 2.0 ** shift, (e2m1_to_float(codes) * scale[:, None]).to(dtype).float())


@pytest.mark.parametrize("asm", [False, True], ids=["plain", "paired-ptx"])
@pytest.mark.parametrize(("dtype", "times"), [(torch.bfloat16, 2.0 ** 118), (torch.float16, 2.0 ** 6),
                                               (torch.float32, 1.0)], ids=["bf16", "fp16", "fp32"])
def test_nvfp4_scale_codes_compiled_decode_every_positive_e4m3_value(dtype, times, asm):
    """NVFP4's scales as the GEMMs take them (fp4_dequant.e4m3_scale_codes), decoded by the compiled
    kernel: one integer multiply-add a code, or a pair (the 16-bit types' paired PTX, which the GEMMs
    run); every positive finite e4m3 value times the fold factor, bit for bit."""
    import triton
    import triton.language as tl
    from moe_registry_kernels.triton.fp4_dequant import _scale_code_value, e4m3_scale_codes

    @triton.jit
    def decode(c_ptr, out_ptr, DT: tl.constexpr, TIMES: tl.constexpr, ASM: tl.constexpr):
        offs = tl.arange(0, 128)
        tl.store(out_ptr + offs, _scale_code_value(tl.load(c_ptr + offs), DT, TIMES, ASM))

    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    positive = every[every.float() > 0]
    _, codes = e4m3_scale_codes(torch.zeros(1, 1, 8 * positive.numel(), dtype=torch.uint8), positive.view(1, 1, -1))
    codes = torch.cat([codes.view(-1), torch.zeros(128 - positive.numel(), dtype=torch.uint8)]).to(DEVICE)
    out = torch.empty(128, dtype=dtype, device=DEVICE)
    decode[(1,)](codes, out, DT={torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32),
                 TIMES=times, ASM=asm)
    assert torch.equal(out[:positive.numel()].cpu(), (positive.float() * times).to(dtype))


@pytest.mark.parametrize("word_pairs", [False, True], ids=["bytes", "word-pairs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mx_fp8_ptx_with_folded_scales_equals_value_times_scale(dtype, word_pairs):
    """MX fp8 weights through dequant_ptx._e4m3_asm, their scales folded as the GEMMs fold them: every
    finite e4m3 byte (subnormals too) times every e8m0 code the fold admits for the dtype, bit for
    bit against the float32 product rounded once (what the plain path gives). bfloat16 needs the
    GPU's paired multiply to keep subnormal inputs: e4m3 subnormals are bfloat16 subnormals here."""
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(c_ptr, s_ptr, out_ptr, DT: tl.constexpr, PAIRS: tl.constexpr):
        rows = tl.arange(0, 64)[:, None]
        scale = dequant_ptx._e4m3_folded_scale(dequant_ptx._e8m0(tl.load(s_ptr + rows)), DT)
        if PAIRS:  # as the swapped kernel reads them: 16-bit words of an even and an odd column
            words = tl.load(c_ptr.to(tl.pointer_type(tl.uint16)) + rows * 128 + tl.arange(0, 128)[None, :])
            even, odd = dequant_ptx._dequant_e4m3(words, scale, DT, True)
            out = tl.reshape(tl.join(even, odd), (64, 256))
        else:
            out = dequant_ptx._dequant_e4m3(tl.load(c_ptr + rows * 256 + tl.arange(0, 256)[None, :]), scale, DT)
        tl.store(out_ptr + rows * 256 + tl.arange(0, 256)[None, :], out)

    if not dequant_ptx._paired_halves(torch.device(DEVICE), dtype):
        pytest.skip("paired 16-bit arithmetic unavailable here")
    lowest, highest = triton_launch.E4M3_MX_FOLD_CODES[dtype]
    every = torch.arange(256, device=DEVICE)
    every = torch.where((every & 0x7F) == 0x7F, 0, every).to(torch.uint8)  # the NaN codes, refused on load
    for first in range(lowest, highest + 1, 64):
        scale_codes = torch.arange(first, first + 64, device=DEVICE).clamp(max=highest).to(torch.uint8)
        codes = every.repeat(64, 1).roll(1, dims=1).contiguous()
        out = torch.empty(64, 256, dtype=dtype, device=DEVICE)
        dequant[(1,)](codes, scale_codes, out, DT=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16,
                      PAIRS=word_pairs)
        scales = torch.exp2(scale_codes.double() - 127)[:, None]
        want = (codes.view(torch.float8_e4m3fn).double() * scales).to(dtype)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (first, dtype)


# ---------------------------------------------------------------------------------------------
# the PTX byte dequantisation against the plain Triton one, bit for bit


@pytest.mark.parametrize("word_pairs", [False, True], ids=["bytes", "word-pairs"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "codes"])
@pytest.mark.parametrize("w_type", ["uint8b128", "int8", "uint8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_byte_asm_matches_plain_dequant(dtype, w_type, scaled, word_pairs):
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(c_ptr, z_ptr, s_ptr, out_ptr, W_TYPE: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr,
                SCALED: tl.constexpr, PAIRS: tl.constexpr):
        offs = tl.arange(0, 64)[:, None] * 32 + tl.arange(0, 32)[None, :]
        zero = dequant_ptx._offset_zero(tl.load(z_ptr + tl.arange(0, 64))[:, None], DT, False)
        scale = tl.load(s_ptr + tl.arange(0, 64))[:, None]
        if PAIRS:  # as the swapped kernel reads them: 16-bit words of an even and an odd column
            words = tl.load(c_ptr.to(tl.pointer_type(tl.uint16)) + tl.arange(0, 64)[:, None] * 16
                            + tl.arange(0, 16)[None, :])
            if ASM:
                even, odd = dequant_ptx._dequant_byte_pairs(words, zero, scale, DT, W_TYPE == "int8", SCALED)
            else:
                even = dequant_ptx._dequant_byte((words & 0xFF).to(tl.uint8), zero, scale, DT, W_TYPE, False, SCALED)
                odd = dequant_ptx._dequant_byte((words >> 8).to(tl.uint8), zero, scale, DT, W_TYPE, False, SCALED)
            out = tl.reshape(tl.join(even, odd), (64, 32))
        else:
            out = dequant_ptx._dequant_byte(tl.load(c_ptr + offs), zero, scale, DT, W_TYPE, ASM, SCALED)
        tl.store(out_ptr + offs, out)

    if not dequant_ptx._paired_halves(torch.device(DEVICE), dtype):
        pytest.skip("paired 16-bit arithmetic unavailable here")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    codes = torch.randint(0, 256, (64, 32), generator=gen, device=DEVICE, dtype=torch.uint8)
    if w_type == "uint8":  # per-row zero points
        zero = torch.randint(0, 256, (64,), generator=gen, device=DEVICE).float()
    else:
        zero = torch.full((64,), 128.0, device=DEVICE)
    scale = (torch.rand(64, generator=gen, device=DEVICE) * 0.02 + 1e-3).to(dtype)
    outs = {}
    for asm in (False, True):
        out = torch.empty(64, 32, dtype=dtype, device=DEVICE)
        dequant[(1,)](codes, zero, scale, out, W_TYPE=w_type, DT=tl.bfloat16 if dtype == torch.bfloat16
                      else tl.float16, ASM=asm, SCALED=scaled, PAIRS=word_pairs)
        outs[asm] = out
    assert torch.equal(outs[True], outs[False])
    # and the plain path is the textbook (code - zero) * scale, or code - zero unscaled
    values = codes.view(torch.int8).float() if w_type == "int8" else codes.float() - zero[:, None]
    expect = (values * (scale.float()[:, None] if scaled else 1.0)).to(dtype)
    assert torch.equal(outs[False], expect)
