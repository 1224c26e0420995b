"""The Triton MoE kernels and ops on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Float16 activations only: the interpreter multiplies bfloat16 dot operands as raw bit patterns
(bfloat16 is covered by tests/test_triton_gpu.py). Shapes are tiny (E=4, H=128, I=64) because the
interpreter runs every program of the grid in numpy.

Tolerances (relative error ‖out − ref‖ / ‖ref‖ against the float64 reference, which quantises
activations the same way):

- 16-bit weights, 5e-3: the kernel rounds GEMM1's output, the activation and GEMM2's output to
  float16 (2^-11 relative each) and accumulates in float32; measured ~5e-4.
- integer weights, 1e-2: dequantised weights are also rounded to float16 in registers, and with
  int8 activations a float16-rounded intermediate lands on the other side of an int8 rounding
  boundary for a few percent of its codes (one code is ~1% of a typical value); measured <= 3e-3.
- fp8 schemes, 3e-2: e4m3 keeps 3 mantissa bits, so one flipped activation code moves a value by
  up to 6%; measured ~1e-3 here, with headroom for the MXFP8 / block-128 rounding of real models.
"""

import contextlib
import json
import os
from types import SimpleNamespace

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # Setting the variable here would turn every Triton kernel imported later into an interpreted
    # one, GPU tests included; set TRITON_INTERPRET=1 yourself to run these on a GPU machine.
    pytest.skip("interpreter tests run on CPU-only machines (GPU: tests/test_triton_gpu.py)",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tests/conftest.py does it too)

triton = pytest.importorskip("triton", reason="triton is not installed")

from launch_spy import ArgSpy, KwargSpy, LaunchSpy, without_and_with  # noqa: E402
from moe_registry_kernels import activations, quant_ref  # noqa: E402
from moe_registry_kernels.reference import reference_moe, reference_moe_batched  # noqa: E402
from moe_registry_kernels.triton import activation_quant, chain, reduce, tile_config  # noqa: E402
from moe_registry_kernels.triton import align as alignment  # noqa: E402
from moe_registry_kernels.triton import gemm as triton_gemm  # noqa: E402
from moe_registry_kernels.triton import launch as triton_launch  # noqa: E402
from moe_registry_kernels.triton import layer as triton_layer  # noqa: E402
from moe_registry_kernels.triton import layout as triton_layout  # noqa: E402
from moe_registry_kernels.triton import plan as triton_plan  # noqa: E402
from moe_registry_kernels.triton import variant as triton_variant  # noqa: E402
from moe_registry_kernels.triton.experts import TritonBatchedExperts, TritonExperts  # noqa: E402
from moe_registry_kernels.triton.fp4_dequant import e2m1_register_order, e4m3_scale_codes  # noqa: E402
from moe_registry_kernels.triton.tile_config import config_file, default_config, get_config, shape_key  # noqa: E402
from moe_registry_kernels.triton.variant import variant_from_keys  # noqa: E402

from moe_registry.core.keys import parse_quant_key  # noqa: E402
from moe_registry.layer.experts import ExpertsConfig  # noqa: E402

E, H, INTER = 4, 128, 64
UNQ = "unquantized"
INT8_TOKEN = "int8 scale:float32:token:dynamic"
INT8_STATIC = "int8 scale:float32:tensor:static"
MXFP8 = "fp8e4m3 scale:e8m0:block(1x32):static"
MXFP8_ACT = "fp8e4m3 scale:e8m0:block(1x32):dynamic"
FP8_BLOCK = "fp8e4m3 scale:float32:block(128x128):static"
FP8_GROUP_ACT = "fp8e4m3 scale:float32:group(128):dynamic"

# (weight key, activation key, tolerance)
SCHEMES = {
    "fp16": (UNQ, UNQ, 5e-3),
    "awq-g128": ("uint4 scale:float16:group(128):static zp:group", UNQ, 1e-2),
    "awq-g32": ("uint4 scale:float16:group(32):static zp:group", UNQ, 1e-2),
    "awq-channel": ("uint4 scale:float16:channel:static zp:group", UNQ, 1e-2),
    "gptq4-g64": ("uint4b8 scale:float16:group(64):static", UNQ, 1e-2),
    "gptq4-channel": ("uint4b8 scale:float16:channel:static", UNQ, 1e-2),
    "gptq8-g128": ("uint8b128 scale:float16:group(128):static", UNQ, 1e-2),
    "gptq8-channel": ("uint8b128 scale:float16:channel:static", UNQ, 1e-2),
    "int4-g128": ("int4 scale:float16:group(128):static", UNQ, 1e-2),
    "int8-w8a16": ("int8 scale:float32:channel:static", UNQ, 1e-2),
    "w8a8-int8-token": ("int8 scale:float32:channel:static", INT8_TOKEN, 1e-2),
    "w8a8-int8-static": ("int8 scale:float32:tensor:static", INT8_STATIC, 1e-2),
    "mxfp8-w8a16": (MXFP8, UNQ, 3e-2),
    "mxfp8": (MXFP8, MXFP8_ACT, 3e-2),
    "fp8-block": (FP8_BLOCK, FP8_GROUP_ACT, 3e-2),
    "fp8-block-w8a16": (FP8_BLOCK, UNQ, 3e-2),
}


def _weights(scheme: str, *, bias: bool = True, act_order: bool = False, seed: int = 0):
    wk, ak, _ = SCHEMES[scheme]
    return quant_ref.make_random_expert_weights(
        parse_quant_key(wk), parse_quant_key(ak), num_experts=E, hidden=H, intermediate=INTER,
        dtype=torch.float16, bias=bias, act_order=act_order, seed=seed)


def _routing(m: int, top_k: int, *, seed: int = 0, skip_expert: int | None = None):
    """Hidden states ~ N(0, 1), distinct experts per token (optionally never ``skip_expert``)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, H, generator=g).to(torch.float16)
    experts = [e for e in range(E) if e != skip_expert]
    ids = torch.stack([torch.tensor(experts)[torch.randperm(len(experts), generator=g)[:top_k]]
                       for _ in range(m)])
    weights = torch.rand(m, top_k, generator=g) + 0.1
    return hidden, weights, ids.to(torch.int32)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _check_layer(scheme: str, m: int, top_k: int, *, activation: str = "silu", act_order: bool = False,
                 bias: bool = True, skip_expert: int | None = None, on_input: bool = False, seed: int = 0):
    weights = _weights(scheme, bias=bias, act_order=act_order, seed=seed)
    config = ExpertsConfig(activation=activation, apply_router_weight_on_input=on_input)
    hidden, topk_weights, topk_ids = _routing(m, top_k, seed=seed, skip_expert=skip_expert)
    before = hidden.clone()
    out = TritonExperts(weights, config).apply(hidden, topk_weights, topk_ids)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, config)
    assert out.shape == (m, H) and out.dtype == torch.float16
    assert torch.equal(hidden, before), "apply mutated its input"
    err = _rel_err(out, ref)
    assert err < SCHEMES[scheme][2], f"{scheme}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------
# the layer, every scheme


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme_matches_reference(scheme, m):
    _check_layer(scheme, m, top_k=2, seed=m)


@pytest.mark.parametrize("scheme,swapped", [("fp16", False), ("fp16", True), ("gptq8-g128", True),
                                            ("w8a8-int8-token", False), ("fp8-block", False)])
def test_one_token_takes_no_alignment_launch(scheme, swapped, monkeypatch):
    """One token: each row block is one of its top-k pairs, read straight from the router's ids;
    more tokens go through the alignment."""
    aligned = []
    real = alignment.align_quant
    monkeypatch.setattr(triton_layer, "align_quant", lambda *a, **k: aligned.append(a[0].shape) or real(*a, **k))
    with tile_config.config_override(SWAPPED, SWAPPED) if swapped else contextlib.nullcontext():
        _check_layer(scheme, 1, top_k=3, seed=4)
        assert aligned == []
        _check_layer(scheme, 2, top_k=3, seed=4)
        assert aligned == [(2, 3)]


@pytest.mark.parametrize("scheme,activation", [
    ("fp16", "gelu"), ("fp16", "swigluoai"), ("awq-g128", "swigluoai"), ("w8a8-int8-token", "gelu"),
])
def test_activations(scheme, activation):
    _check_layer(scheme, 7, top_k=2, activation=activation)


@pytest.mark.parametrize("scheme", ["gptq4-g64", "gptq8-g128", "awq-g32", "w8a8-int8-token"])
def test_act_order(scheme):
    _check_layer(scheme, 7, top_k=2, act_order=True, seed=3)


@pytest.mark.parametrize("scheme", ["fp16", "awq-g128", "fp8-block"])
def test_top_k_equals_num_experts(scheme):
    _check_layer(scheme, 7, top_k=E)


@pytest.mark.parametrize("scheme", ["gptq4-channel", "mxfp8"])
def test_expert_without_tokens_and_no_bias(scheme):
    _check_layer(scheme, 7, top_k=2, skip_expert=1, bias=False)


@pytest.mark.parametrize("scheme", ["fp16", "w8a8-int8-token", "w8a8-int8-static"])
def test_router_weight_on_input(scheme):
    _check_layer(scheme, 7, top_k=1, on_input=True)


# GEMM2 cut into 2 pieces of K (INTER = 64 = 2 x BLOCK_K 32), summed by the top-k reduction
SPLIT_GEMM2 = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 2, "num_warps": 4,
               "num_stages": 2}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_split_k(scheme, monkeypatch):
    """Bias added once, router weight and every scale applied per piece: the pieces sum to the layer.
    The launches are watched: GEMM1 runs whole, GEMM2 over a grid of two K pieces."""
    launched = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", LaunchSpy(triton_gemm._fused_moe_kernel, launched))
    with tile_config.config_override(gemm2=SPLIT_GEMM2):
        _check_layer(scheme, 7, top_k=2, seed=11)
    assert [grid[2] for grid in launched] == [1, 2], f"{scheme}: launch grids {launched}"


GROUP_DOTS_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}


GPTQ4_G32 = "uint4b8 scale:float16:group(32):static"


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("scheme,block_k", [("gptq4-g32", 64), ("gptq4-g64", 128), ("int4-g128", 256)])
def test_group_dots_take_each_groups_scale_on_its_result(scheme, block_k, m, monkeypatch):
    """GROUP_DOTS: a K tile spanning two weight groups (for int4-g128's GEMM2 the second lies past
    K; gptq4-g32's GEMM1 takes two K steps, each with the scales loaded the step before) takes one
    dot per group with the group's scale on its result: the layer within tolerance, and not the
    per-weight-scale tile's numbers (the launches are watched: both GEMMs took it)."""
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "GROUP_DOTS", seen))
    if scheme == "gptq4-g32":
        weights = quant_ref.make_random_expert_weights(parse_quant_key(GPTQ4_G32), parse_quant_key(UNQ), num_experts=E,
                                                       hidden=H, intermediate=INTER, dtype=torch.float16, seed=3)
    else:
        weights = _weights(scheme, seed=3)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=3)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    outs = {}
    for grouped in (True, False):
        tile = {**GROUP_DOTS_TILE, "BLOCK_K": block_k} | ({"GROUP_DOTS": True} if grouped else {})
        with tile_config.config_override(tile, tile):
            outs[grouped] = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True, False, False]
    for grouped, out in outs.items():
        err = _rel_err(out, ref)
        assert err < 1e-2, f"{scheme} GROUP_DOTS={grouped}: relative error {err:.2e}"
    assert not torch.equal(outs[True], outs[False])


W8A16_ASYM = "uint8 scale:float16:group(128):static zp:group"
ZERO_SUMS_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
                  "num_stages": 2}


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("wkey,block_k", [(W8A16_ASYM, 32), (SCHEMES["awq-g32"][0], 32), (SCHEMES["awq-g128"][0], 32),
                                          (SCHEMES["awq-g32"][0], 64)])
def test_zero_sums_take_zero_points_off_the_rows_results(wkey, block_k, m, monkeypatch):
    """ZERO_SUMS: zero-point weights on the factored dot (codes less a constant, each group's scale
    on its result) corrected by the layer's per-group input sums: the layer within tolerance,
    GEMM2 split too, and not the per-weight-zero tile's numbers. A group of 128 spans four K steps
    (its correction taken once); GEMM2's K (64) is half a group: its sums cover a short group, and
    split in two, the second split holds no group's first step. awq-g32 with BLOCK_K 64 takes one
    dot per group (GROUP_DOTS). GEMM1's input sums come with the alignment, GEMM2's from GEMM1's
    epilogue in pieces; one token's GEMMs (one-pair blocks) sum their block's one row themselves.
    The launches are watched: both GEMMs took it, with no launch of their own for the sums."""
    seen: list = []
    seen_grouped: list = []
    seen_pieces: list = []
    seen_buffers: list = []
    spy = KwargSpy(KwargSpy(KwargSpy(KwargSpy(triton_gemm._fused_moe_kernel, "GROUP_DOTS", seen_grouped), "ZERO_SUMS",
                                     seen), "SUM_PIECES", seen_pieces), "row_sums_ptr", seen_buffers)
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", spy)
    sum_launches: list = []
    row_group_sums = alignment.row_group_sums
    monkeypatch.setattr(triton_plan, "row_group_sums",
                        lambda *a, **k: sum_launches.append(1) or row_group_sums(*a, **k))
    weights = quant_ref.make_random_expert_weights(parse_quant_key(wkey), parse_quant_key(UNQ), num_experts=E,
                                                   hidden=H, intermediate=INTER, dtype=torch.float16, seed=5)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=5)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    outs = {}
    grouped = {"GROUP_DOTS": True} if block_k == 64 else {}
    for name, zero_sums, split in (("sums", True, 1), ("sums split", True, 2), ("per weight", False, 1)):
        tile = ZERO_SUMS_TILE | {"BLOCK_K": block_k} | ({"ZERO_SUMS": True, **grouped} if zero_sums else {})
        with tile_config.config_override(tile, {**tile, "SPLIT_K": split}):
            outs[name] = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True, True, True, None, None]
    assert seen_grouped == [block_k == 64] * 4 + [False, False]
    # GEMM2 sums the pieces GEMM1's epilogue left, one per 16-column tile (BLOCK_N 32 of gate and up)
    group = variant_from_keys(wkey, UNQ).weight_group
    assert seen_pieces == ([1, group // 16] if m > 1 else [1, 1]) * 2 + [None, None]
    assert [b is None for b in seen_buffers[:4]] == [m == 1] * 4 and not sum_launches
    for name, out in outs.items():
        err = _rel_err(out, ref)
        assert err < 1e-2, f"{wkey} {name}: relative error {err:.2e}"
    assert not torch.equal(outs["sums"], outs["per weight"])


@pytest.mark.parametrize("m", [1, 5])
def test_zero_sums_take_each_group_once_over_misaligned_splits(m, monkeypatch):
    """GEMM2 over 20 groups of 32 columns in four splits of five groups (the launch is watched):
    each split's terms start at the last multiple of 16 groups (the vector loads' alignment), and
    the groups before its own first one, another split's, add nothing (taken twice, the layer
    would be far off); for sums in GEMM1's pieces, and one token's found from its row."""
    launched: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", LaunchSpy(triton_gemm._fused_moe_kernel, launched))
    weights = quant_ref.make_random_expert_weights(parse_quant_key(SCHEMES["awq-g32"][0]), parse_quant_key(UNQ),
                                                   num_experts=E, hidden=H, intermediate=640, dtype=torch.float16,
                                                   seed=8)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=8)
    tile = ZERO_SUMS_TILE | {"ZERO_SUMS": True}
    with tile_config.config_override(tile, {**tile, "SPLIT_K": 4}):
        out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert [grid[2] for grid in launched] == [1, 4]
    err = _rel_err(out, reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig()))
    assert err < 1e-2, f"ZERO_SUMS over four splits: relative error {err:.2e}"


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("block_k,grouped", [(32, False), (128, True)])
def test_zero_sums_on_fixed_zero_codes_take_no_terms_in_float16(block_k, grouped, m, monkeypatch):
    """GPTQ's 4-bit codes (a fixed zero of 8) on ZERO_SUMS tiles: bfloat16 dots run on the raw codes and
    take (8 + 128) times each group's scale and input sum off after the loop (tests/test_triton_gpu.py:
    the interpreter has no bfloat16 dot); in float16 the dots already run on code - 8, the terms would be
    zero and are not taken: the launches took ZERO_SUMS, and the layer's numbers are the plain tile's."""
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
    weights = quant_ref.make_random_expert_weights(parse_quant_key(SCHEMES["gptq4-g64"][0]), parse_quant_key(UNQ),
                                                   num_experts=E, hidden=H, intermediate=INTER, dtype=torch.float16,
                                                   seed=9)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=9)
    outs = {}
    for zero_sums in (True, False):
        tile = ZERO_SUMS_TILE | {"BLOCK_K": block_k} | ({"GROUP_DOTS": True} if grouped else {})
        tile |= {"ZERO_SUMS": True} if zero_sums else {}
        with tile_config.config_override(tile, {**tile, "SPLIT_K": 2}):
            outs[zero_sums] = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True, None, None]
    assert torch.equal(outs[True], outs[False])
    err = _rel_err(outs[True], reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig()))
    assert err < 1e-2, f"gptq4-g64 ZERO_SUMS in float16: relative error {err:.2e}"


def test_zero_sums_in_the_batched_format(monkeypatch):
    """Expert slabs (expert parallelism's batched format) take the same input sums, row for row."""
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
    weights = quant_ref.make_random_expert_weights(parse_quant_key(W8A16_ASYM), parse_quant_key(UNQ), num_experts=E,
                                                   hidden=H, intermediate=INTER, dtype=torch.float16, seed=6)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(E, 5, H, generator=g).to(torch.float16)
    counts = torch.tensor([5, 0, 3, 1], dtype=torch.int32)
    tile = ZERO_SUMS_TILE | {"ZERO_SUMS": True}
    with tile_config.config_override(tile, tile):
        out = TritonBatchedExperts(weights, ExpertsConfig()).apply_batched(x, counts)
    ref = reference_moe_batched(x, counts, weights, ExpertsConfig())
    assert seen == [True, True]
    err = _rel_err(out, ref)
    assert err < 1e-2, f"batched ZERO_SUMS: relative error {err:.2e}"


def test_zero_sums_are_kept_only_where_a_tile_can_take_them():
    def fit(wkey, **config):
        tile = {**ZERO_SUMS_TILE, "BLOCK_K": 128, "ZERO_SUMS": True, **config}
        return tile_config._fit_config(tile, variant_from_keys(wkey, UNQ), can_split=True).get("ZERO_SUMS")

    assert fit(W8A16_ASYM) is True and fit(SCHEMES["awq-g128"][0], BLOCK_M=32) is True
    assert fit(W8A16_ASYM, BLOCK_K=256) is None  # a K tile spans two groups
    # 4-bit zero points: per-group dots with ZERO_SUMS, and only with them
    awq = variant_from_keys(SCHEMES["awq-g128"][0], UNQ)
    grouped = {**ZERO_SUMS_TILE, "BLOCK_K": 256, "GROUP_DOTS": True}
    assert tile_config._fit_config({**grouped, "ZERO_SUMS": True}, awq, can_split=True).keys() >= {"GROUP_DOTS",
                                                                                                  "ZERO_SUMS"}
    assert "GROUP_DOTS" not in tile_config._fit_config(grouped, awq, can_split=True)
    assert "GROUP_DOTS" not in tile_config._fit_config({**grouped, "ZERO_SUMS": True, "BLOCK_M": 64}, awq,
                                                       can_split=True)
    assert fit(W8A16_ASYM, BLOCK_M=64) is None  # 64+ row tiles keep their per-weight zero
    assert fit(W8A16_ASYM, SWAP_AB=True) is None  # the swapped kernel subtracts them per weight
    assert fit(SCHEMES["awq-channel"][0]) is None  # per-channel scales: no groups
    assert fit(SCHEMES["gptq8-g128"][0]) is None  # 8-bit codes of a fixed zero: no raw dot to correct
    assert fit(SCHEMES["gptq4-g64"][0], BLOCK_K=64) is True  # 4-bit ones: the raw codes' dots (bfloat16)
    assert fit(W8A16_ASYM, ZERO_SUMS=False) is None  # absent, not False: tables stay as they were


def test_zero_sums_need_weights_in_column_order():
    """Act-order weights would take each group's sums over permuted input columns: the layer
    computes no sums and runs the per-weight zero, and a launch given sums where the tile takes
    none (or none where it does) is refused."""
    weights = _weights("awq-g32", act_order=True, seed=2)
    seen: list = []
    tile = ZERO_SUMS_TILE | {"ZERO_SUMS": True}
    hidden, topk_weights, topk_ids = _routing(7, 2, seed=2)
    with pytest.MonkeyPatch.context() as patch, tile_config.config_override(tile, tile):
        patch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
        out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert seen == [None, None]
    assert _rel_err(out, reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())) < 1e-2
    w = triton_layout._Proj(weight=torch.zeros(1), scale=None, zero=None, perm=None, bias=None, input_scale=None,
                         n=8, k=8)
    assert triton_launch._zero_sums(tile, w) and not triton_launch._zero_sums(ZERO_SUMS_TILE, w)
    with pytest.raises(ValueError, match="input row sums go with a ZERO_SUMS tile"):
        triton_launch._gemm(torch.zeros(1, 8), None, w, variant_from_keys(W8A16_ASYM, UNQ), torch.zeros(1, 8),
                         triton_launch._Rows(num_valid=1), {**tile, "SWAP_AB": False}, compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="finds its input sums itself on one-pair blocks"):
        triton_launch._gemm(torch.zeros(1, 8), None, w, variant_from_keys(W8A16_ASYM, UNQ), torch.zeros(1, 8),
                         triton_launch._Rows(num_valid=1), {**tile, "SWAP_AB": False}, compute_dtype=torch.float16,
                         row_sums=triton_launch._RowSums(None))
    with pytest.raises(ValueError, match="row-sum pieces come from the fused-activation kernel"):
        triton_launch._gemm(torch.zeros(1, 8), None, w, variant_from_keys(W8A16_ASYM, UNQ), torch.zeros(1, 8),
                         triton_launch._Rows(num_valid=1), {**ZERO_SUMS_TILE, "SWAP_AB": False},
                         compute_dtype=torch.float16, sums_out=torch.zeros(1, 1))


def test_group_row_sums_cover_a_short_last_group():
    """Each row's group sums (a ZERO_SUMS GEMM's input), alone and in the alignment's launch: the
    same alignment as align's, and a short last group."""
    a = torch.arange(10, dtype=torch.float16).reshape(2, 5)
    want = [[1.0, 5.0, 4.0], [11.0, 15.0, 9.0]]
    assert alignment.row_group_sums(a, 2).tolist() == want
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=g).to(torch.float16)
    ref = torch.nn.functional.pad(x.double(), (0, 84)).view(5, 3, 128).sum(-1)
    assert torch.allclose(alignment.row_group_sums(x, 128).double(), ref, rtol=1e-6, atol=1e-5)
    ids = torch.randint(0, E, (5, 2), generator=g, dtype=torch.int32)
    for one_launch_max in (1024, 4):  # one launch, and the two it takes with many pairs
        *aligned, sums = alignment.align_row_sums(ids, E, 16, x, 128, one_launch_max=one_launch_max)
        assert all(torch.equal(p, q) for p, q in zip(aligned, alignment.align(ids, E, 16), strict=True))
        assert torch.allclose(sums.double(), ref, rtol=1e-6, atol=1e-5)


def test_group_dots_are_kept_only_where_a_tile_spans_several_groups():
    def fit(scheme, **config):
        wk, ak, _ = SCHEMES[scheme]
        tile = {**GROUP_DOTS_TILE, "BLOCK_K": 128, "GROUP_DOTS": True, **config}
        return tile_config._fit_config(tile, variant_from_keys(wk, ak), can_split=True).get("GROUP_DOTS")

    assert fit("gptq4-g64") is True and fit("int4-g128", BLOCK_K=256) is True
    assert fit("gptq4-g64", BLOCK_K=64) is None  # one group a tile: the factored dot already
    assert fit("gptq4-g64", SWAP_AB=True) is None  # the swapped kernel has no per-group dots
    assert fit("awq-g128", BLOCK_K=256) is None  # zero points
    assert fit("gptq8-g128", BLOCK_K=256) is None  # 8-bit codes
    assert fit("gptq4-channel") is None
    assert fit("gptq4-g64", GROUP_DOTS=False) is None  # absent, not False: tables stay as they were
    fp4 = variant_from_keys("e2m1 scale:e8m0:group(32):static", UNQ)
    assert tile_config.group_dot_width(fp4, 16) == 0
    assert tile_config.group_dot_width(variant_from_keys(*SCHEMES["int4-g128"][:2]), 16) == 128


def test_int8_activations_name_the_weights_they_take():
    """int8 activations run on int8 weights with per-channel or per-tensor scales, or on uint4b8
    (W4A8) with group or channel scales of any float dtype (compressed-tensors writes bfloat16);
    other weights are refused by a message that says so."""
    for scale in ("float32", "bfloat16", "float16"):
        assert variant_from_keys(f"uint4b8 scale:{scale}:group(128):static", INT8_TOKEN).weight_type == "uint4b8"
    with pytest.raises(ValueError, match=r"int8 activations need int8 weights with per-channel/tensor scales \(or "
                                         r"uint4b8 with group or channel scales\), got 'int8 scale:float16:group"):
        variant_from_keys("int8 scale:float16:group(64):static", INT8_TOKEN)


def test_w4a8_group_dots_only_on_its_16_bit_dot_tiles():
    """W4A8 takes per-group dots on tiles of <= 32 rows (the codes' 16-bit dot), where its K tile
    may then span groups; a 64-row tile (the int8 dot) keeps one group a K tile and no GROUP_DOTS."""
    w4a8 = variant_from_keys("uint4b8 scale:float32:group(128):static", INT8_TOKEN)
    assert tile_config.group_dot_width(w4a8, 32) == 128 and tile_config.group_dot_width(w4a8, 64) == 0
    tile = {**GROUP_DOTS_TILE, "BLOCK_K": 512}
    few = tile_config._fit_config({**tile, "GROUP_DOTS": True}, w4a8, can_split=True)
    assert few["GROUP_DOTS"] is True and few["BLOCK_K"] == 512
    assert tile_config._fit_config(tile, w4a8, can_split=True)["BLOCK_K"] == 128
    many = tile_config._fit_config({**tile, "BLOCK_M": 64, "GROUP_DOTS": True}, w4a8, can_split=True)
    assert "GROUP_DOTS" not in many and many["BLOCK_K"] == 128


SWAPPED = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 2, "SWAP_AB": True}
SWAPPABLE = [name for name, (wk, ak, _) in SCHEMES.items() if triton_variant.swappable(variant_from_keys(wk, ak))]


def test_swappable_schemes_are_the_16_bit_and_fp8_dot_ones():
    assert {"fp16", "awq-g128", "gptq4-g64", "gptq8-g128", "int8-w8a16", "mxfp8-w8a16", "fp8-block"} <= set(SWAPPABLE)
    assert not {"w8a8-int8-token", "w8a8-int8-static", "mxfp8", "fp8-block-w8a16"} & set(SWAPPABLE)


@pytest.mark.parametrize("scheme", SWAPPABLE)
def test_swapped_operands(scheme, monkeypatch):
    """The swapped-operand kernel (weights on the left of the dot) gives the layer, split or not."""
    launched = []
    real = triton_gemm._fused_moe_swap_kernel
    monkeypatch.setattr(triton_launch, "_fused_moe_swap_kernel", LaunchSpy(real, launched))
    with tile_config.config_override(SWAPPED, {**SWAPPED, "SPLIT_K": 2, "BLOCK_K": 32}):
        _check_layer(scheme, 7, top_k=2, seed=5)
    assert len(launched) == 2


@pytest.mark.parametrize("scheme", ["gptq8-g128", "int8-w8a16", "mxfp8-w8a16"])
def test_swapped_operands_byte_at_a_time(scheme, monkeypatch):
    """8-bit weights whose rows cannot be read as 16-bit words take the byte-wide load."""
    monkeypatch.setattr(triton_launch, "_byte_pairs", lambda weight: False)
    with tile_config.config_override(SWAPPED, SWAPPED):
        _check_layer(scheme, 7, top_k=2, seed=3)


def test_byte_pairs_need_even_rows_and_alignment():
    w = torch.zeros(2, 8, 64, dtype=torch.int8)
    assert triton_launch._byte_pairs(w)
    assert not triton_launch._byte_pairs(w[:, :, :63])  # odd K
    assert not triton_launch._byte_pairs(w.reshape(-1)[1:1 + 2 * 8 * 63].view(2, 8, 63))  # odd rows
    assert not triton_launch._byte_pairs(w.reshape(-1)[1:1 + 2 * 8 * 62].view(2, 8, 62))  # odd address
    assert not triton_launch._byte_pairs(torch.zeros(2, 8, 64, dtype=torch.float16))  # not 8-bit


@pytest.mark.parametrize("dtype, codes, asm, folded", [
    (torch.bfloat16, (0, 134), True, True), (torch.bfloat16, (0, 135), True, False),
    (torch.float16, (103, 142), True, True), (torch.float16, (102, 120), True, False),
    (torch.float16, (110, 143), True, False), (torch.bfloat16, None, True, False),
    (torch.bfloat16, (100, 120), False, False), (torch.float32, (100, 120), True, False)])
def test_mx_fp8_folds_only_on_the_ptx_path_with_every_scale_code_in_range(dtype, codes, asm, folded, monkeypatch):
    """MX fp8 tiles fold their scales (dequant_ptx._e4m3_asm) only on the PTX path and where the layer
    knows every scale code lies in range for its dtype (on a GPU that converts e4m3 pairs: float16's
    form needs it); never for other weight types."""
    monkeypatch.setattr(triton_launch, "fp8_pair_convert", lambda device: True)
    gpu = torch.device("cuda")
    proj = triton_layout._Proj(torch.zeros(1, 2, 32, dtype=torch.uint8), None, None, None, None, None, 2, 32,
                            scale_codes=codes)
    mxfp8 = variant_from_keys("fp8e4m3 scale:e8m0:group(32):static", "unquantized")
    mxfp4 = variant_from_keys("e2m1 scale:e8m0:group(32):static", "unquantized")
    assert mxfp8.paired_dequant
    assert triton_launch._e4m3_folded(proj, mxfp8, dtype, asm, gpu) is folded
    assert triton_launch._e4m3_folded(proj, mxfp4, dtype, asm, gpu) is False


def test_mx_fp8_experts_carry_their_scale_codes_range():
    """The experts read their MX fp8 scales' code range once, for the launcher's fold decision."""
    weights = quant_ref.make_random_expert_weights(parse_quant_key("fp8e4m3 scale:e8m0:group(32):static"),
                                                   parse_quant_key("unquantized"), num_experts=2, hidden=64,
                                                   intermediate=32, dtype=torch.bfloat16, seed=0)
    codes = torch.cat([p.scale.reshape(-1).view(torch.uint8) for p in (weights.w13, weights.w2)])
    experts = TritonExperts(weights, ExpertsConfig())
    assert experts._options["mx_scale_codes"] == [int(codes.min()), int(codes.max())]
    assert int(codes.min()) < int(codes.max())


@pytest.mark.parametrize("scheme,options", [
    ("gptq4-g64", {"act_order": True}), ("gptq8-g128", {"act_order": True}), ("awq-g32", {"activation": "gelu"}),
    ("fp16", {"on_input": True, "top_k": 1}), ("awq-channel", {"bias": False, "skip_expert": 2}),
])
def test_swapped_operands_with_options(scheme, options):
    with tile_config.config_override(SWAPPED, SWAPPED):
        _check_layer(scheme, 7, **{"top_k": 2, **options})


def test_swap_is_dropped_where_it_cannot_run(monkeypatch):
    launched = []
    monkeypatch.setattr(triton_launch, "_fused_moe_swap_kernel",
                        LaunchSpy(triton_gemm._fused_moe_swap_kernel, launched))
    with tile_config.config_override(SWAPPED, SWAPPED):
        _check_layer("w8a8-int8-token", 7, top_k=2)
    assert launched == []



def test_split_k_with_top_1_and_router_weight_on_input():
    with tile_config.config_override(gemm2=SPLIT_GEMM2):
        _check_layer("w8a8-int8-token", 7, top_k=1, on_input=True)
        _check_layer("awq-g128", 7, top_k=1)


@pytest.mark.parametrize("scheme,m,top_k,split", [
    ("fp16", 1, 3, False), ("fp16", 1, 1, False), ("fp16", 7, 2, False), ("w8a8-int8-token", 7, 2, True),
    ("awq-g128", 7, 1, False), ("fp8-block", 7, 3, False), ("mxfp8", 1, 2, False),
])
# Buffers start NaN-filled on purpose; the interpreter computes masked-off lanes too and numpy warns on them.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_foreign_experts_add_nothing(scheme, m, top_k, split, nan_filled_empty):
    """Expert parallelism marks pairs routed to another rank's expert -1: the layer computes none of
    them and adds nothing for them, as the reference does. Fresh buffers are filled with NaN here,
    so a row that is never written but still read shows up."""
    weights = _weights(scheme, seed=6)
    hidden, topk_weights, topk_ids = _routing(m, top_k, seed=6)
    topk_ids[0, -1] = -1
    topk_ids[m - 1, 1:] = -1
    if m > 1:
        topk_ids[m - 1, 0] = -1  # a token with no local expert
    local = (topk_ids >= 0).any(1)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    nan_filled_empty()
    with tile_config.config_override(gemm2=SPLIT_GEMM2) if split else contextlib.nullcontext():
        out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    assert not out.isnan().any()
    assert torch.equal(out[~local], torch.zeros_like(out[~local]))
    if local.any():
        assert _rel_err(out[local], ref[local]) < SCHEMES[scheme][2]


def test_split_k_partial_sums_are_summed(monkeypatch):
    """The override reaches the launch: GEMM2 runs with SPLIT_K 2 and writes float32 partials."""
    seen = []
    real_gemm = triton_launch._gemm

    def spy(a, a_scale, w, scheme, c, rows, config, **kwargs):
        seen.append((config["SPLIT_K"], c.dtype, tuple(c.shape)))
        return real_gemm(a, a_scale, w, scheme, c, rows, config, **kwargs)

    monkeypatch.setattr(triton_layer, "_gemm", spy)
    with tile_config.config_override(gemm2=SPLIT_GEMM2):
        _check_layer("fp16", 3, top_k=2)
    assert seen[0][0] == 1 and seen[0][2] == (6, INTER)  # GEMM1 + activation: [pairs, I]
    assert seen[1] == (2, torch.float32, (2, 6, H))


def test_gemm1_applies_the_activation():
    """GEMM1's epilogue computes act(gate) * up itself: no separate activation kernel runs."""
    weights = _weights("gptq4-g64")
    hidden, topk_weights, topk_ids = _routing(5, 2)
    calls = []
    real = activation_quant.act_quant
    try:
        activation_quant.act_quant = lambda *a, **k: calls.append(a[1:3]) or real(*a, **k)
        TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    finally:
        activation_quant.act_quant = real
    assert calls == []


# GEMM1 in four column tiles: each intermediate row's amax comes in four pieces
NARROW_GEMM1 = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
                "num_stages": 2}


@pytest.mark.parametrize("m,tiles", [(1, False), (7, False), (7, True)])
def test_amax_pieces_give_the_whole_row_quantisation_bit_for_bit(m, tiles, monkeypatch):
    """GEMM1 leaves each per-token int8 intermediate row its amax in pieces, one per column
    tile, and the quantisation cuts rows into chunks (tiles: several rows a program, as at
    prefill): the same codes and scales as one program reading each whole row, so the same
    layer output to the bit."""
    weights = _weights("w8a8-int8-token", seed=8)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=8)
    monkeypatch.setattr(activation_quant, "PIECES_STEP", 2)  # the four pieces in two steps
    # one token's GEMM2 would quantise its input itself (test_one_token_gemms_quantise_their_own_input),
    # or the decode GEMV would run both GEMMs (tests/test_decode_gemv.py)
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM", False)
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    monkeypatch.setattr(activation_quant, "ROW_CHUNK", 16)  # four chunks per 64-column row
    if tiles:  # 14 rows: four a program
        monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_ROWS", 1)
        monkeypatch.setattr(activation_quant, "ROW_TILE_ELEMS", 64)
    pieces = []
    real = activation_quant.act_quant

    def spy(*args, **kwargs):
        amax = kwargs.get("amax_pieces")
        pieces.append(None if amax is None else tuple(amax.shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_plan, "act_quant", spy)  # the layer's quantisations

    def run() -> torch.Tensor:
        pieces.clear()
        with tile_config.config_override(NARROW_GEMM1, NARROW_GEMM1):
            return TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)

    chunked = run()
    assert pieces[-1] == (2 * m, 4)  # GEMM2's input: 2m pairs, 4 column tiles of GEMM1
    monkeypatch.setattr(triton_plan, "AMAX_PIECES", False)
    whole = run()
    assert pieces[-1] is None
    assert torch.equal(chunked, whole)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(chunked, ref) < SCHEMES["w8a8-int8-token"][2]


@pytest.mark.parametrize("scheme", ["fp16", "awq-g128", "gptq4-g64", "gptq8-g128", "w8a8-int8-token",
                                    "w8a8-int8-static"])
def test_batched_matches_reference(scheme):
    weights = _weights(scheme)
    config = ExpertsConfig(activation="silu", activation_format="batched")
    g = torch.Generator().manual_seed(5)
    capacity = 6
    x = torch.randn(E, capacity, H, generator=g).to(torch.float16)
    counts = torch.tensor([3, 0, capacity, 1], dtype=torch.int32)
    out = TritonBatchedExperts(weights, config).apply_batched(x, counts)
    ref = reference_moe_batched(x, counts, weights, config)
    assert out.shape == x.shape
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0, 3:]) == 0
    err = _rel_err(out, ref)
    assert err < SCHEMES[scheme][2], f"{scheme}: relative error {err:.2e}"


@pytest.mark.parametrize("scheme", ["fp16", "awq-g128"])
def test_float32_activations(scheme):
    """float32 hidden states: exact float32 products (no TF32), weights dequantised to float32."""
    wk, ak, _ = SCHEMES[scheme]
    weights = quant_ref.make_random_expert_weights(
        parse_quant_key(wk), parse_quant_key(ak), num_experts=E, hidden=H, intermediate=INTER,
        dtype=torch.float32, bias=True)
    hidden, topk_weights, topk_ids = _routing(5, 2)
    hidden = hidden.float()
    out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert out.dtype == torch.float32 and _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("weight_key", ["e2m1 scale:e8m0:group(32):static",
                                        "e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static"],
                         ids=["mxfp4", "nvfp4"])
def test_one_byte_group_scales_are_padded_to_whole_vectors(weight_key):
    """TritonExperts keeps a row's one-byte group scales padded with zeros to 16 groups (one vector
    load per row, which the pipeliner streams); the op gives the same layer from the converted,
    unpadded scales an op caller passes (with the codes in their decoders' byte order and NVFP4's
    scales as exponent codes, as the op reads them), and the reference's within FP4's tolerance."""
    weights = quant_ref.make_random_expert_weights(parse_quant_key(weight_key), parse_quant_key(UNQ), num_experts=E,
                                                   hidden=H, intermediate=INTER, dtype=torch.float16, bias=True)
    experts = TritonExperts(weights, ExpertsConfig())

    def codes_and_scales(p):
        if p.scale.dtype == torch.float8_e4m3fn:
            return e4m3_scale_codes(p.weight, p.scale)
        return p.weight, p.scale

    for held, proj in ((experts._tensors[1], weights.w13), (experts._tensors[7], weights.w2)):
        groups = proj.scale.shape[2]
        assert groups % 16 and held.shape[2] == 16
        assert torch.equal(held[..., :groups].view(torch.uint8), codes_and_scales(proj)[1].view(torch.uint8))
        assert not held[..., groups:].view(torch.uint8).any()
    hidden, topk_weights, topk_ids = _routing(5, 2)

    def tensors(p):
        codes, scale = codes_and_scales(p)
        return [e2m1_register_order(codes), scale, p.zero, p.perm, None if p.bias is None else p.bias.float(),
                p.input_scale]

    projections = {"w13": weights.w13, "w2": weights.w2}
    scale2 = {f"{name}_scale2": p.scale2.reshape(E, -1).float()
              for name, p in projections.items() if p.scale2 is not None}
    direct = torch.ops.moe_registry.fused_experts(
        hidden, topk_weights, topk_ids, *tensors(weights.w13), *tensors(weights.w2), experts.weight_key,
        experts.activation_key, "silu", False, **scale2)
    out = experts.apply(hidden, topk_weights, topk_ids)
    assert torch.equal(direct, out)
    assert _rel_err(out, reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())) < 3e-2
    if weights.w13.scale.dtype == torch.float8_e4m3fn:  # the file's e4m3 bytes are refused, by name

        def raw(p):
            return [e2m1_register_order(p.weight), p.scale, *tensors(p)[2:]]

        with pytest.raises(ValueError, match="e4m3 group scales reach the Triton GEMMs as exponent codes"):
            torch.ops.moe_registry.fused_experts(
                hidden, topk_weights, topk_ids, *raw(weights.w13), *raw(weights.w2), experts.weight_key,
                experts.activation_key, "silu", False, **scale2)


def test_two_byte_group_scales_are_padded_only_with_zero_points():
    """16-bit group scales are not padded (too few bytes per tile to stream), but with zero points
    they and the zero points are (a ZERO_SUMS epilogue reads 16 groups of a row as vectors): the
    groups as converted, then zeros. 8-bit codes keep two tensors; 4-bit codes hold each group's
    scale and zero point as one int32 word, given as both (see the next test)."""
    gptq = _weights("gptq4-g64")
    assert TritonExperts(gptq, ExpertsConfig())._tensors[1].shape == gptq.w13.scale.shape
    weights = quant_ref.make_random_expert_weights(parse_quant_key(W8A16_ASYM), parse_quant_key(UNQ), num_experts=E,
                                                   hidden=H, intermediate=INTER, dtype=torch.float16, seed=0)
    held = TritonExperts(weights, ExpertsConfig())._tensors
    for got, converted in ((held[7], weights.w2.scale), (held[8], weights.w2.zero)):  # K = INTER: one group
        assert got.dtype == converted.dtype and got.shape == (*converted.shape[:2], 16) and converted.shape[2] == 1
        assert torch.equal(got[..., :1], converted) and not got[..., 1:].any()
    weights = _weights("awq-g32")  # H 128: 4 groups of 32
    held = TritonExperts(weights, ExpertsConfig())._tensors
    assert held[1] is held[2] and held[1].dtype == torch.int32 and held[1].shape == (*weights.w13.scale.shape[:2], 16)
    assert not held[1][..., 4:].any()


def test_four_bit_zero_point_words_hold_the_scale_low_and_the_zero_point_high():
    """The words' low halves are the float16 scales' bits, their high halves the zero points
    (signed: a negative one comes back by the arithmetic shift the kernel reads it with)."""
    scale = torch.tensor([[[0.5, -3.0e-6, 65504.0]]], dtype=torch.float16)  # a subnormal, the largest
    zero = torch.tensor([[[0, 15, -7]]], dtype=torch.int8)
    words, again = triton_layout._scale_zero_words(scale, zero)
    assert again is words and words.dtype == torch.int32
    assert torch.equal((words & 0xFFFF).to(torch.int16).view(torch.float16), scale)
    assert torch.equal(words >> 16, zero.to(torch.int32))
    bf16 = scale.to(torch.bfloat16)
    assert triton_layout._scale_zero_words(bf16, zero) == (bf16, zero)


def test_large_non_swapped_tiles_read_the_words_as_their_two_halves():
    """Non-swapped tiles of WORD_HALVES_MIN_ROWS rows or more read the scale-and-zero words as two
    int16 views of the same storage (strides doubled): the scales' bits, and one element on, the
    signed zero points; smaller tiles and swapped ones read the words themselves."""
    scale = torch.tensor([[[0.5, -3.0e-6], [65504.0, 2.0]]], dtype=torch.float16)
    zero = torch.tensor([[[0, 15], [-7, 3]]], dtype=torch.int8)
    words, _ = triton_layout._scale_zero_words(scale, zero)
    codes = torch.zeros(1, 2, 4, dtype=torch.uint8)
    proj = triton_layout._Proj(codes, words, words, None, None, None, 2, 8)
    tile = {"BLOCK_M": triton_layout.WORD_HALVES_MIN_ROWS, "SWAP_AB": False}
    halves = triton_layout._word_halves_for(proj, tile)
    assert halves.scale.dtype == halves.zero.dtype == torch.int16
    assert halves.scale.untyped_storage().data_ptr() == words.untyped_storage().data_ptr()
    assert halves.scale.stride() == tuple(2 * s for s in words.stride())
    assert torch.equal(halves.scale.view(torch.float16), scale) and torch.equal(halves.zero, zero.to(torch.int16))
    for smaller in ({**tile, "BLOCK_M": 64}, {**tile, "SWAP_AB": True}):
        assert triton_layout._word_halves_for(proj, smaller) is proj


@pytest.mark.parametrize("m", [1, 9])
def test_a_tile_reading_the_words_halves_gives_the_words_numbers(m, monkeypatch):
    """AWQ on a non-swapped 128-row tile: the layer reading its words as two halves
    (_word_halves_for) gives bit for bit what the same tile reading the words gives, GEMM2 split
    too, near the reference; the launches are watched: the halves reach the kernel as int16."""
    weights = _weights("awq-g32")
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=4)
    tile = {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
            "num_stages": 2}
    from launch_spy import ArgSpy

    dtypes: list = []  # of the kernel's group scales (its fourth argument)
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel",
                        ArgSpy(triton_gemm._fused_moe_kernel, lambda a, _: a[3].dtype, dtypes))
    outs = []
    for least_rows in (128, 256):
        monkeypatch.setattr(triton_layout, "WORD_HALVES_MIN_ROWS", least_rows)
        with tile_config.config_override(tile, {**tile, "SPLIT_K": 2}):
            outs.append(TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids))
    assert dtypes == [torch.int16] * 2 + [torch.int32] * 2
    assert torch.equal(outs[0], outs[1])
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(outs[0], ref) < 1e-2


def test_experts_keep_stand_ins_for_the_scales_and_zero_points_they_copied():
    """Scale-and-zero words are the kernel's own copies: the experts keep stand-ins of the converted
    scales and zero points (their shapes), not the tensors too; GPTQ's scales, read as they are, are kept."""
    from moe_registry.layer.resident import reachable_tensors

    weights = _weights("awq-g32")
    experts = TritonExperts(weights, ExpertsConfig())
    held = {t.untyped_storage().data_ptr() for t in reachable_tensors(experts)}
    for p, kept in ((weights.w13, experts.weights.w13), (weights.w2, experts.weights.w2)):
        for name in ("scale", "zero"):
            assert getattr(p, name).untyped_storage().data_ptr() not in held
            assert getattr(kept, name).shape == getattr(p, name).shape
            assert getattr(kept, name).untyped_storage().nbytes() <= 2
        assert kept.weight is p.weight  # the codes are the kernel's own tensor
    gptq = _weights("gptq4-g64")
    assert TritonExperts(gptq, ExpertsConfig()).weights.w13.scale is gptq.w13.scale


@pytest.mark.parametrize("name,converted_kept", [("mixtral-awq", False), ("qwen3-gptq-int4", True)])
def test_a_built_triton_layer_reads_copied_weights_again_rather_than_hold_them(example, name, converted_kept):
    """The built layer keeps the converted weights only where the kernel holds those very tensors (GPTQ);
    AWQ's kernel holds its own scale-and-zero words, so the layer reads the converted weights again when
    asked, and they still give the kernel's output (float64 reference on them)."""
    from moe_registry.layer.build import build

    layer = build(example(name), layer=1, platform="cuda:9.0", device="cpu")
    assert layer.report.chosen == "triton-fused-moe" and (layer.built.converted is not None) == converted_kept
    weights = layer.weights
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, weights.hidden_size, generator=g).to(torch.float16)
    logits = torch.randn(3, weights.num_experts, generator=g)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
    out = layer.kernel(x, topk_weights, topk_ids.to(torch.int32))
    ref = reference_moe(x, topk_weights, topk_ids, weights, layer.kernel.experts.config)
    assert float((out.double() - ref).norm() / ref.norm()) < layer.tolerance


def test_padded_groups_leave_whole_vectors_and_their_input_alone():
    scale = torch.rand(2, 3, 5)
    before = scale.clone()
    padded = triton_layout._padded_groups(scale)
    assert padded.shape == (2, 3, 16) and torch.equal(scale, before)
    aligned = torch.rand(2, 3, 32)
    assert triton_layout._padded_groups(aligned) is aligned and triton_layout._padded_groups(None) is None


def test_no_tokens():
    weights = _weights("fp16")
    hidden = torch.empty(0, H, dtype=torch.float16)
    topk_weights, topk_ids = torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32)
    assert TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids).shape == (0, H)


def test_compiles_without_graph_break(monkeypatch):
    """torch.compile(fullgraph=True) traces the layer as one custom op (fake kernels only); an eager call runs
    the layer's function without the op's dispatch."""
    from moe_registry_kernels.triton import experts as triton_experts

    weights = _weights("awq-g128")
    experts = TritonExperts(weights, ExpertsConfig())
    hidden, topk_weights, topk_ids = _routing(3, 2)
    traced: list[str] = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(experts.apply, fullgraph=True, backend=backend)
    got = compiled(hidden, topk_weights, topk_ids)
    assert traced == ["moe_registry.fused_experts.default"]

    def no_op(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(triton_experts, "fused_experts", no_op)
    torch.testing.assert_close(got, experts.apply(hidden, topk_weights, topk_ids))


def test_unsupported_keys_are_refused():
    with pytest.raises(ValueError, match="int8 activations"):  # W4A8 takes symmetric codes only
        variant_from_keys("uint4 scale:float16:group(128):static zp:group", INT8_TOKEN)


AWQ = "uint4 scale:float16:group(128):static zp:group"


def test_get_config_defaults():
    decode = get_config(1, 2, 8, 2 * INTER, H, AWQ, UNQ, "cpu")
    prefill = get_config(512, 2, 8, 2 * INTER, H, UNQ, UNQ, "cpu")
    assert decode["BLOCK_M"] == 16 and prefill["BLOCK_M"] in (64, 128)
    assert prefill["SPLIT_K"] == 1


def test_default_config_splits_k_when_tiles_leave_sms_idle():
    # Mixtral GEMM2 at one token: 2 experts x 64 column tiles = 128 programs for 132 SMs
    few = default_config(1, 2, 8, 4096, 14336, AWQ, num_sms=132)
    assert few["SPLIT_K"] > 1
    assert 14336 // few["SPLIT_K"] >= 4 * few["BLOCK_K"]
    # GEMM1 of the same layer has 2 x 448 tiles: enough programs already
    assert default_config(1, 2, 8, 28672, 4096, AWQ, num_sms=132)["SPLIT_K"] == 1


GPTQ = "uint4b8 scale:float16:group(128):static"


def test_decode_defaults_of_fixed_zero_int4_take_group_dots_from_a_quarter_row(tmp_path, monkeypatch):
    """Given the activation key, GPTQ-style int4 (a fixed zero code) at decode from GROUP_DOT_ROWS rows an expert
    takes GROUP_DOT_TILE; fewer rows, zero points, int8 activations, short K or no activation key: the narrow
    tiles. get_config gives it where no entry applies, and never lays an entry over it."""
    dsv3 = (256, 7168)  # experts, GEMM1's K (its N 4096)
    tile = {k: v for k, v in default_config(8, 8, dsv3[0], 4096, dsv3[1], GPTQ, 132, UNQ).items()
            if k in tile_config.GROUP_DOT_TILE}
    assert tile == tile_config.GROUP_DOT_TILE == {"BLOCK_N": 128, "BLOCK_K": 512, "GROUP_DOTS": True, "num_stages": 3}
    narrow = {"BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 4}
    for args in ((1, 8, dsv3[0], 4096, dsv3[1], GPTQ, 132, UNQ),  # a thirty-second of a row
                 (8, 8, dsv3[0], 4096, dsv3[1], AWQ, 132, UNQ),  # zero points
                 (8, 8, dsv3[0], 4096, dsv3[1], GPTQ, 132, INT8_TOKEN),  # W4A8
                 (8, 8, dsv3[0], 4096, 768, GPTQ, 132, UNQ),  # K of less than two long tiles
                 (8, 8, dsv3[0], 4096, dsv3[1], GPTQ, 132)):  # the base an entry is laid over
        got = default_config(*args)
        assert "GROUP_DOTS" not in got and {k: got[k] for k in narrow} == narrow, args
    assert default_config(4096, 8, dsv3[0], 4096, dsv3[1], GPTQ, 132, UNQ)["BLOCK_M"] == 128  # prefill: as before
    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    try:
        assert get_config(8, 8, dsv3[0], 4096, dsv3[1], GPTQ, UNQ, "Test GPU")["GROUP_DOTS"] is True  # no file
        # an entry at 8 tokens names no GROUP_DOTS: it runs as tuned; an entry at 512 only, none near 8: the defaults
        table = {shape_key(dsv3[0], 8, 4096, dsv3[1]): {"8": {"BLOCK_N": 32, "BLOCK_K": 256}}}
        config_file(GPTQ, UNQ, "Test GPU").write_text(json.dumps(table))
        tile_config._load_config_file.cache_clear()
        tuned = get_config(8, 8, dsv3[0], 4096, dsv3[1], GPTQ, UNQ, "Test GPU")
        assert "GROUP_DOTS" not in tuned and (tuned["BLOCK_N"], tuned["BLOCK_K"]) == (32, 256)
        table[shape_key(dsv3[0], 8, 4096, dsv3[1])] = {"512": {"BLOCK_N": 32}}
        config_file(GPTQ, UNQ, "Test GPU").write_text(json.dumps(table))
        tile_config._load_config_file.cache_clear()
        assert get_config(8, 8, dsv3[0], 4096, dsv3[1], GPTQ, UNQ, "Test GPU")["GROUP_DOTS"] is True
    finally:
        tile_config._load_config_file.cache_clear()


def test_a_layer_on_the_group_dot_defaults_matches_the_reference(tmp_path, monkeypatch):
    """A GPTQ int4 layer with no table, a quarter of a row an expert (1 token, top-2 of 8) and a K of two long tiles:
    GEMM1 runs GROUP_DOT_TILE (watched), GEMM2 (K 64) the narrow tiles, and the layer is within tolerance."""
    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "GROUP_DOTS", seen))
    hidden_size = 2 * tile_config.GROUP_DOT_TILE["BLOCK_K"]
    weights = quant_ref.make_random_expert_weights(parse_quant_key(GPTQ), parse_quant_key(UNQ), num_experts=8,
                                                   hidden=hidden_size, intermediate=64, dtype=torch.float16, seed=5)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, hidden_size, generator=g).to(torch.float16)
    topk_weights, topk_ids = torch.tensor([[0.7, 0.3]]), torch.tensor([[2, 5]], dtype=torch.int32)
    try:
        out = TritonExperts(weights, ExpertsConfig()).apply(hidden, topk_weights, topk_ids)
    finally:
        tile_config._load_config_file.cache_clear()
    assert seen == [True, False]
    err = _rel_err(out, reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig()))
    assert err < 1e-2, f"relative error {err:.2e}"


def test_tuned_table_overrides_defaults_for_the_nearest_token_count(tmp_path, monkeypatch):
    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    table = {shape_key(8, 2, 2 * INTER, H): {"1": {"BLOCK_N": 32, "SPLIT_K": 1},
                                               "64": {"BLOCK_N": 128, "num_stages": 2}}}
    config_file(AWQ, UNQ, "Test GPU").write_text(json.dumps(table))
    try:
        assert get_config(2, 2, 8, 2 * INTER, H, AWQ, UNQ, "Test GPU")["BLOCK_N"] == 32
        near_64 = get_config(40, 2, 8, 2 * INTER, H, AWQ, UNQ, "Test GPU")
        assert near_64["BLOCK_N"] == 128 and near_64["num_stages"] == 2
        # too far from any tuned count (512 is 8x from 64): defaults
        far = get_config(512, 2, 8, 2 * INTER, H, AWQ, UNQ, "Test GPU")
        assert far == default_config(512, 2, 8, 2 * INTER, H, AWQ) and far["num_stages"] != 2
        # another activation key or device: defaults
        assert get_config(2, 2, 8, 2 * INTER, H, AWQ, INT8_TOKEN, "Test GPU")["BLOCK_N"] == 64
        assert get_config(2, 2, 8, 2 * INTER, H, AWQ, UNQ, "Other GPU")["BLOCK_N"] == 64
    finally:
        tile_config._load_config_file.cache_clear()


def test_a_layer_calls_configs_are_kept_until_its_table_is_read_again(tmp_path, monkeypatch):
    """A layer call's fitted configs are kept per call (a model's every layer asks for the same ones each step), handed
    out as copies, and follow the device's table: a table read again (another dir, or the file rewritten and the
    reader's cache cleared) gives its own tiles, not the kept ones; an override is never kept."""
    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tile_config, "_device_name", lambda device: "Test GPU")
    tile_config._load_config_file.cache_clear()
    variant = variant_from_keys(AWQ, UNQ)
    w13, w2 = SimpleNamespace(n=2 * INTER, k=H), SimpleNamespace(n=H, k=INTER)

    def configs() -> tuple[dict, dict]:
        return tile_config._layer_configs(2, 2, 8, w13, w2, AWQ, UNQ, variant, torch.device("cpu"), split_gemm2=True)

    def write(block_n: int) -> None:
        table = {shape_key(8, 2, 2 * INTER, H): {"2": {"BLOCK_N": block_n}}, shape_key(8, 2, H, INTER): {"2": {}}}
        config_file(AWQ, UNQ, "Test GPU").write_text(json.dumps(table))
        tile_config._load_config_file.cache_clear()

    try:
        write(32)
        first = configs()
        assert first[0]["BLOCK_N"] == 32 and configs() == first
        for pair in (first, configs()):  # a caller's copy, made or kept: the kept pair is not changed through it
            pair[0]["BLOCK_N"] = 999
            assert configs()[0]["BLOCK_N"] == 32
        write(128)
        assert configs()[0]["BLOCK_N"] == 128
        with tile_config.config_override({**first[0], "BLOCK_N": 64}, None):
            assert configs()[0]["BLOCK_N"] == 64
        assert configs()[0]["BLOCK_N"] == 128
    finally:
        tile_config._load_config_file.cache_clear()


def test_an_untuned_shape_takes_the_nearest_tuned_shapes_tiles(tmp_path, monkeypatch, caplog):
    """A shape the device's table lacks runs the tiles tuned for the shape nearest it (rows an expert sees,
    then K and N), its split-K redone for its own programs, and says which; rows no entry is near: defaults."""
    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tile_config, "_WARNED_DEFAULT", set())
    tile_config._load_config_file.cache_clear()
    decode = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "SPLIT_K": 4}
    table = {shape_key(8, 2, 28672, 4096): {"1": {**decode, "BLOCK_N": 32}},  # Mixtral-like: far in K and N
             shape_key(128, 8, 1536, 2048): {"8": decode, "64": {**decode, "BLOCK_N": 64}}}  # Qwen3-like
    config_file(AWQ, UNQ, "Test GPU").write_text(json.dumps(table))
    caplog.set_level("WARNING", logger="moe_registry")
    try:
        # Qwen3-235B's GEMM1 at 8 tokens: 0.5 rows an expert, as Qwen3's at 8; Mixtral's at 1 token has 0.25
        got = get_config(8, 8, 128, 3072, 4096, AWQ, UNQ, "Test GPU", num_sms=132)
        assert {k: got[k] for k in ("BLOCK_N", "BLOCK_K", "num_stages")} == {"BLOCK_N": 128, "BLOCK_K": 256,
                                                                             "num_stages": 3}
        assert got["SPLIT_K"] == 1  # 64 row blocks x 24 column tiles fill 132 SMs: no split, whatever the entry's
        assert ("Using another shape's tuned MoE config for E128_top8_N3072_K4096 on Test GPU" in caplog.text
                and "taking its E128_top8_N1536_K2048 tiles tuned at 8 tokens" in caplog.text)
        assert get_config(64, 8, 128, 3072, 4096, AWQ, UNQ, "Test GPU", num_sms=132)["BLOCK_N"] == 64
        # 1 token: a sixteenth of a row an expert, below TRANSFER_ROWS: the decode defaults, though an entry is near
        table[shape_key(128, 8, 1536, 2048)]["1"] = {**decode, "BLOCK_N": 32}
        config_file(AWQ, UNQ, "Test GPU").write_text(json.dumps(table))
        tile_config._load_config_file.cache_clear()
        assert get_config(1, 8, 128, 3072, 4096, AWQ, UNQ, "Test GPU") == default_config(1, 8, 128, 3072, 4096, AWQ)
        # ... which tools/bench_untuned.py still times beside them
        assert tile_config.nearest_shape_config(1, 8, 128, 3072, 4096, AWQ, UNQ, "Test GPU")["BLOCK_N"] == 32
        assert tile_config.nearest_shape_config(4096, 8, 128, 3072, 4096, AWQ, UNQ, "Test GPU") is None
        # 4096 tokens: 256 rows an expert, no entry within reach: the defaults
        assert get_config(4096, 8, 128, 3072, 4096, AWQ, UNQ, "Test GPU") == default_config(4096, 8, 128, 3072,
                                                                                             4096, AWQ)
    finally:
        tile_config._load_config_file.cache_clear()


def test_untuned_shape_warns_once_per_device_keys_and_shape(tmp_path, monkeypatch, caplog):
    """A GEMM that falls back to the default tiles says so once (like vLLM's "Using default MoE
    config") on the "moe_registry" logger: no file for the device, no table for the shape, or no
    entry near the token count; a tuned one says nothing."""
    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tile_config, "_WARNED_DEFAULT", set())
    tile_config._load_config_file.cache_clear()
    tuned = shape_key(8, 2, 2 * INTER, H)
    config_file(AWQ, UNQ, "Test GPU").write_text(json.dumps({tuned: {"1": {"BLOCK_N": 32}}}))
    caplog.set_level("WARNING", logger="moe_registry")

    def warned(*args):
        caplog.clear()
        get_config(*args)
        return [(r.name, r.levelname, r.getMessage()) for r in caplog.records]

    try:
        assert warned(2, 2, 8, 2 * INTER, H, AWQ, UNQ, "Test GPU") == []
        [(name, level, message)] = warned(512, 2, 8, 2 * INTER, H, AWQ, UNQ, "Test GPU")
        assert name == "moe_registry" and level == "WARNING"
        assert message.startswith(f"Using default MoE config for {tuned} on Test GPU")
        assert "tuned at 1 tokens, none near 512" in message
        assert warned(4096, 2, 8, 2 * INTER, H, AWQ, UNQ, "Test GPU") == []  # once per shape
        [(_, _, message)] = warned(2, 2, 16, 2 * INTER, H, AWQ, UNQ, "Test GPU")
        assert f"has no {shape_key(16, 2, 2 * INTER, H)} table" in message
        [(_, _, message)] = warned(2, 2, 8, 2 * INTER, H, AWQ, UNQ, "Other GPU")
        assert "on Other GPU" in message and "no tuned config file" in message
        [(_, _, message)] = warned(2, 2, 8, 2 * INTER, H, AWQ, INT8_TOKEN, "Test GPU")
        assert INT8_TOKEN in message
        assert warned(2, 2, 8, 2 * INTER, H, AWQ, INT8_TOKEN, "Test GPU") == []
    finally:
        tile_config._load_config_file.cache_clear()


# ---------------------------------------------------------------------------------------------
# ops


def _check_alignment(topk_ids, num_experts, block_m, sorted_ids, expert_ids, num_post):
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    total = int(num_post.item())
    assert total % block_m == 0
    max_padded, num_blocks = alignment.align_sizes(numel, num_experts, block_m)
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (num_blocks,)
    head = sorted_ids[:total].long()
    real = head[head < numel]
    assert sorted(real.tolist()) == torch.nonzero(valid).flatten().tolist()  # each valid pair once
    assert torch.all(sorted_ids[total:] == numel) and torch.all(expert_ids[total // block_m:] == -1)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    for b in range(total // block_m):
        rows = head[b * block_m:(b + 1) * block_m]
        pairs = rows[rows < numel]
        assert pairs.numel() > 0, "a block inside the padded total holds only padding"
        assert torch.all(flat[pairs] == expert_ids[b]), "block mixes experts"
        assert torch.equal(pairs, pairs.sort().values), "pairs lost their order within an expert"
        assert torch.all(rows[:pairs.numel()] == pairs), "padding before real pairs"


@pytest.mark.parametrize("m,top_k,num_experts,block_m,one_launch_max", [
    (1, 2, 4, 16, 1024),
    (7, 2, 4, 16, 1024),
    (33, 3, 9, 32, 1024),  # one launch, two programs
    (100, 3, 9, 16, 1024),  # five programs over nine experts: shares of one or two experts, or none
    (64, 8, 128, 16, 1024),  # eight programs, many experts (256 bins)
    (100, 8, 256, 32, 1024),  # 800 pairs in thirteen programs
    (100, 3, 9, 16, 0),  # chunked path, two chunks
    (60, 8, 64, 16, 0),  # chunked path, many experts
])
def test_align(m, top_k, num_experts, block_m, one_launch_max):
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, num_experts, (m, top_k), generator=g)
    ids[0, 0] = -1  # expert parallelism: a foreign expert is dropped
    out = alignment.align(ids, num_experts, block_m, one_launch_max=one_launch_max)
    _check_alignment(ids, num_experts, block_m, *out)


def test_align_one_launch_equals_the_chunked_path():
    """Both paths give the same arrays, and every slot is written: outputs start as garbage."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 9, (150, 3), generator=g)
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(-77))
        one = alignment.align(ids, 9, 16, one_launch_max=1024)
        chunked = alignment.align(ids, 9, 16, one_launch_max=0)
    assert all(torch.equal(a, b) for a, b in zip(one, chunked, strict=True))


def test_align_of_no_pairs_writes_an_empty_total():
    """An empty batch (a data-parallel rank with no tokens) still gets num_tokens_post_padded = 0,
    also from the prologue that quantises; outputs start as garbage."""
    ids = torch.empty(0, 2, dtype=torch.int32)
    x = torch.randn(0, 128, dtype=torch.float16)
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(-77))
        aligned = alignment.align(ids, 4, 16)
        with_quant = alignment.align_quant(ids, 4, 16, x, "int8_token")
    for sorted_ids, expert_ids, num_post in (aligned, with_quant[:3]):
        assert num_post.tolist() == [0] and sorted_ids.numel() == 0 and expert_ids.numel() == 0


def test_dependent_launch_is_off_where_it_cannot_run(monkeypatch):
    """Programmatic dependent launch needs a Hopper-class CUDA GPU: never on the CPU (interpreter),
    and MOE_REGISTRY_PDL=0 turns it off."""
    assert not chain.pdl_supported(torch.device("cpu"))
    assert chain.pdl_launch(False) == {} and chain.pdl_launch(True) == {"launch_pdl": True}
    chain._pdl_capable.cache_clear()
    chain.compiles_ptx.cache_clear()  # (so the GPU check passes here and MOE_REGISTRY_PDL is what says no)
    monkeypatch.setenv("MOE_REGISTRY_PDL", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        assert chain.compiles_ptx(torch.device("cuda", 0)) or torch.version.hip
        assert not chain.pdl_supported(torch.device("cuda", 0))
    finally:
        chain._pdl_capable.cache_clear()
        chain.compiles_ptx.cache_clear()


def test_plain_launches_turn_dependent_launch_off(monkeypatch):
    """Profiles (tools/bench.py) run the layer with plain launches even where PDL is available."""
    monkeypatch.setattr(chain, "_pdl_capable", lambda device: True)
    gpu = torch.device("cuda", 0)
    assert chain.pdl_supported(gpu)
    with chain.plain_launches():
        assert not chain.pdl_supported(gpu)
    assert chain.pdl_supported(gpu)


def test_align_custom_op():
    ids = torch.tensor([[2, 0], [2, 1], [3, 2]], dtype=torch.int32)
    out = torch.ops.moe_registry.moe_align_block_size(ids, 4, 16)
    _check_alignment(ids, 4, 16, *out)


@pytest.mark.parametrize("top_k", [3, 8])  # 18 pairs: one aligning program; 48: two
@pytest.mark.parametrize("quant", ["int8_token", "int8_static", "fp8_group", "mxfp8"])
def test_align_quant_one_launch_matches_the_two_ops(quant, top_k):
    """The decode prologue (alignment and input quantisation in one launch) gives exactly what the
    separate alignment and quantisation give."""
    x = _quant_inputs(torch.float16)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (x.shape[0], top_k), generator=g, dtype=torch.int32)
    ids[2, 1] = -1
    row_scale = torch.rand(x.shape[0], generator=g) + 0.5 if quant == "int8_static" else None
    static = torch.tensor([0.07]) if quant == "int8_static" else None
    sorted_ids, expert_ids, num_post, q, s = alignment.align_quant(
        ids, 9, 16, x, quant, static_scale=static, row_scale=row_scale, group=32)
    _check_alignment(ids, 9, 16, sorted_ids, expert_ids, num_post)
    want_q, want_s = activation_quant.act_quant(x, "none", quant, static_scale=static, row_scale=row_scale, group=32)
    assert _same_codes(q, want_q) and torch.equal(s, want_s)
    assert torch.equal(sorted_ids, alignment.align(ids, 9, 16)[0])


def _quant_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 200, generator=g) * 3).to(dtype)
    x[1] = 0  # amax floor / e8m0 of zero
    x[2, :32] = 1e-3 * torch.randn(32, generator=g).to(dtype)  # fp8 subnormals
    x[3, 7] = 40.0  # one outlier
    return x


def _same_codes(a, b):
    if a.dtype in (torch.float8_e4m3fn, torch.uint8):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("layout", ["whole", "narrow", "tiles", "tile_chunks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("key", [INT8_TOKEN, INT8_STATIC, FP8_GROUP_ACT, MXFP8_ACT])
def test_quant_ops_bit_match_quant_ref(key, dtype, layout, monkeypatch):
    """Rows of 200 columns: read once as one block, (narrow) cut into 64-column programs (128
    for fp8 groups of 128) and read twice for int8_token (amax pass, then codes), or (tiles, the
    prefill form) four rows per program, the second program half past the last row, or
    (tile_chunks) rows of such programs cut into chunks (int8_token: read twice)."""
    if layout == "narrow":
        monkeypatch.setattr(activation_quant, "ROW_CHUNK", 64)
        monkeypatch.setattr(activation_quant, "ROW_BLOCK_MAX", 64)
    if layout == "tiles":
        monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_ROWS", 1)
        monkeypatch.setattr(activation_quant, "ROW_TILE_ELEMS", 4 * 256)  # 200 columns: 256-column blocks
    if layout == "tile_chunks":  # 200 = 8 * 25: 16-column chunks (128 for fp8 groups of 128), 4 rows
        monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_ROWS", 1)
        monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_CHUNK", 8)
        monkeypatch.setattr(activation_quant, "ROW_TILE_ELEMS", 64)
    x = _quant_inputs(dtype)
    qkey = parse_quant_key(key)
    static = torch.tensor([0.05]) if key == INT8_STATIC else None
    ref = quant_ref.quantize_activation(x, qkey, static)
    if key == INT8_TOKEN:
        q, s = activation_quant.quant_int8_per_token(x)
    elif key == INT8_STATIC:
        q, s = activation_quant.quant_int8_per_token(x, static)
    elif key == FP8_GROUP_ACT:
        q, s = activation_quant.quant_fp8_per_group(x, 128)
    else:
        q, s = activation_quant.quant_mxfp8(x)
    assert q.dtype == ref.q.dtype and s.dtype == ref.scale.dtype and s.shape == ref.scale.shape
    assert _same_codes(q, ref.q)
    assert _same_codes(s, ref.scale)


@pytest.mark.parametrize("width,chunks", [(1408, 11), (768, 3), (14336, 7), (2816, 11), (2048, 1), (200, 1)])
def test_prefill_rows_are_cut_into_chunks_that_tile_them(width, chunks):
    """The largest power-of-two factor (at most ROW_CHUNK) tiles the row; a power of two is one
    block, and a factor under ROW_TILE_MIN_CHUNK (200 = 8 * 25) is not worth the programs."""
    assert activation_quant.prefill_row_chunks(width) == chunks


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("quant", ["none", "int8_token", "int8_static", "fp8_static", "fp8_group", "mxfp8"])
def test_act_quant_row_tiles_match_one_row_programs(quant, activation, monkeypatch):
    """Prefill programs take several rows at once, in chunks that tile the row (_act_quant_tile):
    the codes and scales of one row per program, with a router factor per row, batched rows past
    their expert's count left out, a zero row, and a last tile partly past the end."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(22, 2 * 96 if activation != "none" else 96, generator=g) * 3).to(torch.float16)
    x[4] = 0
    row_scale = torch.rand(22, generator=g) + 0.5
    counts = torch.tensor([5, 11], dtype=torch.int32)  # two experts of capacity 11
    static = torch.tensor([0.05]) if quant.endswith("static") else None

    def run():
        return activation_quant.act_quant(x, activation, quant, static_scale=static, row_scale=row_scale, group=32,
                                    expert_num_tokens=counts, capacity=11)

    want_q, want_s = run()
    monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_ROWS", 1)
    monkeypatch.setattr(activation_quant, "ROW_TILE_ELEMS", 512)
    monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_CHUNK", 16)
    shapes = []
    tile_shape = activation_quant._act_quant_tile_shape
    monkeypatch.setattr(activation_quant, "_act_quant_tile_shape",
                        lambda rows, width, meta: shapes.append((meta["BLOCK"], tile_shape(rows, width, meta)[0]))
                        or tile_shape(rows, width, meta))
    got_q, got_s = run()
    # 96 columns in three 32-column chunks (int8_token: an amax pass, then the codes), 16 rows
    # a program
    assert shapes == [(32, 16)]
    valid = torch.arange(22) % 11 < counts.repeat_interleave(11)
    assert valid.sum() == 16
    assert _same_codes(got_q[valid], want_q[valid])
    if want_s is not None and want_s.shape[0] == 22:  # per-row scales (static ones are returned as given)
        assert _same_codes(got_s[valid], want_s[valid])
    nonzero = got_q[valid].view(torch.uint8) != 0 if got_q.element_size() == 1 else got_q[valid] != 0
    assert nonzero.float().mean() > 0.5  # real codes, not an untouched buffer


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int8_token_rows_in_chunks_from_amax_pieces(dtype, tiles, monkeypatch):
    """With each row's amax given in pieces (a GEMM epilogue's), rows are cut into chunks, each
    scaled by the largest piece (tiles: four rows a program, in 16-column chunks that tile the
    200 columns but the last): quant_ref's codes and scales, zero row and outlier included."""
    monkeypatch.setattr(activation_quant, "ROW_CHUNK", 32)
    monkeypatch.setattr(activation_quant, "PIECES_STEP", 4)  # the 8 pieces in two steps
    if tiles:
        monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_ROWS", 1)
        monkeypatch.setattr(activation_quant, "ROW_TILE_MIN_CHUNK", 8)
        monkeypatch.setattr(activation_quant, "ROW_TILE_ELEMS", 64)
    x = _quant_inputs(dtype)
    x[4, 190] = -30.0  # a row whose amax is in its last piece
    pieces = x.float().abs().reshape(x.shape[0], 8, 25).amax(-1)  # 8 pieces of 25 columns
    q, s = activation_quant.act_quant(x, "none", "int8_token", amax_pieces=pieces)
    ref = quant_ref.quantize_activation(x, parse_quant_key(INT8_TOKEN))
    assert _same_codes(q, ref.q) and _same_codes(s, ref.scale)
    with pytest.raises(ValueError, match=r"amax pieces are a contiguous \[rows, P\] amax"):
        activation_quant.act_quant(x, "none", "fp8_group", amax_pieces=pieces)


@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_act_and_mul(activation):
    h = (torch.randn(5, 2 * 96, generator=torch.Generator().manual_seed(2)) * 4).to(torch.float16)
    out = activation_quant.act_and_mul(h, activation)
    ref = activations.act_and_mul(h.double(), activation)
    assert out.dtype == torch.float16 and out.shape == (5, 96)
    assert _rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("activation,key", [("silu", INT8_TOKEN), ("swigluoai", MXFP8_ACT),
                                            ("gelu", FP8_GROUP_ACT)])
def test_act_and_mul_quant_fused(activation, key, narrow, monkeypatch):
    """The fused op quantises the float32 activation exactly as quant_ref does, whole rows or
    (narrow) rows cut into programs."""
    if narrow:
        monkeypatch.setattr(activation_quant, "ROW_CHUNK", 32)
        monkeypatch.setattr(activation_quant, "ROW_BLOCK_MAX", 64)
    h = (torch.randn(5, 2 * 160, generator=torch.Generator().manual_seed(3)) * 4).to(torch.float16)
    mode = {INT8_TOKEN: "int8_token", MXFP8_ACT: "mxfp8", FP8_GROUP_ACT: "fp8_group"}[key]
    q, s = activation_quant.act_and_mul_quant(h, activation, mode)
    a = activations.act_and_mul(h.float(), activation)
    ref = quant_ref.quantize_activation(a, parse_quant_key(key))
    # float32 exp/erf differ from torch's in the last ulp, which can move a rare code by one
    differ = (q.view(torch.uint8).int() - ref.q.view(torch.uint8).int()).abs()
    assert differ.float().mean() < 1e-2 and torch.allclose(s.float(), ref.scale.float(), rtol=1e-5)


def test_moe_sum_adds_split_k_pieces():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 2, 40, generator=g)
    out = reduce.sum_topk(x, out=torch.empty(5, 40, dtype=torch.float16))
    torch.testing.assert_close(out.float(), x.sum((0, 2)), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("weighted", [False, True])
def test_moe_sum(weighted):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 40, generator=g).to(torch.float16)
    w = torch.rand(5, 3, generator=g) if weighted else None
    out = reduce.moe_sum(x, w)
    ref = (x.float() * (w[..., None] if weighted else 1)).sum(1)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("amax", [1e-10, 3e-4, 0.7, 1.0, 13.0, 6e4])
@pytest.mark.parametrize("dot", ["fp8_outer", "int8"])
def test_codes_by_reciprocal_round_as_the_division(dot, amax):
    """The GEMM's own int8 / fp8 quantisation (Markstein's corrected reciprocal, no division)
    gives the codes of quant_ref's true division at every code and tie and one float32 step
    either side, past saturation, for tiny values and random ones, at scales from the floor up."""
    from quant_codes_probe import codes_at_scale_of

    got, want = codes_at_scale_of(amax, dot, "cpu", hw_cast=False)
    assert torch.equal(got, want)


# one token's activations quantised per token or per tensor: (weight key, activation key)
ONE_TOKEN_SCHEMES = {
    "w8a8-int8-token": SCHEMES["w8a8-int8-token"][:2],
    "w8a8-int8-static": SCHEMES["w8a8-int8-static"][:2],
    "w4a8-int8-token": ("uint4b8 scale:float32:group(32):static", INT8_TOKEN),
    "fp8-static": ("fp8e4m3 scale:float32:tensor:static", "fp8e4m3 scale:float32:tensor:static"),
    "fp8-tensor-dynamic": ("fp8e4m3 scale:float32:tensor:static", "fp8e4m3 scale:float32:tensor:dynamic"),
    "fp8-token-dynamic": ("fp8e4m3 scale:float32:channel:static", "fp8e4m3 scale:float32:token:dynamic"),
}


def _one_token(scheme: str):
    """(weights, hidden, topk_weights, topk_ids) of a ONE_TOKEN_SCHEMES layer and one token (top-3)."""
    wk, ak = ONE_TOKEN_SCHEMES[scheme]
    weights = quant_ref.make_random_expert_weights(parse_quant_key(wk), parse_quant_key(ak), num_experts=E, hidden=H,
                                                   intermediate=INTER, dtype=torch.float16, bias=True, seed=3)
    return (weights, *_routing(1, 3, seed=5))


def _quantisation_calls(monkeypatch) -> list[str]:
    """The names of the layer's activation-quantisation calls (triton_moe's), in order, as they happen."""
    calls: list[str] = []
    for name in ("_quantize", "quant_fp8_from_pieces"):
        real = getattr(triton_layer, name)
        monkeypatch.setattr(triton_layer, name, lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    return calls


@pytest.mark.parametrize("scheme", list(ONE_TOKEN_SCHEMES))
def test_one_token_gemms_quantise_their_own_input(scheme, monkeypatch):
    """One token whose activations take one scale per token or per tensor: both GEMMs quantise its
    input themselves (static scale, or the amax of its hidden state and of GEMM1's row-amax
    pieces), so no quantisation kernel runs; bit-equal to the layer whose quantisation kernels
    do it, with a pair routed to another rank's expert; and near the reference. (The tile kernels:
    int8 activations on int4 or int8 weights otherwise take the decode GEMV.)"""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    weights, hidden, topk_weights, topk_ids = _one_token(scheme)
    topk_ids[0, 1] = -1
    experts = TritonExperts(weights, ExpertsConfig())
    quantised = _quantisation_calls(monkeypatch)
    for switch in ("SCALE_IN_GEMM", "AMAX_PIECES"):
        monkeypatch.setattr(triton_plan, switch, False)
    want = experts.apply(hidden, topk_weights, topk_ids)
    assert quantised == ["_quantize", "_quantize"]
    quantised.clear()
    for switch in ("SCALE_IN_GEMM", "AMAX_PIECES"):
        monkeypatch.setattr(triton_plan, switch, True)
    got = experts.apply(hidden, topk_weights, topk_ids)
    assert quantised == []
    assert torch.equal(got, want)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(got, ref) < 3e-2


FP8_DOTS = {**{k: v for k, v in ONE_TOKEN_SCHEMES.items() if k.startswith("fp8")},
            "fp8-block": SCHEMES["fp8-block"][:2]}
PLAIN = {**SWAPPED, "SWAP_AB": False}


@pytest.mark.parametrize("scheme", list(FP8_DOTS))
@pytest.mark.parametrize("m, swapped", [(7, (True, True)), (1, (True, True)), (1, (True, False)), (1, (False, True))])
def test_fp8_dots_on_the_swapped_kernel(scheme, m, swapped, monkeypatch):
    """fp8 weights with fp8 activations (per token, per tensor, static, 128-column groups) take the
    swapped kernel's fp8 dot on either GEMM or both (GEMM2 split in K), with the plain kernels'
    launches: one token's input quantised by the swapped GEMM itself (per token or tensor), GEMM1
    leaving the amax pieces GEMM2 quantises its input from; near the reference and the plain
    kernels' layer."""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    wk, ak = FP8_DOTS[scheme]
    weights = quant_ref.make_random_expert_weights(parse_quant_key(wk), parse_quant_key(ak), num_experts=E, hidden=H,
                                                   intermediate=INTER, dtype=torch.float16, bias=True, seed=3)
    hidden, topk_weights, topk_ids = _routing(m, 3, seed=5)
    experts = TritonExperts(weights, ExpertsConfig())
    quantised = _quantisation_calls(monkeypatch)
    with tile_config.config_override(PLAIN, PLAIN):
        plain = experts.apply(hidden, topk_weights, topk_ids)
    plain_quantised = list(quantised)
    quantised.clear()
    launched = []
    monkeypatch.setattr(triton_launch, "_fused_moe_swap_kernel",
                        ArgSpy(triton_gemm._fused_moe_swap_kernel,
                               lambda args, kwargs: (kwargs["A_QUANT"], kwargs["A_SCALE_IN"], kwargs["AMAX_OUT"]),
                               launched))
    gemm1, gemm2 = (SWAPPED if swapped[0] else PLAIN), ({**SWAPPED, "SPLIT_K": 2} if swapped[1] else PLAIN)
    with tile_config.config_override(gemm1, gemm2):
        got = experts.apply(hidden, topk_weights, topk_ids)
    act_quant = triton_variant.variant_from_keys(wk, ak).act_quant
    one_token = m == 1 and scheme != "fp8-block"
    static = scheme == "fp8-static"
    pieces = scheme in ("fp8-token-dynamic", "fp8-tensor-dynamic")  # a dynamic intermediate's amax, from GEMM1
    want = [(act_quant, ("static" if static else "rows") if one_token else "none", pieces),
            (act_quant, ("static" if static else "pieces") if one_token else "none", False)]
    assert launched == [w for w, s in zip(want, swapped, strict=True) if s]
    assert quantised == plain_quantised
    if one_token:  # no quantisation launch at all
        assert quantised == []
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(got, ref) < 3e-2
    assert _rel_err(got, plain) < 2e-3  # (the same codes and products; sums in another order: ~3e-4)


@pytest.mark.parametrize("scheme", ["fp8-tensor-dynamic", "w8a8-int8-token"])
def test_one_token_gemms_quantise_only_up_to_a_weight_budget(scheme, monkeypatch):
    """Each GEMM quantises one token's input itself only while the token's experts' weights fit its
    budget (SCALE_IN_GEMM_MAX_BYTES for GEMM1; GEMM2's by activation quantisation in
    SCALE_IN_GEMM2_MAX_BYTES, else the same: past it its longer loop costs more than the launch
    saves); past GEMM1's the hidden state takes a quantisation launch, past GEMM2's its input one
    from GEMM1's pieces. The numbers never move. (Tile kernels: int8 activations on int8 weights
    otherwise take the decode GEMV, which has no budget: tests/test_decode_gemv.py.)"""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    weights, hidden, topk_weights, topk_ids = _one_token(scheme)
    token_bytes = 3 * (weights.w13.weight.numel() + weights.w2.weight.numel()) // E  # a byte a weight
    experts = TritonExperts(weights, ExpertsConfig())
    quant = triton_variant.variant_from_keys(*ONE_TOKEN_SCHEMES[scheme]).act_quant
    from_pieces = "quant_fp8_from_pieces" if quant.startswith("fp8") else "_quantize"
    quantised = _quantisation_calls(monkeypatch)
    outputs = []
    over = token_bytes - 1
    cases = [(token_bytes, {}, []), (over, {}, ["_quantize", from_pieces]),
             (token_bytes, {quant: over}, [from_pieces]), (over, {quant: token_bytes}, ["_quantize"])]
    for budget1, budgets2, launches in cases:
        monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM_MAX_BYTES", budget1)
        monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM2_MAX_BYTES", budgets2)
        quantised.clear()
        outputs.append(experts.apply(hidden, topk_weights, topk_ids))
        assert quantised == launches
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


def test_dynamic_fp8_gemm2_quantises_one_token_past_gemm1s_budget():
    """H100-measured: past SCALE_IN_GEMM_MAX_BYTES (Mixtral's experts), one token's GEMM2 still
    quantises its own input for dynamic fp8 (faster than the launch), not for int8 or static scales."""
    budget = triton_plan.SCALE_IN_GEMM_MAX_BYTES
    assert all(triton_plan.SCALE_IN_GEMM2_MAX_BYTES[q] > 4 * budget for q in ("fp8_token", "fp8_tensor"))
    assert not {"int8_token", "int8_static", "fp8_static"} & set(triton_plan.SCALE_IN_GEMM2_MAX_BYTES)


@pytest.mark.parametrize("quant", ["int8_token", "int8_static"])
def test_int8_codes_stored_as_16_bit_floats_hold_the_codes(quant):
    """act_quant's int8 codes written as float16 or bfloat16 (for W4A8's 16-bit dot) are the int8
    ones' values, with the same scales, and align_quant's one launch at decode writes them so too;
    another dtype is refused by name."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(6, H, generator=g) * 3).to(torch.float16)
    static = torch.tensor([0.03]) if quant == "int8_static" else None
    want, want_scale = activation_quant.act_quant(x, "none", quant, static_scale=static)
    assert want.dtype == torch.int8 and (want != 0).float().mean() > 0.5
    for dtype in (torch.float16, torch.bfloat16):
        got, scale = activation_quant.act_quant(x, "none", quant, static_scale=static, out_dtype=dtype)
        assert got.dtype == dtype and torch.equal(got.float(), want.float()) and torch.equal(scale, want_scale)
    _, _, _, codes, scale = alignment.align_quant(_routing(6, 2)[2], E, 16, x, quant, static_scale=static,
                                                  out_dtype=torch.bfloat16)
    assert codes.dtype == torch.bfloat16 and torch.equal(codes.float(), want.float())
    assert torch.equal(scale, want_scale)
    with pytest.raises(ValueError, match=r"int8 codes are stored as one of .* got torch.float32"):
        activation_quant.act_quant(x, "none", quant, static_scale=static, out_dtype=torch.float32)


def _w4a8_weights(seed: int):
    """W4A8 experts (compressed-tensors' int4 group-32 weights, per-token int8 activations)."""
    return quant_ref.make_random_expert_weights(parse_quant_key(ONE_TOKEN_SCHEMES["w4a8-int8-token"][0]),
                                                parse_quant_key(INT8_TOKEN), num_experts=E, hidden=H,
                                                intermediate=INTER, dtype=torch.float16, seed=seed)


def _gemm_input_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtype of each GEMM launch's activations (launch._gemm's first argument), in order."""
    dtypes: list[torch.dtype] = []
    real_gemm = triton_launch._gemm
    monkeypatch.setattr(triton_layer, "_gemm",
                        lambda a, *args, **kw: dtypes.append(a.dtype) or real_gemm(a, *args, **kw))
    return dtypes


@pytest.mark.parametrize("block_m", [16, 64])
def test_w4a8_few_row_tiles_take_their_codes_as_16_bit_floats(block_m, monkeypatch):
    """GEMMs whose W4A8 tiles run the 16-bit dot of the codes (variant.float_w4a8: BLOCK_M <= 32)
    get them from the quantisation kernels as 16-bit floats, larger tiles as int8; the layer's
    output is the same as when the GEMM converts int8 codes itself, and near the reference."""
    weights = _w4a8_weights(seed=3)
    hidden, topk_weights, topk_ids = _routing(5, 2, seed=4)
    experts = TritonExperts(weights, ExpertsConfig())
    inputs = _gemm_input_dtypes(monkeypatch)
    config = {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "SWAP_AB": False,
              "num_warps": 4, "num_stages": 2}
    with tile_config.config_override(config, config):
        got = experts.apply(hidden, topk_weights, topk_ids)
        codes = torch.float16 if block_m <= 32 else torch.int8
        assert inputs == [codes, codes]
        monkeypatch.setattr(triton_layer, "_codes_dtype", lambda *args: {})  # int8 codes, converted in the GEMM
        inputs.clear()
        want = experts.apply(hidden, topk_weights, topk_ids)
        assert inputs == [torch.int8, torch.int8]
    assert torch.equal(got, want)
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(got, ref) < 3e-2


@pytest.mark.parametrize("m", [1, 7])
def test_w4a8_group_dots_equal_one_group_a_tile(m, monkeypatch):
    """W4A8 tiles of two 32-column groups with GROUP_DOTS (a dot per group, its scale on the result;
    at M = 1 the GEMM quantises the token a group at a time) give the same numbers as one group a K
    tile -- each group's dot of exact codes is exact -- and both GEMMs took them (the decode GEMV,
    which one token's W4A8 GEMMs otherwise take, off)."""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    weights = _w4a8_weights(seed=8)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=9)
    experts = TritonExperts(weights, ExpertsConfig())
    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "GROUP_DOTS", seen))
    outs = {}
    for block_k, grouped in ((64, True), (32, False)):
        tile = {**GROUP_DOTS_TILE, "BLOCK_K": block_k} | ({"GROUP_DOTS": True} if grouped else {})
        with tile_config.config_override(tile, tile):
            outs[grouped] = experts.apply(hidden, topk_weights, topk_ids)
    assert seen == [True, True, False, False]
    assert torch.equal(outs[True], outs[False])
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(outs[True], ref) < 3e-2


def test_w4a8_batched_rows_take_their_codes_as_16_bit_floats(monkeypatch):
    """The batched format's W4A8 GEMMs on few-row tiles take their codes as 16-bit floats too, and
    match the reference, with an expert of no rows and rows past a count left out."""
    weights = _w4a8_weights(seed=6)
    config = ExpertsConfig(activation="silu", activation_format="batched")
    x = torch.randn(E, 6, H, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    counts = torch.tensor([3, 0, 6, 1], dtype=torch.int32)
    inputs = _gemm_input_dtypes(monkeypatch)
    out = TritonBatchedExperts(weights, config).apply_batched(x, counts)
    assert inputs == [torch.float16, torch.float16]
    ref = reference_moe_batched(x, counts, weights, config)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0, 3:]) == 0
    assert _rel_err(out, ref) < 3e-2


def test_experts_keep_the_converted_codes_they_read_and_stand_ins_for_the_ones_they_copy():
    """Codes the kernel reads as converted are kept as they are (one copy); FP4 codes, which it holds in
    another byte order, leave a one-element stand-in of their shape, and so do their one-byte scales,
    which it holds padded to 16 groups (H = 128: 4 groups of 32); 16-bit scales it reads as they are."""
    for key, copied in (("uint4b8 scale:float16:group(32):static", False), ("e2m1 scale:e8m0:group(32):static", True)):
        weights = quant_ref.make_random_expert_weights(parse_quant_key(key), parse_quant_key(UNQ), num_experts=E,
                                                       hidden=H, intermediate=INTER, dtype=torch.float16)
        kept = TritonExperts(weights, ExpertsConfig()).weights
        for given, held in ((weights.w13, kept.w13), (weights.w2, kept.w2)):
            assert (held.weight is not given.weight) == copied, key
            assert held.weight.shape == given.weight.shape and (held.scale is given.scale) != copied
            assert held.scale.shape == given.scale.shape
            assert held.weight.untyped_storage().nbytes() == (1 if copied else given.weight.untyped_storage().nbytes())


HALVES_TILE = {**GROUP_DOTS_TILE, "BLOCK_K": 64, "SWAP_AB": False}


@pytest.mark.parametrize("scheme, m, tile", [
    ("gptq4-g64", 7, {}), ("gptq4-g64", 1, {}), ("awq-g32", 7, {}), ("int4-g128", 7, {"SPLIT_K": 2}),
    ("gptq4-g64", 7, {"BLOCK_K": 128, "GROUP_DOTS": True})])
def test_gemm2_reads_its_input_in_halves(scheme, m, tile, monkeypatch):
    """A GEMM2 tile with INPUT_HALVES reads its input as GEMM1 then stores it, each row's even columns
    and then its odd ones, as its nibble half-dots' two operands: the layer is the one whose GEMM2
    splits the input in registers, bit for bit (per-weight or per-group dots, split in K or not, one
    token or aligned blocks); the launches are watched."""
    weights = _weights(scheme, seed=2)
    hidden, topk_weights, topk_ids = _routing(m, 2, seed=4)
    gemm2 = {**HALVES_TILE, **tile}
    want, got, seen = without_and_with(
        TritonExperts(weights, ExpertsConfig()), (hidden, topk_weights, topk_ids), (HALVES_TILE, gemm2),
        (HALVES_TILE, {**gemm2, "INPUT_HALVES": True}), "_fused_moe_kernel",
        lambda args, kwargs: (kwargs["INPUT_HALVES"], kwargs["HALVES_OUT"]), monkeypatch)
    assert seen == [(False, True), (True, False)]
    assert torch.equal(got, want)


def test_input_halves_fit_where_gemm1_writes_them_and_gemm2_splits_nibbles():
    """INPUT_HALVES stays on a GEMM2 of 4-bit weights on the 16-bit dot, unquantised activations, the standard
    kernel after a standard GEMM1, no ZERO_SUMS; never on GEMM1 nor in the batched format."""
    gptq = variant_from_keys(SCHEMES["gptq4-g64"][0], UNQ)
    halves = {**HALVES_TILE, "INPUT_HALVES": True}
    c1, c2 = tile_config._fit_pair(halves, halves, gptq)
    assert "INPUT_HALVES" not in c1 and c2["INPUT_HALVES"] is True
    assert "INPUT_HALVES" not in tile_config._fit_pair(halves, halves, gptq, split_gemm2=False)[1]
    assert "INPUT_HALVES" not in tile_config._fit_pair({**halves, "SWAP_AB": True}, halves, gptq)[1]
    for variant, config in ((gptq, {**halves, "SWAP_AB": True}),
                            (gptq, {**halves, "ZERO_SUMS": True}),
                            (variant_from_keys(UNQ, UNQ), halves),
                            (variant_from_keys(SCHEMES["int8-w8a16"][0], UNQ), halves),
                            (variant_from_keys("uint4b8 scale:float32:group(32):static", INT8_TOKEN), halves)):
        assert "INPUT_HALVES" not in tile_config._fit_pair(HALVES_TILE, config, variant)[1], (variant, config)


def test_halves_go_with_a_tile_that_reads_them():
    """The launcher refuses an input in halves without a tile that reads them, and halves stored by a GEMM
    without the fused activation: one line each."""
    rows = triton_launch._Rows(expert_ids=torch.zeros(1, dtype=torch.int32), num_valid=1, one_pair_blocks=True)
    proj = triton_layout._Proj(torch.zeros(1, 8, 32, dtype=torch.uint8), torch.ones(1, 8, 1, dtype=torch.float16),
                               None, None, None, None, 8, 64)
    gptq = variant_from_keys("uint4b8 scale:float16:group(64):static", UNQ)
    a, c = torch.zeros(1, 64, dtype=torch.float16), torch.zeros(1, 8, dtype=torch.float16)
    fitted = tile_config._fit_config(HALVES_TILE, gptq, can_split=False)
    with pytest.raises(ValueError, match="an input in halves goes with an INPUT_HALVES tile"):
        triton_launch._gemm(a, None, proj, gptq, c, rows, fitted, compute_dtype=torch.float16, input_halves=True)
    with pytest.raises(ValueError, match="halves are stored by the standard kernel's fused activation"):
        triton_launch._gemm(a, None, proj, gptq, c, rows, fitted, compute_dtype=torch.float16, halves_out=True)


def _far_apart_block_fp8(size: int, seed: int):
    """FP8 block-128 experts (hidden and intermediate ``size``, with bias) whose block scales lie up to 16x apart,
    so a scale taken from the wrong block shows (fp16 weights stay in range), and 9 tokens routed top-2."""
    weights = quant_ref.make_random_expert_weights(parse_quant_key(FP8_BLOCK), parse_quant_key(FP8_GROUP_ACT),
                                                   num_experts=E, hidden=size, intermediate=size,
                                                   dtype=torch.float16, bias=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for proj in (weights.w13, weights.w2):
        proj.scale.mul_(4.0 ** (torch.rand(proj.scale.shape, generator=g) * 2 - 1))
    hidden = torch.randn(9, size, generator=g).to(torch.float16)
    topk_weights = torch.rand(9, 2, generator=g) + 0.1
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(9)]).to(torch.int32)
    return weights, hidden, topk_weights, topk_ids


@pytest.mark.parametrize("block_n, taken", [(64, (True, True)), (128, (True, True)), (256, (True, False))])
@pytest.mark.parametrize("swapped", [False, True], ids=["plain", "swapped"])
def test_block_scales_are_scalars_where_a_tile_lies_in_one_block(block_n, taken, swapped, monkeypatch):
    """FP8 block-128 tiles whose weight rows lie in one block (GEMM1's gate rows in one and its up rows
    in one: 128 of its 256 columns at BLOCK_N 256) take its scales as scalars (TILE_BLOCK_SCALE), on either
    kernel: the layer whose tiles take them as vectors, to the rounding of one product, and near the
    reference, with every block's scale made far from its neighbours' (a scale from the wrong block
    shows); the launches are watched."""
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    weights, hidden, topk_weights, topk_ids = _far_apart_block_fp8(256, seed=7)
    tile = {**(SWAPPED if swapped else PLAIN), "BLOCK_N": block_n, "BLOCK_K": 128}
    experts = TritonExperts(weights, ExpertsConfig())
    kernel = "_fused_moe_swap_kernel" if swapped else "_fused_moe_kernel"
    seen: list = []
    monkeypatch.setattr(triton_launch, kernel, KwargSpy(getattr(triton_gemm, kernel), "TILE_BLOCK_SCALE", seen))
    with tile_config.config_override(tile, tile):
        got = experts.apply(hidden, topk_weights, topk_ids)
    assert tuple(seen) == taken
    monkeypatch.setattr(triton_launch, "_tile_block_scale", lambda *args: False)
    with tile_config.config_override(tile, tile):
        vectors = experts.apply(hidden, topk_weights, topk_ids)
    assert seen[2:] == [False, False]
    assert _rel_err(got, vectors) < 1e-3
    ref = reference_moe(hidden, topk_weights, topk_ids, weights, ExpertsConfig())
    assert _rel_err(got, ref) < 3e-2


@pytest.mark.parametrize("keys, n, block_n, fuse, taken", [
    ((FP8_BLOCK, FP8_GROUP_ACT), 512, 128, "silu", True), ((FP8_BLOCK, FP8_GROUP_ACT), 512, 256, "silu", True),
    ((FP8_BLOCK, FP8_GROUP_ACT), 512, 256, "none", False), ((FP8_BLOCK, FP8_GROUP_ACT), 2 * 2880, 64, "silu", False),
    ((FP8_BLOCK, FP8_GROUP_ACT), 2880, 64, "none", True), ((FP8_BLOCK, UNQ), 512, 64, "none", False),
    (("fp8e4m3 scale:float32:channel:static", "fp8e4m3 scale:float32:token:dynamic"), 512, 64, "none", False)])
def test_tile_block_scale_only_where_each_tiles_rows_lie_in_one_block(keys, n, block_n, fuse, taken):
    """Scalar block scales only for the fp8 dot on 128x128 blocks, where a tile's weight rows (its gate
    rows and its up rows, fused) lie in one block: not past 128 rows, nor up rows that start mid-block
    (gpt-oss-120b's intermediate 2880 is not a whole number of blocks), nor 16-bit activations."""
    assert triton_launch._tile_block_scale(variant_from_keys(*keys), n, block_n, fuse) is taken
