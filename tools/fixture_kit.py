"""What every producer-fixture maker (tools/make_fixtures_*.py) does alike: a tiny random Qwen3-MoE from
transformers' own classes, fixed inputs and calibration ids, the producer's MoE block output with the
routing it chose, the first MoE layer's tensors kept exactly as the producer wrote them, and the
one-argument command line (which producer to run). Imported by the makers as ``fixture_kit`` (tools/ is
on sys.path when a maker runs); like them, it never imports moe_registry.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LAYER = "model.layers.0.mlp."  # the first (only) decoder layer's MoE block: what a fixture keeps


def tiny_qwen3_moe(seed: int, shape: Mapping[str, int], *, intermediate_size: int, head_dim: int,
                   layers: int = 1) -> torch.nn.Module:
    """A random Qwen3-MoE (one layer unless ``layers``) in bfloat16 from transformers' own config class; ``shape``
    gives hidden_size, moe_intermediate_size, num_experts and num_experts_per_tok."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, intermediate_size=intermediate_size, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=128,
                         norm_topk_prob=True, dtype="bfloat16", **shape)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config.architectures = ["Qwen3MoeForCausalLM"]  # what save_pretrained writes; exporters read it
    return model


def inputs(seed: int, tokens: int, shape: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Fixed activations in the model's dtype: the gate/up input and the down input."""
    g = torch.Generator().manual_seed(seed + 1)
    return {"hidden_states": torch.randn(tokens, shape["hidden_size"], generator=g).to(torch.bfloat16),
            "intermediate_states": torch.randn(tokens, shape["moe_intermediate_size"], generator=g).to(torch.bfloat16)}


def calibration_ids(seed: int, rows: int = 4, length: int = 32) -> torch.Tensor:
    """Token ids for calibration: enough that every expert sees tokens."""
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed + 2))


def layer_output(block: torch.nn.Module, experts: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The library's MoE block on ``x``, with the routing its experts module received."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["ids"], seen["weights"] = args[1], args[2]

    handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        out = block(x.unsqueeze(0))
    handle.remove()
    out = out[0] if isinstance(out, tuple) else out
    return {"layer.output": out.reshape(x.shape).contiguous(),
            "layer.topk_ids": seen["ids"].to(torch.int32).contiguous(),
            "layer.topk_weights": seen["weights"].contiguous()}


def copy_layer(export_dir: Path, dest: Path, extra_files: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Copy config.json (+ extra files) and the first MoE layer's tensors exactly as written (names, dtypes,
    the file's metadata) to ``dest``, replacing it; returns the kept tensors."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("config.json", *extra_files):
        if (export_dir / name).is_file():
            shutil.copy(export_dir / name, dest / name)
    kept: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] | None = None
    for path in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = metadata or f.metadata()
            for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                if name.startswith(LAYER):
                    kept[name] = f.get_tensor(name)
    save_file(kept, str(dest / "model.safetensors"), metadata=metadata)
    return kept


def keep_layer(export_dir: Path, dest: Path, extra_files: tuple[str, ...] = ()) -> dict[str, object]:
    """:func:`copy_layer`, summarised for VERSIONS.json."""
    kept = copy_layer(export_dir, dest, extra_files)
    return {"tensors": len(kept), "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in kept.values()}),
            "files": sorted(p.name for p in dest.iterdir())}


def save_ref(dest: Path, ref: Mapping[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous() for k, v in ref.items()}, str(dest / "ref.safetensors"))


def run_producer(tool: str, producers: Mapping[str, Callable[[], None]], argv: list[str]) -> int:
    """``<tool> <producer>``: run one producer's fixtures (each needs its own venv); 2 with a usage line."""
    if len(argv) != 1 or argv[0] not in producers:
        print(f"usage: {tool} {{{'|'.join(producers)}}}", file=sys.stderr)
        return 2
    producers[argv[0]]()
    return 0
