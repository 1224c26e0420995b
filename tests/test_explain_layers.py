"""explain reports the model, not layer 0: MoE layers decided differently (a layer excluded from
quantization, GPTQ ``dynamic``, ModelOpt mixed precision) are listed as runs of alike layers, the head
describes the largest run, and ``--layer N`` still reports that one layer alone. Real configs from
examples/configs; the AWQ one with layer 0 left unquantized is built from the real Mixtral-AWQ config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_registry.cli.main import main

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
MIXED = CONFIGS / "qwen-moe/qwen3-30b-a3b-modelopt-mixed-precision"
DYNAMIC = CONFIGS / "qwen-moe/qwen3-30b-a3b-gptq-int4-dynamic-layer1-int8"


def _explain(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["explain", *argv, "--platform", "cuda:9.0"]) == 0
    return capsys.readouterr().out


def _row(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(label + " ")).split(None, 1)[1]


@pytest.fixture()
def awq_layer0_excluded(tmp_path: Path) -> Path:
    cfg = json.loads((CONFIGS / "mixtral/mixtral-8x7b-instruct-v0.1-awq/config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["gate", "model.layers.0."]  # AutoAWQ's form
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_mixed_precision_lists_both_runs(capsys):
    text = _explain(capsys, str(MIXED))
    assert "layer 0 of 48 MoE layers, which differ: see layers" in text
    assert "layers      layers 0-23   modelopt-mxfp8  triton-fused-moe\n" in text
    assert "            layers 24-47  modelopt-nvfp4  triton-fused-moe\n" in text
    data = json.loads(_explain(capsys, str(MIXED), "--json"))
    assert [(r["first"], r["last"], r["count"], r["scheme"]) for r in data["layers"]] == [
        (0, 23, 24, "modelopt-mxfp8"), (24, 47, 24, "modelopt-nvfp4")]
    md = _explain(capsys, str(MIXED), "--markdown")
    assert "| layers | layers 0-23   modelopt-mxfp8  triton-fused-moe |" in md
    assert "|  | layers 24-47  modelopt-nvfp4  triton-fused-moe |" in md


def test_gptq_dynamic_layer_is_its_own_run_and_the_head_is_the_largest(capsys):
    text = _explain(capsys, str(DYNAMIC))
    assert "layer 0      gptq-w4a16  triton-fused-moe" in text
    assert "layer 1      gptq-w8a16  triton-fused-moe" in text
    assert "layers 2-47  gptq-w4a16  triton-fused-moe" in text
    assert _row(text, "scheme") == "gptq-w4a16"
    assert "layer 2 of 48 MoE layers" in text


def test_awq_with_layer0_excluded_is_headlined_awq_and_names_the_rule(capsys, awq_layer0_excluded):
    text = _explain(capsys, str(awq_layer0_excluded))
    assert _row(text, "scheme") == "awq-w4a16"
    assert "layers 1-31  awq-w4a16    triton-fused-moe" in text
    assert "layer 0      unquantized  triton-fused-moe (excluded: awq-w4a16 checkpoint, but this" in text
    assert "modules_to_not_convert entry 'model.layers.0.' matches its experts)" in " ".join(text.split())
    layer0 = _explain(capsys, str(awq_layer0_excluded), "--layer", "0")  # --layer narrows to that layer alone
    assert _row(layer0, "scheme") == "unquantized" and "\nlayers " not in layer0
    assert "(mixtral, layer 0)" in " ".join(layer0.split())


def test_a_uniform_model_keeps_the_one_layer_report_and_says_every_layer_is_alike(capsys):
    text = _explain(capsys, str(CONFIGS / "mixtral/mixtral-8x7b-instruct-v0.1-awq"))
    assert "(mixtral, layer 0 of 32 MoE layers, all alike) runtime" in " ".join(text.split())
    assert "\nlayers " not in text
    data = json.loads(_explain(capsys, str(CONFIGS / "mixtral/mixtral-8x7b-instruct-v0.1-awq"), "--json"))
    assert data["layers"] == [{"first": 0, "last": 31, "count": 32, "scheme": "awq-w4a16",
                               "kernel": "triton-fused-moe", "excluded": None}] and data["layer"] == 0
    # a dense first layer is no MoE layer: DeepSeek-V2-Lite's plan starts at layer 1
    data = json.loads(_explain(capsys, str(CONFIGS / "deepseek/deepseek-v2-lite"), "--json"))
    assert [(r["first"], r["last"], r["count"]) for r in data["layers"]] == [(1, 26, 26)] and data["layer"] == 1
