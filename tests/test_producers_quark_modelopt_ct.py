"""Checkpoints written by AMD Quark, NVIDIA ModelOpt and llm-compressor themselves (tests/fixtures/
{quark,modelopt,compressed_tensors}, made by tools/make_fixtures_quark_modelopt_ct.py; versions in
each VERSIONS.json) read as their producers mean them.

ref.safetensors beside each checkpoint holds the producer's own numbers: its dequantised weights
(experts 0 and 1; that ours equal them, and what explain says: tests/test_producers.py), its quantized
linears' outputs on fixed inputs, and (Quark, llm-compressor) its MoE block's output with the routing it
chose. The float64 MoE here is written from the producers' code, not from ours: int8 activations per token
with scale amax / 127.5 and codes -128..127 (Quark and compressed-tensors both), static per-tensor int8 with
the stored input_scale, ModelOpt's MXFP8 with exponent ceil(log2(amax / 448)) per 32 inputs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from activation_qdq import qdq
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.cli.main import main
from moe_registry.core.errors import CheckpointError
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.spec.fields import check_field
from moe_registry.spec.models import FieldRule

FIXTURES = Path(__file__).parent / "fixtures"
LAYER = "model.layers.0.mlp.experts"
HIDDEN = INTER = 64
E = 4
DEQUANT_EXPERTS = 2


@dataclass(frozen=True)
class Case:
    scheme: str
    act: str | None  # the scheme's activation quantisation: int8_token, int8_tensor, mxfp8 or None
    linear_act: str | None  # what the producer's own quantized linear did to its 2-D input (activation_qdq.qdq)
    triton: bool  # triton-fused-moe claims the scheme (explain picks it: tests/test_producers.py)
    layer_ref: bool = True  # ref.safetensors has the producer's MoE block output


CASES = {
    "quark/qwen3-w8a8-int8-channel": Case("quark-w8a8-int8", "int8_token", "int8_token_bf16_scale", True),
    "quark/qwen3-w8a8-int8-tensor": Case("quark-w8a8-int8-tensor", "int8_tensor", "int8_tensor", True),
    "modelopt/qwen3-mxfp8": Case("modelopt-mxfp8", "mxfp8", "mxfp8", True, layer_ref=False),
    "compressed_tensors/qwen3-w8a8-int8": Case("compressed-tensors-w8a8-int8", "int8_token", "int8_whole_bf16", True),
    "compressed_tensors/qwen3-w4a16": Case("compressed-tensors-w4a16", None, None, True),
    "compressed_tensors/qwen3-w4a8": Case("compressed-tensors-w4a8-int-quantized", "int8_token", "int8_whole_bf16",
                                          True),
}


def _ref(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "ref.safetensors"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _input_scales(name: str, e: int) -> dict[str, torch.Tensor | None]:
    """The producer's static input scales per role (None where it has none)."""
    t = load_file(str(FIXTURES / name / "model.safetensors"))
    return {r: t.get(f"{LAYER}.{e}.{r}_proj.input_scale") for r in ("gate", "up", "down")}


def _moe64(case: Case, name: str, w: dict[tuple[int, str], torch.Tensor], x: torch.Tensor,
           ids: torch.Tensor, weights: torch.Tensor, producer: bool = False) -> torch.Tensor:
    """A float64 MoE on weights ``w[(e, role)]``, each expert on the [tokens, hidden] block of its
    tokens. Default: the scheme's activation quantisation; static input scales as a fused kernel
    applies them (one for gate and up, one for down: the max over experts, as vLLM does too).
    ``producer``: as the producer's own block does it (its linears' 2-D quantisation, each
    projection with its own static scale)."""
    scales = [_input_scales(name, e) for e in range(E)]
    how = case.linear_act if producer else case.act
    s13 = s2 = None
    if case.act == "int8_tensor":
        s13 = torch.stack([s[r] for s in scales for r in ("gate", "up")]).max()
        s2 = torch.stack([s["down"] for s in scales]).max()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        own = scales[e]
        xe = x[tok].double()
        g = qdq(how, xe, own["gate"] if producer else s13) @ w[(e, "gate")].double().T
        u = qdq(how, xe, own["up"] if producer else s13) @ w[(e, "up")].double().T
        a = qdq(how, torch.nn.functional.silu(g) * u, own["down"] if producer else s2)
        out.index_add_(0, tok, weights[tok, k].double()[:, None] * (a @ w[(e, "down")].double().T))
    return out


def _ours(built: moe_registry.layer.build.LayerBuild) -> dict[tuple[int, str], torch.Tensor]:
    """Our dequantised weights per (expert, role), float64, from the converted checkpoint."""
    from moe_registry_kernels.reference import dense_experts

    dense = dense_experts(built.weights, torch.float64)
    return {**{(e, "gate"): dense.w13[e, :INTER] for e in range(E)},
            **{(e, "up"): dense.w13[e, INTER:] for e in range(E)},
            **{(e, "down"): dense.w2[e] for e in range(E)}}


@pytest.fixture(scope="module")
def built() -> dict[str, object]:
    """Each fixture built once on the CPU with the torch reference."""
    return {n: moe_registry.build(FIXTURES / n, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
            for n in CASES}


# ------------------------------------------------------------------------------------- tests


def test_versions_name_the_producers() -> None:
    wanted = {"quark": "amd-quark", "modelopt": "nvidia-modelopt", "compressed_tensors": "compressed-tensors"}
    for sub, package in wanted.items():
        versions = json.loads((FIXTURES / sub / "VERSIONS.json").read_text())
        assert versions[package] and versions["transformers"].startswith("5.") and versions["torch"]
        assert set(versions["fixtures"]) == {n.split("/")[1] for n in CASES if n.startswith(sub + "/")}


def _routing(seed: int, m: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 over experts 0 and 1 only: the experts whose producer-dequantised weights are kept."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(DEQUANT_EXPERTS, generator=g) for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, 2, generator=g) + 0.1
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _library_weights(name: str) -> dict[tuple[int, str], torch.Tensor]:
    ref = _ref(name)
    return {(e, r): ref[f"experts.{e}.{r}.dequant"] for e in range(DEQUANT_EXPERTS) for r in ("gate", "up", "down")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_matches_float64_moe_on_the_producers_weights(name: str, built) -> None:
    case, layer = CASES[name], built[name]
    ids, w = _routing(7)
    x = _ref(name)["hidden_states"].float()
    want = _moe64(case, name, _library_weights(name), x, ids, w)
    got = layer.kernel(x, w, ids)
    assert _rel(got, want) <= layer.tolerance, f"{name}: {_rel(got, want):.2e} > {layer.tolerance}"


NATIVE = sorted(n for n, c in CASES.items()
                if "torch-cpu-native" in moe_registry.load_registry().scheme(c.scheme).kernels)


@pytest.mark.parametrize("name", NATIVE)
def test_native_cpu_kernel_matches_float64_moe_on_the_producers_weights(name: str) -> None:
    """The compiled CPU kernel torch-cpu-native on the files Quark / ModelOpt / llm-compressor wrote, against the
    float64 MoE on the producer library's own dequantised weights."""
    _compiled_cpu_kernel_matches(name, "torch-cpu-native")


W8A8_INT8 = sorted(n for n, c in CASES.items() if c.act == "int8_token"
                   and "torch-cpu-dot8" in moe_registry.load_registry().scheme(c.scheme).kernels)


@pytest.mark.parametrize("name", W8A8_INT8)
def test_dot8_runs_w8a8_int8_as_the_oracle_picks_it_on_a_cpu(name: str) -> None:
    """W8A8 int8 (per-channel int8 weights, per-token int8 activations) on a CPU: the oracle picks torch-cpu-dot8,
    which quantises each token with one scale as the scheme declares; on the producers' files it is the float64
    MoE of their own dequantised weights within the scheme's tolerance."""
    assert W8A8_INT8, "no W8A8 int8 producer fixture"
    assert moe_registry.build(FIXTURES / name, platform="cpu", layer=0, dtype="float32").report.chosen == \
        "torch-cpu-dot8"
    _compiled_cpu_kernel_matches(name, "torch-cpu-dot8")


def _compiled_cpu_kernel_matches(name: str, kernel: str) -> None:
    case = CASES[name]
    layer = moe_registry.build(FIXTURES / name, platform="cpu", layer=0, dtype="float32", kernel=kernel)
    assert layer.report.chosen == kernel
    x = _ref(name)["hidden_states"].float()
    for m in (1, x.shape[0]):
        ids, w = _routing(7, m)
        want = _moe64(case, name, _library_weights(name), x[:m], ids, w)
        got = layer.kernel(x[:m], w, ids)
        assert _rel(got, want) <= layer.tolerance, f"{name} M={m}: {_rel(got, want):.2e} > {layer.tolerance}"


INT8_ACTIVATION_CASES = sorted(n for n, c in CASES.items() if c.triton and c.act in ("int8_token", "int8_tensor"))


@pytest.mark.parametrize("name", INT8_ACTIVATION_CASES)
def test_decode_gemv_on_the_producers_files_matches_float64_moe(name: str, built, monkeypatch) -> None:
    """One token of the producers' int8-activation checkpoints (Quark W8A8 int8 per channel and per
    tensor, compressed-tensors W8A8 int8 and W4A8) runs the decode GEMV in both GEMMs, on the
    converted weights, within the scheme's tolerance of the float64 MoE of the producer's own
    dequantisation."""
    pytest.importorskip("triton")
    from launch_spy import LaunchSpy
    from moe_registry_kernels.triton import decode_gemv
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import launch as triton_launch

    case, layer = CASES[name], built[name]
    ids, w = _routing(12, m=1)
    x = _ref(name)["hidden_states"][:1].to(torch.float16)
    want = _moe64(case, name, _library_weights(name), x.float(), ids, w)
    launched: list = []
    monkeypatch.setattr(triton_launch, "_decode_gemv_kernel", LaunchSpy(decode_gemv._decode_gemv_kernel, launched))
    got = triton_experts.TritonExperts(layer.weights, ExpertsConfig()).apply(x, w, ids)
    assert len(launched) == 2
    tol = moe_registry.load_registry().scheme(case.scheme).tolerance["float16"]
    assert got.dtype == torch.float16 and _rel(got, want) <= tol, f"{name}: {_rel(got, want):.2e} > {tol}"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.triton))
def test_triton_kernel_matches_float64_moe_float16(name: str, built) -> None:
    """The Triton fused kernel (interpreter, float16 activations) on the converted weights."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton.experts import TritonExperts

    case, layer = CASES[name], built[name]
    ids, w = _routing(11)
    x = _ref(name)["hidden_states"].to(torch.float16)
    want = _moe64(case, name, _library_weights(name), x.float(), ids, w)
    got = TritonExperts(layer.weights, ExpertsConfig()).apply(x, w, ids)
    tol = moe_registry.load_registry().scheme(case.scheme).tolerance["float16"]
    assert got.dtype == torch.float16 and _rel(got, want) <= tol, f"{name}: {_rel(got, want):.2e} > {tol}"


def test_modelopt_mxfp8_checkpoint_takes_the_folded_ptx_decode(built, monkeypatch) -> None:
    """What ModelOpt writes for MXFP8 folds in both 16-bit dtypes on the GPU's PTX path (its e8m0 scale
    codes lie in launch.E4M3_MX_FOLD_CODES) of a GPU that converts e4m3 pairs (sm_89+, as the GPU fixture
    test's), so that test runs the folded decode on it; the interpreter (no PTX) does not fold."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton import layer as triton_layer

    experts = triton_experts.TritonExperts(built["modelopt/qwen3-mxfp8"].weights, ExpertsConfig())
    codes = experts._options["mx_scale_codes"]
    p13, p2 = triton_layer._projections(1, *experts._tensors, mx_scale_codes=codes)
    monkeypatch.setattr(triton_launch, "fp8_pair_convert", lambda device: True)
    gpu = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        for proj in (p13, p2):
            assert triton_launch._e4m3_folded(proj, experts.variant, dtype, True, gpu), (codes, dtype)
            assert not triton_launch._e4m3_folded(proj, experts.variant, dtype, False, gpu)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.layer_ref))
def test_layer_matches_the_producers_moe_block(name: str, built) -> None:
    """The producer's own quantized MoE block (its routing, all four experts, bfloat16).

    First our float64 MoE done the producer's way must reproduce its block. Then our layer must be
    within tolerance of the block, except for Quark's per-tensor scheme: its block quantizes each
    projection's input with that projection's own static scale, the fused kernel with the max over
    experts (vLLM too), which moves this layer by ~3% here; there the layer is held to the float64
    MoE with the fused scales."""
    case, ref, layer = CASES[name], _ref(name), built[name]
    x, ids, w = ref["hidden_states"].float(), ref["layer.topk_ids"], ref["layer.topk_weights"].float()
    ours = _ours(layer)
    assert _rel(_moe64(case, name, ours, x, ids, w, producer=True), ref["layer.output"]) < 1.5e-2
    got = layer.kernel(x, w, ids)
    want = ref["layer.output"] if case.act != "int8_tensor" else _moe64(case, name, ours, x, ids, w)
    assert _rel(got, want) <= layer.tolerance


# ------------------------------------------------------------------------------------ bad input


def _copy(tmp_path: Path, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    dest = tmp_path / name.replace("/", "_")
    shutil.copytree(FIXTURES / name, dest)
    return dest, load_file(str(dest / "model.safetensors"))


def test_nonzero_quark_zero_point_is_refused(tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, "quark/qwen3-w8a8-int8-channel")
    zp = f"{LAYER}.1.up_proj.weight_zero_point"
    bad = tensors[zp].clone()
    bad[5] = 3
    save_file({**tensors, zp: bad}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value) == (f"{zp}: 1 of 64 values are not 0 (first at [5] = 3); expected all 0 "
                              "(scheme quark-w8a8-int8 fixes this tensor)")


def test_nonzero_quark_input_zero_point_is_refused(tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, "quark/qwen3-w8a8-int8-tensor")
    zp = f"{LAYER}.2.down_proj.input_zero_point"
    save_file({**tensors, zp: torch.tensor(-4, dtype=torch.int8)}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value) == (f"{zp}: 1 of 1 values are not 0 (first at [] = -4); expected all 0 "
                              "(scheme quark-w8a8-int8-tensor fixes this tensor)")


@pytest.mark.parametrize(("name", "tensor", "needs"), [
    ("quark/qwen3-w8a8-int8-channel", "weight_scale", "weight, weight_scale, weight_zero_point"),
    ("compressed_tensors/qwen3-w4a16", "weight_scale", "weight_g_idx, weight_packed, weight_scale, weight_shape"),
    ("modelopt/qwen3-mxfp8", "weight_scale", "weight, weight_scale"),
])
def test_missing_scale_is_refused(tmp_path: Path, name: str, tensor: str, needs: str) -> None:
    dest, tensors = _copy(tmp_path, name)
    gone = f"{LAYER}.3.gate_proj.{tensor}"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value) == f"{gone}: missing (scheme {CASES[name].scheme} needs {needs})"


def test_int4_value_out_of_range_is_refused(tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, "compressed_tensors/qwen3-w4a8")
    name = f"{LAYER}.0.down_proj.weight"
    bad = tensors[name].clone()
    bad[2, 9] = 12
    save_file({**tensors, name: bad}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value) == (f"{name}: 1 of 4096 values are outside the int4 range (first at [2, 9] = 12); "
                              "expected signed 4-bit values -8..7 stored in int8")


def test_equals_null_tells_null_from_a_section_and_from_absent() -> None:
    rule = FieldRule.model_validate({"equals": None})
    assert check_field({"input_activations": None}, "input_activations", rule).passed
    seen = check_field({"input_activations": {"num_bits": 8}}, "input_activations", rule)
    assert not seen.passed and "wanted None" in seen.message
    assert not check_field({}, "input_activations", rule).passed
    with pytest.raises(ValueError, match="exactly one of"):
        FieldRule.model_validate({"default": 1})


def test_w4a16_with_activations_is_not_w4a16(tmp_path: Path, capsys) -> None:
    """The same checkpoint with an int8 activation section is W4A8 (pack-quantized), not W4A16."""
    dest, _ = _copy(tmp_path, "compressed_tensors/qwen3-w4a16")
    config = json.loads((dest / "config.json").read_text())
    w4a8 = json.loads((FIXTURES / "compressed_tensors/qwen3-w4a8/config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = w4a8["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    (dest / "config.json").write_text(json.dumps(config))
    assert main(["explain", str(dest), "--platform", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scheme"]["name"] == "compressed-tensors-w4a8-int"
