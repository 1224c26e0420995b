"""Write the FP4 fixtures under tests/fixtures/fp4/ (MXFP4 gpt-oss; NVFP4 where a producer writes it on a CPU).

Run by hand (not in CI), each in its producer's venv:

    # transformers 5.23 + accelerate (Mxfp4Config(dequantize=True) needs it; no other change to the venv):
    /work/producers/tf/bin/pip install --no-deps accelerate psutil
    /work/producers/tf/bin/python tools/make_fixtures_fp4.py mxfp4
    # nvidia-modelopt 0.47 (its own venv, transformers 5.23), NVFP4 calibrated and exported on the CPU:
    /work/producers/modelopt/bin/python tools/make_fixtures_fp4.py modelopt-nvfp4
    # llm-compressor 0.14 / compressed-tensors 0.19, the presets NVFP4, NVFP4A16 (nvfp4-pack-quantized)
    # and MXFP4A16, MXFP4 (mxfp4-pack-quantized):
    /work/producers/llmc/bin/python tools/make_fixtures_fp4.py compressed-tensors-fp4

mxfp4: a tiny gpt-oss (transformers' own GptOssConfig/GptOssForCausalLM, bfloat16, one layer, hidden 64,
intermediate 64, 4 experts, top-2) whose experts are stored as OpenAI's checkpoints store them:
``mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] (two e2m1 codes a byte, low nibble the even
input), ``gate_up_proj_scales`` uint8 [E, 2I, H/32] (E8M0), biases in bfloat16, ``down_proj_*`` likewise,
config.json ``quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}`` as gpt-oss-20b has
it. transformers cannot write MXFP4 on a CPU (its quantizer is triton_kernels' downcast_to_mxfp on a GPU),
so the codes are made here with that quantizer's rounding (scale 2^ceil(log2(amax / 6)), codes rounded to
nearest, ties to even); the GROUND TRUTH is transformers' own reader: the checkpoint loaded by
``GptOssForCausalLM.from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))`` on the CPU.
ref.safetensors holds what it produced:

- ``experts.gate_up_proj`` [E, H, 2I], ``experts.down_proj`` [E, I, H]: its dequantised weights (bfloat16);
- ``hidden_states`` [8, 64]; ``layer.output``: its MoE block (router, experts, clamped swiglu) on them,
  with the routing it chose (``layer.topk_ids``, ``layer.topk_weights``, caught at its experts module).

VERSIONS.json names every version used. Nothing here imports moe_registry.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import fixture_kit
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "fp4"
SEED = 4321
TOKENS = 8
HIDDEN, INTER, EXPERTS, TOP_K = 64, 64, 4, 2
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GPT_OSS_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale (|x| <= 6) -> e2m1 codes, nearest, ties to the even code."""
    mag = x.abs().float()
    dist = (mag[..., None] - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best  # at a tie two codes are nearest: take the even one (mantissa bit 0)
    even = ties & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), ties.float().argmax(-1))
    return (idx + 8 * ((x < 0) & (idx > 0))).to(torch.uint8)


def openai_mxfp4(w_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] float -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32])."""
    e, n, k = w_out_in.shape
    groups = w_out_in.float().reshape(e, n, k // 32, 32)
    amax = groups.abs().amax(-1)
    exp = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax)))).clamp(-127, 127)
    codes = _e2m1_codes(groups / torch.exp2(exp)[..., None])
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def tiny_gpt_oss() -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(SEED)
    cfg = GptOssConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, layer_types=["full_attention"], max_position_embeddings=128, dtype="bfloat16")
    model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # a useful spread (as tools/make_transformers_tiny.py): the clamp at 7 is reached
        for name, p in model.model.layers[0].mlp.named_parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * (0.3 if "bias" in name else 0.15)).to(p.dtype))
    model.config.architectures = ["GptOssForCausalLM"]
    return model


def _block_output(block: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, Any] = {}

    def hook(_m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["ids"] = kwargs.get("router_indices", args[1] if len(args) > 1 else None)
        seen["weights"] = kwargs.get("routing_weights", args[2] if len(args) > 2 else None)

    handle = block.experts.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        out = block(x.unsqueeze(0))
    handle.remove()
    out = out[0] if isinstance(out, tuple) else out
    weights = seen["weights"]
    if weights.shape[-1] != TOP_K:  # dense [tokens, E] scores: keep the chosen experts' weights
        weights = weights.gather(-1, seen["ids"].long())
    return {"layer.output": out.reshape(x.shape).contiguous(), "layer.topk_ids": seen["ids"].to(torch.int32),
            "layer.topk_weights": weights.contiguous()}


def as_openai_mxfp4(saved: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """Rewrite a gpt-oss dir saved by transformers in place as OpenAI's checkpoints are: every experts'
    ``gate_up_proj`` / ``down_proj`` ([E, in, out]) as ``*_blocks`` / ``*_scales`` ([E, out, in/32, 16] / [E, out,
    in/32]), config.json's quantization_config as gpt-oss-20b has it; returns the tensors, metadata and config."""
    path = saved / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = openai_mxfp4(tensors.pop(key).transpose(1, 2))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, str(path), metadata=metadata)
    cfg = json.loads((saved / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERT}
    (saved / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return tensors, metadata, cfg


def make_mxfp4() -> None:
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = tiny_gpt_oss()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors, metadata, cfg = as_openai_mxfp4(Path(tmp))

        loaded = GptOssForCausalLM.from_pretrained(tmp, quantization_config=Mxfp4Config(dequantize=True),
                                                   dtype=torch.bfloat16, device_map="cpu").eval()
        block = loaded.model.layers[0].mlp
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(SEED + 1)).to(torch.bfloat16)
        ref = {"experts.gate_up_proj": block.experts.gate_up_proj.detach().clone(),
               "experts.down_proj": block.experts.down_proj.detach().clone(), "hidden_states": x,
               **_block_output(block, x)}

        dest = ROOT / "gpt-oss-mxfp4"
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        kept = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.mlp.")}
        save_file(kept, str(dest / "model.safetensors"), metadata=metadata)
        save_file({k: v.contiguous() for k, v in ref.items()}, str(dest / "ref.safetensors"))
    _versions({"gpt-oss-mxfp4": {"model": f"GptOssForCausalLM, bfloat16, 1 layer, hidden {HIDDEN}, intermediate "
                                          f"{INTER}, {EXPERTS} experts, top-{TOP_K}",
                                 "tensors": sorted(kept), "ref": sorted(ref)}},
              {"mxfp4": "codes written by openai_mxfp4() here in OpenAI's layout (transformers cannot quantize MXFP4 "
                        "on a CPU); ref = transformers' Mxfp4Config(dequantize=True) reader and its GptOssMLP"})


def _versions(fixtures: dict[str, object], notes: dict[str, str],
              packages: tuple[str, ...] = ("transformers", "torch", "safetensors", "accelerate")) -> None:
    """Merge this run's fixtures, notes and versions (per fixture: each is made in its producer's venv)."""
    path = ROOT / "VERSIONS.json"
    old = json.loads(path.read_text()) if path.is_file() else {"fixtures": {}, "notes": {}}
    run = {"python": platform.python_version(), **{p: version(p) for p in packages}}
    out = {"producer": "tools/make_fixtures_fp4.py", "seed": SEED, "tokens": TOKENS,
           "packages": {**old.get("packages", {}), **{f"{name}": run for name in fixtures}},
           "fixtures": {**old.get("fixtures", {}), **fixtures}, "notes": {**old.get("notes", {}), **notes}}
    path.write_text(json.dumps(out, indent=2) + "\n")


def make_modelopt_nvfp4() -> None:
    """ModelOpt NVFP4 on the tiny Qwen3-MoE of make_fixtures_quark_modelopt_ct (mtq.NVFP4_DEFAULT_CFG,
    export_hf_checkpoint: hf_quant_config.json and config.json's quantization_config both written).
    ref: ``experts.{e}.{role}.dequant`` (experts 0, 1), float32, by ModelOpt's NVFP4QTensor.dequantize
    of the exported weight / weight_scale / weight_scale_2; ``hidden_states``."""
    import modelopt.torch.quantization as mtq
    from make_fixtures_quark_modelopt_ct import calibration, keep_layer, tiny_qwen3_moe
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    model = tiny_qwen3_moe()
    cal = calibration()

    def loop(m: torch.nn.Module) -> None:
        for row in cal:
            m(row.unsqueeze(0))

    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, loop)
    dest = ROOT / "modelopt-qwen3-nvfp4"
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(model, export_dir=tmp)
        kept = keep_layer(Path(tmp), dest, ("hf_quant_config.json",))
    tensors = load_file_pt(dest / "model.safetensors")
    ref: dict[str, torch.Tensor] = {
        "hidden_states": torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(SEED + 1)).to(torch.bfloat16)}
    for e in range(2):
        for role in ("gate", "up", "down"):
            p = f"model.layers.0.mlp.experts.{e}.{role}_proj."
            w = tensors[p + "weight"]
            q = NVFP4QTensor(torch.Size([w.shape[0], w.shape[1] * 2]), torch.float32, w)
            ref[f"experts.{e}.{role}.dequant"] = q.dequantize(dtype=torch.float32, scale=tensors[p + "weight_scale"],
                                                              double_scale=tensors[p + "weight_scale_2"],
                                                              block_sizes={-1: 16})
    save_file({k: v.contiguous() for k, v in ref.items()}, str(dest / "ref.safetensors"))
    _versions({"modelopt-qwen3-nvfp4": kept}, {
        "modelopt-nvfp4": "Qwen3MoeForCausalLM (make_fixtures_quark_modelopt_ct.tiny_qwen3_moe: hidden 64, moe "
                          "intermediate 64, 4 experts, top-2), mtq.NVFP4_DEFAULT_CFG calibrated on the CPU, "
                          "export_hf_checkpoint; ref = NVFP4QTensor.dequantize (float32) of the exported tensors"},
        ("nvidia-modelopt", "transformers", "torch", "safetensors"))


def load_file_pt(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


CT_PRESETS = {"ct-qwen3-nvfp4": "NVFP4", "ct-qwen3-nvfp4a16": "NVFP4A16", "ct-qwen3-mxfp4a16": "MXFP4A16",
              "ct-qwen3-mxfp4": "MXFP4"}


def make_compressed_tensors_fp4() -> None:
    """llm-compressor's FP4 presets (NVFP4, NVFP4A16, MXFP4A16, MXFP4; oneshot calibrated on 8 random sequences:
    NVFP4's static input global scale needs data) on the same tiny Qwen3-MoE, saved compressed
    (nvfp4-pack-quantized / mxfp4-pack-quantized). ref: ``experts.{e}.{role}.dequant`` (experts 0, 1) by
    compressed-tensors' own decompressor (bfloat16, as it returns them); ``hidden_states``."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from make_fixtures_quark_modelopt_ct import keep_layer, tiny_qwen3_moe
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(SEED + 2))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    fixtures: dict[str, object] = {}
    for name, preset in CT_PRESETS.items():
        scheme = preset_name_to_scheme(preset, ["Linear"])
        dest = ROOT / name
        with tempfile.TemporaryDirectory() as base:
            tiny_qwen3_moe().save_pretrained(base)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            model = oneshot(model=model, dataset=data, num_calibration_samples=8, recipe=QuantizationModifier(
                config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]))
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp, save_compressed=True)
                fixtures[name] = {"preset": preset, **keep_layer(Path(tmp), dest)}
        compressor = MXFP4PackedCompressor if preset.startswith("MX") else NVFP4PackedCompressor
        tensors = load_file_pt(dest / "model.safetensors")
        ref: dict[str, torch.Tensor] = {"hidden_states": torch.randn(
            TOKENS, 64, generator=torch.Generator().manual_seed(SEED + 1)).to(torch.bfloat16)}
        for e in range(2):
            for role in ("gate", "up", "down"):
                p = f"model.layers.0.mlp.experts.{e}.{role}_proj."
                state = {k.removeprefix(p): v for k, v in tensors.items() if k.startswith(p)}
                ref[f"experts.{e}.{role}.dequant"] = compressor.decompress(state, scheme)["weight"]
        save_file({k: v.contiguous() for k, v in ref.items()}, str(dest / "ref.safetensors"))
    _versions(fixtures, {
        "compressed-tensors-fp4": "tiny Qwen3-MoE (as modelopt-nvfp4), llm-compressor oneshot with "
                                  "preset_name_to_scheme(preset, ['Linear']), 8 calibration sequences, "
                                  "save_pretrained(save_compressed=True); ref = the format's compressor .decompress"},
        ("llmcompressor", "compressed-tensors", "transformers", "torch", "safetensors"))


PRODUCERS = {"mxfp4": make_mxfp4, "modelopt-nvfp4": make_modelopt_nvfp4,
             "compressed-tensors-fp4": make_compressed_tensors_fp4}


if __name__ == "__main__":
    sys.exit(fixture_kit.run_producer("make_fixtures_fp4.py", PRODUCERS, sys.argv[1:]))
