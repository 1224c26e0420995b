"""The broken-checkpoint corpus: each case copies a bundled example, breaks one thing, and expects
a clear error naming the tensor (full checkpoint name) or config field — never a traceback, never
a half-built layer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.core.errors import MoERegistryError

Tensors = dict[str, torch.Tensor]
AWQ = "model.layers.1.block_sparse_moe.experts"
QWEN = "model.layers.1.mlp.experts"
# "tiny:<model_type>" cases break a committed transformers fixture (tests/fixtures/transformers/tiny).
TINY = Path(__file__).parent / "fixtures" / "transformers" / "tiny"
OSS = "model.layers.0.mlp.experts"
L4 = "model.layers.0.feed_forward.experts"
DBRX = "transformer.blocks.0.ffn.experts.mlp"
MIX = "model.layers.0.block_sparse_moe"


def _rename(old: str, new: str, projections: dict[str, str] | None = None) -> Callable[[Tensors], None]:
    """Every tensor under ``old`` moved under ``new`` (projection module names mapped by ``projections``)."""
    def apply(t: Tensors) -> None:
        for name in [n for n in t if n.startswith(old + ".")]:
            parts = name[len(old):].split(".")
            parts = [(projections or {}).get(p, p) for p in parts]
            t[new + ".".join(parts)] = t.pop(name)
    return apply


@dataclass(frozen=True)
class Case:
    name: str
    example: str
    expected: tuple[str, ...]
    tensors: Callable[[Tensors], None] | None = None
    config: Callable[[dict], None] | None = None
    layer: int = 1
    files: Callable[[Path], None] | None = None


def _set(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], None]:
    def apply(t: Tensors) -> None:
        t[name] = fn(t[name].clone())
    return apply


def _poke(value: float, index: tuple[int, ...] = (0, 0)) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[index] = value
        return y
    return fn


def _drop(name: str) -> Callable[[Tensors], None]:
    def apply(t: Tensors) -> None:
        del t[name]
    return apply


def _add(name: str, value: torch.Tensor) -> Callable[[Tensors], None]:
    return lambda t: t.__setitem__(name, value)


def _cfg(**changes: object) -> Callable[[dict], None]:
    return lambda c: c.update(changes)


CASES = [
    Case("missing-tensor", "mixtral-awq", (f"{AWQ}.3.w1.qzeros: missing",), _drop(f"{AWQ}.3.w1.qzeros")),
    Case("missing-projection", "qwen3-gptq-int4", (f"{QWEN}.5.down_proj.qweight: missing",),
         lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{QWEN}.5.down_proj.")] and None),
    Case("extra-tensor", "mixtral-awq", (f"{AWQ}.0.w1.qweight_extra: unexpected tensor",),
         _add(f"{AWQ}.0.w1.qweight_extra", torch.zeros(2, dtype=torch.int32))),
    Case("wrong-shape", "mixtral-awq", (f"{AWQ}.2.w3.qweight: shape [256, 8]; expected [256, 16]",),
         _set(f"{AWQ}.2.w3.qweight", lambda x: x[:, :8].contiguous())),
    Case("wrong-dtype", "mixtral-awq", (f"{AWQ}.1.w2.scales: dtype float32; expected float16",),
         _set(f"{AWQ}.1.w2.scales", lambda x: x.float())),
    Case("nan-scale", "mixtral-awq", (f"{AWQ}.4.w1.scales", "NaN"), _set(f"{AWQ}.4.w1.scales", _poke(float("nan")))),
    Case("inf-scale", "mixtral-quark-w8a8", (f"{AWQ}.0.w2.weight_scale", "infinite"),
         _set(f"{AWQ}.0.w2.weight_scale", _poke(float("inf"), (3,)))),
    Case("zero-scale", "qwen3-gptq-int4", (f"{QWEN}.6.up_proj.scales", "zero"),
         _set(f"{QWEN}.6.up_proj.scales", _poke(0.0))),
    Case("negative-scale", "mixtral-quark-w8a8", (f"{AWQ}.7.w1.weight_scale", "negative"),
         _set(f"{AWQ}.7.w1.weight_scale", _poke(-0.5, (1,)))),
    Case("gptq-asymmetric-zeros", "qwen3-gptq-int4", (f"{QWEN}.0.gate_proj.qzeros",),
         _set(f"{QWEN}.0.gate_proj.qzeros", lambda x: x ^ 0x1)),
    Case("gptq-gidx-out-of-range", "qwen3-gptq-int4-actorder", (f"{QWEN}.2.down_proj.g_idx",),
         _set(f"{QWEN}.2.down_proj.g_idx", _poke(999, (0,)))),
    Case("gptq-zeros-dtype", "qwen3-gptq-int4", (f"{QWEN}.1.gate_proj.qzeros: dtype int64; expected int32",),
         _set(f"{QWEN}.1.gate_proj.qzeros", lambda x: x.long())),
    Case("mxfp8-nan-exponent", "qwen3-modelopt-mxfp8", (f"{QWEN}.3.gate_proj.weight_scale", "255"),
         _set(f"{QWEN}.3.gate_proj.weight_scale", _poke(255))),
    Case("fp8-block-nan-scale", "deepseek-fp8-block", (f"{QWEN}.9.up_proj.weight_scale_inv", "NaN"),
         _set(f"{QWEN}.9.up_proj.weight_scale_inv", _poke(float("nan")))),
    Case("quark-input-scale-nan", "mixtral-quark-w8a8-tensor", (f"{AWQ}.2.w1.input_scale", "NaN"),
         _set(f"{AWQ}.2.w1.input_scale", lambda x: torch.full_like(x, float("nan")))),
    Case("ct-scale-shape", "qwen3-ct-w8a8", (f"{QWEN}.0.gate_proj.weight_scale: shape [128]; expected [128, 1]",),
         _set(f"{QWEN}.0.gate_proj.weight_scale", lambda x: x.flatten().contiguous())),
    Case("router-shape", "mixtral-awq", ("model.layers.1.block_sparse_moe.gate.weight: shape [8, 128]",),
         _set("model.layers.1.block_sparse_moe.gate.weight", lambda x: x[:, :128].contiguous())),
    Case("bias-on-some-experts", "mixtral-awq", ("some expert projections have a bias",),
         _add(f"{AWQ}.0.w1.bias", torch.ones(128, dtype=torch.float16))),
    Case("fewer-experts-in-config", "mixtral-awq", ("expert 4 exists but config.json says 4 experts",),
         config=_cfg(num_local_experts=4)),
    Case("hidden-size-disagrees", "mixtral-awq", (f"{AWQ}.0.w1.qweight: shape [256, 16]; expected [512, 16]",),
         config=_cfg(hidden_size=512)),
    Case("intermediate-disagrees", "qwen3-gptq-int4", (f"{QWEN}.0.gate_proj.qweight: shape", "expected [32, 192]"),
         config=_cfg(moe_intermediate_size=192)),
    Case("layer-without-moe", "deepseek-fp8-block", ("--layer: layer 7 has no MoE",), layer=7),
    Case("unknown-scheme", "mixtral-awq", ("quant_method 'bitsandbytes': no scheme spec claims it",),
         config=lambda c: c["quantization_config"].update(quant_method="bitsandbytes")),
    Case("pickle-only", "mixtral-awq", ("no .safetensors files", "pytorch_model.bin"),
         files=lambda d: [p.unlink() for p in d.glob("*.safetensors")] and (d / "pytorch_model.bin").write_bytes(b"x")
         and None),
    Case("corrupt-header", "mixtral-awq", ("cannot read safetensors header",),
         files=lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
         and None),
    Case("missing-shard", "qwen2-gptq-int8", ("names shard(s) that are not there",),
         files=lambda d: next(iter(sorted(d.glob("model-0000*.safetensors")))).unlink()),
    Case("fused-gate-up-shape", "tiny:gpt_oss",
         (f"{OSS}.gate_up_proj: shape [8, 64, 30]; expected [8, 64, 32] ([E, in, out] with E=8 (experts), "
          "in=64 (hidden), out=32 (2 x intermediate 16)",),
         _set(f"{OSS}.gate_up_proj", lambda x: x[:, :, :30].contiguous()), layer=0),
    Case("fused-down-transposed", "tiny:llama4_text", (f"{L4}.down_proj: shape [8, 64, 16]; expected [8, 16, 64]",),
         _set(f"{L4}.down_proj", lambda x: x.transpose(1, 2).contiguous()), layer=0),
    Case("fused-gate-up-transposed", "tiny:gpt_oss", (f"{OSS}.gate_up_proj: shape [8, 32, 64]; expected [8, 64, 32]",),
         _set(f"{OSS}.gate_up_proj", lambda x: x.transpose(1, 2).contiguous()), layer=0),
    Case("fused-experts-disagree-with-config", "tiny:gpt_oss",
         (f"{OSS}.gate_up_proj: shape [8, 64, 32]; expected [6, 64, 32]",), config=_cfg(num_local_experts=6),
         layer=0),
    Case("fused-bias-shape", "tiny:gpt_oss", (f"{OSS}.gate_up_proj_bias: shape [8, 16]; expected [8, 32]",),
         _set(f"{OSS}.gate_up_proj_bias", lambda x: x[:, :16].contiguous()), layer=0),
    Case("fused-bias-on-one-projection", "tiny:gpt_oss",
         (f"{OSS}.down_proj_bias: missing while {OSS}.gate_up_proj_bias exists",), _drop(f"{OSS}.down_proj_bias"),
         layer=0),
    Case("fused-missing", "tiny:llama4_text", (f"{L4}.gate_up_proj: missing",), _drop(f"{L4}.gate_up_proj"), layer=0),
    Case("fused-dtype", "tiny:gpt_oss", (f"{OSS}.down_proj: dtype int8; expected",),
         _set(f"{OSS}.down_proj", lambda x: x.to(torch.int8)), layer=0),
    Case("fused-bias-nan", "tiny:gpt_oss", (f"{OSS}.gate_up_proj_bias", "[2, 5]", "NaN"),
         _set(f"{OSS}.gate_up_proj_bias", _poke(float("nan"), (2, 5))), layer=0),
    Case("router-bias-shape", "tiny:gpt_oss", ("model.layers.0.mlp.router.bias: shape [9]; expected [8]",),
         _add("model.layers.0.mlp.router.bias", torch.zeros(9)), layer=0),
    # A Mixtral layer under neither the transformers naming nor GPTQModel's (naming.alternatives): one line
    # naming what was looked for under each naming.
    Case("mixtral-no-naming-holds-the-layer", "tiny:mixtral",
         ("layer 0: no expert tensors or router under any naming of family mixtral",
          f"naming: {MIX}.experts.N.{{w1,w3,w2}}.* or {MIX}.gate.weight",
          "naming.alternatives[0]: model.layers.0.mlp.experts.N.{gate_proj,up_proj,down_proj}.* or "
          "model.layers.0.mlp.gate.weight"),
         _rename(MIX, "model.layers.0.moe"), layer=0),
    # DBRX's 2-D stacked experts [E*I, H]: a short or transposed one names the tensor, the shape and the stacking.
    Case("stacked-2d-rows", "tiny:dbrx",
         (f"{DBRX}.v1: shape [120, 64]; expected [128, 64] ([E*out, in] with E*out=128 (experts 8 x "
          "intermediate 16), in=64 (hidden))",),
         _set(f"{DBRX}.v1", lambda x: x[:120].contiguous()), layer=0),
    Case("stacked-2d-down-transposed", "tiny:dbrx",
         (f"{DBRX}.w2: shape [64, 128]; expected [128, 64] ([E*in, out] with E*in=128 (experts 8 x intermediate "
          "16), out=64 (hidden)), from config.json and naming.fused.down_layout",),
         _set(f"{DBRX}.w2", lambda x: x.t().contiguous()), layer=0),
]


def _source(example: Callable[[str], Path], name: str) -> Path:
    return TINY / name.removeprefix("tiny:") if name.startswith("tiny:") else example(name)


def _break(src: Path, dst: Path, case: Case) -> Path:
    shutil.copytree(src, dst)
    if case.tensors is not None:
        path = dst / "model.safetensors"
        tensors = load_file(str(path))
        case.tensors(tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})
    if case.config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        case.config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if case.files is not None:
        case.files(dst)
    return dst


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_broken_checkpoint_gets_a_clear_error(example, tmp_path: Path, case: Case) -> None:
    path = _break(_source(example, case.example), tmp_path / case.name, case)
    with pytest.raises(MoERegistryError) as err:
        moe_registry.load_layer(path, layer=case.layer, platform="cpu")
    message = str(err.value)
    for needle in case.expected:
        assert needle in message, message
    assert "\n" not in message.strip() or case.name == "unknown-scheme"


@pytest.mark.parametrize("case", CASES[:3], ids=[c.name for c in CASES[:3]])
def test_cli_reports_one_line_without_traceback(example, tmp_path: Path, case: Case, capsys) -> None:
    from moe_registry.cli.main import main

    path = _break(example(case.example), tmp_path / case.name, case)
    assert main(["run", str(path), "--platform", "cpu", "--layer", str(case.layer)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and case.expected[0] in err


@pytest.mark.parametrize("rename", [None, "gptqmodel"])
def test_mixtral_loads_under_transformers_and_gptqmodel_names(tmp_path: Path, rename: str | None) -> None:
    """transformers' block_sparse_moe.experts.N.w1/w3/w2 (as saved) and the same tensors under GPTQModel's
    mlp.experts.N.gate_proj/up_proj/down_proj (renamed here in tmp_path) give the same layer; messages name
    the tensors as this checkpoint does."""
    src = TINY / "mixtral"
    path = src
    if rename:
        case = Case("renamed", "tiny:mixtral", (), _rename(MIX, "model.layers.0.mlp",
                                                           {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}))
        path = _break(src, tmp_path / "gptqmodel-names", case)
    layer = moe_registry.build(path, layer=0, platform="cpu")
    plain = load_file(str(src / "model.safetensors"))
    assert torch.equal(layer.tensors.router, plain[f"{MIX}.gate.weight"])
    for e in range(8):
        for role, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            assert torch.equal(layer.tensors.experts[e][role]["weight"], plain[f"{MIX}.experts.{e}.{w}.weight"])
    want = "model.layers.0.mlp.experts.3.up_proj.weight" if rename else f"{MIX}.experts.3.w3.weight"
    assert layer.tensors.names.tensor(3, "up", "weight") == want


@pytest.mark.parametrize(("alt", "wanted"), [
    ({"router": "mlp.gate", "expert": "mlp.experts", "projections": {"gate": "g", "up": "u", "down": "d"}},
     "must contain {expert}"),
    ({"router": "mlp.gate", "expert": "mlp.experts.{expert}", "projections": {"gate": "g", "up": "u"}},
     "needs gate, up and down"),
    ({"router": "mlp.gate", "expert": "mlp.experts.{expert}", "projections": {"gate": "g", "up": "u", "down": "d"},
      "layer": "x.{layer}"}, "Extra inputs are not permitted"),
])
def test_naming_alternatives_are_validated(alt: dict, wanted: str) -> None:
    from pydantic import ValidationError

    from moe_registry.spec.models import Naming

    with pytest.raises(ValidationError) as err:
        Naming(router="g", expert="e.{expert}", projections={"gate": "a", "up": "b", "down": "c"}, alternatives=[alt])
    assert wanted in str(err.value)
