"""Write the FP8 W8A8 fixtures under tests/fixtures/fp8/ with the producers themselves.

Run by hand (not in CI), once per producer, each in its own venv (they pin different transformers):

    /work/producers/llmc/bin/python     tools/make_fixtures_fp8.py llmc       # llm-compressor 0.14.0.1,
                                                                             # compressed-tensors 0.19.0
    /work/producers/modelopt/bin/python tools/make_fixtures_fp8.py modelopt   # nvidia-modelopt 0.47.0
    /work/producers/tf/bin/python       tools/make_fixtures_fp8.py transformers  # transformers 5.24.0 alone

(all venvs: torch 2.13.0 CPU, transformers 5.x; see VERSIONS.json for the exact versions used.)

``quant_method: fp8`` without ``weight_block_size`` (AutoFP8 / Mixtral-FP8 style) has no fixture
here: AutoFP8 is not on PyPI (``pip download auto-fp8`` and ``pip download autofp8`` find no
distribution) and ``pip download git+https://github.com/neuralmagic/AutoFP8`` could not resolve
github.com from this machine, so tests/test_producers_fp8.py
writes that checkpoint itself with torch from the public facts of vLLM's Fp8Config (see its docstring).

Each fixture is a tiny Qwen3-MoE (transformers' own config class and model, bfloat16, one layer,
4 experts, hidden 128, moe_intermediate 128: whole 128x128 blocks for FP8_BLOCK) quantized and saved
by the library on the CPU. Only config.json (+ hf_quant_config.json where the library writes one)
and the first MoE layer's router and expert tensors are kept, with the names and dtypes the library
wrote. ref.safetensors holds the library's OWN numbers:

- ``experts.0.{role}.dequant``: expert 0's weights as the library dequantises them, the first 16
  output rows of each projection (the fixture budget: 1 MB for all fixtures);
- ``experts.{e}.{role}.output``: the library's quantized linear on ``hidden_states`` (gate/up) or
  ``intermediate_states`` (down), with its activation quantisation (experts 0 and 1);
- ``layer.output`` (llm-compressor): the library's quantized MoE block on ``hidden_states``, with
  the routing it chose (``layer.topk_ids``, ``layer.topk_weights``).

Nothing here imports moe_registry: the fixture tensors are the producers' own.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import fixture_kit
import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "fp8"
SEED = 4321
TOKENS = 8
LAYER = fixture_kit.LAYER
SHAPE = {"hidden_size": 128, "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}
ROLES = ("gate", "up", "down")
OUTPUT_EXPERTS = 2  # producer linear outputs kept for experts 0..1
DEQUANT_EXPERTS = 1  # producer dequantised weights kept for expert 0 ...
DEQUANT_ROWS = 16  # ... its first 16 output rows of each projection (all fixtures together stay under 1 MB)
TF_DEQUANT_ROWS = 4  # transformers: the first 4 rows of EVERY expert's projections (its scales are stacked)


def tiny_qwen3_moe() -> torch.nn.Module:
    """A random one-layer Qwen3-MoE in bfloat16 from transformers' own config class."""
    return fixture_kit.tiny_qwen3_moe(SEED, SHAPE, intermediate_size=256, head_dim=32)


def inputs() -> dict[str, torch.Tensor]:
    return fixture_kit.inputs(SEED, TOKENS, SHAPE)


def calibration() -> torch.Tensor:
    return fixture_kit.calibration_ids(SEED)


layer_output, keep_layer, save_ref = fixture_kit.layer_output, fixture_kit.keep_layer, fixture_kit.save_ref


def make_llmc() -> None:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    presets = {"llmc-fp8": "FP8", "llmc-fp8-dynamic": "FP8_DYNAMIC", "llmc-fp8-block": "FP8_BLOCK"}
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]
    fixtures: dict[str, object] = {}
    cal = calibration()
    with tempfile.TemporaryDirectory() as base:
        tiny_qwen3_moe().save_pretrained(base)
        for name, preset in presets.items():
            scheme = preset_name_to_scheme(preset, ["Linear"])
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)
            static = not scheme.input_activations.dynamic
            if static:  # static input scales need calibration data
                ds = Dataset.from_dict({"input_ids": cal.tolist(), "attention_mask": torch.ones_like(cal).tolist()})
                model = oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(cal),
                                max_seq_length=cal.shape[1])
            else:
                model = oneshot(model=model, recipe=recipe)
            block = model.model.layers[0].mlp
            experts = block.experts  # llm-compressor's linearised experts: experts[e].gate_proj ...
            x = inputs()
            ref: dict[str, torch.Tensor] = dict(x)
            with torch.no_grad():
                for e in range(SHAPE["num_experts"]):
                    for role in ROLES:
                        lin = getattr(experts[e], f"{role}_proj")
                        if e < DEQUANT_EXPERTS:
                            ref[f"experts.{e}.{role}.dequant"] = forward_quantize(
                                lin, lin.weight.data, "weight", lin.quantization_scheme.weights)[:DEQUANT_ROWS]
                        if e < OUTPUT_EXPERTS:
                            src = x["intermediate_states"] if role == "down" else x["hidden_states"]
                            ref[f"experts.{e}.{role}.output"] = lin(src)
            ref.update(layer_output(block, experts, x["hidden_states"]))
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp, save_compressed=True)
                dest = ROOT / name
                fixtures[name] = {"preset": preset, "calibrated": static, **keep_layer(Path(tmp), dest)}
            save_ref(dest, ref)
    _merge_versions("llmc", ["llmcompressor", "compressed-tensors", "transformers", "torch", "safetensors"],
                    fixtures, {
                        "recipe": "oneshot(QuantizationModifier(config_groups={group_0: preset_name_to_scheme(preset, "
                                  "[Linear])})); FP8 (static input scales) calibrated on 4 x 32 random token ids, "
                                  "the dynamic presets data-free",
                        "dequant": "compressed_tensors forward_quantize(module, weight, 'weight', scheme.weights)",
                        "output": "the quantized Linear's own forward (its input QDQ: static per-tensor, dynamic "
                                  "per-token or per-group-128 fp8)",
                    })


# ---------------------------------------------------------------- NVIDIA ModelOpt


def make_modelopt() -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = tiny_qwen3_moe()
    cal = calibration()

    def loop(m: torch.nn.Module) -> None:
        for row in cal:
            m(row.unsqueeze(0))

    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, loop)
    experts = model.model.layers[0].mlp.experts  # transformers 5 fused experts under ModelOpt's _QuantFusedExperts
    x = inputs()
    with torch.no_grad():  # ModelOpt's input quantizers (the export removes them)
        qdq = {"hidden_states": experts.gate_up_proj_input_quantizer(x["hidden_states"]).float(),
               "intermediate_states": experts.down_proj_input_quantizer(x["intermediate_states"]).float()}
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(model, export_dir=tmp)
        dest = ROOT / "modelopt-fp8"
        fixtures = {"modelopt-fp8": keep_layer(Path(tmp), dest, ("hf_quant_config.json",))}
    ref: dict[str, torch.Tensor] = dict(x)
    ref.update(_modelopt_refs(dest, qdq))
    save_ref(dest, ref)
    _merge_versions("modelopt", ["nvidia-modelopt", "transformers", "torch", "safetensors"], fixtures, {
        "config": "mtq.FP8_DEFAULT_CFG (weights and inputs fp8 e4m3 per tensor, max calibration on 4 x 32 random "
                  "token ids), export_hf_checkpoint",
        "dequant": "ModelOpt's FP8QTensor(exported codes).dequantize(dtype=float32, scale=exported weight_scale): "
                   "the exported checkpoint as ModelOpt's real-quant tensor reads it (its fake quant of the same "
                   "weights picks a different code for ~2.5% of them, so the checkpoint, which is what a server "
                   "loads, is the reference)",
        "output": "F.linear(ModelOpt's input quantizer(x) (static per-tensor fake quant), that weight), float32",
    })


def _modelopt_refs(dest: Path, qdq: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt's dequantisation of the exported projections and its linear on its quantized inputs."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    ref: dict[str, torch.Tensor] = {}
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    h, i = qdq["hidden_states"], qdq["intermediate_states"]
    with torch.no_grad():
        for e in range(OUTPUT_EXPERTS):
            for role in ROLES:
                name = f"{LAYER}experts.{e}.{role}_proj"
                q, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
                w = FP8QTensor(q.shape, torch.float32, q).dequantize(dtype=torch.float32, scale=s)
                if e < DEQUANT_EXPERTS:
                    ref[f"experts.{e}.{role}.dequant"] = w[:DEQUANT_ROWS]
                ref[f"experts.{e}.{role}.output"] = torch.nn.functional.linear(i if role == "down" else h, w)
    return ref


def _merge_versions(producer: str, packages: list[str], fixtures: dict[str, object], notes: dict[str, str]) -> None:
    """VERSIONS.json is shared by the producers: each run replaces its own entry only."""
    path = ROOT / "VERSIONS.json"
    ROOT.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.is_file() else {
        "producer": "tools/make_fixtures_fp8.py", "seed": SEED, "tokens": TOKENS, "dequant_experts": DEQUANT_EXPERTS,
        "dequant_rows": DEQUANT_ROWS, "output_experts": OUTPUT_EXPERTS,
        "model": "Qwen3MoeForCausalLM, bfloat16, 1 layer, " + ", ".join(f"{k}={v}" for k, v in SHAPE.items()),
        "producers": {}}
    data["producers"][producer] = {"python": platform.python_version(), **{p: version(p) for p in packages},
                                   "notes": notes, "fixtures": fixtures}
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------- transformers' own FP8 (FineGrainedFP8Config)


def make_transformers() -> None:
    """transformers' FineGrainedFP8Config (quant_method fp8) quantizes while from_pretrained loads the bf16
    model (Fp8Quantize, the quantizer's own op) and save_pretrained writes it. Its validate_environment
    refuses a CPU-only machine before quantizing (``No GPU or XPU found``); that check alone is bypassed.

    What transformers 5.24 writes for a Qwen3-MoE (found here, see VERSIONS.json): the experts module is
    FP8Experts, fused 3-D ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] quantized as whole
    [2I, H] / [H, I] tensors; save_pretrained splits the WEIGHTS back per expert
    (``experts.N.gate_proj.weight``) but writes the scales stacked as the module holds them:
    ``experts.gate_up_proj_scale_inv`` / ``experts.down_proj_scale_inv`` [E, 1, 1] (per tensor: ONE scale
    shared by gate and up) or [E, 2I/128, H/128] / [E, H/128, I/128] (block 128, gate's block rows first).
    Static (``activation_scheme='static'``) adds ``experts.{gate_up,down}_proj_activation_scale`` [E]
    float32, which nothing calibrates (requires_calibration is False): they hold uninitialised memory, so
    no static fixture is kept; only the names, dtypes and shapes written are recorded.

    ref.safetensors: the quantizer's in-memory codes and scales dequantised by transformers' own
    ``Fp8Dequantize._dequantize_one`` (float32; first 4 rows of every expert's projections), and
    ``layer.output``: transformers' Qwen3MoeSparseMoeBlock (bfloat16) with those dequantised weights, with its
    routing. The producer's fp8 forward cannot run here (it needs the kernels-community/finegrained-fp8
    Triton kernel from the Hub and a GPU), so activations in that output are not quantised.
    """
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None  # CPU: no GPU check
    configs = {"transformers-fp8-dynamic": {"weight_block_size": None},
               "transformers-fp8-block": {},  # the default: weight_block_size (128, 128), dynamic
               # DeepSeek-V4-style block scales: powers of two stored as float8_e8m0fnu
               "transformers-fp8-block-ue8m0": {"scale_fmt": "ue8m0"},
               "transformers-fp8-static": {"weight_block_size": None, "activation_scheme": "static"}}
    fixtures: dict[str, object] = {}
    x = inputs()
    i = SHAPE["moe_intermediate_size"]
    with tempfile.TemporaryDirectory() as base:
        tiny_qwen3_moe().save_pretrained(base)
        for name, kwargs in configs.items():
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16,
                                                         quantization_config=FineGrainedFP8Config(**kwargs))
            block = model.model.layers[0].mlp
            experts = block.experts
            deq = Fp8Dequantize(model.hf_quantizer)._dequantize_one
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                if name.endswith("static"):  # recorded, not kept (see the docstring)
                    fixtures[name] = {"kept": False, **_written_facts(Path(tmp))}
                    continue
                dest = ROOT / name
                fixtures[name] = keep_layer(Path(tmp), dest)
            written = load_file(str(dest / "model.safetensors"))
            ref: dict[str, torch.Tensor] = dict(x)
            with torch.no_grad():
                dense = {}
                for what in ("gate_up_proj", "down_proj"):
                    q, s = getattr(experts, what).data, getattr(experts, f"{what}_scale_inv").data
                    # the file is the module's state: scales as held, codes split per expert (gate rows first)
                    assert torch.equal(written[f"{LAYER}experts.{what}_scale_inv"], s), what
                    dense[what] = torch.stack([deq(q[e], s[e], torch.float32) for e in range(q.shape[0])])
                    for e in range(q.shape[0]):
                        parts = {"gate": q[e, :i], "up": q[e, i:]} if what == "gate_up_proj" else {"down": q[e]}
                        for role, codes in parts.items():
                            file_codes = written[f"{LAYER}experts.{e}.{role}_proj.weight"]
                            assert torch.equal(file_codes.view(torch.uint8), codes.view(torch.uint8)), (e, role)
                            w = dense[what][e, :i] if role == "gate" else dense[what][e, i:] if role == "up" \
                                else dense[what][e]
                            ref[f"experts.{e}.{role}.dequant"] = w[:TF_DEQUANT_ROWS].contiguous()
                plain = tiny_qwen3_moe().model.layers[0].mlp  # same seed: the bf16 model that was quantized
                plain.experts.gate_up_proj.data = dense["gate_up_proj"].to(torch.bfloat16)
                plain.experts.down_proj.data = dense["down_proj"].to(torch.bfloat16)
                plain.gate.weight.data = block.gate.weight.data.clone()
                ref.update(layer_output(plain, plain.experts, x["hidden_states"]))
            save_ref(dest, ref)
    _merge_versions("transformers", ["transformers", "torch", "safetensors"], fixtures, {
        "config": "AutoModelForCausalLM.from_pretrained(bf16 model, quantization_config=FineGrainedFP8Config(**kw)) "
                  "(kw: weight_block_size=None; the default (128, 128); scale_fmt='ue8m0'; weight_block_size=None + "
                  "activation_scheme='static'), save_pretrained; FineGrainedFP8HfQuantizer.validate_environment "
                  "bypassed (it refuses to quantize without a GPU)",
        "dequant": "transformers' Fp8Dequantize._dequantize_one(FP8Experts codes [2I, H] / [H, I], their scale_inv, "
                   "float32), every expert, first 4 rows per projection",
        "output": "layer.output: transformers' Qwen3MoeSparseMoeBlock (bfloat16) with those dequantised weights, "
                  "activations NOT quantised (the fp8 forward needs the Hub's kernels-community/finegrained-fp8 "
                  "Triton kernel and a GPU)",
        "static": "FineGrainedFP8Config(activation_scheme='static') writes {gate_up,down}_proj_activation_scale "
                  "[E] float32 that nothing calibrates (uninitialised memory: 2.1e13, 3.1e-41 seen); not kept",
    })


def _written_facts(export_dir: Path) -> dict[str, object]:
    """quantization_config and the first MoE layer's expert-0 and stacked tensors: name -> [dtype, shape]."""
    config = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    tensors: dict[str, list[object]] = {}
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118  (safe_open is not iterable)
            rest = k.removeprefix(LAYER + "experts.")
            if rest != k and (rest.startswith("0.") or not rest[0].isdigit()):
                sl = f.get_slice(k)
                tensors[k] = [sl.get_dtype(), list(sl.get_shape())]
    return {"quantization_config": config, "expert_tensors": tensors}


PRODUCERS = {"llmc": make_llmc, "modelopt": make_modelopt, "transformers": make_transformers}


if __name__ == "__main__":
    sys.exit(fixture_kit.run_producer("make_fixtures_fp8.py", PRODUCERS, sys.argv[1:]))
