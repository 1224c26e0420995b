"""No silent downgrade: where what runs differs from what the checkpoint or the user asked for, explain and
run say so, in text and as structured ``downgrades`` in --json, derived from spec words (a scheme's or a key
pattern's ``emulation``, a key pattern's ``compute``, a kernel's ``slow_path``), never from names."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moe_registry.cli import main as cli
from moe_registry.spec.validation import SpecErrors, validate_paths

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
GPTQ8_ASYM = FIXTURES / "gptqmodel" / "qwen3-gptq-w8-asym" / "checkpoint"
GPTQ4_ASYM = FIXTURES / "gptqmodel" / "qwen3-gptq-w4-asym" / "checkpoint"
MXFP8 = FIXTURES / "modelopt" / "qwen3-mxfp8"
NVFP4 = FIXTURES / "fp4" / "modelopt-qwen3-nvfp4"
FP8_STATIC = FIXTURES / "fp8" / "modelopt-fp8"


def explain(capsys, path: Path, *flags: str) -> tuple[dict, str]:
    """explain's --json and its text for the same flags."""
    assert cli.main(["explain", str(path), *flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert cli.main(["explain", str(path), *flags]) == 0
    return data, " ".join(capsys.readouterr().out.split())


def kinds(data: dict) -> dict[str, dict]:
    return {d["kind"]: d for d in data["downgrades"]}


def test_a_layer_left_on_the_reference_on_a_gpu_is_called_the_slow_path_with_why(capsys) -> None:
    """GPTQ 8-bit asymmetric below the Triton kernels' capability: the reference runs, and the note names
    each faster kernel's reason."""
    data, text = explain(capsys, GPTQ8_ASYM, "--platform", "cuda:7.5")
    assert data["chosen_kernel"] == "torch-reference"
    slow = kinds(data)["slow-path"]
    assert slow["runs"] == "torch-reference" and "gptq-w8a16-asym on cuda:7.5" in slow["asked"]
    assert "triton-fused-moe: cuda capability 7.5; kernel wants cuda >=8.0" in slow["why"]
    assert "torch-cpu-native: platform cuda; kernel runs on cpu" in slow["why"]
    assert "slow path torch-reference is the slow path: it dequantises every expert to float32" in text
    assert slow["message"] in text


def test_gptq_8bit_asymmetric_runs_on_triton_on_every_cuda_platform(capsys) -> None:
    for platform in ("cuda:8.0", "cuda:9.0"):
        data, text = explain(capsys, GPTQ8_ASYM, "--platform", platform)
        assert data["chosen_kernel"] == "triton-fused-moe", platform
        assert data["downgrades"] == [] and "slow path" not in text


def test_the_user_who_pins_the_reference_gets_no_slow_path_note(capsys) -> None:
    data, _ = explain(capsys, GPTQ8_ASYM, "--platform", "cuda:7.5", "--kernel", "torch-reference")
    assert data["chosen_kernel"] == "torch-reference" and data["downgrades"] == []


def test_an_eligible_faster_kernel_later_in_the_order_is_named_with_the_flag_that_runs_it(capsys, tmp_path) -> None:
    """MXFP8 on a CPU without a compiler: the reference comes before torch-cpu-packed in the scheme's order."""
    from moe_registry.oracle.select import select
    from moe_registry.situation.describe import Flags, situation_for
    from moe_registry.situation.runtime import Environment
    from moe_registry.spec.loader import load_registry

    registry = load_registry()
    situation = situation_for(MXFP8, registry, Flags(platform="cpu"))
    no_compiler = Environment(installed=frozenset({"torch"}), commands=frozenset())
    report = select(registry, replace(situation, runtime=replace(situation.runtime, environment=no_compiler)))
    assert report.chosen == "torch-reference"
    slow = next(d for d in report.downgrades if d.kind.value == "slow-path")
    assert "torch-cpu-native: needs c++, ninja on PATH: not found" in slow.why
    assert "torch-cpu-packed: eligible, after torch-reference in the scheme's order (--prefer torch-cpu-packed" \
        in slow.why


def test_fp8_on_ampere_says_what_runs(capsys) -> None:
    """Every FP8 scheme on cuda:8.0 either runs weight-only on the Triton kernel (the activation note) or on
    the reference (the slow-path note): never silently."""
    data, text = explain(capsys, FP8_STATIC, "--platform", "cuda:8.0")
    notes = kinds(data)
    if data["chosen_kernel"] == "triton-fused-moe":
        act = notes["activation"]
        assert act["asked"] == "fp8e4m3 scale:float32:tensor:static" and act["runs"] == "unquantized"
        assert "triton-fused-moe runs them in the 16-bit activation dtype (weight-only) on cuda:8.0" in text
    else:
        assert "triton-fused-moe: cuda capability 8.0; these keys run on cuda >=8.9" in notes["slow-path"]["why"]


@pytest.mark.parametrize("path,asked", [
    (MXFP8, "fp8e4m3 scale:e8m0:group(32):dynamic"),
    (NVFP4, "e2m1 scale:fp8e4m3:group(16):dynamic scale2:float32:tensor:static"),
])
def test_declared_activation_quantisation_that_does_not_run_is_said_alike(capsys, path: Path, asked: str) -> None:
    """ModelOpt MXFP8 and NVFP4 both declare quantised activations and both run 16-bit ones: one note each,
    in the same words and the same structure."""
    data, text = explain(capsys, path, "--platform", "cuda:9.0")
    act = kinds(data)["activation"]
    assert (act["asked"], act["runs"]) == (asked, "unquantized")
    assert act["why"] and act["message"] == data["scheme"]["emulation"]
    assert f"emulation the checkpoint's activations are {asked}; they run in the 16-bit activation dtype " \
           "(weight-only emulation)" in text


def test_float16_on_the_cpu_int4_path_runs_as_asked_and_the_packed_op_says_what_it_computes_in(capsys) -> None:
    """float16 and float32 4-bit layers go to the kernel that computes them as asked (torch-cpu-dot8, first in the
    scheme's order, declares an error beyond the scheme's tolerance for them, and the packed kernel computes them
    in bfloat16: both passed over, the first said); --prefer torch-cpu-packed runs it, with the compute-dtype
    note."""
    for dtype in ("float16", "float32"):
        data, text = explain(capsys, GPTQ4_ASYM, "--platform", "cpu", "--dtype", dtype)
        assert (data["chosen_kernel"], data["downgrades"]) == ("torch-cpu-native", [])
        assert data["notes"] == [f"torch-cpu-dot8 passed over: its numbers for {dtype} (emulation; declared error "
                                 "up to 0.02) exceed scheme gptq-w4a16-asym's tolerance 0.01; torch-cpu-native "
                                 "computes it as asked (--prefer torch-cpu-dot8 runs it)"]
        data, text = explain(capsys, GPTQ4_ASYM, "--platform", "cpu", "--dtype", dtype, "--prefer", "torch-cpu-packed")
        note = kinds(data)["compute-dtype"]
        assert (data["chosen_kernel"], note["asked"], note["runs"]) == ("torch-cpu-packed", dtype, "bfloat16")
        assert f"compute {dtype} asked; torch-cpu-packed computes these weights' GEMMs in bfloat16" in text
    data, _ = explain(capsys, GPTQ4_ASYM, "--platform", "cpu", "--dtype", "bfloat16", "--prefer", "torch-cpu-packed")
    assert (data["chosen_kernel"], data["downgrades"]) == ("torch-cpu-packed", [])


def test_run_prints_the_notes_in_text_and_json(capsys, example, tmp_path) -> None:
    """An unquantized layer on a CPU whose hidden size torch-cpu-grouped (overridden by a user spec) does not
    take runs on the reference: run says so, as explain does."""
    path = str(example("mixtral-bf16"))
    spec = (ROOT / "specs" / "kernels" / "torch-cpu-grouped.yaml").read_text()
    narrowed = spec.replace("hidden: {multiple_of: 8}", "hidden: {multiple_of: 8, min: 4096}")
    assert narrowed != spec
    (tmp_path / "torch-cpu-grouped.yaml").write_text(narrowed)
    flags = ["--platform", "cpu", "--tokens", "2", "--max-tokens", "2", "--repeat", "1", "--threads", "1",
             "--spec-dir", str(tmp_path)]
    assert cli.main(["run", path, *flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    slow = kinds(data["report"])["slow-path"]
    assert slow["runs"] == "torch-reference"
    assert "torch-cpu-grouped: hidden = 256; kernel wants at least 4096" in slow["why"]
    assert cli.main(["run", path, *flags]) == 0
    assert slow["message"] in " ".join(capsys.readouterr().out.split())


def _user_kernel(tmp_path: Path, extra: str) -> Path:
    """A user spec dir whose kernel takes AWQ weights on a CPU with ``extra`` in its key pattern."""
    (tmp_path / "kernels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels" / "my-cpu.yaml").write_text(
        "kernel: my-cpu\nsummary: a user kernel\nimpl: moe_registry_kernels.reference:ReferenceExperts\n"
        "platforms: [{device: cpu}]\ndtypes: [float32, bfloat16, float16]\n"
        "keys:\n  - weight: \"uint4 scale:float16:group(*):static zp:group\"\n    activation: unquantized\n"
        + extra + "activations: [silu]\nfeatures: [zero_point, act_order]\n")
    (tmp_path / "schemes").mkdir(exist_ok=True)
    scheme = (ROOT / "specs" / "schemes" / "gptq-w4a16-asym.yaml").read_text()
    line = next(x for x in scheme.splitlines() if x.startswith("kernels:"))
    (tmp_path / "schemes" / "gptq-w4a16-asym.yaml").write_text(scheme.replace(line, "kernels: [my-cpu]"))
    return tmp_path


def test_the_notes_come_from_spec_words_of_any_kernel(capsys, tmp_path) -> None:
    """A user kernel that writes compute and emulation words gets the notes: the oracle reads words, not names."""
    user = _user_kernel(tmp_path, "    compute: {dtypes: {float32: float16}, reason: my op is half precision}\n"
                                  "    emulation: {activation: \"int8 scale:float32:token:dynamic\", reason: mine}\n")
    data, text = explain(capsys, GPTQ4_ASYM, "--platform", "cpu", "--dtype", "float32", "--spec-dir", str(user))
    notes = kinds(data)
    assert (notes["compute-dtype"]["asked"], notes["compute-dtype"]["runs"]) == ("float32", "float16")
    assert notes["activation"]["runs"] == "int8 scale:float32:token:dynamic"
    assert "my-cpu runs them as int8 scale:float32:token:dynamic on cpu: mine" in text
    assert "compute float32 asked; my-cpu computes these weights' GEMMs in float16: my op is half precision" in text


@pytest.mark.parametrize("extra,message", [
    ("    compute: {dtypes: {float16: float16}, reason: r}\n", "float16 maps to itself"),
    ("    emulation: {activation: \"int9 scale:x\", reason: r}\n", "emulation.activation:"),
    ("    compute: {dtypes: {float16: bfloat16}}\n", "reason"),
])
def test_bad_downgrade_words_are_refused_naming_the_field(tmp_path, extra: str, message: str) -> None:
    user = _user_kernel(tmp_path, extra)
    problems = validate_paths([user / "kernels" / "my-cpu.yaml"])
    assert problems and message in str(problems[0]), problems
    assert "my-cpu.yaml" in str(problems[0])
    with pytest.raises(SpecErrors):
        from moe_registry.spec.loader import load_registry
        load_registry([user])


@pytest.mark.parametrize("weight_key", ["uint4 scale:float16:group(32):static zp:group",
                                        "uint4b8 scale:float16:channel:static"])
def test_int4_on_the_cpu_computes_float16_as_the_reference_does(weight_key: str) -> None:
    """The compiled kernel's 4-bit path sums in float32: in float16 its error against the float64 MoE is the
    float32 reference's (rounded to float16), where torch's bfloat16 int4 op is many times that. One and
    many rows per expert (the register kernel and the dequantised tiles)."""
    import torch
    from moe_registry_kernels.cpu_native import NativeExperts
    from moe_registry_kernels.cpu_packed import CpuPackedExperts
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.reference import reference_moe

    from moe_registry.core.keys import parse_quant_key
    from moe_registry.layer.experts import ExpertsConfig
    from moe_registry.layer.modular import FusedMoEKernel, LocalPrepareFinalize

    weights = make_random_expert_weights(parse_quant_key(weight_key), parse_quant_key("unquantized"), num_experts=4,
                                         hidden=128, intermediate=64, dtype=torch.float16, bias=False,
                                         act_order=True, seed=3)
    gen = torch.Generator().manual_seed(4)
    for tokens in (1, 40):
        x = torch.randn(tokens, 128, generator=gen).half()
        ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]).int()
        w = torch.rand(tokens, 2, generator=gen) + 0.1
        w = w / w.sum(-1, keepdim=True)
        exact = reference_moe(x, w, ids, weights, ExpertsConfig(), torch.float64)

        def err(out: torch.Tensor, exact: torch.Tensor = exact) -> float:
            return float((out.double() - exact).norm() / exact.norm())

        reference = err(reference_moe(x, w, ids, weights, ExpertsConfig(), torch.float32).half())
        native, packed = (err(FusedMoEKernel(LocalPrepareFinalize(), cls(weights, ExpertsConfig()))(x, w, ids))
                          for cls in (NativeExperts, CpuPackedExperts))
        assert native <= 1.2 * reference, (tokens, native, reference)
        assert packed > 5 * reference, (tokens, packed, reference)  # what the compute-dtype note says
