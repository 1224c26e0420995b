"""GPTQModel and AutoAWQ checkpoints as those libraries write them (tests/fixtures/gptqmodel, autoawq; made
by tools/make_fixtures_gptq_awq.py, versions in each VERSIONS.json) are the ground truth here, not our packers.

Each fixture is a tiny Qwen3-MoE layer (4 experts, hidden 64, expert intermediate 64, group 32; one is a
Mixtral, saved by GPTQModel under its own module names mlp.gate / mlp.experts.N.gate_proj, which the mixtral
family reads through naming.alternatives) with the library's own dequantised weight of every expert
projection and that quantized linear's output on fixed inputs (ref.safetensors). What every producer passes
(tests/test_producers.py): `explain` picks the right scheme and a Triton kernel accepts its keys; our
converter's weights, rounded to float16, are the library's dequantisation bit for bit (both libraries compute
scale * (q - zero) in float16 with one rounding, as rounding our float32 value once does); the built layer
(torch reference on CPU, Triton in the interpreter) matches a float64 MoE computed from the LIBRARY'S weights
within the scheme's tolerance. Here: the library's own linear outputs, the Triton tile paths its codes take
(group dots, zero sums, word halves) against that float64 MoE, and broken zero points refused naming the
tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from moe_registry_kernels.dequant import dequantize
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.core.errors import CheckpointError
from moe_registry.layer.experts import ExpertsConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PREFIX = "model.layers.0.mlp.experts"
ROLES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

# fixture -> (library dir, scheme explain must pick, weight key)
CASES = {
    "qwen3-gptq-w4-sym": ("gptqmodel", "gptq-w4a16", "uint4b8 scale:float16:group(32):static"),
    "qwen3-gptq-w4-asym": ("gptqmodel", "gptq-w4a16-asym", "uint4 scale:float16:group(32):static zp:group"),
    "qwen3-gptq-w8-sym-actorder": ("gptqmodel", "gptq-w8a16", "uint8b128 scale:float16:group(32):static"),
    "qwen3-gptq-w4-sym-v2": ("gptqmodel", "gptq-v2-w4a16", "uint4b8 scale:float16:group(32):static"),
    "qwen3-gptq-w4-asym-actorder-v2": ("gptqmodel", "gptq-v2-w4a16-asym",
                                       "uint4 scale:float16:group(32):static zp:group"),
    "qwen3-awq-w4-gemm": ("autoawq", "awq-w4a16", "uint4 scale:float16:group(32):static zp:group"),
    "mixtral-gptq-w4-sym": ("gptqmodel", "gptq-w4a16", "uint4b8 scale:float16:group(32):static"),
    "qwen3-gptq-w8-asym": ("gptqmodel", "gptq-w8a16-asym", "uint8 scale:float16:group(32):static zp:group"),
    "qwen3-gptq-w8-asym-v2": ("gptqmodel", "gptq-v2-w8a16-asym", "uint8 scale:float16:group(32):static zp:group"),
    # Intel AutoRound's int4 export, packing auto_round:auto_gptq (tools/make_fixtures_autoround.py)
    "qwen3-autoround-w4-sym": ("autoround", "autoround-w4a16", "uint4b8 scale:float16:group(32):static"),
    "qwen3-autoround-w4-asym": ("autoround", "autoround-w4a16-asym", "uint4 scale:float16:group(32):static zp:group"),
}


def checkpoint(name: str) -> Path:
    return FIXTURES / CASES[name][0] / name / "checkpoint"


def library_weights(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The library's own dequantised weights as float16 [E, N, K] per role, and its raw ref tensors."""
    ref = load_file(str(FIXTURES / CASES[name][0] / name / "ref.safetensors"))
    e = 0
    while f"{PREFIX}.{e}.gate_proj.weight" in ref:
        e += 1
    stacked = {role: torch.stack([ref[f"{PREFIX}.{i}.{proj}.weight"] for i in range(e)])
               for role, proj in ROLES.items()}
    return ref, stacked


def build(name: str, path: Path | None = None):
    """The layer as the oracle builds it on CPU, pinned to the torch reference (the kernel under test)."""
    return moe_registry.build(path or checkpoint(name), layer=0, platform="cpu", dtype="float16",
                              kernel="torch-reference")


def our_weights(built) -> dict[str, torch.Tensor]:
    """Our converted weights read back through the one definition of the layout, float32 [E, N, K]."""
    w = built.weights
    w13 = dequantize(w.w13, w.weight_key)
    inter = w.intermediate_size
    return {"gate": w13[:, :inter], "up": w13[:, inter:], "down": dequantize(w.w2, w.weight_key)}


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return weights, ids


def moe_float64(x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor, lib: dict[str, torch.Tensor]):
    """Plain float64 SiLU-gated MoE on the library's weights."""
    h = x.double()
    out = torch.zeros_like(h)
    for m in range(h.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[m, j])
            gate, up, down = (lib[r][e].double() for r in ("gate", "up", "down"))
            a = torch.nn.functional.silu(gate @ h[m]) * (up @ h[m])
            out[m] += float(topk_w[m, j]) * (down @ a)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------- detection


def test_the_fixtures_hold_what_they_are_named_for() -> None:
    """Guards the fixtures themselves: act-order g_idx, v2 zeros, and a v1 borrow are really there."""
    def tensors(name):
        return load_file(str(checkpoint(name) / "model.safetensors"))

    for name in ("qwen3-gptq-w8-sym-actorder", "qwen3-gptq-w4-asym-actorder-v2"):
        g_idx = tensors(name)[f"{PREFIX}.0.gate_proj.g_idx"].long()
        assert not torch.equal(g_idx, torch.arange(64) // 32), name
    v2 = tensors("qwen3-gptq-w4-sym-v2")[f"{PREFIX}.0.up_proj.qzeros"]
    assert bool((v2 == 0x88888888 - (1 << 32)).all())  # zero 8 stored as 8
    v1 = tensors("qwen3-gptq-w4-sym")[f"{PREFIX}.0.up_proj.qzeros"]
    assert bool((v1 == 0x77777777).all())  # zero 8 stored as 7
    # eight zero points of 0, stored by GPTQModel v1 as 0 - 0x11111111: a borrow through the word
    asym = tensors("qwen3-gptq-w4-asym")[f"{PREFIX}.0.gate_proj.qzeros"]
    assert int(asym[0, 0]) & 0xFFFFFFFF == 0xEEEEEEEF
    # GPTQModel's Mixtral names, not transformers' block_sparse_moe.experts.N.w1/w3/w2
    mixtral = tensors("mixtral-gptq-w4-sym")
    config = json.loads((checkpoint("mixtral-gptq-w4-sym") / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    assert "model.layers.0.mlp.gate.weight" in mixtral and f"{PREFIX}.3.down_proj.qweight" in mixtral
    assert not any("block_sparse_moe" in k for k in mixtral)


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("name", sorted(CASES))
def test_projection_outputs_match_the_library_linear(name: str) -> None:
    """Our weights times the fixed inputs against the library's own quantized linear (float16 GEMM)."""
    ref, _ = library_weights(name)
    ours = our_weights(build(name).built)
    x = ref["inputs"].double()
    for role, proj in ROLES.items():
        for e in range(ours[role].shape[0]):
            lib_out = ref[f"{PREFIX}.{e}.{proj}.output"]
            err = rel_err(lib_out, x @ ours[role][e].double().t())
            assert err < 2e-3, f"{name} expert {e} {proj}: relative error {err:.2e} vs the library's output"


# ---------------------------------------------------------------- the layer


def _triton_against_library(name: str, tokens: int, seeds: tuple[int, int], tile: dict | None = None,
                            dtype: str = "float16", device: str = "cpu"):
    """(relative error, the scheme's ``dtype`` tolerance) of the Triton layer (the interpreter on the CPU;
    ``tile``: both GEMMs' configs) on our conversion of the fixture, against the float64 MoE on the
    library's weights."""
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import tile_config

    _, lib = library_weights(name)
    layer = build(name)
    gen = torch.Generator().manual_seed(seeds[0])
    x = torch.randn(tokens, 64, generator=gen).to(getattr(torch, dtype))
    topk_w, topk_ids = routing(tokens, 4, 2, seed=seeds[1])
    experts = triton_experts.TritonExperts(layer.built.weights.to(device), ExpertsConfig())
    with tile_config.config_override(tile, tile):
        out = experts.apply(x.to(device), topk_w.to(device), topk_ids.to(device))
    assert out.dtype == x.dtype
    scheme = moe_registry.load_registry().scheme(CASES[name][1])
    return rel_err(out.cpu(), moe_float64(x, topk_w, topk_ids, lib)), scheme.tolerance[dtype]


@pytest.mark.parametrize("name", ["qwen3-gptq-w4-sym", "qwen3-gptq-w4-sym-v2", "mixtral-gptq-w4-sym"])
def test_triton_group_dots_match_float64_moe_on_library_weights(name: str, monkeypatch) -> None:
    """GPTQModel's symmetric int4 files under decode tiles that span both of a row's 32-column
    groups with one dot per group (GROUP_DOTS), against the float64 MoE on the library's weights;
    the launches are watched: both GEMMs took it."""
    pytest.importorskip("triton", reason="triton is not installed")
    from launch_spy import KwargSpy
    from moe_registry_kernels.triton import gemm as triton_gemm
    from moe_registry_kernels.triton import launch as triton_launch

    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "GROUP_DOTS", seen))
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2,
            "GROUP_DOTS": True}
    err, tolerance = _triton_against_library(name, 3, (9, 10), tile)
    assert seen == [True, True]
    assert 0 < err <= tolerance, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name,grouped,tokens", [
    ("qwen3-awq-w4-gemm", False, 3), ("qwen3-awq-w4-gemm", True, 3), ("qwen3-gptq-w4-asym", False, 3),
    ("qwen3-gptq-w4-asym", True, 3), ("qwen3-gptq-w8-asym", False, 3), ("qwen3-gptq-w8-asym-v2", False, 3),
    ("qwen3-awq-w4-gemm", False, 1), ("qwen3-awq-w4-gemm", True, 1), ("qwen3-gptq-w8-asym", False, 1)])
def test_triton_zero_sums_match_float64_moe_on_library_weights(name: str, grouped: bool, tokens: int,
                                                               monkeypatch) -> None:
    """AutoAWQ's and GPTQModel's zero-point files under ZERO_SUMS decode tiles (the codes less a
    constant on the factored dot, the zero points' terms from the inputs' group sums after the
    loop): one 32-column group a K step, or (4-bit, ``grouped``) one dot per group over both of a
    row's groups, against the float64 MoE on the library's weights; one token's GEMMs find their
    sums from its row. The launches are watched: both GEMMs took it."""
    pytest.importorskip("triton", reason="triton is not installed")
    from launch_spy import KwargSpy
    from moe_registry_kernels.triton import gemm as triton_gemm
    from moe_registry_kernels.triton import launch as triton_launch

    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
    err, tolerance = _triton_against_library(name, tokens, (11, 12), _zero_sums_tile(grouped))
    assert seen == [True, True]
    assert 0 < err <= tolerance, f"{name}: relative error {err:.2e}"


def _zero_sums_tile(grouped: bool) -> dict:
    return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64 if grouped else 32, "GROUP_M": 1, "SPLIT_K": 1,
            "num_warps": 4, "num_stages": 2, "ZERO_SUMS": True} | ({"GROUP_DOTS": True} if grouped else {})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,grouped,tokens", [
    ("qwen3-awq-w4-gemm", False, 3), ("qwen3-awq-w4-gemm", True, 3), ("qwen3-awq-w4-gemm", True, 1),
    ("qwen3-gptq-w4-asym", True, 3), ("qwen3-autoround-w4-asym", False, 3), ("qwen3-gptq-w8-asym", False, 3),
    ("qwen3-gptq-w4-sym", False, 3), ("qwen3-gptq-w4-sym-v2", True, 3), ("qwen3-gptq-w4-sym", True, 1)])
def test_gpu_zero_sums_match_float64_moe_on_library_weights(name: str, grouped: bool, tokens: int, dtype: str,
                                                            monkeypatch) -> None:
    """The same files and tiles compiled for the GPU, where bfloat16 4-bit tiles dot the raw codes
    (128 + code, the zero points' terms then carrying the 128) and float16 ones the codes less 8;
    the interpreter cannot run bfloat16 dots, so only the GPU holds the raw-code path to a
    producer's own weights. GPTQModel's symmetric files (a fixed zero of 8) take the same raw dots in
    bfloat16, their terms (8 + 128) times each group's scale and input sum."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from launch_spy import KwargSpy
    from moe_registry_kernels.triton import gemm as triton_gemm
    from moe_registry_kernels.triton import launch as triton_launch

    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
    err, tolerance = _triton_against_library(name, tokens, (15, 16), _zero_sums_tile(grouped), dtype, "cuda")
    assert seen == [True, True]
    assert 0 < err <= tolerance, f"{name} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["qwen3-awq-w4-gemm", "qwen3-gptq-w4-asym"])
def test_triton_large_prefill_tiles_match_float64_moe_on_library_weights(name: str, monkeypatch) -> None:
    """AutoAWQ's and GPTQModel's 4-bit zero-point files under a non-swapped 128-row tile, which reads
    the scale-and-zero words as their two 16-bit halves (layout._word_halves_for), against the
    float64 MoE on the library's weights; the launches are watched: both GEMMs took the halves."""
    pytest.importorskip("triton", reason="triton is not installed")
    from launch_spy import ArgSpy
    from moe_registry_kernels.triton import gemm as triton_gemm
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton import layout as triton_layout

    seen: list = []  # the dtype of the kernel's group scales (its fourth argument)
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel",
                        ArgSpy(triton_gemm._fused_moe_kernel, lambda a, _: a[3].dtype, seen))
    tile = {"BLOCK_M": triton_layout.WORD_HALVES_MIN_ROWS, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1,
            "num_warps": 4, "num_stages": 2}
    err, tolerance = _triton_against_library(name, 9, (13, 14), tile)
    assert seen == [torch.int16, torch.int16]
    assert 0 < err <= tolerance, f"{name}: relative error {err:.2e}"


# ---------------------------------------------------------------- bad input


def _broken_copy(name: str, tmp_path: Path, tensor: str, change) -> Path:
    dst = tmp_path / name
    shutil.copytree(checkpoint(name), dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[tensor] = change(tensors[tensor])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_mixtral_under_gptqmodel_names_routes_with_its_router() -> None:
    """The router is read under the alternative naming too (mlp.gate), and messages name tensors as saved."""
    layer = build("mixtral-gptq-w4-sym")
    router = load_file(str(checkpoint("mixtral-gptq-w4-sym") / "model.safetensors"))["model.layers.0.mlp.gate.weight"]
    assert layer.tensors.router is not None and torch.equal(layer.tensors.router, router)
    assert layer.tensors.names.tensor(2, "up", "qweight") == f"{PREFIX}.2.up_proj.qweight"


def test_mixtral_under_gptqmodel_names_with_a_bad_tensor_names_it_as_saved(tmp_path: Path) -> None:
    tensor = f"{PREFIX}.1.down_proj.scales"
    path = _broken_copy("mixtral-gptq-w4-sym", tmp_path, tensor, lambda t: torch.cat((t, t[:1])))
    with pytest.raises(CheckpointError) as err:
        build("mixtral-gptq-w4-sym", path)
    assert str(err.value).startswith(f"{tensor}: shape [3, 64]; expected [2, 64]"), str(err.value)


@pytest.mark.parametrize("name", ["qwen3-gptq-w4-asym", "qwen3-gptq-w4-asym-actorder-v2", "qwen3-gptq-w4-sym-v2"])
def test_zero_point_tensor_of_the_wrong_shape_names_it(name: str, tmp_path: Path) -> None:
    tensor = f"{PREFIX}.1.up_proj.qzeros"
    path = _broken_copy(name, tmp_path, tensor, lambda t: torch.cat((t, t[:1])))
    with pytest.raises(CheckpointError) as err:
        build(name, path)
    msg = str(err.value)
    assert msg.startswith(f"{tensor}: shape [3, 8]; expected [2, 8]"), msg
    assert "groups(in, $group)" in msg and "$group=32" in msg


def test_v2_symmetric_zero_that_is_not_the_bias_is_refused(tmp_path: Path) -> None:
    tensor = f"{PREFIX}.2.down_proj.qzeros"
    path = _broken_copy("qwen3-gptq-w4-sym-v2", tmp_path, tensor, lambda t: torch.where(
        torch.arange(t.numel()).reshape(t.shape) == 3, t - 1, t))  # word [0, 3]: its lowest zero 8 -> 7
    with pytest.raises(CheckpointError) as err:
        build("qwen3-gptq-w4-sym-v2", path)
    msg = str(err.value)
    assert msg.startswith(f"{tensor}: asymmetric zero points: 1 of 128 stored zero points"), msg
    assert "(first at [0, 24] = 7)" in msg and "GPTQ v2 stores the zero itself" in msg
    assert "expected 8 everywhere (zero = 8)" in msg
