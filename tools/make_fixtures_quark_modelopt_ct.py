"""Write the Quark / ModelOpt / compressed-tensors fixtures under tests/fixtures/ with the producers themselves.

Run by hand (not in CI), once per producer, each in its own venv (they pin different transformers):

    /work/producers/quark/bin/python    tools/make_fixtures_quark_modelopt_ct.py quark
    /work/producers/modelopt/bin/python tools/make_fixtures_quark_modelopt_ct.py modelopt
    /work/producers/llmc/bin/python     tools/make_fixtures_quark_modelopt_ct.py compressed-tensors

Each fixture is a tiny Qwen3-MoE (transformers' own config class and model, bfloat16, one layer)
quantized and saved by the library on the CPU. Only config.json (+ hf_quant_config.json where the
library writes one) and the first MoE layer's router and expert tensors are kept, with the names
and dtypes the library wrote. ref.safetensors holds the library's OWN numbers:

- ``experts.{e}.{role}.dequant``: the weight as the library's quantized module dequantises it
  (experts 0 and 1: the fixture budget);
- ``experts.{e}.{role}.output``: the library's quantized linear on ``hidden_states`` (gate/up) or
  ``intermediate_states`` (down), with its activation quantisation;
- ``layer.output``: the library's quantized MoE block on ``hidden_states``, with the routing it
  chose (``layer.topk_ids``, ``layer.topk_weights``, captured at its experts module).

VERSIONS.json beside the fixtures names every version used. Nothing here imports moe_registry:
the fixture tensors are the producers' own.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import fixture_kit
import torch

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SEED = 1234
TOKENS = 8
LAYER = fixture_kit.LAYER
SHAPE = {"hidden_size": 64, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
ROLES = ("gate", "up", "down")
DEQUANT_EXPERTS = 2  # dequantised weights kept for experts 0..1 only: all four would pass the 1 MB fixture budget


def tiny_qwen3_moe() -> torch.nn.Module:
    """A random one-layer Qwen3-MoE in bfloat16 from transformers' own config class."""
    return fixture_kit.tiny_qwen3_moe(SEED, SHAPE, intermediate_size=128, head_dim=16)


def inputs() -> dict[str, torch.Tensor]:
    return fixture_kit.inputs(SEED, TOKENS, SHAPE)


def calibration() -> torch.Tensor:
    return fixture_kit.calibration_ids(SEED)


layer_output, keep_layer, save_ref = fixture_kit.layer_output, fixture_kit.keep_layer, fixture_kit.save_ref


def write_versions(sub: str, packages: list[str], fixtures: dict[str, object], notes: dict[str, str]) -> None:
    model = "Qwen3MoeForCausalLM, bfloat16, 1 layer, " + ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    out = {"producer": "tools/make_fixtures_quark_modelopt_ct.py", "python": platform.python_version(),
           "seed": SEED, "tokens": TOKENS, "dequant_experts": DEQUANT_EXPERTS, "model": model,
           **{p: version(p) for p in packages}, "notes": notes, "fixtures": fixtures}
    (ROOT / sub / "VERSIONS.json").write_text(json.dumps(out, indent=2) + "\n")


def linear_refs(lin_of: Callable[[int, str], torch.nn.Module], dequant: Callable[[torch.nn.Module], torch.Tensor],
                x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each expert projection's library dequantisation and library linear output."""
    ref: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for e in range(SHAPE["num_experts"]):
            for role in ROLES:
                lin = lin_of(e, role)
                if e < DEQUANT_EXPERTS:
                    ref[f"experts.{e}.{role}.dequant"] = dequant(lin)
                src = x["intermediate_states"] if role == "down" else x["hidden_states"]
                ref[f"experts.{e}.{role}.output"] = lin(src)
    return ref


# ---------------------------------------------------------------- AMD Quark


def make_quark() -> None:
    from quark.torch import ModelQuantizer, export_safetensors
    from quark.torch.quantization.config.config import (
        Int8PerChannelSpec,
        Int8PerTensorSpec,
        QConfig,
        QLayerConfig,
    )
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    # Per-channel weights with dynamic per-token activations: the expert linears see 2-D
    # [tokens, hidden] inputs, so the activation's channel axis is 0 (one scale per token).
    schemes = {
        "qwen3-w8a8-int8-channel": QLayerConfig(
            weight=Int8PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=False).to_quantization_spec(),
            input_tensors=Int8PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=True).to_quantization_spec()),
        "qwen3-w8a8-int8-tensor": QLayerConfig(
            weight=Int8PerTensorSpec(observer_method="min_max", symmetric=True, scale_type="float",
                                     round_method="half_even", is_dynamic=False).to_quantization_spec(),
            input_tensors=Int8PerTensorSpec(observer_method="min_max", symmetric=True, scale_type="float",
                                            round_method="half_even", is_dynamic=False).to_quantization_spec()),
    }
    fixtures: dict[str, object] = {}
    for name, layer_cfg in schemes.items():
        model = tiny_qwen3_moe()
        preprocess_for_quantization(model)
        qc = QConfig(global_quant_config=layer_cfg, exclude=["lm_head", "*self_attn*", "*mlp.gate"])
        loader = torch.utils.data.DataLoader(calibration(), batch_size=1)
        model = ModelQuantizer(qc).quantize_model(model, loader)
        block = model.model.layers[0].mlp
        x = inputs()
        ref = {**x, **linear_refs(lambda e, r, b=block: getattr(getattr(b.experts, str(e)), f"{r}_proj"),
                                  lambda lin: lin.get_quant_weight(lin.weight), x),
               **layer_output(block, block.experts, x["hidden_states"])}
        with tempfile.TemporaryDirectory() as tmp:
            export_safetensors(model, tmp)
            dest = ROOT / "quark" / name
            fixtures[name] = keep_layer(Path(tmp), dest)
        save_ref(dest, ref)
    write_versions("quark", ["amd-quark", "transformers", "torch", "safetensors"], fixtures, {
        "dequant": "QuantLinear.get_quant_weight(weight) on the quantized (not frozen) model: Quark's own QDQ",
        "output": "QuantLinear(x): Quark's fake-quantized input (dynamic per-token or static per-tensor int8) "
                  "times its QDQ weight, in bfloat16",
        "exclude": "attention, router and lm_head left unquantized (only the experts are the subject)",
    })


# ---------------------------------------------------------------- NVIDIA ModelOpt


def make_modelopt() -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import MXFP8QTensor

    model = tiny_qwen3_moe()
    cal = calibration()

    def loop(m: torch.nn.Module) -> None:
        for row in cal:
            m(row.unsqueeze(0))

    model = mtq.quantize(model, mtq.MXFP8_DEFAULT_CFG, loop)
    experts = model.model.layers[0].mlp.experts  # transformers 5 fused experts under ModelOpt's _QuantFusedExperts
    inter = SHAPE["moe_intermediate_size"]

    def qdq(t: torch.Tensor) -> torch.Tensor:
        # ModelOpt's fake-quant of MX formats needs its CUDA extension; its MXFP8QTensor (what the
        # exporter packs with) quantizes and dequantizes on the CPU.
        q, scale = MXFP8QTensor.quantize(t)
        return q.dequantize(scale=scale)

    x = inputs()
    ref: dict[str, torch.Tensor] = dict(x)
    with torch.no_grad():
        h, i = qdq(x["hidden_states"]), qdq(x["intermediate_states"])
        for e in range(SHAPE["num_experts"]):
            gate_up, down = qdq(experts.gate_up_proj[e].detach()), qdq(experts.down_proj[e].detach())
            gu_out = torch.nn.functional.linear(h, gate_up)
            for role, w, out in (("gate", gate_up[:inter], gu_out[:, :inter]),
                                 ("up", gate_up[inter:], gu_out[:, inter:]),
                                 ("down", down, torch.nn.functional.linear(i, down))):
                if e < DEQUANT_EXPERTS:
                    ref[f"experts.{e}.{role}.dequant"] = w
                ref[f"experts.{e}.{role}.output"] = out
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(model, export_dir=tmp)
        dest = ROOT / "modelopt" / "qwen3-mxfp8"
        fixtures = {"qwen3-mxfp8": keep_layer(Path(tmp), dest, ("hf_quant_config.json",))}
    save_ref(dest, ref)
    write_versions("modelopt", ["nvidia-modelopt", "transformers", "torch", "safetensors"], fixtures, {
        "config": "mtq.MXFP8_DEFAULT_CFG (weights and inputs MXFP8, E8M0 scale per 32), export_hf_checkpoint",
        "dequant": "MXFP8QTensor.quantize(w) then .dequantize(scale=...) on the fused transformers-5 expert tensor "
                   "(gate = first moe_intermediate_size rows of gate_up_proj[e]); ModelOpt's TensorQuantizer fake "
                   "quant of MX formats needs its CUDA extension, which cannot build here",
        "output": "F.linear(MXFP8 QDQ of x, that weight), the activation QDQ by the same MXFP8QTensor; no layer "
                  "output (the quantized block's forward needs the CUDA extension)",
    })


# ---------------------------------------------------------------- llm-compressor / compressed-tensors


def make_compressed_tensors() -> None:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    group = 32  # the presets' 128 would be one group per row at these widths
    presets = {"qwen3-w8a8-int8": ("W8A8", None), "qwen3-w4a16": ("W4A16", group), "qwen3-w4a8": ("W4A8", group)}
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]
    fixtures: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as base:
        tiny_qwen3_moe().save_pretrained(base)  # oneshot reads the model's config from its directory
        for name, (preset, group_size) in presets.items():
            scheme = preset_name_to_scheme(preset, ["Linear"])
            if group_size is not None:
                scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(
                    update={"group_size": group_size})})
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            model = oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore))
            block = model.model.layers[0].mlp
            experts = block.experts  # llm-compressor's linearised experts: experts[e].gate_proj ...
            x = inputs()
            ref = {**x, **linear_refs(
                lambda e, r, ex=experts: getattr(ex[e], f"{r}_proj"),
                lambda lin: forward_quantize(lin, lin.weight.data, "weight", lin.quantization_scheme.weights), x),
                **layer_output(block, experts, x["hidden_states"])}
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp, save_compressed=True)
                dest = ROOT / "compressed_tensors" / name
                fixtures[name] = {"preset": preset, "group_size": group_size, **keep_layer(Path(tmp), dest)}
            save_ref(dest, ref)
    write_versions("compressed_tensors", ["llmcompressor", "compressed-tensors", "transformers", "torch",
                                          "safetensors"], fixtures, {
        "recipe": "oneshot(QuantizationModifier(config_groups={group_0: preset_name_to_scheme(preset, [Linear])}))"
                  ", data-free; W4 presets with group_size 32 instead of 128",
        "dequant": "compressed_tensors forward_quantize(module, weight, 'weight', scheme.weights) before saving",
        "output": "the quantized Linear's own forward (dynamic per-token int8 input QDQ where the preset has it)",
    })


PRODUCERS = {"quark": make_quark, "modelopt": make_modelopt, "compressed-tensors": make_compressed_tensors}


if __name__ == "__main__":
    sys.exit(fixture_kit.run_producer("make_fixtures_quark_modelopt_ct.py", PRODUCERS, sys.argv[1:]))
