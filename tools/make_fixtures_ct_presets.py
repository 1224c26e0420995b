"""Write tests/fixtures/compressed_tensors_presets/ with llm-compressor and compressed-tensors themselves.

Run by hand (not in CI) in the llm-compressor venv:

    python3 -m venv /work/producers/llmc && . /work/producers/llmc/bin/activate
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install llmcompressor==0.14.0.1 compressed-tensors==0.19.0 transformers==5.17.0 datasets
    /work/producers/llmc/bin/python tools/make_fixtures_ct_presets.py

(VERSIONS.json records the versions actually used.) Each fixture is a tiny random Qwen3-MoE from
transformers' own config class (bfloat16, one layer, hidden = moe_intermediate = 128 so group 128
fits, 4 experts, top-2), quantized by llm-compressor's ``oneshot`` with one integer preset and saved
with ``save_compressed=True`` (format pack-quantized). Kept: config.json as written and the first MoE
layer's router and expert tensors, names and dtypes as written. ``ref.safetensors`` holds the
producer's own numbers: ``experts.0.{role}.dequant``, the saved tensors of expert 0 run through
compressed-tensors' ``PackedQuantizationCompressor.decompress`` (only expert 0: the 1 MB budget).

``ignore.json`` records what compressed-tensors' own matcher (``compressed_tensors.utils.match``)
makes of the recipe's ignore list, which has ``re:`` patterns: llm-compressor 0.14 writes the
matched module NAMES into config.json, not the patterns, so the patterns and the names each of
them (and the config's targets) matches in the model are kept beside it for the test.

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
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "compressed_tensors_presets"
SEED = 4321
LAYER = fixture_kit.LAYER
SHAPE = {"hidden_size": 128, "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}
ROLES = ("gate", "up", "down")
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]
# preset name -> (compressed-tensors preset, weight args changed, GPTQ actorder or None for RTN)
PRESETS: dict[str, tuple[str, dict[str, object], str | None]] = {
    "w4a16-g128": ("W4A16", {}, None),
    "w4a16-channel": ("W4A16", {"strategy": "channel", "group_size": None}, None),
    "w4a16-asym-g64-actorder-weight": ("W4A16_ASYM", {"group_size": 64}, "weight"),
    "w8a16-asym-g32": ("W8A16", {"symmetric": False, "group_size": 32}, None),
}


def tiny_qwen3_moe() -> torch.nn.Module:
    """A random one-layer Qwen3-MoE in bfloat16 from transformers' own config class."""
    return fixture_kit.tiny_qwen3_moe(SEED, SHAPE, intermediate_size=256, head_dim=32)


def calibration():
    """A small token-id data set for GPTQ: enough tokens that every expert sees some."""
    from datasets import Dataset

    ids = fixture_kit.calibration_ids(SEED, rows=8, length=64)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def scheme_for(preset: str, changes: dict[str, object], actorder: str | None):
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    update = dict(changes)
    if actorder is not None:
        update["actorder"] = actorder
    return scheme.model_copy(update={"weights": scheme.weights.model_copy(update=update)})


def keep_layer(export_dir: Path, dest: Path) -> dict[str, torch.Tensor]:
    """Copy config.json and the first MoE layer's tensors exactly as written; returns them."""
    return fixture_kit.copy_layer(export_dir, dest)


def decompress_expert0(kept: dict[str, torch.Tensor], scheme) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of expert 0's saved tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    ref: dict[str, torch.Tensor] = {}
    for role in ROLES:
        prefix = f"{LAYER}experts.0.{role}_proj."
        state = {k.removeprefix(prefix): v for k, v in kept.items() if k.startswith(prefix)}
        ref[f"experts.0.{role}.dequant"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return ref


def ignore_matches(model: torch.nn.Module, targets: list[str]) -> dict[str, object]:
    """Per pattern of the recipe's ignore list, the module names compressed-tensors matches."""
    from compressed_tensors.utils.match import is_match

    names = [(n, m) for n, m in model.named_modules() if n]
    return {"ignore": IGNORE, "targets": targets,
            "matched": {p: [n for n, m in names if is_match(n, m, p)] for p in IGNORE},
            "quantized": [n for n, m in names if is_match(n, m, targets, IGNORE)]}


def make() -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    fixtures: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as base:
        tiny_qwen3_moe().save_pretrained(base)
        for name, (preset, changes, actorder) in PRESETS.items():
            scheme = scheme_for(preset, changes, actorder)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            if actorder is None:
                model = oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme},
                                                                         ignore=IGNORE))
            else:
                model = oneshot(model=model, dataset=calibration(), num_calibration_samples=8,
                                recipe=GPTQModifier(config_groups={"group_0": scheme}, ignore=IGNORE))
            matches = ignore_matches(model, ["Linear"])
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp, save_compressed=True)
                dest = ROOT / name
                kept = keep_layer(Path(tmp), dest)
            save_file({k: v.contiguous() for k, v in decompress_expert0(kept, scheme).items()},
                      str(dest / "ref.safetensors"))
            (dest / "ignore.json").write_text(json.dumps(matches, indent=1) + "\n")
            fixtures[name] = {"preset": preset, "weights_changed": changes, "gptq_actorder": actorder,
                              "tensors": len(kept),
                              "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in kept.values()})}
    model_line = "Qwen3MoeForCausalLM, bfloat16, 1 layer, " + ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    out = {"producer": "tools/make_fixtures_ct_presets.py", "python": platform.python_version(), "seed": SEED,
           "model": model_line,
           **{p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch",
                                      "safetensors")},
           "notes": {
               "recipe": "oneshot(QuantizationModifier or GPTQModifier(config_groups={group_0: "
                         "preset_name_to_scheme(preset, [Linear]) with weights_changed}, ignore=IGNORE))",
               "dequant": "PackedQuantizationCompressor.decompress on expert 0's saved tensors",
               "ignore": "ignore.json: the recipe's ignore patterns and the names compressed_tensors.utils.match "
                         "matches with each; config.json carries the expanded names, as the library writes them",
               "actorder": "compressed-tensors 0.19 removed actorder 'group' (g_idx); 'weight' writes no g_idx",
           },
           "fixtures": fixtures}
    (ROOT / "VERSIONS.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    make()
    sys.exit(0)
