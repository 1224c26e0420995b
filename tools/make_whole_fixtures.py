"""Write tests/fixtures/whole/<producer-scheme>/checkpoint/: tiny WHOLE models quantized and saved by their
producers, each with the reference ``load_model`` is held to (run by hand, not in CI; each producer in its own
venv, as the layer makers' docstrings set them up):

    /work/producers/llmc/bin/python tools/make_whole_fixtures.py compressed-tensors   # llm-compressor presets
    /work/producers/llmc/bin/python tools/make_whole_fixtures.py gpt-oss-mxfp4        # needs accelerate
    /work/producers/tf/bin/python   tools/make_whole_fixtures.py transformers-fp8     # FineGrainedFP8Config

The model is a random Qwen3-MoE from transformers' own classes (fixture_kit.tiny_qwen3_moe, two decoder layers,
both MoE, weights spread as tools/make_transformers_whole.py spreads them so greedy tokens are decided by clear
margins); gpt-oss for MXFP4. The producer quantizes it as it always does, attention included where its recipe
includes it, and saves it; every file a loader reads is kept as written. ``<producer-scheme>/ref.safetensors``:

- ``input_ids`` [1, 8]; ``greedy`` [1, 8 + 16]: the greedy continuation (one full forward per token, no cache) of
  transformers' own model class in float32 holding the PRODUCER'S OWN dequantised weights (every quantized linear
  and expert as the producer's dequantisation reconstructs it, the rest as the source model had it);
- ``logits`` [1, 8 + 16, vocab]: that model's logits on ``greedy`` (the first 8 rows: on the prompt; each later
  row: what its greedy step chose from).

VERSIONS.json names every version and what each producer did. Nothing here imports moe_registry.
"""

from __future__ import annotations

import copy
import json
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

import fixture_kit
import torch
from make_transformers_whole import randomise

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "whole"
SEED = 5678
LAYERS = 2
PROMPT_TOKENS = 8
NEW_TOKENS = 16
SHAPE = {"hidden_size": 64, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
# FP8 with 128x128 weight blocks: whole blocks need widths of 128
WIDE = {"hidden_size": 128, "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}
EXPERT = re.compile(r"(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<role>gate|up|down)_proj$")
KEPT_FILES = ("config.json", "hf_quant_config.json", "generation_config.json")


def source_model(shape: Mapping[str, int], head_dim: int = 16) -> torch.nn.Module:
    model = fixture_kit.tiny_qwen3_moe(SEED, shape, intermediate_size=64, head_dim=head_dim, layers=LAYERS)
    randomise(model, SEED)
    return model


def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(SEED + 1))


def parameters_of(dequantised: Mapping[str, torch.Tensor],
                  state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-module dequantised weights ([out, in], keyed by module name) as transformers' parameters: a linear's
    ``<module>.weight``; a linearised expert's projection into the fused ``experts.gate_up_proj`` [E, 2I, H] (gate
    rows first) / ``experts.down_proj`` [E, H, I]. Names that already are parameters pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, w in dequantised.items():
        m = EXPERT.match(name)
        if name in state:
            out[name] = w.float()
        elif m is None:
            out[f"{name}.weight"] = w.float()
        else:
            fused = f"{m['experts']}.{'down_proj' if m['role'] == 'down' else 'gate_up_proj'}"
            target = out.setdefault(fused, state[fused].float().clone())
            e, rows = int(m["e"]), w.shape[0]
            start = rows if m["role"] == "up" else 0
            target[e, start:start + rows] = w.float()
    return out


def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def reference(model: torch.nn.Module, dequantised: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """``model`` (transformers' own class) in float32 with ``dequantised`` put in: logits and greedy tokens, and how
    many parameters were replaced."""
    ref_model = copy.deepcopy(model).float().eval()
    state = ref_model.state_dict()
    params = parameters_of(dequantised, state)
    missing = sorted(set(params) - set(state))
    if missing:
        raise SystemExit(f"dequantised weights name no parameter of the model: {missing[:3]}")
    with torch.no_grad():
        for name, w in params.items():
            if state[name].shape != w.shape:
                raise SystemExit(f"{name}: dequantised {tuple(w.shape)}, parameter {tuple(state[name].shape)}")
            state[name].copy_(w)
    ids = prompt()
    tokens = greedy(ref_model, ids, NEW_TOKENS)
    with torch.no_grad():  # causal: the logits at each position are those its greedy step saw
        logits = ref_model(tokens).logits.float()
    return {"input_ids": ids, "greedy": tokens, "logits": logits}, len(params)


def keep_whole(export_dir: Path, name: str, ref: tuple[dict[str, torch.Tensor], int]) -> dict[str, object]:
    """Every file the producer wrote that a loader reads (config, quantization config, safetensors) into
    tests/fixtures/whole/<name>/checkpoint/ (a model dir), ref.safetensors beside it (outside: a loader reads every
    safetensors file of the dir); returns the facts for VERSIONS.json."""
    dest = ROOT / name
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "checkpoint").mkdir(parents=True)
    for path in sorted(export_dir.iterdir()):
        if path.name in KEPT_FILES or path.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(path, dest / "checkpoint" / path.name)
    fixture_kit.save_ref(dest, ref[0])
    config = json.loads((dest / "checkpoint" / "config.json").read_text())
    return {"quantization_config": config.get("quantization_config"),
            "files": sorted(p.name for p in (dest / "checkpoint").iterdir()),
            "bytes": sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()),
            "dequantised_parameters": ref[1]}


def write_versions(producer: str, packages: list[str], fixtures: dict[str, object], notes: dict[str, str]) -> None:
    path = ROOT / "VERSIONS.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("maker", "tools/make_whole_fixtures.py")
    data["model"] = (f"Qwen3MoeForCausalLM (gpt-oss: GptOssForCausalLM), {LAYERS} decoder layers, all MoE, "
                     f"{SHAPE} (FP8 blocks: {WIDE}), vocab 256, seed {SEED}")
    data["reference"] = (f"ref.safetensors: input_ids [1, {PROMPT_TOKENS}], the greedy continuation [1, "
                         f"{PROMPT_TOKENS + NEW_TOKENS}] of transformers' model (float32) holding the producer's "
                         f"dequantised weights, and its float32 logits on that sequence")
    producers = data.setdefault("producers", {})
    producers[producer] = {"python": platform.python_version(),
                           "versions": {p: version(p) for p in packages}, "notes": notes, "fixtures": fixtures}
    for name in fixtures:
        for other, entry in producers.items():
            if other != producer:
                entry["fixtures"].pop(name, None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- llm-compressor / compressed-tensors

CT_PRESETS = {"ct-w4a16": ("W4A16", 32), "ct-w8a8-int8": ("W8A8", None), "ct-fp8-dynamic": ("FP8_DYNAMIC", None),
              "ct-nvfp4": ("NVFP4", None), "ct-mxfp4": ("MXFP4", None)}
CT_IGNORE = ["lm_head", "re:.*mlp.gate$"]  # llm-compressor's MoE examples: the router and lm_head stay float


def make_compressed_tensors() -> None:
    """llm-compressor's ``oneshot`` with one preset over every Linear but lm_head and the router (attention
    included, the experts linearised by llm-compressor itself), 8 calibration sequences (NVFP4's global input scale
    needs data), saved with ``save_compressed=True``. Dequantised: compressed-tensors' ``forward_quantize`` of each
    quantized module's weight with its own scheme and scales, the fake quantisation its forward runs (bfloat16)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    ids = fixture_kit.calibration_ids(SEED, rows=8)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    fixtures: dict[str, object] = {}
    for name, (preset, group) in CT_PRESETS.items():
        scheme = preset_name_to_scheme(preset, ["Linear"])
        if group is not None:  # the preset's 128 would be one group per row at these widths
            scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"group_size": group})})
        src = source_model(SHAPE)
        with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as tmp:
            src.save_pretrained(base)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            model = oneshot(model=model, dataset=data, num_calibration_samples=8,
                            recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=CT_IGNORE))
            dequantised = {}
            with torch.no_grad():
                for mod_name, mod in model.named_modules():
                    qs = getattr(mod, "quantization_scheme", None)
                    if qs is not None and qs.weights is not None:
                        # the producer's forward: bfloat16 weight, code x scale rounded to bfloat16 as it computes
                        dequantised[mod_name] = forward_quantize(mod, mod.weight.data, "weight", qs.weights).float()
            ref = reference(src, dequantised)
            model.save_pretrained(tmp, save_compressed=True)
            fixtures[name] = {"preset": preset, "group_size": group, **keep_whole(Path(tmp), name, ref)}
    write_versions("compressed-tensors", ["llmcompressor", "compressed-tensors", "transformers", "torch",
                                          "safetensors"], fixtures, {
        "recipe": f"oneshot(QuantizationModifier(config_groups={{group_0: preset_name_to_scheme(preset, [Linear])}}, "
                  f"ignore={CT_IGNORE}), 8 calibration sequences; W4A16 with group_size 32 instead of 128",
        "dequant": "compressed_tensors forward_quantize(module, weight, 'weight', scheme.weights) per quantized module "
                   "(bfloat16, as its forward runs: code x scale rounded to bfloat16)",
    })


# ---------------------------------------------------------------- transformers FineGrainedFP8

def make_transformers_fp8() -> None:
    """transformers' FineGrainedFP8Config (default: 128x128 blocks, dynamic activations) quantizes while
    from_pretrained loads the bf16 model, every Linear but lm_head and the fused experts; save_pretrained writes it.
    Its GPU check is bypassed (as tools/make_fixtures_fp8.py does: the quantizer's op runs on the CPU). Dequantised:
    transformers' own ``Fp8Dequantize._dequantize_one`` of every fp8 weight with its scale_inv."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None  # CPU: no GPU check
    name = "transformers-fp8-block"
    src = source_model(WIDE, head_dim=64)
    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as tmp:
        src.save_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16,
                                                     quantization_config=FineGrainedFP8Config())
        deq = Fp8Dequantize(model.hf_quantizer)._dequantize_one
        dequantised = {}
        with torch.no_grad():
            for mod_name, mod in model.named_modules():
                for pname, p in mod.named_parameters(recurse=False):
                    scale = getattr(mod, f"{pname}_scale_inv", None)
                    if p.dtype == torch.float8_e4m3fn and scale is not None:
                        full = f"{mod_name}.{pname}"
                        dequantised[full] = deq(p, scale, torch.float32) if p.dim() == 2 else \
                            torch.stack([deq(p[e], scale[e], torch.float32) for e in range(p.shape[0])])
        ref = reference(src, dequantised)
        model.save_pretrained(tmp)
        fixtures = {name: keep_whole(Path(tmp), name, ref)}
    write_versions("transformers-fp8", ["transformers", "torch", "safetensors"], fixtures, {
        "config": "from_pretrained(bf16 model, quantization_config=FineGrainedFP8Config()), save_pretrained; "
                  "FineGrainedFP8HfQuantizer.validate_environment bypassed (it refuses to quantize without a GPU)",
        "dequant": "transformers' Fp8Dequantize._dequantize_one(codes, scale_inv, float32), per expert for FP8Experts",
    })


# ---------------------------------------------------------------- gpt-oss MXFP4

def make_gpt_oss_mxfp4() -> None:
    """A two-layer gpt-oss whose experts are written in OpenAI's MXFP4 layout by make_fixtures_fp4.as_openai_mxfp4
    (transformers cannot quantize MXFP4 on a CPU: its quantizer is triton_kernels' downcast_to_mxfp on a GPU),
    attention and router in bfloat16 as gpt-oss-20b has them. Dequantised: transformers' own reader,
    ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``."""
    from make_fixtures_fp4 import as_openai_mxfp4
    from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

    torch.manual_seed(SEED)
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, layer_types=["full_attention"] * LAYERS, max_position_embeddings=128,
                       dtype="bfloat16")
    src = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    randomise(src, SEED)
    src.config.architectures = ["GptOssForCausalLM"]
    name = "gpt-oss-mxfp4"
    with tempfile.TemporaryDirectory() as tmp:
        src.save_pretrained(tmp)
        as_openai_mxfp4(Path(tmp))
        loaded = GptOssForCausalLM.from_pretrained(tmp, quantization_config=Mxfp4Config(dequantize=True),
                                                   dtype=torch.bfloat16, device_map="cpu").eval()
        dequantised = {k: v.detach().float() for k, v in loaded.state_dict().items() if ".experts." in k
                       and k.endswith(("gate_up_proj", "down_proj"))}
        ref = reference(src, dequantised)
        fixtures = {name: keep_whole(Path(tmp), name, ref)}
    write_versions("gpt-oss-mxfp4", ["transformers", "accelerate", "torch", "safetensors"], fixtures, {
        "layout": "codes written by make_fixtures_fp4.as_openai_mxfp4 in OpenAI's layout (transformers cannot quantize "
                  "MXFP4 on a CPU); config quantization_config as gpt-oss-20b has it",
        "dequant": "transformers' Mxfp4Config(dequantize=True) reader: the loaded model's experts.gate_up_proj / "
                   "down_proj",
    })


PRODUCERS = {"compressed-tensors": make_compressed_tensors, "transformers-fp8": make_transformers_fp8,
             "gpt-oss-mxfp4": make_gpt_oss_mxfp4}


if __name__ == "__main__":
    sys.exit(fixture_kit.run_producer("make_whole_fixtures.py", PRODUCERS, sys.argv[1:]))
