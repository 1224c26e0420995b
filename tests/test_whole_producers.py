"""Whole models quantized by their producers (tests/fixtures/whole/<name>/checkpoint/, written by
tools/make_whole_fixtures.py: llm-compressor's presets, transformers' FineGrainedFP8, gpt-oss MXFP4, GPTQModel,
AutoAWQ, AMD Quark, NVIDIA ModelOpt FP8 and NVFP4) through
``load_model`` on the CPU, against ``ref.safetensors`` beside each: transformers' own model class in float32 holding
the PRODUCER'S OWN dequantised weights, its logits along its greedy 16-token continuation.

Tolerances (relative error of the logits, ‖ours − reference‖ / ‖reference‖), one per fixture in CASES:

- weight-only schemes: both sides run the same dequantised weights in float32 and differ in summation order and in
  how the kernel holds the weights; a misread scale, group or code is O(1e-2) or more through two layers.
- schemes that quantize activations (W8A8 int8, FP8, NVFP4, MXFP4 with A): the reference holds the producer's
  dequantised weights only (its forward with activation quantisation needs a GPU for FP8, and is bfloat16 for
  llm-compressor), while our experts quantize their inputs as the scheme says; the bound is that quantisation's
  error, measured, with headroom; far under the error of losing the weights' quantisation or of a wrong scale.

A token whose routing in a later layer is at a near tie (the second and third router logits within 1e-2) may take
another expert under activation quantisation and so differ by O(0.1-1) at that position alone; where a fixture has
such positions the whole-sequence tolerance is widened for them and the median over positions (``typical``) is held
to the quantisation error instead.

Greedy generation of 16 tokens gives the reference's tokens; where one differs, the reference's two best logits at
that step must be within the tolerance of each other (a near tie, not a wrong model).

Where transformers reads the format itself on the CPU, its own model is compared with the same reference; where it
cannot, or reads it wrongly, the test asserts what it does, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")  # the dev extra installs it; the core does not need it

from moe_registry.whole.load import load_model  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "whole"
PROMPT_TOKENS = 8


@dataclass(frozen=True)
class Case:
    """One producer fixture: its dir under tests/fixtures/whole and the logits tolerance of its scheme."""

    name: str
    tol: float
    scheme: str  # the scheme the oracle must pick for every MoE layer
    typical: float | None = None  # bound on the median per-position error, where near ties widen ``tol``


CASES = [  # tol: the measured relative error (comment) with headroom (the why: the module docstring)
    Case("ct-w4a16", 1e-2, "compressed-tensors-w4a16"),  # 3.1e-3: the reference's code x scale rounded to bf16
    # 1.6e-2: per-token int8 inputs of the experts and the attention linears (torch-cpu-dot8)
    Case("ct-w8a8-int8", 3e-2, "compressed-tensors-w8a8-int8"),
    # 1.56e-1: per-token fp8 inputs of the experts and, as the checkpoint stores them, of the attention linears
    # (torch-cpu-dot8's one-projection form; transformers' own compressed-tensors forward does the same: 1.50e-1,
    # 4.4e-2 from ours); median 6.0e-2; layer 0 routes position 14 at a near tie (second and third router logits
    # 6e-4 apart), which 16-bit activations tip to the other expert (0.60 there; position 19: 0.35)
    Case("ct-fp8-dynamic", 2e-1, "compressed-tensors-w8a8-fp8-dynamic", typical=8e-2),
    Case("ct-nvfp4", 1.5e-2, "compressed-tensors-nvfp4"),  # 4.4e-3: code x scale x global scale rounded to bf16
    Case("ct-mxfp4", 1.5e-3, "compressed-tensors-mxfp4"),  # 3.5e-4
    # 9.4e-2: fp8 inputs in groups of 128 in the experts and the attention linears (torch-cpu-dot8's
    # one-projection form); median 8.5e-2, at most 0.15 at a position
    Case("transformers-fp8-block", 1.3e-1, "fp8-block128", typical=1.1e-1),
    Case("gpt-oss-mxfp4", 3e-3, "mxfp4"),  # 7.5e-4
    Case("gptqmodel-w4-sym", 3e-3, "gptq-w4a16"),  # 6.1e-4: GPTQModel's float16 dequantisation
    Case("autoawq-w4-gemm", 3e-3, "awq-w4a16"),  # 6.3e-4: AutoAWQ's float16 dequantisation
    # 6.2e-2: per-token int8 inputs of the experts and the attention linears (median 1.5e-2); layer 1 routes
    # positions 4 and 15 at near ties (second and third router logits 5e-3 and 2e-4 apart), where one expert changes
    Case("quark-w8a8-int8", 1e-1, "quark-w8a8-int8", typical=2e-2),
    # 5.1e-2: static per-tensor fp8 inputs, one scale per GEMM (median 3.4e-2); position 4's near tie: 0.16
    Case("modelopt-fp8", 8e-2, "modelopt-fp8", typical=5e-2),
    Case("modelopt-nvfp4", 1.5e-3, "modelopt-nvfp4"),  # 3.4e-4: runs weight-only (the scheme's emulation)
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ref(case: Case) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / case.name / "ref.safetensors"))


def _assert_matches_reference(model: torch.nn.Module, ref: dict[str, torch.Tensor], tol: float,
                              typical: float | None = None, device: str = "cpu") -> None:
    """Logits along the reference's greedy sequence within ``tol`` (their median over positions within
    ``typical``, where given); greedy tokens equal, or a differing token at a near tie of the reference's two best
    logits."""
    with torch.no_grad():
        logits = model(ref["greedy"].to(device)).logits.float().cpu()
    assert _rel(logits, ref["logits"]) <= tol, _rel(logits, ref["logits"])
    if typical is not None:
        per_position = (logits - ref["logits"]).double().norm(dim=-1) / ref["logits"].double().norm(dim=-1)
        assert float(per_position.median()) <= typical, per_position.tolist()
    got = model.generate(ref["input_ids"].to(device), max_new_tokens=ref["greedy"].shape[1] - PROMPT_TOKENS,
                         do_sample=False, pad_token_id=0).cpu()
    want = ref["greedy"]
    if torch.equal(got, want):
        return
    first = int((got[0, :want.shape[1]] != want[0, :got.shape[1]]).nonzero()[0])
    step = ref["logits"][0, first - 1]
    top2 = step.topk(2).values
    assert float(top2[0] - top2[1]) <= tol * float(step.norm()), (first, got.tolist(), want.tolist())


@pytest.fixture(scope="module")
def ours():  # type: ignore[no-untyped-def]
    """Each fixture loaded once (float32, the oracle's CPU kernel per layer)."""
    loaded: dict[str, torch.nn.Module] = {}

    def get(case: Case) -> torch.nn.Module:
        if case.name not in loaded:
            loaded[case.name] = load_model(FIXTURES / case.name / "checkpoint", dtype="float32")
        return loaded[case.name]
    return get


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_load_model_matches_the_producers_dequantised_model(case: Case, ours) -> None:  # type: ignore[no-untyped-def]
    model = ours(case)
    report = model.moe_registry_report
    assert [p.scheme for p in report.layers] == [case.scheme] * len(report.layers), report.layers
    assert len(report.layers) >= 2
    _assert_matches_reference(model, _ref(case), case.tol, case.typical)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_load_model_on_cuda_matches_the_producers_dequantised_model(case: Case) -> None:
    """The same files on the GPU in float16, each MoE layer on the kernel the oracle picks there (a Triton kernel
    where one takes the scheme): float16 activations add ~1e-3 a layer to the scheme's error, so the bound is the
    CPU's or 2e-2, whichever is larger."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model(FIXTURES / case.name / "checkpoint", device="cuda", dtype="float16")
    report = model.moe_registry_report
    assert [p.scheme for p in report.layers] == [case.scheme] * len(report.layers), report.layers
    assert "torch-reference" not in {p.kernel for p in report.layers}, report.layers
    typical = None if case.typical is None else max(case.typical, 2e-2)
    _assert_matches_reference(model, _ref(case), max(case.tol, 2e-2), typical, device="cuda")


# ------------------------------------------------------------ transformers' own reading of the same files
#
# transformers 5 loads FineGrainedFP8, MXFP4 and compressed-tensors checkpoints itself (accelerate and
# compressed-tensors installed, as the dev extra installs them). Each test below loads the fixture with
# ``from_pretrained`` on the CPU in float32 and holds what transformers makes of it to the same reference;
# where transformers is wrong, the test asserts the discrepancy exactly as it is.

CASE = {c.name: c for c in CASES}
EXPERTS = "model.layers.0.mlp.experts"
INTER = 64


def _transformers_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name / "checkpoint", dtype=dtype,
                                                             device_map="cpu").eval()


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def _checkpoint(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "checkpoint" / "model.safetensors"))


def test_transformers_reads_gpt_oss_mxfp4_as_load_model_does(ours) -> None:  # type: ignore[no-untyped-def]
    """Mxfp4 on a CPU: transformers dequantises the experts at load (no triton_kernels); its logits and ours agree
    with each other and with the reference."""
    case, ref = CASE["gpt-oss-mxfp4"], _ref(CASE["gpt-oss-mxfp4"])
    theirs = _transformers_model(case.name)
    _assert_matches_reference(theirs, ref, case.tol)
    assert _rel(_logits(ours(case), ref["greedy"]), _logits(theirs, ref["greedy"])) <= 1e-4


def test_transformers_fine_grained_fp8_cannot_run_on_the_cpu() -> None:
    """FineGrainedFP8 block-128 on a CPU: transformers loads it, but its forward hands the fp8 codes to a matmul
    that takes only 16/32-bit floats; load_model runs the same file (the parametrised test above)."""
    ref = _ref(CASE["transformers-fp8-block"])
    theirs = _transformers_model("transformers-fp8-block")
    with pytest.raises(RuntimeError, match="Expected mat_a to be Float32, BFloat16 or Float16 matrix, got "
                                           "Float8_e4m3fn"):
        _logits(theirs, ref["input_ids"])


def test_transformers_decompresses_ct_w4a16_ten_times_less_accurately(ours) -> None:  # type: ignore[no-untyped-def]
    """compressed-tensors W4A16: transformers decompresses every linear at load; its greedy tokens are the
    reference's, but its logits are 3.0e-2 from it where ours are 3.1e-3 (its expert weights are 1.5e-3 from our
    dequantisation, which is the producer's)."""
    pytest.importorskip("compressed_tensors")
    case, ref = CASE["ct-w4a16"], _ref(CASE["ct-w4a16"])
    theirs = _transformers_model(case.name)
    _assert_matches_reference(theirs, ref, 5e-2)
    err_theirs = _rel(_logits(theirs, ref["greedy"]), ref["logits"])
    assert err_theirs >= 5 * _rel(_logits(ours(case), ref["greedy"]), ref["logits"]), err_theirs


def test_transformers_refuses_ct_w8a8_int8() -> None:
    """compressed-tensors W8A8 int8 (llm-compressor's preset): transformers' weight conversion fails at load."""
    pytest.importorskip("compressed_tensors")
    with pytest.raises(RuntimeError, match="We encountered some issues during automatic conversion of the weights"):
        _transformers_model("ct-w8a8-int8")


def test_transformers_ct_nvfp4_experts_lose_their_global_scale(ours) -> None:  # type: ignore[no-untyped-def]
    """compressed-tensors NVFP4: transformers' fused experts hold code x scale without dividing by the
    projection's weight_global_scale, so every expert weight is that global scale (4736 here) times too large and
    its logits are garbage (relative error > 1); load_model's experts hold the producer's values."""
    pytest.importorskip("compressed_tensors")
    from moe_registry_kernels.reference import dense_experts

    import moe_registry

    name = "ct-nvfp4"
    checkpoint, theirs = _checkpoint(name), _transformers_model(name, torch.bfloat16)
    dense = dense_experts(moe_registry.build(FIXTURES / name / "checkpoint", layer=0, platform="cpu",
                                             dtype="float32", kernel="torch-reference").weights, torch.float32)
    gate_up = theirs.get_submodule(EXPERTS).gate_up_proj.detach().float()
    for e in range(gate_up.shape[0]):
        for rows, role in ((slice(0, INTER), "gate"), (slice(INTER, 2 * INTER), "up")):
            global_scale = float(checkpoint[f"{EXPERTS}.{e}.{role}_proj.weight_global_scale"])
            assert _rel(gate_up[e, rows], dense.w13[e, rows] * global_scale) <= 1e-2, (e, role)
    ref = _ref(CASE[name])
    assert _rel(_logits(theirs, ref["greedy"]), ref["logits"]) > 1
    assert _rel(_logits(ours(CASE[name]), ref["greedy"]), ref["logits"]) <= CASE[name].tol


def test_transformers_ct_mxfp4_fails_in_float32_and_quantizes_activations_in_bfloat16() -> None:
    """compressed-tensors MXFP4: in float32 transformers' forward mixes float32 inputs with bfloat16 weights and
    fails; in bfloat16 its expert weights are ours exactly and it runs the checkpoint's MXFP4 activation
    quantisation too (W4A4: 0.26 from the weight-only reference; load_model runs weight-only and says so)."""
    pytest.importorskip("compressed_tensors")
    ref = _ref(CASE["ct-mxfp4"])
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"):
        _logits(_transformers_model("ct-mxfp4"), ref["input_ids"])
    assert 0.1 <= _rel(_logits(_transformers_model("ct-mxfp4", torch.bfloat16), ref["greedy"]), ref["logits"]) <= 0.4


def test_transformers_refuses_modelopt_nvfp4() -> None:
    """transformers 5 has no ModelOpt quantizer: ModelOpt's packed NVFP4 weights (two codes a byte) do not fit
    its float linears, and from_pretrained refuses the file; load_model runs it (the parametrised test above)."""
    with pytest.raises(RuntimeError, match="You set `ignore_mismatched_sizes` to `False`, thus raising an error"):
        _transformers_model("modelopt-nvfp4")


@pytest.mark.parametrize("name", ["modelopt-fp8", "ct-fp8-dynamic"])
def test_transformers_fp8_linears_hold_the_codes(name: str, ours) -> None:  # type: ignore[no-untyped-def]
    """transformers 5 has no ModelOpt quantizer: it loads ModelOpt FP8 codes as the float weights themselves, the
    weight_scale dropped as an unexpected key, so attention and experts are the codes (~1/scale times too large)
    and its logits are garbage. compressed-tensors FP8 dynamic: its attention linears hold the codes beside a
    weight_scale that its compressed forward applies, with fp8 activations in attention too, as load_model runs
    them (torch-cpu-dot8's one-projection form): the two models are 4.4e-2 apart, each 1.5e-1 from the
    weight-only reference."""
    if name.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    checkpoint, theirs = _checkpoint(name), _transformers_model(name)
    q_proj = "model.layers.0.self_attn.q_proj"
    assert torch.equal(theirs.get_submodule(q_proj).weight.float(), checkpoint[f"{q_proj}.weight"].float())
    ref = _ref(CASE[name])
    err = _rel(_logits(theirs, ref["greedy"]), ref["logits"])
    if name == "modelopt-fp8":
        codes = torch.cat([checkpoint[f"{EXPERTS}.0.{r}_proj.weight"].float() for r in ("gate", "up")])
        assert torch.equal(theirs.get_submodule(EXPERTS).gate_up_proj[0].float(), codes)
        assert err > 1, err
    else:
        assert isinstance(theirs.get_submodule(q_proj).weight_scale, torch.Tensor) and err <= 2e-1, err
        assert _rel(_logits(ours(CASE[name]), ref["greedy"]), _logits(theirs, ref["greedy"])) <= 6e-2


DOT8_WEIGHT_ONLY = ["gptqmodel-w4-sym", "autoawq-w4-gemm", "ct-w4a16", "ct-nvfp4", "modelopt-nvfp4", "ct-mxfp4"]


@pytest.mark.parametrize("name", DOT8_WEIGHT_ONLY)
def test_producers_weight_only_models_on_dot8_run_their_attention_packed(name: str) -> None:
    """The producers' 4-bit whole models with torch-cpu-dot8 asked for: their 8 quantized attention linears run
    packed on its one-projection form (int8 activations per 32 columns, as its experts), and the logits stay
    within the kernel's declared error of the reference: median over positions 2e-2 (measured 1.2e-2 to 1.4e-2),
    whole sequence 4e-2 (ct-w4a16 3.2e-2: one position at 0.14, a near tie)."""
    model = load_model(FIXTURES / name / "checkpoint", dtype="float32", kernel="torch-cpu-dot8")
    (packed,) = [t for t in model.moe_registry_report.non_expert if t.how.startswith("run packed on torch-cpu-dot8")]
    assert len(packed.names) == 8 and "activations quantised to int8 scale:float32:group(32):dynamic" in packed.how
    ref = _ref(CASE[name])
    with torch.no_grad():
        logits = model(ref["greedy"]).logits.float()
    per_position = (logits - ref["logits"]).double().norm(dim=-1) / ref["logits"].double().norm(dim=-1)
    assert float(per_position.median()) <= 2e-2, per_position.tolist()
    assert _rel(logits, ref["logits"]) <= 4e-2
