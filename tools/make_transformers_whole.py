"""Tiny random whole transformers MoE models, made from the project's tiny fixtures' config.json (a family's
settings: routing, shared experts, a dense first layer) with more decoder layers, seeded weights and
``save_pretrained``: ground truth for ``load_model`` is transformers' own model on the same weights.

The tests make them in a temporary dir (seconds, nothing committed: the seeded weights and the pinned config are
the fixture); by hand::

    python tools/make_transformers_whole.py OUT_DIR [model_type ...] [--layers 3]
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path
from typing import Any

import torch

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "transformers" / "tiny"
SEED = 1234


# Config fields set for the whole model (merged into the fixture's, nested tables too), where the tiny fixture's
# config builds a layer but not a model whose forward runs: ernie's MoE layers end at the fixture's one otherwise;
# DBRX's attention clamps q/k/v by clip_qkv, which its tiny config leaves unset; DeepSeek-V3.2's indexer wants as
# many key/value heads as query heads; Mistral 4's and GLM-4.5V's rotary sizes must fit their tiny heads.
OVERRIDES: dict[str, dict[str, Any]] = {
    "ernie4_5_moe": {"moe_layer_end_index": -1},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v32": {"num_key_value_heads": 4},
    "mistral4": {"rope_parameters": {"partial_rotary_factor": 1.0}},
    "glm4v_moe": {"text_config": {"rope_parameters": {"mrope_section": [2, 1, 1]}}},
}


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` set over it, a nested table merged key by key."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


LAYER_COUNTS = ("num_hidden_layers", "n_layers")  # DBRX names its layer count n_layers


def whole_config(tiny_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """``tiny_config`` with ``layers`` decoder layers (in its ``text_config`` where the text model's settings
    live): every per-layer list (layer types, MLP kinds) is extended by repeating its last entry, and a list of
    every layer's index (Llama 4's moe_layers) by the new layers' indices."""
    out = dict(tiny_config)
    key = next((k for k in LAYER_COUNTS if k in out), None)
    if key is None and isinstance(out.get("text_config"), dict):
        out["text_config"] = whole_config(out["text_config"], layers)
        return out
    if key is None:
        raise SystemExit(f"config has none of {LAYER_COUNTS}")
    old = int(out[key])
    for name, value in tiny_config.items():
        if isinstance(value, list) and len(value) == old and old > 0:
            every_index = value == list(range(old))
            out[name] = list(range(layers)) if every_index else value + [value[-1]] * (layers - old)
    out[key] = layers
    return out


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with a useful spread (std 0.15, router logits of a few units, so routing is decided by
    clear margins), norms at 1 + noise, biases std 0.3; embeddings std 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and p.dim() == 1:
                value = 1.0 + 0.1 * noise
            elif "embed" in name:
                value = noise
            else:
                value = noise * (0.3 if "bias" in name else 0.15)
            p.copy_(value.to(p.dtype))


def make_whole_model(model_type: str, out_dir: Path, *, layers: int = 3, dtype: torch.dtype = torch.bfloat16,
                     **fields: Any) -> Path:
    """Write a tiny whole model of ``model_type`` (a dir under the tiny fixtures) to ``out_dir`` with
    ``save_pretrained``, config ``fields`` set over the fixture's; returns ``out_dir``."""
    import transformers

    from moe_registry.whole.load import generating_class

    raw = json.loads((TINY / model_type / "config.json").read_text())
    cfg_dict = merged(merged(whole_config(raw, layers), OVERRIDES.get(model_type, {})), fields)
    cfg_dict.pop("transformers_version", None)
    kind = cfg_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(kind, **cfg_dict)
    torch.manual_seed(SEED)
    model = generating_class(transformers, config).from_config(config, dtype=dtype)
    randomise(model, SEED + zlib.crc32(model_type.encode()))
    model.save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write tiny random whole MoE models with save_pretrained")
    parser.add_argument("out", type=Path, help="dir to write <model_type>/ dirs under")
    parser.add_argument("model_types", nargs="*", help="tiny fixtures' model types (default: every one)")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers (default 3)")
    args = parser.parse_args(argv)
    names = args.model_types or sorted(p.name for p in TINY.iterdir() if (p / "config.json").is_file())
    for name in names:
        out = make_whole_model(name, args.out / name, layers=args.layers)
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {out} ({size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
