"""Write small, deterministic example checkpoints: one per supported checkpoint format and model
family, named as the real models name their tensors and with the real ``quantization_config``, so
detection, loading and conversion can be exercised end to end without downloading a model.

Each example has 2 decoder layers holding only their MoE tensors (router and experts; no
attention, embeddings or norms), E=8 experts, top-2, hidden 256, expert intermediate 128 (the
DeepSeek example: E=16, top-4, 4 groups, top-2 groups). Weights are random and seeded by name.

    python tools/make_examples.py                 # all, under examples/checkpoints/
    python tools/make_examples.py --out DIR mixtral-awq qwen3-gptq-int4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_registry.testing import packers

HIDDEN, INTER, LAYERS = 256, 128, 2
ROLES = ("gate", "up", "down")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "examples" / "checkpoints"

ExpertPacker = Callable[[Mapping[str, torch.Tensor], torch.Generator], dict[str, dict[str, torch.Tensor]]]
"""One expert's float weights (role -> [out, in]) -> role -> checkpoint tensors."""


@dataclass(frozen=True)
class Family:
    """How a model family names its MoE tensors."""

    moe_prefix: str  # format with layer=
    projections: Mapping[str, str]  # role -> projection name

    def router(self, layer: int) -> str:
        return f"{self.moe_prefix.format(layer=layer)}.gate.weight"

    def expert(self, layer: int, e: int, role: str, tensor: str) -> str:
        return f"{self.moe_prefix.format(layer=layer)}.experts.{e}.{self.projections[role]}.{tensor}"


MIXTRAL = Family("model.layers.{layer}.block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})
QWEN = Family("model.layers.{layer}.mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
DEEPSEEK = QWEN  # DeepSeek-V3 names its routed experts like Qwen


@dataclass(frozen=True)
class Example:
    """One example checkpoint: naming, config, how each expert is packed, and how it is stored."""

    name: str
    family: Family
    config: dict
    pack: ExpertPacker
    experts: int = 8
    router_dtype: torch.dtype = torch.bfloat16
    expert_bias: bool = False
    router_bias: bool = False  # DeepSeek-V3 e_score_correction_bias
    shards: int = 1
    extra_files: Mapping[str, dict] = field(default_factory=dict)


# ---- configs (real field names of each family) ---------------------------------------------------


def mixtral_config(dtype: str, quant: dict | None) -> dict:
    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
        "torch_dtype": dtype,
    }
    return _with_quant(cfg, quant)


def qwen3_config(dtype: str, quant: dict | None) -> dict:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,
        "moe_intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
        "torch_dtype": dtype,
    }
    return _with_quant(cfg, quant)


def qwen2_config(dtype: str, quant: dict | None) -> dict:
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,
        "moe_intermediate_size": INTER,
        "shared_expert_intermediate_size": 4 * INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
        "torch_dtype": dtype,
    }
    return _with_quant(cfg, quant)


def deepseek_v3_config(dtype: str, quant: dict | None) -> dict:
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,
        "moe_intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 16,
        "n_shared_experts": 0,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "vocab_size": 129280,
        "torch_dtype": dtype,
    }
    return _with_quant(cfg, quant)


def _with_quant(cfg: dict, quant: dict | None) -> dict:
    return cfg if quant is None else {**cfg, "quantization_config": quant}


def gptq_config(bits: int, group: int, desc_act: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": True,
            "checkpoint_format": "gptq", "true_sequential": True}


def quark_config(per_tensor: bool) -> dict:
    weight = {"dtype": "int8", "qscheme": "per_tensor" if per_tensor else "per_channel", "ch_axis": 0,
              "is_dynamic": False, "symmetric": True}
    if per_tensor:
        weight = {k: v for k, v in weight.items() if k != "ch_axis"}
        inputs = {"dtype": "int8", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
    else:
        inputs = {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 1, "is_dynamic": True, "symmetric": True}
    return {
        "quant_method": "quark",
        "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["lm_head", "*block_sparse_moe.gate"],
        "export": {"pack_method": "reorder"},
    }


def compressed_tensors_config(fmt: str, weights: dict) -> dict:
    cfg = {"quant_method": "compressed-tensors", "format": fmt}
    if fmt == "int-quantized":
        cfg["quantization_status"] = "compressed"
    cfg["config_groups"] = {"group_0": {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }}
    cfg["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    return cfg


# ---- expert packers --------------------------------------------------------------------------------


def each_role(pack: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> ExpertPacker:
    return lambda weights, gen: {role: pack(w) for role, w in weights.items()}


def gptq_act_order(bits: int, group: int) -> ExpertPacker:
    """desc_act: a random column order per expert, one for gate and up (same input), one for down."""

    def pack(weights: Mapping[str, torch.Tensor], gen: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
        order_in = torch.randperm(HIDDEN, generator=gen)
        order_down = torch.randperm(INTER, generator=gen)
        return {role: packers.pack_gptq(w, bits, group, order_down if role == "down" else order_in)
                for role, w in weights.items()}

    return pack


def quark_static_per_tensor(weights: Mapping[str, torch.Tensor],
                            gen: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    """Per-tensor weight scales and static input scales, different per expert and between gate and up."""
    out = {}
    for role, w in weights.items():
        input_scale = float(0.01 + 0.02 * torch.rand((), generator=gen))
        out[role] = packers.pack_quark_int8(w, per_tensor=True, input_scale=input_scale)
    return out


def _mxfp8_hf_quant_config() -> dict:
    return {"producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}


def _examples() -> dict[str, Example]:
    int8_channel = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    int4_group = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                  "dynamic": False}
    examples = [
        Example("mixtral-awq", MIXTRAL,
                mixtral_config("float16", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                           "version": "gemm", "modules_to_not_convert": ["gate"]}),
                each_role(lambda w: packers.pack_awq_gemm(w, 128)), router_dtype=torch.float16),
        Example("qwen3-gptq-int4", QWEN, qwen3_config("float16", gptq_config(4, 64, False)),
                each_role(lambda w: packers.pack_gptq(w, 4, 64)), router_dtype=torch.float16),
        Example("qwen3-gptq-int4-actorder", QWEN, qwen3_config("float16", gptq_config(4, 64, True)),
                gptq_act_order(4, 64), router_dtype=torch.float16),
        Example("qwen2-gptq-int8", QWEN, qwen2_config("float16", gptq_config(8, 128, False)),
                each_role(lambda w: packers.pack_gptq(w, 8, 128)), router_dtype=torch.float16, shards=2),
        Example("mixtral-quark-w8a8", MIXTRAL, mixtral_config("bfloat16", quark_config(per_tensor=False)),
                each_role(packers.pack_quark_int8)),
        Example("mixtral-quark-w8a8-tensor", MIXTRAL, mixtral_config("bfloat16", quark_config(per_tensor=True)),
                quark_static_per_tensor),
        Example("qwen3-modelopt-mxfp8", QWEN, qwen3_config("bfloat16", None),
                each_role(packers.pack_modelopt_mxfp8),
                extra_files={"hf_quant_config.json": _mxfp8_hf_quant_config()}),
        Example("qwen3-modelopt-mxfp8-inline", QWEN,
                qwen3_config("bfloat16", {"quant_method": "modelopt", "quant_algo": "MXFP8",
                                          "exclude_modules": ["lm_head"]}),
                each_role(packers.pack_modelopt_mxfp8)),
        Example("deepseek-fp8-block", DEEPSEEK,
                deepseek_v3_config("bfloat16", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [128, 128]}),
                each_role(packers.pack_fp8_block), experts=16, router_bias=True),
        Example("mixtral-bf16", MIXTRAL, mixtral_config("bfloat16", None),
                each_role(lambda w: packers.pack_unquantized(w, torch.bfloat16)), expert_bias=True),
        Example("qwen3-ct-w8a8", QWEN,
                qwen3_config("bfloat16", compressed_tensors_config("int-quantized", int8_channel)),
                each_role(packers.pack_compressed_tensors_int8)),
        Example("qwen3-ct-w4a8", QWEN,
                qwen3_config("bfloat16", compressed_tensors_config("pack-quantized", int4_group)),
                each_role(lambda w: packers.pack_compressed_tensors_int4(w, 128))),
    ]
    return {ex.name: ex for ex in examples}


_BY_NAME = _examples()
EXAMPLES: tuple[str, ...] = tuple(_BY_NAME)


# ---- writing ---------------------------------------------------------------------------------------


def layer_tensors(ex: Example, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's MoE tensors, named as the family names them."""
    fam = ex.family
    out = {fam.router(layer): (torch.randn(ex.experts, HIDDEN, generator=gen) * 0.05).to(ex.router_dtype)}
    if ex.router_bias:
        out[fam.router(layer).replace(".weight", ".e_score_correction_bias")] = (
            torch.randn(ex.experts, generator=gen) * 0.1).to(torch.float32)
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    for e in range(ex.experts):
        weights = {role: torch.randn(shapes[role], generator=gen) * 0.05 for role in ROLES}
        for role, tensors in ex.pack(weights, gen).items():
            if ex.expert_bias:
                tensors = {**tensors, "bias": (torch.randn(shapes[role][0], generator=gen) * 0.05).to(ex.router_dtype)}
            for tensor, value in tensors.items():
                out[fam.expert(layer, e, role, tensor)] = value.contiguous()
    return out


def make_example(name: str, out_dir: Path | str = DEFAULT_OUT) -> Path:
    """Write example ``name`` to ``out_dir/name`` (replacing what an earlier run wrote there) and
    return that directory. The files are written into a hidden sibling directory that is renamed
    into place at the end, so a run that fails (no numpy for ``save_file``, a full disk) leaves the
    earlier example or nothing, never an empty or half-written directory."""
    try:
        ex = _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown example {name!r}; known: {', '.join(EXAMPLES)}") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name
    work, old = out_dir / f".{name}.partial-{os.getpid()}", out_dir / f".{name}.old-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _write_example(ex, work)
        if target.exists():
            target.rename(old)
        work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if old.exists() and not target.exists():
            old.rename(target)  # put the earlier example back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return target


def _write_example(ex: Example, target: Path) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(ex.name.encode()))
    layers = [layer_tensors(ex, layer, gen) for layer in range(LAYERS)]
    if ex.shards == 1:
        save_file({k: v for t in layers for k, v in t.items()}, target / "model.safetensors", metadata={"format": "pt"})
    else:
        _save_sharded(layers, ex.shards, target)
    _write_json(target / "config.json", ex.config)
    for filename, content in ex.extra_files.items():
        _write_json(target / filename, content)


def _save_sharded(layers: list[dict[str, torch.Tensor]], shards: int, target: Path) -> None:
    """Layers split evenly over ``shards`` files, with the index transformers writes."""
    per_shard = -(-len(layers) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        filename = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {k: v for t in layers[s * per_shard:(s + 1) * per_shard] for k, v in t.items()}
        save_file(tensors, target / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        total += sum(v.numel() * v.element_size() for v in tensors.values())
    _write_json(target / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"examples to write (default: all): {', '.join(EXAMPLES)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in _BY_NAME]
    if unknown:
        parser.error(f"unknown example(s) {', '.join(unknown)}; known: {', '.join(EXAMPLES)}")
    for name in args.names or EXAMPLES:
        path = make_example(name, args.out)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"{path}  {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
