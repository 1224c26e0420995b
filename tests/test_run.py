"""End to end on CPU: each bundled example checkpoint is explained, loaded, converted and run
through the chosen kernel, and compared with the float64 dequantised reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.checkpoint.tensor_index import CheckpointIndex
from moe_registry.cli.main import main
from moe_registry.spec.loader import load_registry

EXPECTED_SCHEME = {
    "mixtral-awq": "awq-w4a16",
    "qwen3-gptq-int4": "gptq-w4a16",
    "qwen3-gptq-int4-actorder": "gptq-w4a16",
    "qwen2-gptq-int8": "gptq-w8a16",
    "mixtral-quark-w8a8": "quark-w8a8-int8",
    "mixtral-quark-w8a8-tensor": "quark-w8a8-int8-tensor",
    "qwen3-modelopt-mxfp8": "modelopt-mxfp8",
    "qwen3-modelopt-mxfp8-inline": "modelopt-mxfp8",
    "deepseek-fp8-block": "fp8-block128",
    "mixtral-bf16": "unquantized",
    "qwen3-ct-w8a8": "compressed-tensors-w8a8-int8",
    "qwen3-ct-w4a8": "compressed-tensors-w4a8-int",
}


def first_cpu_kernel(scheme: str, dtype: str = "bfloat16") -> str:
    """The kernel the specs put first for ``scheme`` among those that run on cpu; in float16 or float32 a 4-bit
    layer passes over the packed op (it computes them in bfloat16) and an integer weight-only one over
    torch-cpu-dot8 (its int8 activations' declared error exceeds the scheme's 1e-2) for the compiled kernel; fp8
    W8A8 runs there as declared, in every dtype."""
    registry = load_registry()
    first = next(k for k in registry.scheme(scheme).kernels
                 if any(p.device == "cpu" for p in registry.kernel(k).platforms))
    if first == "torch-cpu-dot8" and dtype != "bfloat16" and not registry.scheme(scheme).weight.startswith("fp8"):
        return "torch-cpu-native"
    if first == "torch-cpu-packed" and dtype != "bfloat16" and registry.scheme(scheme).weight.startswith("uint4"):
        return "torch-cpu-native"
    return first


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEME))
def test_run_every_example_within_tolerance(example, name: str, capsys) -> None:
    rc = main(["run", str(example(name)), "--platform", "cpu", "--layer", "1", "--tokens", "7",
               "--repeat", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["report"]["scheme"]["name"] == EXPECTED_SCHEME[name]
    assert out["report"]["chosen_kernel"] == first_cpu_kernel(EXPECTED_SCHEME[name], out["report"]["runtime"]["dtype"])
    result = out["result"]
    assert 0 < result["relative_error"] <= result["tolerance"], result
    assert rc == 0


def test_run_text_shows_report_error_and_time(example, capsys) -> None:
    assert main(["run", str(example("mixtral-awq")), "--platform", "cpu", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    for needle in (f"ran         awq-w4a16 on {first_cpu_kernel('awq-w4a16', 'float16')} (cpu, float16)", "rel. error",
                   "vs float64 reference", "ms per call"):
        assert needle in text
    assert "scheme      awq-w4a16" not in text  # the whole report only with --verbose
    assert main(["run", str(example("mixtral-awq")), "--platform", "cpu", "--repeat", "1", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "scheme      awq-w4a16" in text and f"kernel      {first_cpu_kernel('awq-w4a16', 'float16')}" in text


def test_inputs_with_routing_and_saved_output_match_reference(example, tmp_path: Path, capsys) -> None:
    from moe_registry_kernels.reference import reference_moe

    from moe_registry.layer.experts import ExpertsConfig

    path = example("qwen3-gptq-int4")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=gen).to(torch.float16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
    w = torch.rand(5, 2, generator=gen)
    save_file({"hidden_states": x, "topk_ids": ids, "topk_weights": w}, str(tmp_path / "in.safetensors"))
    rc = main(["run", str(path), "--platform", "cpu", "--inputs", str(tmp_path / "in.safetensors"),
               "--save-output", str(tmp_path / "out.safetensors"), "--repeat", "1"])
    assert rc == 0
    out = load_file(str(tmp_path / "out.safetensors"))["output"]
    built = moe_registry.build(path, platform="cpu").built
    ref = reference_moe(x, w, ids, built.weights, ExpertsConfig(), torch.float64)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    capsys.readouterr()


def test_load_layer_reads_only_that_layer(example, monkeypatch) -> None:
    loaded: list[str] = []
    real = CheckpointIndex.load

    def spy(self: CheckpointIndex, name: str) -> torch.Tensor:
        loaded.append(name)
        return real(self, name)

    monkeypatch.setattr(CheckpointIndex, "load", spy)
    layer = moe_registry.load_layer(example("qwen2-gptq-int8"), layer=1, platform="cpu")
    assert loaded and all(n.startswith("model.layers.1.") for n in loaded)
    x = torch.randn(4, 256).to(torch.float16)
    y = layer(x)
    assert y.shape == (4, 256) and torch.isfinite(y).all() and y.abs().sum() > 0


def test_deepseek_layer_uses_grouped_sigmoid_routing(example) -> None:
    layer = moe_registry.load_layer(example("deepseek-fp8-block"), layer=0, platform="cpu")
    assert layer.correction_bias is not None
    r = layer.route(torch.randn(6, 256))
    assert r.topk_ids.shape == (6, 4)
    # routed_scaling_factor 2.5 with renormalised weights: each row sums to 2.5
    torch.testing.assert_close(r.topk_weights.sum(-1), torch.full((6,), 2.5))


def test_build_logs_chosen_kernel_once(example, caplog) -> None:
    import logging

    from moe_registry.layer import build as builder

    builder._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="moe_registry"):
        moe_registry.build(example("mixtral-bf16"), platform="cpu", dtype="float32")
        moe_registry.build(example("mixtral-bf16"), platform="cpu", dtype="float32")
    lines = [r.message for r in caplog.records if "runs on kernel" in r.message]
    assert lines == ["moe-registry: scheme unquantized runs on kernel torch-cpu-grouped (cpu, float32)"]


def test_kernels_distribution_name_is_not_shadowed() -> None:
    import importlib.util

    import moe_registry_kernels

    assert Path(moe_registry_kernels.__file__).parent.name == "kernels"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or "moe_registry" not in str(spec.origin or spec.submodule_search_locations)
