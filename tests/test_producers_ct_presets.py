"""llm-compressor's integer presets (tests/fixtures/compressed_tensors_presets, written by
tools/make_fixtures_ct_presets.py with llm-compressor 0.14 / compressed-tensors 0.19; versions in
VERSIONS.json) read as compressed-tensors means them.

ref.safetensors beside each checkpoint holds expert 0's weights as compressed-tensors' own
PackedQuantizationCompressor.decompress returns them (bfloat16). Ours equal them bit for bit after
rounding to bfloat16 (tests/test_producers.py, with what explain says): both are code · scale with one
rounding (bf16 scales are exact in the float16 the kernels read), and the layer (torch reference, Triton in
the interpreter) is held to a float64 MoE on those weights (expert 0) and on ours (experts 1..3). Here: the
zero-sum Triton tiles and the packed CPU kernel against that MoE, ignore lists and targets matched as
compressed-tensors matches them, act-order g_idx, and bad input.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.cli.main import main
from moe_registry.core.errors import CheckpointError
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.oracle.scope_index import pattern_matches

FIXTURES = Path(__file__).parent / "fixtures" / "compressed_tensors_presets"
LAYER = "model.layers.0.mlp.experts"
HIDDEN = INTER = 128
E = 4
ROLES = ("gate", "up", "down")

# fixture -> (scheme, weight key)
CASES = {
    "w4a16-g128": ("compressed-tensors-w4a16", "uint4b8 scale:float16:group(128):static"),
    "w4a16-channel": ("compressed-tensors-w4a16", "uint4b8 scale:float16:channel:static"),
    "w4a16-asym-g64-actorder-weight": ("compressed-tensors-w4a16-asym",
                                       "uint4 scale:float16:group(64):static zp:group"),
    "w8a16-asym-g32": ("compressed-tensors-w8a16-asym", "uint8 scale:float16:group(32):static zp:group"),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ref(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "ref.safetensors"))


@pytest.fixture(scope="module")
def built() -> dict[str, object]:
    return {n: moe_registry.build(FIXTURES / n, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
            for n in CASES}


def _ours(layer) -> dict[tuple[int, str], torch.Tensor]:
    from moe_registry_kernels.reference import dense_experts

    dense = dense_experts(layer.weights, torch.float64)
    return {**{(e, "gate"): dense.w13[e, :INTER] for e in range(E)},
            **{(e, "up"): dense.w13[e, INTER:] for e in range(E)},
            **{(e, "down"): dense.w2[e] for e in range(E)}}


def _weights(name: str, layer) -> dict[tuple[int, str], torch.Tensor]:
    """The producer's expert 0, ours for experts 1..3."""
    ref = _ref(name)
    return {**_ours(layer), **{(0, r): ref[f"experts.0.{r}.dequant"].double() for r in ROLES}}


def _moe64(w: dict[tuple[int, str], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
           topk: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = x[tok].double()
            a = torch.nn.functional.silu(xe @ w[(e, "gate")].T) * (xe @ w[(e, "up")].T)
            out.index_add_(0, tok, topk[tok, k].double()[:, None] * (a @ w[(e, "down")].T))
    return out


def _routing(seed: int, m: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and top-2 routing in which every token uses expert 0 (the producer's own)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=g)
    other = torch.randint(1, E, (m,), generator=g)
    ids = torch.stack([torch.zeros(m, dtype=torch.int64), other], 1).to(torch.int32)
    w = torch.rand(m, 2, generator=g) + 0.1
    return x, ids, (w / w.sum(-1, keepdim=True)).float()


# ------------------------------------------------------------------------------------- tests


def test_versions_name_the_producer() -> None:
    v = json.loads((FIXTURES / "VERSIONS.json").read_text())
    assert v["llmcompressor"].startswith("0.14") and v["compressed-tensors"] and v["transformers"].startswith("5.")
    assert set(v["fixtures"]) == set(CASES)


@pytest.mark.parametrize("m", [16, 1])
def test_triton_zero_sums_match_float64_moe_float16(built, m, monkeypatch) -> None:
    """llm-compressor's W8A16 asym file under a ZERO_SUMS decode tile (zero points on the factored
    dot, their terms from the inputs' group sums; one token's found by the GEMMs from its row),
    against the float64 MoE with compressed-tensors' own dequantisation of expert 0; the launches
    are watched: both GEMMs took it."""
    pytest.importorskip("triton")
    from launch_spy import KwargSpy
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import gemm as triton_gemm
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton import tile_config

    seen: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_kernel", KwargSpy(triton_gemm._fused_moe_kernel, "ZERO_SUMS", seen))
    layer = built["w8a16-asym-g32"]
    x, ids, w = _routing(6, m)
    want = _moe64(_weights("w8a16-asym-g32", layer), x, ids, w)
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2,
            "ZERO_SUMS": True}
    with tile_config.config_override(tile, tile):
        got = triton_experts.TritonExperts(layer.weights, ExpertsConfig()).apply(x.to(torch.float16), w, ids)
    tol = moe_registry.load_registry().scheme("compressed-tensors-w8a16-asym").tolerance["float16"]
    assert seen == [True, True]
    assert _rel(got, want) <= tol, f"w8a16-asym-g32 ZERO_SUMS: {_rel(got, want):.2e} > {tol}"


@pytest.mark.parametrize("name", ["w4a16-g128", "w4a16-asym-g64-actorder-weight"])
def test_cpu_packed_kernel_matches_float64_moe(name: str) -> None:
    """torch's packed int4 op, asked for (the oracle's bfloat16 default on a CPU is torch-cpu-dot8)."""
    layer = moe_registry.build(FIXTURES / name, platform="cpu", layer=0, dtype="bfloat16", kernel="torch-cpu-packed")
    assert layer.report.chosen == "torch-cpu-packed"
    x, ids, w = _routing(9)
    want = _moe64(_weights(name, layer), x.to(torch.bfloat16).float(), ids, w)
    got = layer.kernel(x.to(torch.bfloat16), w, ids)
    assert _rel(got, want) <= layer.tolerance


# ---------------------------------------------------------- ignore lists with re: patterns


@pytest.mark.parametrize("name", sorted(CASES))
def test_ct_target_matches_like_compressed_tensors(name: str) -> None:
    """The recipe's ignore patterns match exactly the module names compressed-tensors' own matcher
    (compressed_tensors.utils.match) matched in the producer's model."""
    seen = json.loads((FIXTURES / name / "ignore.json").read_text())
    names = sorted({n for ns in seen["matched"].values() for n in ns} | set(seen["quantized"]))
    for pattern, matched in seen["matched"].items():
        ours = [n for n in names if pattern_matches("ct-target", pattern, n, ())]
        assert sorted(ours) == sorted(matched), pattern
    assert not any(pattern_matches("ct-target", p, n, ()) for p in seen["ignore"] for n in seen["quantized"])


def _with_config(tmp_path: Path, name: str, change) -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    config = json.loads((dest / "config.json").read_text())
    change(config["quantization_config"])
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_regex_ignore_list_loads_the_same_layer(tmp_path: Path, built) -> None:
    """config.json with the recipe's own regex ignore list (what older exports and hand-written
    configs carry) instead of the expanded names: same scheme, same weights."""
    name = "w4a16-asym-g64-actorder-weight"
    ignore = json.loads((FIXTURES / name / "ignore.json").read_text())["ignore"]
    dest = _with_config(tmp_path, name, lambda q: q.update(ignore=ignore))
    layer = moe_registry.build(dest, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
    assert layer.report.scheme.scheme == CASES[name][0]
    assert torch.equal(layer.weights.w13.weight, built[name].weights.w13.weight)


def test_ignore_regex_matching_the_experts_excludes_the_layer(tmp_path: Path, capsys) -> None:
    dest = _with_config(tmp_path, "w4a16-g128", lambda q: q.update(ignore=["lm_head", "re:.*mlp.experts.*"]))
    assert main(["explain", str(dest), "--platform", "cpu", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["excluded"], report


def test_targets_are_names_class_names_or_regexes() -> None:
    """compressed-tensors targets a module by its name, its class name (``Linear``: what llm-compressor's
    presets write) or ``re:`` over the name; the class names come from the scope rule's ``types``."""
    expert = f"{LAYER}.0.gate_proj"
    assert pattern_matches("ct-target", "Linear", expert, ("Linear",))
    assert not pattern_matches("ct-target", "Linear", expert, ())
    assert pattern_matches("ct-target", "re:.*experts.*", expert, ())
    assert not pattern_matches("ct-target", "re:.*self_attn.*", expert, ("Linear",))


def test_targets_that_miss_the_experts_leave_them_unquantized(tmp_path: Path, capsys) -> None:
    """A config group whose targets match no expert projection quantizes none of them: explain says so
    (the layer is unquantized, naming the field), and a checkpoint that nevertheless holds packed expert
    tensors is refused in one line naming the tensor, not read as something else."""
    dest = _with_config(tmp_path, "w4a16-g128",
                        lambda q: q["config_groups"]["group_0"].update(targets=["re:.*self_attn.*"]))
    assert main(["explain", str(dest), "--platform", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme"]["name"] == "unquantized", report["scheme"]
    assert report["excluded"] == ("compressed-tensors-w4a16 checkpoint, but this layer is excluded: "
                                  f"{LAYER}.0.gate_proj is not listed in config_groups.group_0.targets")
    assert main(["run", str(dest), "--layer", "0", "--platform", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {LAYER}.0.gate_proj.weight_packed: unexpected tensor for scheme unquantized "
                   "(expected weight)"), err


# ------------------------------------------------------------------------------- bad input


def _copy(tmp_path: Path, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    return dest, load_file(str(dest / "model.safetensors"))


def test_missing_zero_point_of_an_asymmetric_scheme_is_refused(tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, "w4a16-asym-g64-actorder-weight")
    gone = f"{LAYER}.2.up_proj.weight_zero_point"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value) == (f"{gone}: missing (scheme compressed-tensors-w4a16-asym needs weight_g_idx, "
                              "weight_packed, weight_scale, weight_shape, weight_zero_point)")


G_IDX = "w4a16-asym-g64-actorder-weight"  # two groups of 64 per projection


def _g_idx(tmp_path: Path, values: torch.Tensor) -> Path:
    """The group-64 fixture with a weight_g_idx on every projection: ``values`` on expert 1's gate
    and up (they share their input, so their act-order), the trivial k // 64 elsewhere."""
    dest, tensors = _copy(tmp_path, G_IDX)
    trivial = torch.arange(HIDDEN, dtype=torch.int32) // 64
    extra = {f"{LAYER}.{e}.{r}_proj.weight_g_idx": trivial.clone() for e in range(E) for r in ROLES}
    extra[f"{LAYER}.1.gate_proj.weight_g_idx"] = values.to(torch.int32)
    extra[f"{LAYER}.1.up_proj.weight_g_idx"] = values.to(torch.int32).clone()
    save_file({**tensors, **extra}, str(dest / "model.safetensors"))
    return dest


def _dequant_with_g_idx(tensors: dict[str, torch.Tensor], prefix: str, g_idx: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' (pre-0.19) meaning of weight_g_idx, float64: column k takes the scale and
    zero point of group g_idx[k]. Codes and zero points unpacked as compressed-tensors packs them."""
    from moe_registry.formats.bitpack import unpack_int32

    q = unpack_int32(tensors[prefix + "weight_packed"], 4, dim=1).double()
    zp = unpack_int32(tensors[prefix + "weight_zero_point"], 4, dim=0).double()
    s = tensors[prefix + "weight_scale"].double()
    g = g_idx.long()
    return (q - zp[:, g]) * s[:, g]


def test_act_order_g_idx_is_applied(tmp_path: Path, built) -> None:
    """A permuting weight_g_idx (columns alternate between the two groups): the layer computes with
    column k scaled by its group g_idx[k], on the reference and on Triton in the interpreter."""
    g_idx = torch.arange(HIDDEN) % 2
    dest = _g_idx(tmp_path, g_idx)
    layer = moe_registry.build(dest, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
    assert layer.weights.w13.perm is not None
    tensors = load_file(str(dest / "model.safetensors"))
    w = _ours(built[G_IDX])
    for role in ("gate", "up"):
        w[(1, role)] = _dequant_with_g_idx(tensors, f"{LAYER}.1.{role}_proj.", g_idx)
    assert not torch.equal(w[(1, "gate")], _ours(built[G_IDX])[(1, "gate")])
    x, _, topk = _routing(13)
    ids = torch.tensor([[1, 0]] * x.shape[0], dtype=torch.int32)
    want = _moe64(w, x, ids, topk)
    assert _rel(layer.kernel(x, topk, ids), want) <= layer.tolerance
    pytest.importorskip("triton")
    from moe_registry_kernels.triton.experts import TritonExperts

    got = TritonExperts(layer.weights, ExpertsConfig()).apply(x.to(torch.float16), topk, ids)
    assert _rel(got, want) <= 1e-2


def test_trivial_g_idx_changes_nothing(tmp_path: Path, built) -> None:
    layer = moe_registry.build(_g_idx(tmp_path, torch.arange(HIDDEN) // 64), platform="cpu", layer=0,
                               dtype="float32", kernel="torch-reference")
    assert layer.weights.w13.perm is None
    assert torch.equal(layer.weights.w13.weight, built[G_IDX].weights.w13.weight)


def test_g_idx_outside_the_groups_is_refused(tmp_path: Path) -> None:
    bad = torch.arange(HIDDEN) // 64
    bad[7] = 3
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(_g_idx(tmp_path, bad), platform="cpu", layer=0)
    assert str(err.value) == (f"{LAYER}.1.gate_proj.weight_g_idx: 1 of 128 values are outside 0..1 "
                              "(first at [7] = 3); expected group indices of 128 columns in groups of 64")


def test_g_idx_that_is_no_group_permutation_is_refused(tmp_path: Path) -> None:
    bad = (torch.arange(HIDDEN) >= 100).long()  # 100 columns in group 0, 28 in group 1
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(_g_idx(tmp_path, bad), platform="cpu", layer=0)
    assert str(err.value) == (f"{LAYER}.1.gate_proj.weight_g_idx: group 0 has 100 columns; expected every "
                              "group to hold 64 columns (the last one fewer when 128 is not a multiple), "
                              "as act-order g_idx does")
