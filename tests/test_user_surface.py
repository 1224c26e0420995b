"""What a user meets first: the Python API's names, MoELayer's inputs (3-D, any float dtype), and the
command-line cases that were wrong (each test is the case that found it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.cli.main import main
from moe_registry.layer.moe_layer import load_layer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests/fixtures/transformers/tiny"
CONFIGS = ROOT / "examples/configs"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the Python API


def test_all_names_the_api_and_dir_finds_it():
    assert {"build", "load_layer", "load_model", "MoELayer"} <= set(moe_registry.__all__)
    assert {"build", "load_layer", "load_model"} <= set(dir(moe_registry))
    for name in moe_registry.__all__:
        assert getattr(moe_registry, name) is not None


@pytest.fixture(scope="module")
def mixtral() -> moe_registry.MoELayer:
    return load_layer(TINY / "mixtral", platform="cpu", dtype="float32", kernel="torch-reference")


def test_3d_input_as_transformers_layers_take_it(mixtral):
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    out = mixtral(x)
    assert out.shape == (2, 3, 64)
    flat = mixtral(x.reshape(6, 64))
    assert torch.equal(out.reshape(6, 64), flat)
    r = mixtral.route(x)
    assert r.topk_ids.shape == (6, mixtral.top_k)


def test_any_float_dtype_in_and_out(mixtral):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    ref = mixtral(x)
    half = mixtral(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    assert float((half.double() - ref.double()).norm() / ref.double().norm()) < 2e-2  # bf16-rounded input
    r = mixtral.route(x)  # routing weights of another float dtype are taken as float32
    given = mixtral.kernel(x, r.topk_weights.to(torch.float16), r.topk_ids)
    assert float((given - ref).norm() / ref.norm()) < 1e-3


def test_bad_inputs_are_one_line(mixtral):
    with pytest.raises(ValueError, match=r"^hidden states must be a floating-point tensor .*got torch.int64$"):
        mixtral(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^hidden states must be \[tokens, 64\] or \[batch, seq, 64\], got shape "
                                         r"\[2, 32\]$"):
        mixtral(torch.ones(2, 32))


# ---------------------------------------------------------------- Llama 4 at top-2


def _llama4_top2(tmp_path: Path) -> Path:
    cfg = json.loads((TINY / "llama4_text/config.json").read_text())
    cfg["num_experts_per_tok"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TINY / "llama4_text/model.safetensors", tmp_path / "model.safetensors")
    return tmp_path


def test_llama4_top2_runs_as_transformers_does(tmp_path, capsys):
    """transformers' Llama4TextMoe runs any num_experts_per_tok (each expert on the input scaled by its
    sigmoid score, outputs summed); run used to fail with 'k == 1' after explain passed."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    path = _llama4_top2(tmp_path)
    layer = load_layer(path, platform="cpu", dtype="float32", kernel="torch-reference")
    cfg = Llama4TextConfig.from_pretrained(path)
    block = Llama4TextMoe(cfg).float()
    sd = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.0.feed_forward."
    block.load_state_dict({k[len(prefix):]: v.float() for k, v in sd.items() if k.startswith(prefix)}, strict=False)
    torch.nn.init.zeros_(block.shared_expert.down_proj.weight)  # the routed experts alone
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = block(x)
    got = layer(x)
    assert float((got - want).norm() / want.norm()) < 1e-5
    code, out, _ = _cli(capsys, "run", str(path), "--platform", "cpu", "--repeat", "1")
    assert code == 0 and "rel. error" in out


def test_qwen35_text_only_checkpoint_names_its_layers_model_layers(tmp_path):
    """Qwen3_5MoeForCausalLM saves model.layers.N (the multimodal model: model.language_model.layers.N):
    the same tiny weights under the text-only names give transformers' routed output."""
    src = TINY / "qwen3_5_moe"
    text = json.loads((src / "config.json").read_text())["text_config"]
    text["architectures"] = ["Qwen3_5MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(text))
    tensors = {k.replace("model.language_model.", "model.", 1): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    assert not any(k.startswith("model.language_model.") for k in tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    io = load_file(str(src / "io.safetensors"))
    layer = load_layer(tmp_path, platform="cpu", dtype="float32", kernel="torch-reference")
    out = layer(io["hidden_states"])
    assert float((out - io["output"]).norm() / io["output"].norm()) < 1e-5


def test_layer_alternatives_must_name_the_layer():
    from pydantic import ValidationError

    from moe_registry.spec.models import Naming

    per_expert = {"router": "mlp.gate", "expert": "mlp.experts.{expert}",
                  "projections": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}
    assert Naming(**per_expert, layer_alternatives=["model.layers.{layer}"]).layer_alternatives == [
        "model.layers.{layer}"]
    with pytest.raises(ValidationError, match=r"naming.layer_alternatives\[\] must contain \{layer\}"):
        Naming(**per_expert, layer_alternatives=["model.layers.0"])


def test_llama4_top2_on_the_triton_kernel_matches_the_reference(tmp_path):
    """The Triton kernel (interpreter, float16) takes the top-2 weight-on-input layer as k rows of top-1."""
    from moe_registry.layer.build import build

    path = _llama4_top2(tmp_path)
    triton = build(path, platform="cuda:9.0", dtype="float16", kernel="triton-fused-moe", device="cpu")
    assert type(triton.kernel.experts).__name__ == "TritonExperts"
    ref = load_layer(path, platform="cpu", dtype="float32", kernel="torch-reference")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    r = ref.route(x)
    want = ref.kernel(x, r.topk_weights, r.topk_ids)
    got = triton.kernel(x.half(), r.topk_weights, r.topk_ids).float()
    assert float((got - want).norm() / want.norm()) < 5e-3  # the unquantized scheme's float16 tolerance


# ---------------------------------------------------------------- explain's refusals name the case


def test_dense_model_is_said_to_have_no_moe_layers(tmp_path, capsys):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 11008, "num_hidden_layers": 32}  # transformers' LlamaConfig keys
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = _cli(capsys, "explain", str(tmp_path), "--platform", "cpu")
    assert code == 2 and err.count("\n") == 1
    assert "this model has no MoE layers" in err and "closest known" not in err


def test_unknown_family_names_each_family_once(tmp_path, capsys):
    cfg = {"model_type": "llama5", "architectures": ["Llama5ForCausalLM"], "num_local_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = _cli(capsys, "explain", str(tmp_path), "--platform", "cpu")
    near = err.split("closest known: ")[1]
    families = re.findall(r"(\S+) \(", near)
    assert code == 2 and "llama4" in families and len(families) == len(set(families))


def test_qwen3_omni_text_model_is_a_qwen_moe_layer(tmp_path, capsys):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

    Qwen3OmniMoeTextConfig().save_pretrained(tmp_path)
    code, out, _ = _cli(capsys, "explain", str(tmp_path), "--platform", "cpu", "--json")
    data = json.loads(out)
    assert code == 0 and data["family"] == "qwen-moe"
    assert data["runtime"]["shape"]["num_experts"] == 128 and data["runtime"]["shape"]["top_k"] == 8


def test_bare_quantization_config_json_is_explained(tmp_path, capsys):
    q = json.loads((CONFIGS / "mixtral/mixtral-8x7b-instruct-v0.1-awq/config.json").read_text())["quantization_config"]
    (tmp_path / "quantization_config.json").write_text(json.dumps(q))
    code, out, err = _cli(capsys, "explain", str(tmp_path / "quantization_config.json"), "--platform", "cuda:9.0",
                          "--json")
    data = json.loads(out)
    assert code == 0 and data["scheme"]["name"] == "awq-w4a16" and data["quant_source"] == "quantization_config.json"


def test_hqq_is_named_and_no_unrelated_scheme_is_offered(tmp_path, capsys):
    cfg = json.loads((CONFIGS / "mixtral/mixtral-8x7b-instruct-v0.1/config.json").read_text())
    cfg["quantization_config"] = {  # transformers' HqqConfig.to_dict()
        "quant_method": "hqq", "skip_modules": ["lm_head"],
        "quant_config": {"weight_quant_params": {"nbits": 4, "group_size": 64, "axis": 1, "channel_wise": True,
                                                 "optimize": True, "round_zero": True, "view_as_float": False},
                         "scale_quant_params": None, "zero_quant_params": None, "offload_meta": False}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = _cli(capsys, "explain", str(tmp_path), "--platform", "cpu")
    assert code == 1
    assert "quant_method 'hqq': no scheme spec claims it" in err and err.count("\n") == 1
    assert "schemes turned down (" in out and "\n  - " not in out  # no "nearest" scheme: none is near


def test_all2all_help_lists_what_runs(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "all2all backend for EP dispatch: none, allgather_reducescatter (default none" in text
    assert "known, not implemented here: naive, deepep_high_throughput, pplx, deepep_low_latency" in text


# ---------------------------------------------------------------- run's output


def test_run_prints_a_summary_not_the_report(capsys):
    code, out, _ = _cli(capsys, "run", str(TINY / "mixtral"), "--platform", "cpu", "--repeat", "3")
    assert code == 0 and "kernels, in the scheme's order" not in out and "cpu (cpu)" not in out
    assert out.startswith("ran         unquantized on torch-cpu-grouped (cpu, ")
    # the line wraps where the figures are wide
    assert re.search(r"^time        [\d.]+ ms per call \(median of 3 after warm-up;\s+middle\s+half\s+[\d.]+-[\d.]+,"
                     r"\s+min\s+[\d.]+,\s+max", out, re.M)
    code, out, _ = _cli(capsys, "run", str(TINY / "mixtral"), "--platform", "cpu", "--repeat", "1", "--verbose")
    assert code == 0 and "kernels, in the scheme's order of preference:" in out


def test_run_times_enough_calls_without_repeat(capsys):
    code, out, _ = _cli(capsys, "run", str(TINY / "mixtral"), "--platform", "cpu", "--json")
    r = json.loads(out)["result"]
    assert code == 0 and r["repeat"] >= 10
    assert r["min_ms"] <= r["p25_ms"] <= r["median_ms"] <= r["p75_ms"] <= r["max_ms"]
