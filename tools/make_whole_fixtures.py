"""Write tests/fixtures/whole/<producer-scheme>/checkpoint/: tiny WHOLE models quantized and saved by their
producers, each with the reference ``load_model`` is held to (run by hand, not in CI; each producer in its own
venv, as the layer makers' docstrings set them up):

    /work/producers/llmc/bin/python tools/make_whole_fixtures.py compressed-tensors   # llm-compressor presets
    /work/producers/llmc/bin/python tools/make_whole_fixtures.py gpt-oss-mxfp4        # needs accelerate
    /work/producers/tf/bin/python   tools/make_whole_fixtures.py transformers-fp8     # FineGrainedFP8Config
    GPTQMODEL_CPU_WORKERS=2 /work/producers/gptq/bin/python tools/make_whole_fixtures.py gptqmodel
    /work/producers/awq/bin/python      tools/make_whole_fixtures.py autoawq   # + datasets, zstandard, hub < 1
    /work/producers/quark/bin/python    tools/make_whole_fixtures.py quark     # amd-quark 0.13 --no-deps, + scipy, onnx
    /work/producers/modelopt/bin/python tools/make_whole_fixtures.py modelopt  # nvidia-modelopt 0.47 --no-deps

(gptq and awq: tools/make_fixtures_gptq_awq.py's setup plus the packages named; quark and modelopt: torch==2.13.0,
the producer with --no-deps, then transformers==5.23.0, accelerate, safetensors and what its import asks for.)

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
KEPT_FILES = ("config.json", "hf_quant_config.json", "generation_config.json", "quantize_config.json",
              "quant_config.json")


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
        elif m is None or f"{name}.weight" in state:  # a linear, or an expert of a per-expert (transformers 4) model
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


def unquantized(tensors: Mapping[str, torch.Tensor],
                dequantised: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The producer's own float tensors (by parameter name) outside its quantized modules: what it left of the
    norms, embeddings, router and lm_head (AutoAWQ divides its scales into the norms before quantising)."""
    return {k: v for k, v in tensors.items()
            if k.rpartition(".")[0] not in dequantised and v.is_floating_point() and v.element_size() > 1}


def saved_tensors(export_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the producer saved, by its name in the file."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(export_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def reference(model: torch.nn.Module, dequantised: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``model`` (transformers' own class) in float32 with ``dequantised`` put in, and the producer's ``rest``
    (its float tensors outside the quantized modules, where it may have changed them) over the model's own:
    logits and greedy tokens, and how many parameters were replaced."""
    ref_model = copy.deepcopy(model).float().eval()
    state = ref_model.state_dict()
    kept = {k: v for k, v in (rest or {}).items() if k in state}
    replaced = parameters_of(dequantised, state)
    params = {**{k: v.float() for k, v in kept.items()}, **replaced}
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
    return {"input_ids": ids, "greedy": tokens, "logits": logits}, len(replaced)


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


# ---------------------------------------------------------------- GPTQModel and AutoAWQ

GPTQ_GROUP = 32


def calibration_rows() -> list[dict[str, torch.Tensor]]:
    ids = fixture_kit.calibration_ids(SEED, rows=8)
    return [{"input_ids": row[None], "attention_mask": torch.ones(1, ids.shape[1], dtype=torch.long)} for row in ids]


def make_gptqmodel() -> None:
    """GPTQModel's own quantisation (4-bit symmetric, group 32, format gptq, every Linear its Qwen3-MoE
    definition lists: attention and experts; the router and lm_head stay float) on the CPU, saved by
    ``GPTQModel.save``. Dequantised: the saved checkpoint loaded back by GPTQModel (torch backend, float16:
    v1 zero points converted as it converts them), each quantized linear's ``dequantize_weight``; the rest as
    GPTQModel saved it."""
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from make_fixtures_gptq_awq import tokenizer

    name = "gptqmodel-w4-sym"
    src = source_model(SHAPE).to(torch.float16)
    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as tmp:
        src.save_pretrained(base)
        tokenizer(Path(base), vocab=256)
        model = GPTQModel.load(base, QuantizeConfig(bits=4, group_size=GPTQ_GROUP, sym=True, desc_act=False,
                                                    format="gptq"), device="cpu")
        model.quantize(calibration_rows(), batch_size=1)
        model.save(tmp)
        del model
        loaded = GPTQModel.load(tmp, device="cpu", backend=BACKEND.GPTQ_TORCH, dtype=torch.float16)
        dequantised = {}
        with torch.no_grad():
            for mod_name, mod in loaded.model.named_modules():
                if hasattr(mod, "dequantize_weight") and hasattr(mod, "qweight"):
                    dequantised[mod_name] = type(mod).dequantize_weight(mod).t().float()  # [in, out] -> [out, in]
        ref = reference(src, dequantised, unquantized(saved_tensors(Path(tmp)), dequantised))
        fixtures = {name: {"bits": 4, "group_size": GPTQ_GROUP, "sym": True, "desc_act": False, "format": "gptq",
                           **keep_whole(Path(tmp), name, ref)}}
    write_versions("gptqmodel", ["gptqmodel", "transformers", "torch", "safetensors"], fixtures, {
        "config": f"GPTQModel.load(float16 model, QuantizeConfig(bits=4, group_size={GPTQ_GROUP}, sym=True, "
                  "desc_act=False, format='gptq')).quantize(8 calibration sequences), .save; float16 source; attention "
                  "and experts quantized, router and lm_head float as GPTQModel's Qwen3-MoE definition leaves them",
        "dequant": "the saved checkpoint loaded back by GPTQModel (BACKEND.GPTQ_TORCH, float16): each "
                   "TorchQuantLinear's dequantize_weight; norms, embeddings, router, lm_head as GPTQModel saved them",
    })


def make_autoawq() -> None:
    """AutoAWQ's own quantisation (4-bit, group 32, zero point, GEMM; the router left float with
    ``modules_to_not_convert``) on the CPU under the transformers it pins (4.51, per-expert Qwen3-MoE modules),
    saved by ``save_quantized``. head_dim 32: its clip search wants every clipped linear's outputs in multiples of
    64. Dequantised: AutoAWQ's ``dequantize_gemm`` of every WQLinear_GEMM; the rest (norms its scale search
    rescaled, embeddings, router, lm_head) as AutoAWQ's quantized model holds it."""
    from awq import AutoAWQForCausalLM
    from make_fixtures_gptq_awq import awq_dequantize, tokenizer
    from transformers import AutoTokenizer

    name = "autoawq-w4-gemm"
    src = source_model(SHAPE, head_dim=32).to(torch.float16)
    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as tmp:
        src.save_pretrained(base)
        tokenizer(Path(base), vocab=256)
        model = AutoAWQForCausalLM.from_pretrained(base, device_map="cpu", torch_dtype=torch.float16)
        ids = [row["input_ids"][0].tolist() for row in calibration_rows()]
        quant_config = {"w_bit": 4, "q_group_size": GPTQ_GROUP, "zero_point": True, "version": "GEMM",
                        "modules_to_not_convert": ["mlp.gate"]}
        model.quantize(AutoTokenizer.from_pretrained(base), quant_config=dict(quant_config), calib_data=ids,
                       n_parallel_calib_samples=None, max_calib_samples=8, max_calib_seq_len=32)
        dequantised = {}
        with torch.no_grad():
            for mod_name, mod in model.model.named_modules():
                if hasattr(mod, "qweight") and hasattr(mod, "qzeros"):
                    dequantised[mod_name] = awq_dequantize(mod).float()
        ref = reference(src, dequantised, unquantized(model.model.state_dict(), dequantised))
        model.save_quantized(tmp)
        fixtures = {name: {**quant_config, **keep_whole(Path(tmp), name, ref)}}
    write_versions("autoawq", ["autoawq", "transformers", "torch", "safetensors"], fixtures, {
        "config": f"AutoAWQForCausalLM.quantize(quant_config={{w_bit: 4, q_group_size: {GPTQ_GROUP}, zero_point: "
                  "True, version: GEMM, modules_to_not_convert: [mlp.gate]}, 8 calibration sequences), "
                  "save_quantized; attention and experts quantized; float16 source with head_dim 32 (its clip search "
                  "wants outputs in multiples of 64)",
        "dequant": "awq.utils.packing_utils.dequantize_gemm of each WQLinear_GEMM; norms (rescaled by AWQ's scale "
                   "search), embeddings, router and lm_head as the quantized model holds them",
    })


# ---------------------------------------------------------------- AMD Quark

def make_quark() -> None:
    """Quark's ModelQuantizer, int8 weights per output channel and dynamic per-token int8 inputs, every Linear
    but lm_head and the router (attention included), ``export_safetensors``. Dequantised: each QuantLinear's
    ``get_quant_weight`` (Quark's own QDQ of its weight, bfloat16) on the quantized model."""
    from quark.torch import ModelQuantizer, export_safetensors
    from quark.torch.quantization.config.config import Int8PerChannelSpec, QConfig, QLayerConfig
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    name = "quark-w8a8-int8"
    src = source_model(SHAPE)
    model = copy.deepcopy(src)
    preprocess_for_quantization(model)
    layer_cfg = QLayerConfig(
        weight=Int8PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=False).to_quantization_spec(),
        input_tensors=Int8PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=True).to_quantization_spec())
    exclude = ["lm_head", "*mlp.gate"]
    loader = torch.utils.data.DataLoader(fixture_kit.calibration_ids(SEED, rows=8), batch_size=1)
    model = ModelQuantizer(QConfig(global_quant_config=layer_cfg, exclude=exclude)).quantize_model(model, loader)
    dequantised = {}
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            if hasattr(mod, "get_quant_weight") and isinstance(getattr(mod, "weight", None), torch.Tensor):
                dequantised[mod_name] = mod.get_quant_weight(mod.weight).float()
    ref = reference(src, dequantised)
    with tempfile.TemporaryDirectory() as tmp:
        export_safetensors(model, tmp)
        fixtures = {name: keep_whole(Path(tmp), name, ref)}
    write_versions("quark", ["amd-quark", "transformers", "torch", "safetensors"], fixtures, {
        "config": f"QConfig(global_quant_config=QLayerConfig(weight=Int8PerChannelSpec(ch_axis=0), input_tensors="
                  f"Int8PerChannelSpec(ch_axis=0, is_dynamic=True)), exclude={exclude}), 8 calibration sequences, "
                  "export_safetensors; attention and experts quantized",
        "dequant": "QuantLinear.get_quant_weight(weight) of every quantized linear (Quark's QDQ, bfloat16)",
    })


# ---------------------------------------------------------------- NVIDIA ModelOpt

MODELOPT_CONFIGS = {"modelopt-fp8": "FP8_DEFAULT_CFG", "modelopt-nvfp4": "NVFP4_DEFAULT_CFG"}


def modelopt_dequantised(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt's own real-quant tensors on its export: ``FP8QTensor.dequantize`` of each fp8 weight with its
    weight_scale, ``NVFP4QTensor.dequantize`` of each packed e2m1 weight with its weight_scale and weight_scale_2
    (blocks of 16), float32."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    out: dict[str, torch.Tensor] = {}
    for key, codes in tensors.items():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or f"{module}.weight_scale" not in tensors:
            continue
        scale = tensors[f"{module}.weight_scale"]
        if codes.dtype == torch.float8_e4m3fn:
            out[module] = FP8QTensor(codes.shape, torch.float32, codes).dequantize(dtype=torch.float32, scale=scale)
        elif codes.dtype == torch.uint8:
            shape = torch.Size([codes.shape[0], codes.shape[1] * 2])
            out[module] = NVFP4QTensor(shape, torch.float32, codes).dequantize(
                dtype=torch.float32, scale=scale, double_scale=tensors[f"{module}.weight_scale_2"],
                block_sizes={-1: 16})
    return out


def make_modelopt() -> None:
    """ModelOpt's ``mtq.quantize`` with FP8_DEFAULT_CFG (fp8 e4m3 weights and static inputs per tensor) and
    NVFP4_DEFAULT_CFG (e2m1 weights in blocks of 16 with e4m3 scales and a global scale; its inputs NVFP4 too),
    its own exclusions (router and lm_head), calibrated on 8 sequences, ``export_hf_checkpoint``. Dequantised:
    the exported checkpoint (its export re-quantizes linears that share an input with one scale) read by
    ModelOpt's own real-quant tensors (:func:`modelopt_dequantised`); the rest as exported."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    cal = fixture_kit.calibration_ids(SEED, rows=8)

    def loop(m: torch.nn.Module) -> None:
        for row in cal:
            m(row[None])

    fixtures: dict[str, object] = {}
    for name, config in MODELOPT_CONFIGS.items():
        src = source_model(SHAPE)
        model = mtq.quantize(copy.deepcopy(src), getattr(mtq, config), loop)
        with tempfile.TemporaryDirectory() as tmp:
            export_hf_checkpoint(model, export_dir=tmp)
            tensors = saved_tensors(Path(tmp))
            dequantised = modelopt_dequantised(tensors)
            ref = reference(src, dequantised, unquantized(tensors, dequantised))
            fixtures[name] = {"config": config, **keep_whole(Path(tmp), name, ref)}
    write_versions("modelopt", ["nvidia-modelopt", "transformers", "torch", "safetensors"], fixtures, {
        "config": "mtq.quantize(model, mtq.<config>, 8 calibration sequences), export_hf_checkpoint; attention and "
                  "experts quantized, router and lm_head left as ModelOpt's config leaves them",
        "dequant": "FP8QTensor / NVFP4QTensor(exported codes).dequantize(dtype=float32, scale=weight_scale[, "
                   "double_scale=weight_scale_2, blocks of 16]) of every quantized weight; the other tensors as "
                   "exported",
    })

PRODUCERS = {"compressed-tensors": make_compressed_tensors, "transformers-fp8": make_transformers_fp8,
             "gpt-oss-mxfp4": make_gpt_oss_mxfp4, "gptqmodel": make_gptqmodel, "autoawq": make_autoawq,
             "quark": make_quark, "modelopt": make_modelopt}


if __name__ == "__main__":
    sys.exit(fixture_kit.run_producer("make_whole_fixtures.py", PRODUCERS, sys.argv[1:]))
