"""Decode GEMMs with int8 activations as decode_gemv's dp4a GEMV (launch.DECODE_GEMV): which
layers take it and at how many tokens, that both GEMMs then launch it and nothing else quantises,
and its numbers against the tile kernels' and the reference, over K with whole steps and a masked
rest, rows read in one chunk and in several, group and channel scales, static and per-token
scales, a foreign expert, one token and two sharing experts (aligned blocks of one pair or two).
In Triton's interpreter on the CPU (its dp4a the plain-Triton form); on a GPU (``-m gpu``) the
PTX dp4a at a model's sizes."""

from __future__ import annotations

import collections
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)
pytest.importorskip("triton", reason="triton is not installed")

from launch_spy import KwargSpy, LaunchSpy  # noqa: E402
from moe_registry_kernels import quant_ref  # noqa: E402
from moe_registry_kernels.reference import reference_moe  # noqa: E402
from moe_registry_kernels.triton import activation_quant, decode_gemv, tile_config  # noqa: E402
from moe_registry_kernels.triton import align as alignment
from moe_registry_kernels.triton import gemm as triton_gemm
from moe_registry_kernels.triton import launch as triton_launch
from moe_registry_kernels.triton import layer as triton_layer
from moe_registry_kernels.triton import layout as triton_layout
from moe_registry_kernels.triton import plan as triton_plan
from moe_registry_kernels.triton import variant as triton_variant
from moe_registry_kernels.triton.experts import TritonExperts  # noqa: E402

from moe_registry.core.keys import parse_quant_key  # noqa: E402
from moe_registry.layer.experts import ExpertsConfig  # noqa: E402

INT8_TOKEN = "int8 scale:float32:token:dynamic"
INT8_STATIC = "int8 scale:float32:tensor:static"
# (weight key, activation key) of the layers the GEMV takes
GEMV_SCHEMES = {
    "w4a8-g128-bf16": ("uint4b8 scale:bfloat16:group(128):static", INT8_TOKEN),
    "w4a8-g32": ("uint4b8 scale:float32:group(32):static", INT8_TOKEN),
    "w4a8-channel": ("uint4b8 scale:float16:channel:static", INT8_TOKEN),
    "w8a8-int8-token": ("int8 scale:float32:channel:static", INT8_TOKEN),
    "w8a8-int8-static": ("int8 scale:float32:tensor:static", INT8_STATIC),
}
E = 6
# hidden 640: int4 rows of 80 words (a whole 64-word step and a masked rest), int8 rows of 160 (two
# and a rest); intermediate 96: one masked step
CPU_SIZES = (640, 96)
GPU_SIZES = (2048 + 640, 1408)


def _layer(scheme: str, hidden: int, inter: int, device: str, seed: int = 0, m: int = 1):
    wk, ak = GEMV_SCHEMES[scheme]
    weights = quant_ref.make_random_expert_weights(parse_quant_key(wk), parse_quant_key(ak), num_experts=E,
                                                   hidden=hidden, intermediate=inter, dtype=torch.float16,
                                                   bias=True, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, hidden, generator=g) * 2).to(torch.float16)
    # distinct experts a token, some shared between tokens (E = 6, top-3)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(m)]).to(torch.int32)
    ids[0, 1] = -1  # a pair routed to another rank's expert: never read, no output
    router = torch.rand(m, 3, generator=g) + 0.1
    return weights.to(device), x.to(device), router.to(device), ids.to(device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _gemv_against_tiles(scheme: str, sizes: tuple[int, int], device: str, monkeypatch, seed: int = 0, m: int = 1):
    """(GEMV layer output, the tile kernels' output, reference) for ``m`` tokens, with the GEMV's
    launches and the layer's quantisation calls checked."""
    weights, x, router, ids = _layer(scheme, *sizes, device, seed, m)
    experts = TritonExperts(weights, ExpertsConfig())
    gemv_grids: list = []
    monkeypatch.setattr(triton_launch, "_decode_gemv_kernel", LaunchSpy(decode_gemv._decode_gemv_kernel,
                                                                        gemv_grids))
    tile_grids: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", LaunchSpy(triton_gemm._fused_moe_kernel, tile_grids))
    quantised: list = []
    real_quantize = triton_plan._quantize
    monkeypatch.setattr(triton_layer, "_quantize", lambda *a, **k: quantised.append(1) or real_quantize(*a, **k))
    got = experts.apply(x, router, ids)
    assert len(gemv_grids) == 2 and tile_grids == [] and quantised == []
    # a program per (row block, column tile): one token's pairs, or GEMV_BLOCK_M aligned pairs as the
    # alignment sizes them; GEMM1's tiles hold BLOCK_N / 2 gate and up rows each
    blocks = 3 if m == 1 else alignment.align_sizes(3 * m, E, triton_launch.GEMV_BLOCK_M)[1]
    inter, hidden = sizes[1], sizes[0]
    assert gemv_grids == [(blocks, inter // (decode_gemv.BLOCK_N // 2)), (blocks, hidden // decode_gemv.BLOCK_N)]
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    tiles = experts.apply(x, router, ids)
    assert len(tile_grids) == 2  # the tile kernels (quantising in the GEMM or by launches, by budget)
    ref = reference_moe(x, router, ids, weights, ExpertsConfig())
    return got, tiles, ref


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("scheme", list(GEMV_SCHEMES))
def test_decode_gemv_matches_the_tile_kernels_and_the_reference(scheme, m, monkeypatch):
    """Both GEMMs of a decode layer (one token; two, experts shared between them) with int8
    activations on int4 or int8 weights run as the GEMV, no quantisation launch; its output is the
    tile kernels' (the same int8 codes and int32 sums, float32 sums in another order) and near
    the reference."""
    got, tiles, ref = _gemv_against_tiles(scheme, CPU_SIZES, "cpu", monkeypatch, m=m)
    assert _rel_err(got, tiles) < 2e-3
    assert _rel_err(got, ref) < 2e-2


def test_decode_gemv_layers_do_not_warn_about_tiles_they_do_not_read(monkeypatch, caplog):
    """A layer whose GEMMs both run as the GEMV reads no tile config, so an untuned shape is not warned
    about ("Using default MoE config"); the same layer on the tile kernels is, once a GEMM."""
    from moe_registry_kernels.triton import launch as triton_launch

    monkeypatch.setattr(tile_config, "_WARNED_DEFAULT", set())
    # (and no layer call's configs kept from an earlier test: a kept pair is served without asking for tiles again)
    monkeypatch.setattr(tile_config, "_LAYER_CONFIGS", collections.OrderedDict())
    caplog.set_level("WARNING", logger="moe_registry")
    weights, x, router, ids = _layer("w4a8-g128-bf16", *CPU_SIZES, "cpu")
    experts = TritonExperts(weights, ExpertsConfig())
    experts.apply(x, router, ids)
    assert [r for r in caplog.records if "Using default MoE config" in r.getMessage()] == []
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    experts.apply(x, router, ids)
    warned = [r.getMessage() for r in caplog.records if "Using default MoE config" in r.getMessage()]
    assert len(warned) == 2 and all("uint4b8 scale:bfloat16:group(128)" in w for w in warned), warned


@pytest.mark.parametrize("scheme", ["w4a8-g32", "w8a8-int8-static"])
def test_decode_gemv_blocks_of_several_pairs(scheme, monkeypatch):
    """GEMV_BLOCK_M aligned pairs a program (each weight word read once for the block's rows; slower
    than a pair a program on an H100, kept for other GPUs): the same output as a pair a program."""
    weights, x, router, ids = _layer(scheme, *CPU_SIZES, "cpu", m=2)
    experts = TritonExperts(weights, ExpertsConfig())
    one = experts.apply(x, router, ids)
    monkeypatch.setattr(triton_launch, "GEMV_BLOCK_M", 2)
    block_m: list = []
    monkeypatch.setattr(triton_launch, "_decode_gemv_kernel",
                        KwargSpy(decode_gemv._decode_gemv_kernel, "BLOCK_M", block_m))
    two = experts.apply(x, router, ids)
    assert block_m == [2, 2] and _rel_err(two, one) < 1e-3


@pytest.mark.parametrize("scheme", ["w4a8-g128-bf16", "w8a8-int8-token"])
def test_decode_gemv_reads_long_rows_in_chunks(scheme, monkeypatch):
    """Rows longer than ROW_CHUNK are quantised a chunk at a time (amax over all of them first):
    the same output as rows read at once."""
    weights, x, router, ids = _layer(scheme, *CPU_SIZES, "cpu")
    experts = TritonExperts(weights, ExpertsConfig())
    whole = experts.apply(x, router, ids)
    monkeypatch.setattr(activation_quant, "ROW_BLOCK_MAX", 128)  # 640 and 96 columns: an amax pass, then five chunks
    chunked = experts.apply(x, router, ids)
    assert torch.equal(chunked, whole)


def _sentinel_empty(monkeypatch) -> None:
    """Every later torch.empty comes back filled: int8 with 99, floating point with -1, so what a
    kernel never wrote shows."""
    real_empty = torch.empty

    def filled(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(-1.0 if t.is_floating_point() else 99)

    monkeypatch.setattr(torch, "empty", filled)


@pytest.mark.parametrize("row_block_max", [16384, 256])
def test_decode_gemv_quantises_as_the_quantisation_kernel(row_block_max, monkeypatch):
    """The GEMV's input codes are act_quant's, for int4 words split into even and odd columns (nibble
    halves): every rounding tie and saturation the same, the scale too, rows read at once or in an
    amax pass and chunks."""
    k, unit = 640, 2.0 ** -4  # amax 127 units: the scale is the unit itself, exactly
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, k, generator=g) * 2).clamp(-7.8, 7.8)
    x[0, :9] = torch.tensor([0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 0.0, 3.0, 127.0]) * unit  # ties, the amax
    x = x.to(torch.float16)
    want, want_scale = activation_quant.act_quant(x, "none", "int8_token")
    assert want_scale[0].item() == unit and want[0, 4] == 126 and want[0, 2] == 2  # ties to even
    monkeypatch.setattr(activation_quant, "ROW_BLOCK_MAX", row_block_max)
    for packed, order in ((True, torch.cat([want[:, 0::2], want[:, 1::2]], dim=1)), (False, want)):
        codes, scales = activation_quant.act_quant(x, "none", "int8_token", nibble_halves=packed)
        assert torch.equal(codes, order) and torch.equal(scales, want_scale)
    with pytest.raises(ValueError, match=r"codes in nibble halves are int8 codes of rows of even width, no "
                                         r"activation; got int8_token rows of 639"):
        activation_quant.act_quant(x[:, :639], "none", "int8_token", nibble_halves=True)


def test_decode_gemv_leaves_the_rows_of_foreign_pairs_alone(monkeypatch):
    """GEMM2's input rows are the pairs': the row of a pair routed to another rank's expert (never
    written by GEMM1: NaN here) is neither read nor quantised, and the other rows are."""
    k = 64
    x = torch.randn(3, k).to(torch.float16)
    x[1] = float("nan")
    ids = torch.tensor([2, -1, 0], dtype=torch.int32)
    want, want_scale = activation_quant.act_quant(x[[0, 2]], "none", "int8_token")
    _sentinel_empty(monkeypatch)
    codes, scales = activation_quant.act_quant(x, "none", "int8_token", pair_experts=ids, num_experts=4)
    assert (codes[1] == 99).all() and scales[1] == -1.0
    assert torch.equal(codes[[0, 2]], want) and torch.equal(scales[[0, 2]], want_scale)
    with pytest.raises(ValueError, match=r"pair_experts holds one expert per row: \[3\], got \[2\]"):
        activation_quant.act_quant(x, "none", "int8_token", pair_experts=ids[:2], num_experts=4)


def _proj(weight: torch.Tensor, scale: torch.Tensor, *, zero=None, perm=None, k: int | None = None):
    return triton_layout._Proj(weight, scale, zero, perm, None, None, weight.shape[1], k or weight.shape[2] * 2)


def test_which_one_token_gemms_take_the_gemv(monkeypatch):
    """The GEMV takes int8 activations per token or static on uint4b8 or int8 codes with 16/32-bit
    channel or group scales (groups of whole words, at most a step) in column order, rows of
    aligned words; anything else keeps the tile kernels."""
    w4a8 = triton_variant.variant_from_keys("uint4b8 scale:bfloat16:group(128):static", INT8_TOKEN)
    w4, s4 = torch.zeros(2, 32, 64, dtype=torch.uint8), torch.ones(2, 32, 1, dtype=torch.bfloat16)
    assert triton_launch._takes_gemv(w4a8, _proj(w4, s4))
    assert not triton_launch._takes_gemv(w4a8, _proj(w4, s4, zero=s4))
    assert not triton_launch._takes_gemv(w4a8, _proj(w4, s4, perm=torch.zeros(2, 128, dtype=torch.int32)))
    assert not triton_launch._takes_gemv(w4a8, _proj(w4, s4.to(torch.float8_e4m3fn)))
    assert not triton_launch._takes_gemv(w4a8, _proj(w4[:, :, :62], s4, k=124))  # K not whole words
    assert not triton_launch._takes_gemv(w4a8, _proj(torch.zeros(2, 32, 66, dtype=torch.uint8)[:, :, 1:65], s4))
    wide = triton_variant.variant_from_keys("uint4b8 scale:float16:group(1024):static", INT8_TOKEN)
    assert not triton_launch._takes_gemv(wide, _proj(w4, s4))  # a group past a step's 64 words
    w4a16 = triton_variant.variant_from_keys("uint4b8 scale:float16:group(128):static", "unquantized")
    assert not triton_launch._takes_gemv(w4a16, _proj(w4, s4))
    w8a8 = triton_variant.variant_from_keys("int8 scale:float32:channel:static", INT8_STATIC)
    assert triton_launch._takes_gemv(w8a8, _proj(torch.zeros(2, 32, 64, dtype=torch.int8),
                                              torch.ones(2, 32, 1), k=64))
    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    assert not triton_launch._takes_gemv(w4a8, _proj(w4, s4))


def test_decode_gemv_runs_where_it_pays(monkeypatch):
    """The GEMV reads an expert's weights once a pair: it runs while uniform routing gives the
    experts hit at most GEMV_PAIRS_PER_EXPERT pairs each, as measured on the benchmark shapes
    (Qwen3-30B-A3B and DeepSeek-V2-Lite up to 8 tokens, Mixtral up to 4), and the layer follows."""
    pays = triton_plan._gemv_pays
    assert pays(8, 8, 128) and not pays(16, 8, 128)
    assert pays(8, 6, 64) and not pays(16, 6, 64)
    assert pays(4, 2, 8) and not pays(8, 2, 8)
    assert pays(1, 4, 4) and pays(1, 8, 4)  # one token: one pair an expert, however few the experts
    weights, x, router, ids = _layer("w4a8-g32", *CPU_SIZES, "cpu", m=3)  # E = 6, top-3: 9 pairs on ~5.3 experts
    experts = TritonExperts(weights, ExpertsConfig())
    gemv_grids: list = []
    monkeypatch.setattr(triton_launch, "_decode_gemv_kernel", LaunchSpy(decode_gemv._decode_gemv_kernel, gemv_grids))
    experts.apply(x, router, ids)
    assert gemv_grids == []
    experts.apply(x[:2], router[:2], ids[:2])  # 6 pairs on 4.5
    assert len(gemv_grids) == 2


def test_decode_gemv_range_is_reckoned_over_the_routers_experts(monkeypatch):
    """Under expert parallelism a rank holds a share of the router's experts and sees the pairs
    routed to them (others' pairs carry foreign ids): the GEMV's range is reckoned over the router's
    count (ExpertsConfig.routed_experts), which the layer builder sets. 3 tokens, top-3: over 6
    experts 9 pairs on ~5.3 hit, 1.7 a hit (tiles); over 12, of which a rank holds these 6, 9 pairs
    on ~6.9 hit, 1.3 a hit (the GEMV), its output the reference's."""
    weights, x, router, ids = _layer("w4a8-g32", *CPU_SIZES, "cpu", m=3)
    gemv_grids: list = []
    monkeypatch.setattr(triton_launch, "_decode_gemv_kernel", LaunchSpy(decode_gemv._decode_gemv_kernel, gemv_grids))
    TritonExperts(weights, ExpertsConfig()).apply(x, router, ids)
    assert gemv_grids == []
    got = TritonExperts(weights, ExpertsConfig(routed_experts=2 * E)).apply(x, router, ids)
    assert len(gemv_grids) == 2
    assert _rel_err(got, reference_moe(x, router, ids, weights, ExpertsConfig())) < 2e-2


def test_decode_gemv_has_no_weight_budget(monkeypatch):
    """A GEMV quantises its row once a program, not once a K step: past SCALE_IN_GEMM_MAX_BYTES both
    GEMMs still take it, and no quantisation launch runs."""
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM_MAX_BYTES", 0)
    monkeypatch.setattr(triton_plan, "SCALE_IN_GEMM2_MAX_BYTES", {})
    got, _, ref = _gemv_against_tiles("w4a8-g32", CPU_SIZES, "cpu", monkeypatch)
    assert _rel_err(got, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", list(GEMV_SCHEMES))
def test_decode_gemv_on_the_gpu(scheme, monkeypatch):
    """The PTX dp4a at a model's sizes (hidden 2688: five whole steps of int4 words and a masked
    rest; intermediate 1408): the tile kernels' output and near the reference."""
    got, tiles, ref = _gemv_against_tiles(scheme, GPU_SIZES, "cuda", monkeypatch)
    assert _rel_err(got, tiles) < 2e-3
    assert _rel_err(got, ref) < 2e-2
