"""Example checkpoints (tools/make_examples.py): each is written deterministically, loads with
safetensors, has a config that parses, holds exactly the MoE tensors its model family names, is
small, and converts with the registered converter of its format."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from moe_registry_kernels.dequant import dequantize
from safetensors import safe_open

from moe_registry.core.keys import parse_quant_key
from moe_registry.formats import ConvertContext, get_converter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_examples  # noqa: E402

H, INTER, LAYERS = 256, 128, 2
MIXTRAL = ("model.layers.{L}.block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}, "num_local_experts",
           "mixtral", "MixtralForCausalLM")
QWEN3 = ("model.layers.{L}.mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, "num_experts",
         "qwen3_moe", "Qwen3MoeForCausalLM")
QWEN2 = (*QWEN3[:3], "qwen2_moe", "Qwen2MoeForCausalLM")
DEEPSEEK = (QWEN3[0], QWEN3[1], "n_routed_experts", "deepseek_v3", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class Expect:
    family: tuple
    tensors: frozenset[str]
    quant_method: str | None
    torch_dtype: str
    fmt: str
    weight_key: str
    activation_key: str = "unquantized"
    experts: int = 8
    top_k: int = 2
    shards: int = 1


def _t(*names: str) -> frozenset[str]:
    return frozenset(names)


GPTQ = _t("qweight", "qzeros", "scales", "g_idx")
EXPECT = {
    "mixtral-awq": Expect(MIXTRAL, _t("qweight", "qzeros", "scales"), "awq", "float16", "awq-gemm",
                          "uint4 scale:float16:group(128):static zp:group"),
    "qwen3-gptq-int4": Expect(QWEN3, GPTQ, "gptq", "float16", "gptq", "uint4b8 scale:float16:group(64):static"),
    "qwen3-gptq-int4-actorder": Expect(QWEN3, GPTQ, "gptq", "float16", "gptq",
                                       "uint4b8 scale:float16:group(64):static"),
    "qwen2-gptq-int8": Expect(QWEN2, GPTQ, "gptq", "float16", "gptq", "uint8b128 scale:float16:group(128):static",
                              shards=2),
    "mixtral-quark-w8a8": Expect(MIXTRAL, _t("weight", "weight_scale"), "quark", "bfloat16", "quark-int8",
                                 "int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic"),
    "mixtral-quark-w8a8-tensor": Expect(MIXTRAL, _t("weight", "weight_scale", "input_scale"), "quark", "bfloat16",
                                        "quark-int8", "int8 scale:float32:tensor:static",
                                        "int8 scale:float32:tensor:static"),
    "qwen3-modelopt-mxfp8": Expect(QWEN3, _t("weight", "weight_scale"), None, "bfloat16", "modelopt-mxfp8",
                                   "fp8e4m3 scale:e8m0:block(1x32):static"),
    "qwen3-modelopt-mxfp8-inline": Expect(QWEN3, _t("weight", "weight_scale"), "modelopt", "bfloat16",
                                          "modelopt-mxfp8", "fp8e4m3 scale:e8m0:block(1x32):static"),
    "deepseek-fp8-block": Expect(DEEPSEEK, _t("weight", "weight_scale_inv"), "fp8", "bfloat16", "fp8-block",
                                 "fp8e4m3 scale:float32:block(128x128):static", experts=16, top_k=4),
    "mixtral-bf16": Expect(MIXTRAL, _t("weight", "bias"), None, "bfloat16", "unquantized", "unquantized"),
    "qwen3-ct-w8a8": Expect(QWEN3, _t("weight", "weight_scale"), "compressed-tensors", "bfloat16", "quark-int8",
                            "int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic"),
    "qwen3-ct-w4a8": Expect(QWEN3, _t("weight_packed", "weight_scale", "weight_shape"), "compressed-tensors",
                            "bfloat16", "compressed-tensors-pack", "uint4b8 scale:bfloat16:group(128):static",
                            "int8 scale:float32:token:dynamic"),
}


def test_every_example_is_covered() -> None:
    assert set(make_examples.EXAMPLES) == set(EXPECT)


@pytest.fixture(scope="module")
def written(example: Callable[[str], Path]) -> dict[str, Path]:
    """Every example, from the session's (tests/conftest.py): written once for all test files."""
    return {name: example(name) for name in make_examples.EXAMPLES}


def load(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with its index)."""
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            assert st.metadata() == {"format": "pt"}
            tensors.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return tensors


def expected_names(exp: Expect) -> set[str]:
    prefix, projections = exp.family[0], exp.family[1]
    names = set()
    for layer in range(LAYERS):
        moe = prefix.format(L=layer)
        names.add(f"{moe}.gate.weight")
        if exp.family is DEEPSEEK:
            names.add(f"{moe}.gate.e_score_correction_bias")
        for e in range(exp.experts):
            for proj in projections.values():
                names.update(f"{moe}.experts.{e}.{proj}.{t}" for t in exp.tensors)
    return names


@pytest.mark.parametrize("name", list(EXPECT))
def test_example_files(written: dict[str, Path], name: str) -> None:
    exp, path = EXPECT[name], written[name]
    config = json.loads((path / "config.json").read_text())
    _, _, experts_field, model_type, arch = exp.family
    assert config["model_type"] == model_type and config["architectures"] == [arch]
    assert config[experts_field] == exp.experts and config["num_experts_per_tok"] == exp.top_k
    assert config["hidden_size"] == H and config["num_hidden_layers"] == LAYERS
    assert config.get("moe_intermediate_size", config.get("intermediate_size")) == INTER
    assert config["torch_dtype"] == exp.torch_dtype
    assert config.get("quantization_config", {}).get("quant_method") == exp.quant_method

    tensors = load(path)
    assert set(tensors) == expected_names(exp)
    router = tensors[f"{exp.family[0].format(L=1)}.gate.weight"]
    assert router.shape == (exp.experts, H)
    assert router.dtype == getattr(torch, exp.torch_dtype)

    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 8 * 2**20, f"{name} is {size} bytes"
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    if exp.shards == 1:
        assert shards == ["model.safetensors"]
        assert not (path / "model.safetensors.index.json").exists()
    else:
        assert shards == [f"model-{i:05d}-of-{exp.shards:05d}.safetensors" for i in range(1, exp.shards + 1)]


def test_sharded_index_maps_every_tensor_to_its_file(written: dict[str, Path]) -> None:
    path = written["qwen2-gptq-int8"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    seen, total = {}, 0
    for f in path.glob("model-*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118
                seen[k] = f.name
                t = st.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total
    assert {v for v in seen.values()} == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_modelopt_quant_config_beside_or_inline(written: dict[str, Path]) -> None:
    beside = written["qwen3-modelopt-mxfp8"]
    hf = json.loads((beside / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt" and hf["quantization"]["quant_algo"] == "MXFP8"
    assert "quantization_config" not in json.loads((beside / "config.json").read_text())
    inline = written["qwen3-modelopt-mxfp8-inline"]
    assert not (inline / "hf_quant_config.json").exists()
    assert json.loads((inline / "config.json").read_text())["quantization_config"]["quant_algo"] == "MXFP8"


@pytest.mark.parametrize("name", list(EXPECT))
def test_example_converts(written: dict[str, Path], name: str) -> None:
    """The example's layer 1 goes through its format's converter and dequantizes to finite,
    non-zero weights of the configured shape."""
    exp = EXPECT[name]
    tensors = load(written[name])
    prefix, projections = exp.family[0].format(L=1), exp.family[1]
    experts = [
        {role: {t: tensors[f"{prefix}.experts.{e}.{proj}.{t}"] for t in exp.tensors}
         for role, proj in projections.items()}
        for e in range(exp.experts)
    ]
    ctx = ConvertContext(parse_quant_key(exp.weight_key), parse_quant_key(exp.activation_key),
                         getattr(torch, exp.torch_dtype), {},
                         lambda e, role, t: f"{prefix}.experts.{e}.{projections[role]}.{t}")
    ew = get_converter(exp.fmt, "nk")(experts, ctx)
    assert (ew.num_experts, ew.hidden_size, ew.intermediate_size) == (exp.experts, H, INTER)
    for proj in (ew.w13, ew.w2):
        w = dequantize(proj, ew.weight_key)
        assert torch.isfinite(w).all() and (w != 0).float().mean() > 0.5
        assert 0.02 < float(w.std()) < 0.1  # the examples' weights have std 0.05
    assert (ew.w13.perm is not None) == name.endswith("actorder")
    assert (ew.w13.bias is not None) == (name == "mixtral-bf16")
    assert (ew.w13.input_scale is not None) == (name == "mixtral-quark-w8a8-tensor")


def test_examples_are_deterministic(tmp_path: Path) -> None:
    for name in ("qwen3-gptq-int4-actorder", "mixtral-quark-w8a8-tensor"):
        a = make_examples.make_example(name, tmp_path / "a")
        b = make_examples.make_example(name, tmp_path / "b")
        for f in sorted(a.iterdir()):
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_rewriting_replaces_earlier_files_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "qwen2-gptq-int8" / "model.safetensors"
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    assert make_examples.main(["--out", str(tmp_path), "qwen2-gptq-int8"]) == 0
    assert not stale.exists()
    assert "qwen2-gptq-int8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown example 'nope'; known: mixtral-awq"):
        make_examples.make_example("nope", tmp_path)


def test_a_failed_write_leaves_no_partial_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_file failing (as it does without numpy) leaves no empty or half-written directory, and
    an example an earlier run wrote stays as it was."""

    def broken_save(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'numpy'")

    monkeypatch.setattr(make_examples, "save_file", broken_save)
    with pytest.raises(ModuleNotFoundError, match="numpy"):
        make_examples.make_example("mixtral-awq", tmp_path)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()
    earlier = make_examples.make_example("mixtral-awq", tmp_path)
    files = {f.name: f.read_bytes() for f in earlier.iterdir()}
    monkeypatch.setattr(make_examples, "save_file", broken_save)
    with pytest.raises(ModuleNotFoundError):
        make_examples.make_example("mixtral-awq", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["mixtral-awq"]
    assert {f.name: f.read_bytes() for f in earlier.iterdir()} == files
