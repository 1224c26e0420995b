"""Decode GEMMs with 16-bit activations on integer codes (W4A16, W8A16) as decode_gemv's float GEMV
(launch.FLOAT_GEMV): which layers take it, that both GEMMs then launch it and no tile kernel runs, and its numbers
against the tile kernels' and the reference, over K with whole steps and a masked rest, group and channel scales,
fixed zero codes, zero points as scale-and-zero words and as their own tensor, bias, the router weight on the
output and on the input, a foreign expert, one token and several sharing experts. In Triton's interpreter on the
CPU; on a GPU (``-m gpu``) at a model's sizes, in bfloat16."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)
pytest.importorskip("triton", reason="triton is not installed")

from launch_spy import LaunchSpy  # noqa: E402
from moe_registry_kernels import quant_ref  # noqa: E402
from moe_registry_kernels.reference import reference_moe  # noqa: E402
from moe_registry_kernels.triton import decode_gemv  # noqa: E402
from moe_registry_kernels.triton import gemm as triton_gemm  # noqa: E402
from moe_registry_kernels.triton import launch as triton_launch  # noqa: E402
from moe_registry_kernels.triton import layout as triton_layout  # noqa: E402
from moe_registry_kernels.triton import plan as triton_plan  # noqa: E402
from moe_registry_kernels.triton.experts import TritonExperts  # noqa: E402

from moe_registry.core.keys import parse_quant_key  # noqa: E402
from moe_registry.layer.experts import ExpertsConfig  # noqa: E402

A16 = "unquantized"
# weight keys of the layers the float GEMV takes (activations 16-bit)
FLOAT_GEMV_SCHEMES = {
    "gptq-w4-g128": "uint4b8 scale:float16:group(128):static",
    "gptq-w4-g32-bf16": "uint4b8 scale:bfloat16:group(32):static",
    "w4-channel": "uint4b8 scale:float16:channel:static",
    "awq-w4-g128-zp": "uint4 scale:float16:group(128):static zp:group",
    "w8-g128": "uint8b128 scale:float16:group(128):static",
    "w8-g32-zp": "uint8 scale:float16:group(32):static zp:group",
}
E = 6
# hidden 640: int4 rows of 80 words (a whole 64-word step and a masked rest), int8 rows of 160 (two and a rest);
# intermediate 96: one masked step
CPU_SIZES = (640, 96)
GPU_SIZES = (2048 + 640, 1408)


def _layer(scheme: str, hidden: int, inter: int, device: str, dtype: torch.dtype, seed: int = 0, m: int = 1,
           top_k: int = 3):
    weights = quant_ref.make_random_expert_weights(parse_quant_key(FLOAT_GEMV_SCHEMES[scheme]), parse_quant_key(A16),
                                                   num_experts=E, hidden=hidden, intermediate=inter, dtype=dtype,
                                                   bias=True, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, hidden, generator=g) * 2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    if top_k > 1:
        ids[0, 1] = -1  # a pair routed to another rank's expert: never read, no output
    router = torch.rand(m, top_k, generator=g) + 0.1
    return weights.to(device), x.to(device), router.to(device), ids.to(device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _gemv_against_tiles(scheme: str, sizes: tuple[int, int], device: str, monkeypatch, *, m: int = 1,
                        dtype: torch.dtype = torch.float16, config: ExpertsConfig | None = None, top_k: int = 3):
    """(float GEMV layer output, the tile kernels' output, reference) for ``m`` tokens, with the GEMV's launches
    checked: two, a program per (row block, column tile), and no tile kernel."""
    config = config or ExpertsConfig()
    weights, x, router, ids = _layer(scheme, *sizes, device, dtype, m=m, top_k=top_k)
    experts = TritonExperts(weights, config)
    gemv_grids: list = []
    monkeypatch.setattr(triton_launch, "_decode_gemv_float_kernel",
                        LaunchSpy(decode_gemv._decode_gemv_float_kernel, gemv_grids))
    tile_grids: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", LaunchSpy(triton_gemm._fused_moe_kernel, tile_grids))
    got = experts.apply(x, router, ids)
    assert len(gemv_grids) == 2 and tile_grids == []
    blocks = top_k if m == 1 else gemv_grids[0][0]
    inter, hidden = sizes[1], sizes[0]
    assert gemv_grids == [(blocks, inter // (decode_gemv.BLOCK_N // 2)), (blocks, hidden // decode_gemv.BLOCK_N)]
    monkeypatch.setattr(triton_launch, "FLOAT_GEMV", False)
    tiles = experts.apply(x, router, ids)
    assert len(tile_grids) == 2 and len(gemv_grids) == 2
    ref = reference_moe(x, router, ids, weights, config)
    return got, tiles, ref


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("scheme", list(FLOAT_GEMV_SCHEMES))
def test_float_gemv_matches_the_tile_kernels_and_the_reference(scheme, m, monkeypatch):
    """Both GEMMs of a decode layer (one token; two, experts shared between them) run as the float GEMV; its
    output is the tile kernels' (the same exact products, float32 sums in another order) and the reference's."""
    got, tiles, ref = _gemv_against_tiles(scheme, CPU_SIZES, "cpu", monkeypatch, m=m)
    assert _rel_err(got, tiles) < 2e-3
    assert _rel_err(got, ref) < 2e-3


def test_float_gemv_router_weight_on_the_input(monkeypatch):
    """Llama 4's top-1 layers weigh the input by the router: GEMM1's epilogue takes it, GEMM2 writes the output
    straight (top-1: no sum launch)."""
    config = ExpertsConfig(apply_router_weight_on_input=True)
    got, tiles, ref = _gemv_against_tiles("gptq-w4-g128", CPU_SIZES, "cpu", monkeypatch, config=config, top_k=1)
    assert _rel_err(got, tiles) < 2e-3
    assert _rel_err(got, ref) < 2e-3


def test_float_gemv_reads_zero_points_as_their_own_tensor(monkeypatch):
    """Zero points kept beside float32 scales (not packed into scale-and-zero words) are read from their tensor
    at the scales' strides."""
    monkeypatch.setattr(triton_layout, "_scale_zero_words", lambda scale, zero: (scale, zero))
    got, tiles, ref = _gemv_against_tiles("awq-w4-g128-zp", CPU_SIZES, "cpu", monkeypatch)
    assert _rel_err(got, tiles) < 2e-3
    assert _rel_err(got, ref) < 2e-3


def _proj(weight: torch.Tensor, scale: torch.Tensor, *, zero=None, perm=None) -> triton_layout._Proj:
    return triton_layout._Proj(weight, scale, zero, perm, None, None, weight.shape[1], 2 * weight.shape[2])


def test_which_gemms_take_the_float_gemv():
    """16-bit activations on unsigned 4-bit codes with group scales take it; act-order weights, int8 activations,
    FP4 codes and a group of fewer columns than a word do not; past the range where a pair rarely shares its
    expert, the tile kernels run."""
    from moe_registry_kernels.triton.variant import variant_from_keys

    gptq = variant_from_keys(FLOAT_GEMV_SCHEMES["gptq-w4-g128"], A16)
    w = _proj(torch.zeros(8, 64, 128, dtype=torch.uint8), torch.ones(8, 64, 2, dtype=torch.float16))
    assert triton_launch._takes_float_gemv(gptq, w)
    assert not triton_launch._takes_float_gemv(gptq, dataclasses.replace(w, perm=torch.arange(256)))
    w4a8 = variant_from_keys(FLOAT_GEMV_SCHEMES["gptq-w4-g128"], "int8 scale:float32:token:dynamic")
    assert not triton_launch._takes_float_gemv(w4a8, w)
    mxfp4 = variant_from_keys("e2m1 scale:e8m0:group(32):static", A16)
    assert not triton_launch._takes_float_gemv(mxfp4, w)
    assert triton_plan._float_gemv_pays(gptq, 1, 8, w, w, 128)
    assert triton_plan._float_gemv_pays(gptq, 8, 8, w, w, 128)
    assert not triton_plan._float_gemv_pays(gptq, 64, 8, w, w, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", list(FLOAT_GEMV_SCHEMES))
@pytest.mark.parametrize("m", [1, 4])
def test_float_gemv_on_the_gpu(scheme, m, monkeypatch):
    """At a model's sizes (hidden 2688: five whole steps of int4 words and a masked rest; intermediate 1408), in
    bfloat16: the tile kernels' output and the reference's."""
    got, tiles, ref = _gemv_against_tiles(scheme, GPU_SIZES, "cuda", monkeypatch, m=m, dtype=torch.bfloat16)
    assert _rel_err(got, tiles) < 5e-3
    assert _rel_err(got, ref) < 5e-3
