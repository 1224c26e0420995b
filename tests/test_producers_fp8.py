"""FP8 W8A8 checkpoints read as their producers mean them: llm-compressor's FP8, FP8_DYNAMIC and
FP8_BLOCK presets, NVIDIA ModelOpt FP8 and transformers' own FineGrainedFP8Config, per tensor
(``weight_block_size: null``) and its default block 128 (tests/fixtures/fp8/, written by the producers with
tools/make_fixtures_fp8.py; versions in VERSIONS.json), and ``quant_method: fp8`` without
``weight_block_size`` (AutoFP8 / Mixtral-FP8 style).

transformers 5.24 saves a MoE's FP8Experts with per-expert fp8 weights but its scales stacked over
experts (``experts.gate_up_proj_scale_inv`` [E, 1, 1]: one scale shared by gate and up; block 128:
[E, 2I/128, H/128], gate's block rows first), read through the schemes' ``stacked`` tensor word. Its
static config writes ``experts.{gate_up,down}_proj_activation_scale`` [E] but never calibrates them
(uninitialised memory), so the static checkpoint here is the dynamic fixture plus calibrated scales under
exactly the names, dtypes and shapes transformers wrote (VERSIONS.json records them).

AutoFP8 cannot be installed here (not on PyPI: ``pip download auto-fp8`` / ``autofp8`` find no
distribution; ``pip download git+https://github.com/neuralmagic/AutoFP8``: could not resolve host
github.com), so its checkpoint is written by this test with torch
from public facts: vLLM's Fp8Config reads ``{"quant_method": "fp8", "activation_scheme":
"static"|"dynamic", "ignored_layers": [...]}``; AutoFP8's ``per_tensor_quantize`` stores a 0-d
float32 ``weight_scale`` = amax / 448 (as the reciprocal of 448 / amax) beside fp8 codes
clamp(w * 448 / amax), and (static) a 0-d float32 ``input_scale`` = calibration amax / 448.

ref.safetensors beside each producer checkpoint holds the producer's own numbers: expert 0's
dequantised weights (first 16 rows per projection; ours equal them: tests/test_producers.py), its
quantized linears' outputs on fixed inputs (experts 0 and 1) and, for llm-compressor, its MoE block's
output with its routing. The float64 MoE
here is written from what the schemes mean (vLLM's fp8 MoE), not from our code: static per-tensor
input scales collapsed by max over gate/up and experts; dynamic per-token scales amax / 448; per
group of 128; and for ``quant_method: fp8`` dynamic ONE scale per GEMM input over all its rows.

The Triton kernel runs in the interpreter (fp8 x fp8 tl.dot works there, float16 activations);
on a GPU (sm_89+) test_triton_kernel_matches_float64_moe_on_gpu (marked gpu, bfloat16) and the
conformance suite (-m gpu -k "fp8-w8a8 or modelopt-fp8 or compressed-tensors-w8a8-fp8").
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from activation_qdq import FP8_MAX, bf16, qdq
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.cli.main import main
from moe_registry.core.errors import CheckpointError
from moe_registry.layer.experts import ExpertsConfig

FIXTURES = Path(__file__).parent / "fixtures" / "fp8"
LAYER = "model.layers.0.mlp.experts"
HIDDEN = INTER = 128
E = 4
ROWS = 16  # producer dequantised rows kept per projection (expert 0)
ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class Case:
    scheme: str
    weight: str
    activation: str
    act: str  # the scheme's activation quantisation in _moe64: static, token, group128, tensor
    linear_act: str | None = None  # the producer's own quantized linear on a 2-D input (activation_qdq.qdq)
    producer_block: bool = False  # ref.safetensors has the producer's MoE block output


TENSOR = "fp8e4m3 scale:float32:tensor:static"
CASES = {
    "llmc-fp8": Case("compressed-tensors-w8a8-fp8", TENSOR, TENSOR, "static", "ct_static", True),
    "llmc-fp8-dynamic": Case("compressed-tensors-w8a8-fp8-dynamic", "fp8e4m3 scale:float32:channel:static",
                             "fp8e4m3 scale:float32:token:dynamic", "token", "ct_whole", True),
    "llmc-fp8-block": Case("compressed-tensors-w8a8-fp8-block", "fp8e4m3 scale:float32:block(128x128):static",
                           "fp8e4m3 scale:float32:group(128):dynamic", "group128", "ct_group128", True),
    "modelopt-fp8": Case("modelopt-fp8", TENSOR, TENSOR, "static", "modelopt_static"),
    "autofp8-static": Case("fp8-w8a8-static", TENSOR, TENSOR, "static"),
    "autofp8-dynamic": Case("fp8-w8a8-dynamic", TENSOR, "fp8e4m3 scale:float32:tensor:dynamic", "tensor"),
    "transformers-fp8-dynamic": Case("fp8-w8a8-dynamic", TENSOR, "fp8e4m3 scale:float32:tensor:dynamic", "tensor"),
    "transformers-fp8-block": Case("fp8-block128", "fp8e4m3 scale:float32:block(128x128):static",
                                   "fp8e4m3 scale:float32:group(128):dynamic", "group128"),
    # scale_fmt 'ue8m0': the block scales stored as float8_e8m0fnu, read as float32 (exact)
    "transformers-fp8-block-ue8m0": Case("fp8-block128", "fp8e4m3 scale:float32:block(128x128):static",
                                         "fp8e4m3 scale:float32:group(128):dynamic", "group128"),
    "transformers-fp8-static": Case("fp8-w8a8-static", TENSOR, TENSOR, "static"),
}
PRODUCED = sorted(n for n, c in CASES.items() if c.linear_act)  # llm-compressor, ModelOpt: their linears' outputs too
# committed; the static one is built here
TRANSFORMERS = ["transformers-fp8-block", "transformers-fp8-block-ue8m0", "transformers-fp8-dynamic"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------ AutoFP8-style checkpoints


def _autofp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoFP8's per_tensor_quantize: codes of w * (448 / amax), weight_scale its float32 reciprocal."""
    amax = w.abs().max().clamp(min=1e-12)
    scale = FP8_MAX / amax
    return (w * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.float().reciprocal()


def _write_autofp8(dest: Path, activation_scheme: str) -> Path:
    """A Qwen3-MoE checkpoint as AutoFP8 writes it (see the module docstring), tiny, one layer."""
    dest.mkdir(parents=True)
    config = json.loads((FIXTURES / "llmc-fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activation_scheme,
                                     "ignored_layers": ["lm_head"]}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(99)
    router = load_file(str(FIXTURES / "llmc-fp8" / "model.safetensors"))["model.layers.0.mlp.gate.weight"]
    tensors = {"model.layers.0.mlp.gate.weight": router}
    cal_h = torch.randn(64, HIDDEN, generator=g)
    for e in range(E):
        for role in ROLES:
            k = INTER if role == "down" else HIDDEN
            w = (torch.randn(HIDDEN if role == "down" else INTER, k, generator=g) / k ** 0.5).to(torch.bfloat16)
            q, s = _autofp8_quantize(w.float())
            name = f"{LAYER}.{e}.{role}_proj"
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, s
            if activation_scheme == "static":  # calibration amax / 448 (the down input ~ the gated product)
                amax = cal_h.abs().max() * (0.5 if role == "down" else 1.0) * (1 + 0.1 * e)
                tensors[f"{name}.input_scale"] = (amax / FP8_MAX).float().reshape(())
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def _transformers_static_facts() -> dict[str, list]:
    """What transformers wrote for FineGrainedFP8Config(weight_block_size=None, activation_scheme='static'):
    tensor name -> [safetensors dtype, shape], and its quantization_config."""
    return json.loads((FIXTURES / "VERSIONS.json").read_text())["producers"]["transformers"]["fixtures"][
        "transformers-fp8-static"]


def _write_transformers_static(dest: Path) -> Path:
    """transformers' per-tensor dynamic checkpoint made static as transformers lays it out: its config's
    quantization_config, and the stacked activation scales it writes (names, dtype, shape from VERSIONS.json),
    holding calibration amax / 448 per expert (transformers' own are uninitialised memory)."""
    shutil.copytree(FIXTURES / "transformers-fp8-dynamic", dest)
    facts = _transformers_static_facts()
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = facts["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tensors = _checkpoint(dest)
    amax = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(98)).abs().max()
    for name, (dtype, shape) in facts["expert_tensors"].items():
        if name.endswith("_activation_scale"):
            assert dtype == "F32" and shape == [E], (name, dtype, shape)
            part = 0.5 if ".down_proj" in name else 1.0
            tensors[name] = torch.tensor([amax * part * (1 + 0.1 * e) / FP8_MAX for e in range(E)], dtype=torch.float32)
    kept = {k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()
            if k.startswith(f"{LAYER}.0.") or (k.startswith(f"{LAYER}.") and not k[len(LAYER) + 1].isdigit())}
    st = {"F32": "torch.float32", "F8_E4M3": "torch.float8_e4m3fn"}
    assert kept == {k: [shape, st[dtype]] for k, (dtype, shape) in facts["expert_tensors"].items()}
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("autofp8")
    out = {n: FIXTURES / n for n in [*PRODUCED, *TRANSFORMERS]}
    out["autofp8-static"] = _write_autofp8(base / "static", "static")
    out["autofp8-dynamic"] = _write_autofp8(base / "dynamic", "dynamic")
    out["transformers-fp8-static"] = _write_transformers_static(base / "transformers-static")
    return out


@pytest.fixture(scope="module")
def built(dirs) -> dict[str, object]:
    return {n: moe_registry.build(d, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
            for n, d in dirs.items()}


def _ours(layer) -> dict[tuple[int, str], torch.Tensor]:
    from moe_registry_kernels.reference import dense_experts

    dense = dense_experts(layer.weights, torch.float64)
    return {**{(e, "gate"): dense.w13[e, :INTER] for e in range(E)},
            **{(e, "up"): dense.w13[e, INTER:] for e in range(E)},
            **{(e, "down"): dense.w2[e] for e in range(E)}}


def _checkpoint(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def _moe64(case: Case, d: Path, w: dict[tuple[int, str], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
           weights: torch.Tensor) -> torch.Tensor:
    """A float64 MoE on weights ``w[(e, role)]`` with the scheme's activation quantisation, as vLLM's
    fused fp8 MoE applies it: static scales one per GEMM (max over gate/up and experts); dynamic
    per-tensor: one amax over the whole GEMM1 input and one over all routed intermediates."""
    t = _checkpoint(d)
    s13 = s2 = None
    if case.act == "static" and f"{LAYER}.gate_up_proj_activation_scale" in t:  # transformers: [E] per fused part
        s13, s2 = t[f"{LAYER}.gate_up_proj_activation_scale"].max(), t[f"{LAYER}.down_proj_activation_scale"].max()
    elif case.act == "static":
        s13 = torch.stack([t[f"{LAYER}.{e}.{r}_proj.input_scale"].float().reshape(()) for e in range(E)
                           for r in ("gate", "up")]).max()
        s2 = torch.stack([t[f"{LAYER}.{e}.down_proj.input_scale"].float().reshape(()) for e in range(E)]).max()
    x = x.double()
    xq = qdq(case.act, x, s13)  # per token / per tensor over all rows: quantising x once is the same
    inter = {}
    for e in range(E):
        tok, _ = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            g, u = xq[tok] @ w[(e, "gate")].double().T, xq[tok] @ w[(e, "up")].double().T
            inter[e] = torch.nn.functional.silu(g) * u
    if case.act == "tensor":
        s2 = torch.cat(list(inter.values())).abs().max() / FP8_MAX
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e, a in inter.items():
        tok, k = (ids == e).nonzero(as_tuple=True)
        aq = qdq("static" if case.act == "tensor" else case.act, a, s2)
        out.index_add_(0, tok, weights[tok, k].double()[:, None] * (aq @ w[(e, "down")].double().T))
    return out


def _routing(seed: int, m: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, 2, generator=g) + 0.1
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _hidden(seed: int, m: int = 8) -> torch.Tensor:
    return torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------- tests


def test_versions_name_the_producers() -> None:
    versions = json.loads((FIXTURES / "VERSIONS.json").read_text())
    llmc, modelopt = versions["producers"]["llmc"], versions["producers"]["modelopt"]
    assert llmc["llmcompressor"] and llmc["compressed-tensors"] and llmc["transformers"].startswith("5.")
    assert modelopt["nvidia-modelopt"] and modelopt["transformers"].startswith("5.")
    assert {**llmc["fixtures"], **modelopt["fixtures"]}.keys() == set(PRODUCED)
    assert {f["preset"] for f in llmc["fixtures"].values()} == {"FP8", "FP8_DYNAMIC", "FP8_BLOCK"}
    tf = versions["producers"]["transformers"]
    assert tf["transformers"].startswith("5.") and set(tf["fixtures"]) == {*TRANSFORMERS, "transformers-fp8-static"}
    assert tf["fixtures"]["transformers-fp8-static"]["kept"] is False


def _explain(path: Path, platform: str, capsys) -> dict:
    assert main(["explain", str(path), "--platform", platform, "--dtype", "bfloat16", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_explain_picks_triton_on_hopper_and_a_cpu_kernel(name: str, dirs, capsys) -> None:
    case = CASES[name]
    report = _explain(dirs[name], "cuda:9.0", capsys)
    assert report["scheme"]["name"] == case.scheme
    text = json.dumps(report)
    assert case.weight in text and case.activation in text
    assert report["chosen_kernel"] == "triton-fused-moe"
    # the compiled CPU kernels where the scheme lists them (not per-tensor dynamic activations; the e4m3 dots first
    # where they run the scheme's keys), else the reference
    cpu = next((k for k, names in COMPILED.items() if name in names), "torch-reference")
    assert _explain(dirs[name], "cpu", capsys)["chosen_kernel"] == cpu


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_runs_weight_only_before_ada(name: str, dirs, capsys) -> None:
    """cuda:8.0 (A100) has no fp8 tensor-core dot: the Triton kernel runs the fp8 weights on 16-bit activations, as
    vLLM runs fp8 checkpoints on Ampere, and explain says so as an emulation note."""
    assert main(["explain", str(dirs[name]), "--platform", "cuda:8.0", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "kernel      triton-fused-moe" in out
    assert "emulation" in out and "runs them in the 16-bit activation dtype (weight-only) on cuda:8.0" in out


@pytest.mark.parametrize("form", ["hf_quant_config", "config_json"])
def test_modelopt_both_config_forms(form: str, tmp_path: Path, capsys) -> None:
    """ModelOpt writes hf_quant_config.json AND a quantization_config in config.json; each alone is enough."""
    dest = tmp_path / "m"
    shutil.copytree(FIXTURES / "modelopt-fp8", dest)
    if form == "hf_quant_config":
        config = json.loads((dest / "config.json").read_text())
        del config["quantization_config"]
        (dest / "config.json").write_text(json.dumps(config))
    else:
        (dest / "hf_quant_config.json").unlink()
    report = _explain(dest, "cuda:9.0", capsys)
    assert report["scheme"]["name"] == "modelopt-fp8" and report["chosen_kernel"] == "triton-fused-moe"


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_layer_matches_float64_moe(name: str, built, dirs) -> None:
    case, layer = CASES[name], built[name]
    ids, w = _routing(7)
    x = _hidden(3)
    want = _moe64(case, dirs[name], _ours(layer), x, ids, w)
    got = layer.kernel(x, w, ids)
    assert _rel(got, want) <= 5e-3, f"{name}: {_rel(got, want):.2e}"  # float32 vs float64: rare code flips only


COMPILED = {kernel: sorted(n for n, c in CASES.items()
                           if kernel in moe_registry.load_registry().scheme(c.scheme).kernels)
            for kernel in ("torch-cpu-dot8", "torch-cpu-native")}  # the CPU's preference order


@pytest.mark.parametrize(("name", "kernel"), [(n, k) for k, names in COMPILED.items() for n in names])
def test_compiled_cpu_kernels_match_float64_moe(name: str, kernel: str, dirs) -> None:
    """Each compiled CPU kernel the scheme lists, on the files the producer wrote, against the float64 MoE on the
    producer's own dequantisation (equal to ours: test_dequantised_weights_equal_the_producers)."""
    case = CASES[name]
    layer = moe_registry.build(dirs[name], platform="cpu", layer=0, dtype="float32", kernel=kernel)
    assert layer.report.chosen == kernel
    reference = moe_registry.build(dirs[name], platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
    for m in (1, 7):
        ids, w = _routing(5, m)
        x = _hidden(4, m)
        want = _moe64(case, dirs[name], _ours(reference), x, ids, w)
        got = layer.kernel(x, w, ids)
        assert _rel(got, want) <= layer.tolerance, f"{name} M={m}: {_rel(got, want):.2e} > {layer.tolerance}"


# the swapped-operand kernel's fp8 dot on both GEMMs (GEMM2 split in K), as a tuned table may pick it
SWAPPED_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
                "num_stages": 2, "SWAP_AB": True}
SWAPPED_TILES = (SWAPPED_TILE, {**SWAPPED_TILE, "SPLIT_K": 2})


@pytest.mark.parametrize("tiles", ["tables", "swapped"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_matches_float64_moe_float16(name: str, tiles: str, built, dirs, monkeypatch) -> None:
    """The Triton fused kernel (interpreter: fp8 x fp8 dots; float16 activations) on the converted weights,
    on the tiles the layer picks here and on the swapped kernel's (its launches watched)."""
    pytest.importorskip("triton")
    from launch_spy import LaunchSpy
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton.experts import TritonExperts
    from moe_registry_kernels.triton.tile_config import config_override

    case, layer = CASES[name], built[name]
    tol = moe_registry.load_registry().scheme(case.scheme).tolerance["float16"]
    swapped: list = []
    monkeypatch.setattr(triton_launch, "_fused_moe_swap_kernel",
                        LaunchSpy(triton_launch._fused_moe_swap_kernel, swapped))
    for m in (1, 8):
        ids, w = _routing(11, m)
        x = _hidden(5, m).to(torch.float16)
        want = _moe64(case, dirs[name], _ours(layer), x.float(), ids, w)
        with config_override(*SWAPPED_TILES) if tiles == "swapped" else contextlib.nullcontext():
            got = TritonExperts(layer.weights, ExpertsConfig()).apply(x, w, ids)
        assert got.dtype == torch.float16 and _rel(got, want) <= tol, f"{name} M={m}: {_rel(got, want):.2e} > {tol}"
    assert len(swapped) == (4 if tiles == "swapped" else 0)


def _moe64_producer(case: Case, d: Path, w: dict[tuple[int, str], torch.Tensor], x: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A float64 MoE done as llm-compressor's block does it: each expert's linears quantise their own
    2-D input their way (``case.linear_act``), each projection with its own static input scale."""
    t = _checkpoint(d)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        own = {r: t.get(f"{LAYER}.{e}.{r}_proj.input_scale") for r in ROLES}
        xe = x[tok].double()
        g = bf16(qdq(case.linear_act, xe, own["gate"]) @ w[(e, "gate")].T)  # its linears output bfloat16
        u = bf16(qdq(case.linear_act, xe, own["up"]) @ w[(e, "up")].T)
        a = qdq(case.linear_act, bf16(bf16(torch.nn.functional.silu(g)) * u), own["down"])
        out.index_add_(0, tok, weights[tok, k].double()[:, None] * bf16(a @ w[(e, "down")].T))
    return out


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.producer_block))
def test_layer_matches_the_producers_moe_block(name: str, built) -> None:
    """llm-compressor's own quantized MoE block (its routing, all four experts, bfloat16). First our
    float64 MoE done the producer's way must reproduce it. Then our layer is held to the block
    within the scheme's tolerance, except FP8_DYNAMIC: its linears quantise a 2-D input with ONE
    scale ('token' keeps dims 0 and 1), the scheme (and vLLM) per token, which moves this layer by
    ~6% here; there the layer is held to the float64 MoE with per-token scales."""
    case, ref, layer = CASES[name], load_file(str(FIXTURES / name / "ref.safetensors")), built[name]
    x, ids, w = ref["hidden_states"].float(), ref["layer.topk_ids"], ref["layer.topk_weights"].float()
    ours = _ours(layer)
    # bfloat16 intermediates flip some fp8 codes of the next quantisation: ~1-2% here; the scheme's
    # own quantisation (one scale per GEMM, per token) lands 4-6% from the block
    assert _rel(_moe64_producer(case, FIXTURES / name, ours, x, ids, w), ref["layer.output"]) < 2.5e-2
    got = layer.kernel(x, w, ids)
    if case.act == "token":
        assert _rel(got, _moe64(case, FIXTURES / name, ours, x, ids, w)) <= 5e-3
    else:
        assert _rel(got, ref["layer.output"]) <= layer.tolerance


def test_dynamic_per_tensor_scale_spans_the_whole_batch(built, dirs) -> None:
    """``quant_method: fp8`` dynamic: one scale per GEMM input over all tokens and experts (vLLM),
    so a token's output depends on the batch; per-expert or per-token scales would not match."""
    layer, case = built["autofp8-dynamic"], CASES["autofp8-dynamic"]
    ids, w = _routing(21)
    x = _hidden(9)
    x[0] *= 20.0  # one loud token sets the batch's scale
    want = _moe64(case, dirs["autofp8-dynamic"], _ours(layer), x, ids, w)
    got = layer.kernel(x, w, ids)
    assert _rel(got, want) <= 5e-3
    per_token = _moe64(CASES["llmc-fp8-dynamic"], dirs["autofp8-dynamic"], _ours(layer), x, ids, w)
    assert _rel(got, per_token) > 4 * _rel(got, want)


def test_dynamic_per_tensor_skips_foreign_pairs_in_triton(built) -> None:
    """Pairs routed to another rank's expert (id -1) leave their intermediate rows unwritten; the
    per-tensor amax must not read them (the reference computes nowhere for them either)."""
    pytest.importorskip("triton")
    from moe_registry_kernels.reference import ReferenceExperts
    from moe_registry_kernels.triton.experts import TritonExperts

    layer = built["autofp8-dynamic"]
    ids, w = _routing(13, 6)
    ids[1, 0] = ids[4, 1] = -1
    x = _hidden(17, 6).to(torch.float16)
    want = ReferenceExperts(layer.weights, ExpertsConfig()).apply(x.float(), w, ids)
    got = TritonExperts(layer.weights, ExpertsConfig()).apply(x, w, ids)
    assert _rel(got, want) <= 2e-2  # float16 intermediates flip a few fp8 codes


class _LoudEmpty:
    """torch for triton_moe, but its empty float tensors hold 1000.0: rows a kernel never writes
    (pairs routed to another rank's expert) are loud, so reading one changes the result."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs) -> torch.Tensor:
        t = torch.empty(*args, **kwargs)
        return t.fill_(1000.0) if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t


@pytest.mark.parametrize(("name", "m", "after"), [
    ("autofp8-dynamic", 1, []), ("autofp8-dynamic", 5, ["align_quant", "from_pieces"]),
    ("llmc-fp8-dynamic", 1, []), ("llmc-fp8-dynamic", 5, ["align_quant", "from_pieces"])])
def test_decode_quantisation_from_the_gemms_equals_the_quantisation_kernels(name: str, m: int, after: list,
                                                                            built, monkeypatch) -> None:
    """Dynamic fp8 at decode: for one token the GEMMs quantise their input themselves (GEMM1 from
    the token's row, GEMM2 from GEMM1's row-amax pieces), so fp8_act launches nothing; for a few,
    alignment and GEMM1's input share a launch and GEMM2's input is quantised from the pieces.
    Bit-equal to the layer that quantises with fp8_act's own passes (an alignment, a quantisation
    of each input), with a foreign pair (id -1) whose unwritten intermediate row and pieces are
    loud."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import fp8_act
    from moe_registry_kernels.triton import layer as triton_layer
    from moe_registry_kernels.triton import plan as triton_plan
    from moe_registry_kernels.triton.experts import TritonExperts

    calls: list[str] = []

    def counted(name: str, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for label, fn in (("align_quant", "align_quant_fp8"), ("from_pieces", "quant_fp8_from_pieces")):
        monkeypatch.setattr(triton_layer, fn, counted(label, getattr(fp8_act, fn)))
    monkeypatch.setattr(triton_plan, "quant_fp8_dynamic", counted("quant", fp8_act.quant_fp8_dynamic))
    for module in (triton_layer, triton_plan):  # the layer's buffers, and the pieces' GEMM1 leaves
        monkeypatch.setattr(module, "torch", _LoudEmpty())
    experts = TritonExperts(built[name].weights, ExpertsConfig())
    ids, w = _routing(31, m)
    ids[m - 1, 1] = -1
    x = _hidden(37, m).to(torch.float16)
    for switch in ("SCALE_IN_GEMM", "AMAX_PIECES"):
        monkeypatch.setattr(triton_plan, switch, False)
    want = experts.apply(x, w, ids)
    assert calls == (["quant", "quant"] if m == 1 else ["align_quant", "quant"])
    calls.clear()
    for switch in ("SCALE_IN_GEMM", "AMAX_PIECES"):
        monkeypatch.setattr(triton_plan, switch, True)
    got = experts.apply(x, w, ids)
    assert calls == after
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launches"])
def test_alignment_and_fp8_quantisation_in_one_launch(mode: str, one_launch: bool, monkeypatch) -> None:
    """align_quant_fp8 (decode: one launch) equals align.align followed by quant_fp8_dynamic,
    bit for bit, with a router weight per row too."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import align as alignment
    from moe_registry_kernels.triton import fp8_act

    if not one_launch:
        monkeypatch.setattr(alignment, "ALIGN_ONE_LAUNCH_MAX", 0)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 700, generator=g) * 3).to(torch.float16)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)]).to(torch.int32)
    for row_scale in (None, torch.rand(6, generator=g) + 0.5):
        got = fp8_act.align_quant_fp8(ids, E, 16, x, mode, row_scale=row_scale)
        want = (*alignment.align(ids, E, 16), *fp8_act.quant_fp8_dynamic(x, mode, row_scale=row_scale))
        used = int(want[2].item())
        assert torch.equal(got[2], want[2]) and torch.equal(got[0][:used], want[0][:used])
        assert torch.equal(got[1][:used // 16], want[1][:used // 16])
        assert torch.equal(got[3].view(torch.uint8), want[3].view(torch.uint8)) and torch.equal(got[4], want[4])


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["tables", "swapped"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_matches_float64_moe_on_gpu(name: str, tiles: str, built, dirs) -> None:
    """The same on the GPU (sm_89+: fp8 tensor-core dots), bfloat16 activations, decode and prefill; on the
    layer's tiles and on the swapped kernel's (Hopper: its own fp8 wgmma)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with fp8 dots (capability >= 8.9)")
    from moe_registry_kernels.triton.experts import TritonExperts
    from moe_registry_kernels.triton.tile_config import config_override

    case, layer = CASES[name], built[name]
    tol = moe_registry.load_registry().scheme(case.scheme).tolerance["bfloat16"]
    experts = TritonExperts(layer.weights.to("cuda"), ExpertsConfig())
    for m in (1, 8, 512):
        ids, w = _routing(23, m)
        x = _hidden(29, m).to(torch.bfloat16)
        want = _moe64(case, dirs[name], _ours(layer), x.float(), ids, w)
        with config_override(*SWAPPED_TILES) if tiles == "swapped" else contextlib.nullcontext():
            got = experts.apply(x.cuda(), w.cuda(), ids.cuda()).cpu()
        assert got.dtype == torch.bfloat16 and _rel(got, want) <= tol, f"{name} M={m}: {_rel(got, want):.2e} > {tol}"


@pytest.mark.parametrize(("mode", "key"), [("fp8_token", "fp8e4m3 scale:float32:token:dynamic"),
                                           ("fp8_tensor", "fp8e4m3 scale:float32:tensor:dynamic")])
@pytest.mark.parametrize("path", ["one-program", "row-amaxes", "atomic-amax"])
def test_triton_fp8_quantisers_are_quant_ref_bit_for_bit(mode: str, key: str, path: str, monkeypatch) -> None:
    """The Triton kernel's per-token / per-tensor fp8 quantisation (interpreter) equals quant_ref's
    codes and scales exactly, with a router weight per row too; fp8_tensor's amax skips the rows
    whose pair routes to another rank's expert (a huge value there changes nothing), in one launch
    (decode), in row programs storing each row's amax, and in row programs with an atomic amax."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import fp8_act
    from moe_registry_kernels.triton.fp8_act import quant_fp8_dynamic

    monkeypatch.setattr(fp8_act, "ONE_PROGRAM_ELEMENTS", 1 << 16 if path == "one-program" else 0)
    monkeypatch.setattr(fp8_act, "ROW_AMAX_MAX_ROWS", 0 if path == "atomic-amax" else 1 << 11)
    monkeypatch.setattr(fp8_act, "ONE_PROGRAM_TILE", 1 << 11)  # several row tiles and column blocks
    from moe_registry_kernels.quant_ref import quantize_activation

    from moe_registry.core.keys import parse_quant_key

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 1300, generator=g) * 3).to(torch.float16)
    factor = torch.rand(5, generator=g) + 0.5
    for rows_scale in (None, factor):
        q, s = quant_fp8_dynamic(x, mode, row_scale=rows_scale)
        src = x.float() if rows_scale is None else x.float() * rows_scale[:, None]
        want = quantize_activation(src, parse_quant_key(key))
        assert torch.equal(q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(s.reshape(-1), want.scale.reshape(-1))
    if mode == "fp8_tensor":  # rows of pairs routed to another rank's expert (ids outside [0, 4)): not in the amax
        loud = x.clone()
        loud[2], loud[4] = 60000.0, -60000.0
        pair_ids = torch.tensor([3, 0, -1, 2, 4], dtype=torch.int32)
        _, s = quant_fp8_dynamic(loud, mode, pair_ids=pair_ids, num_experts=4)
        assert torch.equal(s, quantize_activation(x[[0, 1, 3]].float(), parse_quant_key(key)).scale)


# ------------------------------------------------------------------------------------ bad input


def _copy(tmp_path: Path, src: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    return dest, load_file(str(dest / "model.safetensors"))


@pytest.mark.parametrize("name", ["llmc-fp8", "modelopt-fp8", "autofp8-static"])
def test_missing_input_scale_of_a_static_scheme_is_refused(name: str, dirs, tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, dirs[name])
    gone = f"{LAYER}.2.up_proj.input_scale"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value).startswith(f"{gone}: missing (scheme {CASES[name].scheme} needs ")
    assert "\n" not in str(err.value)


def test_dynamic_scheme_needs_no_input_scale(dirs) -> None:
    assert f"{LAYER}.0.gate_proj.input_scale" not in _checkpoint(dirs["autofp8-dynamic"])
    assert moe_registry.build(dirs["autofp8-dynamic"], platform="cpu", layer=0).weights.w13.input_scale is None


@pytest.mark.parametrize(("name", "tensor"), [("llmc-fp8", "weight_scale"), ("llmc-fp8", "input_scale"),
                                              ("llmc-fp8-dynamic", "weight_scale"),
                                              ("modelopt-fp8", "weight_scale"), ("autofp8-static", "input_scale")])
@pytest.mark.parametrize(("value", "what", "wanted"), [(0.0, "are zero", "expected finite scales > 0"),
                                                      (float("nan"), "NaN", "expected finite"),
                                                      (float("inf"), "infinite", "expected finite")])
def test_bad_scale_is_refused(name: str, tensor: str, value: float, what: str, wanted: str, dirs,
                              tmp_path: Path) -> None:
    """Zero is refused by the converter, NaN and inf already when the checkpoint is read (one line each)."""
    dest, tensors = _copy(tmp_path, dirs[name])
    key = f"{LAYER}.1.down_proj.{tensor}"
    bad = tensors[key].clone()
    bad.view(-1)[-1] = value
    save_file({**tensors, key: bad}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    msg = str(err.value)
    assert msg.startswith(f"{key}: ") and what in msg and wanted in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["llmc-fp8-dynamic", "modelopt-fp8", "autofp8-dynamic"])
def test_weight_that_is_not_fp8_is_refused(name: str, dirs, tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, dirs[name])
    key = f"{LAYER}.3.gate_proj.weight"
    save_file({**tensors, key: tensors[key].to(torch.bfloat16)}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    msg = str(err.value)
    assert msg.startswith(f"{key}: ") and "bfloat16" in msg and "float8_e4m3fn" in msg and "\n" not in msg


# ------------------------------------------------------------------ transformers' own FP8 (FineGrainedFP8Config)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformers_writes_its_scales_stacked_over_experts(name: str) -> None:
    """FP8Experts' scales stacked over experts, not per expert (the stacked tensor word reads them; that ours then
    equal transformers' Fp8Dequantize for every expert: tests/test_producers.py)."""
    checkpoint = _checkpoint(FIXTURES / name)
    assert f"{LAYER}.gate_up_proj_scale_inv" in checkpoint and f"{LAYER}.0.gate_proj.weight_scale_inv" not in checkpoint


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_layer_matches_transformers_moe_block(name: str, built) -> None:
    """transformers' own Qwen3-MoE block (bfloat16, its routing) on its dequantised weights, activations not
    quantised (its fp8 forward needs the Hub's Triton kernel and a GPU). The float64 MoE without activation
    quantisation reproduces it to bfloat16 rounding; our layer, which quantises activations as the scheme
    says, stays within the scheme's tolerance of it and within 5e-3 of the float64 MoE that quantises them."""
    case, ref, layer = CASES[name], load_file(str(FIXTURES / name / "ref.safetensors")), built[name]
    x, ids, w = ref["hidden_states"].float(), ref["layer.topk_ids"], ref["layer.topk_weights"].float()
    ours = _ours(layer)
    plain = Case(case.scheme, case.weight, case.activation, act=None)  # type: ignore[arg-type]
    assert _rel(_moe64(plain, FIXTURES / name, ours, x, ids, w), ref["layer.output"]) < 1e-2
    got = layer.kernel(x, w, ids)
    assert _rel(got, ref["layer.output"]) <= layer.tolerance
    assert _rel(got, _moe64(case, FIXTURES / name, ours, x, ids, w)) <= 5e-3


def _with_quantization_config(tmp_path: Path, **changes: object) -> Path:
    dest = tmp_path / "m"
    shutil.copytree(FIXTURES / "transformers-fp8-dynamic", dest)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("changes", "scheme"), [
    ({}, "fp8-w8a8-dynamic"),                                # weight_block_size: null, as written
    ({"activation_scheme": "static"}, "fp8-w8a8-static"),
    ({"weight_block_size": [128, 128]}, "fp8-block128"),
    ({"activation_scheme": "static", "weight_block_size": [128, 128]}, None),  # no static block-128 scheme
    ({"expert_dtype": "fp4"}, None),                         # DeepSeek-V4's FP4-packed experts: not these schemes
    ({"weight_block_size": [64, 64]}, None),
])
def test_transformers_config_detection(changes: dict, scheme: str | None, tmp_path: Path, capsys) -> None:
    dest = _with_quantization_config(tmp_path, **changes)
    code = main(["explain", str(dest), "--platform", "cuda:9.0", "--dtype", "bfloat16", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)
    if scheme is None:
        assert code == 1 and report["report"]["scheme"] is None
        assert "no scheme matches this config" in report["error"]
    else:
        assert code == 0 and report["scheme"]["name"] == scheme


def test_transformers_static_reads_its_stacked_activation_scales(built, dirs) -> None:
    """One input scale per GEMM: the max of transformers' per-expert activation scales of that fused part."""
    t = _checkpoint(dirs["transformers-fp8-static"])
    weights = built["transformers-fp8-static"].weights
    assert torch.equal(weights.w13.input_scale, t[f"{LAYER}.gate_up_proj_activation_scale"].max().reshape(1))
    assert torch.equal(weights.w2.input_scale, t[f"{LAYER}.down_proj_activation_scale"].max().reshape(1))


@pytest.mark.parametrize("gone", ["down_proj_activation_scale", "gate_up_proj_activation_scale"])
def test_transformers_static_missing_activation_scale_is_refused(gone: str, dirs, tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, dirs["transformers-fp8-static"])
    save_file({k: v for k, v in tensors.items() if k != f"{LAYER}.{gone}"}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    msg = str(err.value)
    assert msg.startswith(f"{LAYER}.{gone}: missing (scheme fp8-w8a8-static needs ") and "\n" not in msg


@pytest.mark.parametrize(("name", "value", "prefix", "what"), [
    *[(name, 0.0, "[1]: ", "are zero") for name in TRANSFORMERS if not name.endswith("ue8m0")],  # e8m0 has no 0
    *[(name, float("nan"), ": ", "NaN") for name in TRANSFORMERS]])
def test_transformers_bad_stacked_scale_is_refused(name: str, value: float, prefix: str, what: str,
                                                   tmp_path: Path) -> None:
    """Expert 1's down scale: zero is refused by the converter naming the stacked tensor's slice, NaN (an e8m0
    byte 0xFF too) when the tensor is read, each in one line."""
    dest, tensors = _copy(tmp_path, FIXTURES / name)
    key = f"{LAYER}.down_proj_scale_inv"
    bad = tensors[key].clone()
    bad[1] = value
    save_file({**tensors, key: bad}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    msg = str(err.value)
    assert msg.startswith(key + prefix) and what in msg and "\n" not in msg


@pytest.mark.parametrize(("name", "shape", "wanted"), [
    ("transformers-fp8-dynamic", [E, 1], "expected [4, 1, 1]"),
    ("transformers-fp8-block", [E, 3, 1], "expected [4, 2, 1]"),
])
def test_transformers_stacked_scale_of_wrong_shape_is_refused(name: str, shape: list[int], wanted: str,
                                                              tmp_path: Path) -> None:
    dest, tensors = _copy(tmp_path, FIXTURES / name)
    key = f"{LAYER}.gate_up_proj_scale_inv"
    save_file({**tensors, key: torch.ones(shape)}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    msg = str(err.value)
    assert msg.startswith(f"{key}: shape {shape}; {wanted}") and "\n" not in msg


def test_transformers_scale_both_per_expert_and_stacked_is_refused(tmp_path: Path) -> None:
    """A per-expert weight_scale beside the stacked one: one line naming both, not 'unexpected' beside
    'expected'."""
    dest, tensors = _copy(tmp_path, FIXTURES / "transformers-fp8-dynamic")
    extra = f"{LAYER}.0.gate_proj.weight_scale"
    save_file({**tensors, extra: torch.ones(())}, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(dest, platform="cpu", layer=0)
    assert str(err.value) == (f"{extra}: per expert, but this layer also holds it stacked over its experts as "
                              f"{LAYER}.gate_up_proj_scale_inv; wanted one of the two")


def test_stacked_shape_whose_gate_share_cannot_be_computed_is_one_line(tmp_path: Path) -> None:
    """A user spec whose stacked shape fits gate_up (out = 2I = 256) but not one projection (out = I = 128):
    one line naming the tensor, not a traceback from the shape expression."""
    spec = tmp_path / "specs"
    spec.mkdir()
    shipped = (Path(__file__).parent.parent / "specs" / "schemes" / "fp8-w8a8-dynamic.yaml").read_text()
    stacked = 'stacked: {name: "{part}_proj_scale_inv", shape: [1, 1]}'
    assert stacked in shipped
    (spec / "fp8-w8a8-dynamic.yaml").write_text(shipped.replace(
        stacked, 'stacked: {name: "{part}_proj_scale_inv", shape: ["out / 256", 1]}'))
    with pytest.raises(CheckpointError) as err:
        moe_registry.build(FIXTURES / "transformers-fp8-dynamic", platform="cpu", layer=0, spec_dirs=[spec])
    msg = str(err.value)
    assert msg.startswith(f"{LAYER}.gate_up_proj_scale_inv: gate's share of its shape ['out / 256', 1] cannot be "
                          "computed for intermediate size 128: ") and "\n" not in msg


def test_transformers_stacked_scales_for_an_expert_parallel_rank(dirs) -> None:
    """A rank reading experts (3, 1) gets exactly their slices of the stacked scales, and every expert's
    activation scales as layer-wide values (the layer's one input scale per GEMM is the max over all)."""
    from moe_registry.checkpoint.read import read_layer
    from moe_registry.checkpoint.tensor_index import open_checkpoint
    from moe_registry.formats.stacked import experts_of, layer_wide_of
    from moe_registry.oracle.select import select
    from moe_registry.situation.config import read_model_config
    from moe_registry.situation.describe import Flags, situation_for_model

    d = dirs["transformers-fp8-static"]
    registry = moe_registry.load_registry()
    model = read_model_config(d, registry)
    situation = situation_for_model(model, registry, Flags(platform="cpu", dtype="float32"))
    report = select(registry, situation)
    assert report.scheme is not None and situation.layer is not None and situation.runtime.shape is not None
    args = (open_checkpoint(d), registry.families[model.family].spec, situation.layer,
            registry.scheme(report.scheme.scheme), report.scheme.bindings, situation.runtime.shape)
    whole, part = experts_of(read_layer(*args)), read_layer(*args, experts=(3, 1))
    for got, e in zip(experts_of(part), (3, 1), strict=True):
        assert {r: set(t) for r, t in got.items()} == {r: {"weight", "weight_scale", "input_scale"} for r in ROLES}
        for role in ROLES:
            for t in got[role]:
                assert torch.equal(got[role][t], whole[e][role][t]), (e, role, t)
    stacked = _checkpoint(d)
    assert len(layer_wide_of(part)) == E
    for e, wide in enumerate(layer_wide_of(part)):
        assert torch.equal(wide["up"]["input_scale"], stacked[f"{LAYER}.gate_up_proj_activation_scale"][e])
        assert torch.equal(wide["down"]["input_scale"], stacked[f"{LAYER}.down_proj_activation_scale"][e])
