"""Write tiny random transformers MoE models as ground truth for ``moe-registry run`` (by hand, not in CI).

For each family: build a tiny model from transformers' own config class, randomise its first MoE
block, ``save_pretrained`` it in bfloat16, and keep under ``tests/fixtures/transformers/tiny/<model_type>/``:

- ``config.json`` exactly as saved;
- ``model.safetensors``: only the first MoE layer's router (+ biases) and routed-expert tensors, with
  the names, dtypes and layout ``save_pretrained`` wrote (per expert or fused 3-D: not re-laid out);
- ``io.safetensors``: ``hidden_states`` [16, H] (seeded), ``output``: transformers' own MoE block on
  them, run in float32 on the model reloaded with ``from_pretrained`` from what was saved, with every
  shared-expert parameter zeroed so the block returns the routed experts only; ``topk_ids`` /
  ``topk_weights`` as transformers' router computed them (the experts module's inputs; for a block
  whose experts take no routing, the router's output).

Needs transformers 5.x in its own venv (never a dependency of the package)::

    python3 -m venv /work/producers/tf && /work/producers/tf/bin/pip install torch==2.13.0 transformers
    /work/producers/tf/bin/python tools/make_transformers_tiny.py [model_type ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "transformers" / "tiny"
TOKENS = 16
SEED = 1234

COMMON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
# Per model type: the config fields that make it tiny (8 experts of intermediate 16, top-2; 2I != H so
# a transposed fused tensor shows in its shape) and
# exercise its routing (groups, correction bias, scaling, a dense first layer where the family has one).
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, head_dim=16),
    "deepseek_v3": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "gpt_oss": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(intermediate_size=16, intermediate_size_mlp=64, num_local_experts=8,
                        num_experts_per_tok=1, head_dim=16),
    "glm4_moe": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, norm_topk_prob=True, head_dim=16),
    "minimax_m2": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    "olmoe": dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "ernie4_5_moe": dict(intermediate_size=64, moe_intermediate_size=16, moe_num_experts=8, moe_k=2,
                         moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1,
                         moe_layer_end_index=1, head_dim=16),
    "deepseek_v2": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy", kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "exaone_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_shared_experts=1,
                       num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                       first_k_dense_replace=1, head_dim=16),
    "granitemoe": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
    # Multimodal: the text decoder gets COMMON and these; the vision tower is made small (it is not kept).
    "qwen3_vl_moe": dict(text_config=dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                          num_experts_per_tok=2, head_dim=16),
                         vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                            out_hidden_size=64, deepstack_visual_indexes=[0])),
    "qwen3_5_moe": dict(text_config=dict(moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, head_dim=16,
                                         linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                         linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"]),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                           out_hidden_size=64)),
    "hunyuan_v1_moe": dict(intermediate_size=16, num_experts=8, moe_topk=2, head_dim=16),
    "lfm2_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                     num_dense_layers=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                     layer_types=["conv", "full_attention"]),
    "jetmoe": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, kv_channels=16),
    "mistral4": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                     kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                     head_dim=8),
    "dots1": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.0, norm_topk_prob=True, head_dim=16),
    "kimi_linear": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_shared_experts=1,
                        num_experts_per_token=2, num_expert_group=2, topk_group=1, routed_scaling_factor=2.0,
                        moe_renormalize=True, mlp_layer_types=["dense", "sparse"],
                        layer_types=["linear_attention", "full_attention"], kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
                        linear_num_heads=4, head_dim=8, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "glm4_moe_lite": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                          num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse"],
                          routed_scaling_factor=1.8, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "deepseek_v32": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse"],
                         routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_topk=8,
                         index_head_dim=16, index_n_heads=2),
    "mimo_v2_flash": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, head_dim=16,
                          v_head_dim=16, mlp_layer_types=["dense", "sparse"],
                          layer_types=["full_attention", "sliding_attention"]),
    "solar_open": dict(moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                       n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, head_dim=16),
    "flex_olmo": dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                      pad_token_id=None, eos_token_id=None),
    # Step-3.5 (model_type step3p5) has no auto model class in 5.23; its multimodal Step-3.7 wraps the same decoder.
    "step3p7": dict(text_config=dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                     num_experts_per_tok=2, share_expert_dim=32, mlp_layer_types=["dense", "sparse"],
                                     moe_router_scaling_factor=1.5, layer_types=["full_attention", "sliding_attention"],
                                     head_dim=16, num_sliding_attention_heads=4),
                    vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14),
                    image_token_id=100),
    "qwen3_next": dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "full_attention"]),
    "glm4v_moe": dict(text_config=dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                       n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                       first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                                       head_dim=16),
                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                         out_hidden_size=64)),
    # DBRX names its sizes its own way (d_model, n_layers, ffn_config): COMMON is not passed.
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128, tie_word_embeddings=False,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0),  # 5.23's DbrxAttention reads rope_theta here
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2, moe_normalize_expert_weights=1.0)),
}
OWN_SIZES = ("dbrx",)  # families whose config takes no COMMON fields
MODEL_CLASS = {"mistral4": "Mistral4ForCausalLM"}  # not in transformers' AutoModelForCausalLM mapping (5.23)
# Saved tensors of the MoE layer that are not the router or the routed experts.
NOT_ROUTED = ("attn", "attention", "norm", "share")  # share: shared_expert(s), Step's share_expert


def _first_moe_block(model: torch.nn.Module) -> tuple[int, str, torch.nn.Module]:
    """(layer index, module path, block): the first decoder layer whose MLP holds an ``experts`` module
    (or, JetMoE, 3-D ``input_linear`` experts beside a ``router``); attention experts (JetMoE's MoA) are not ours."""
    for name, module in model.named_modules():
        stack = next((s for s in (".layers.", ".blocks.") if s in name), None)
        if not stack or "attention" in name:
            continue
        if name.endswith(".experts"):
            block_name = name.rsplit(".", 1)[0]
        elif hasattr(module, "input_linear") and hasattr(module, "router"):
            block_name = name
        else:
            continue
        layer = int(block_name.split(stack)[1].split(".")[0])
        return layer, block_name, model.get_submodule(block_name)
    raise SystemExit("no MoE block with an 'experts' module found")


def _randomise(block: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded values with a useful spread: weights std 0.15 (router logits and gate/up outputs of a
    few units, so gpt-oss's clamp at 7 is reached by some), biases std 0.3."""
    with torch.no_grad():
        for name, p in block.named_parameters():
            std = 0.3 if "bias" in name else 0.15
            p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))
        for name, b in block.named_buffers():
            if "bias" in name and b.is_floating_point():
                b.copy_((torch.randn(b.shape, generator=gen) * 0.3).to(b.dtype))


def _zero_shared(block: torch.nn.Module) -> list[str]:
    """Zero every shared-expert parameter and the block's own output bias (JetMoE's ``mlp.bias``, added
    once after the experts): the block then returns its routed experts alone."""
    zeroed = []
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "shared" in name or name == "bias":
                p.zero_()
                zeroed.append(name)
    return zeroed


def _routing(block: torch.nn.Module, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the block on x; return (output, topk_ids, topk_weights) as transformers computed them."""
    seen: dict[str, Any] = {}

    def experts_hook(_m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["experts"] = (args, kwargs)

    def experts_out_hook(_m: torch.nn.Module, _args: tuple, out: Any) -> None:
        seen["experts_out"] = out[0] if isinstance(out, tuple) else out

    router = next((block.get_submodule(n) for n in ("gate", "router") if hasattr(block, n)), None)

    def router_hook(_m: torch.nn.Module, _args: tuple, out: Any) -> None:
        seen["router"] = out

    experts = getattr(block, "experts", None)
    h1 = experts.register_forward_pre_hook(experts_hook, with_kwargs=True) if experts is not None else None
    h2 = router.register_forward_hook(router_hook) if router is not None else None
    h3 = experts.register_forward_hook(experts_out_hook) if experts is not None else None
    with torch.no_grad():
        out = block(x.unsqueeze(0))
    for h in (h1, h2, h3):
        if h is not None:
            h.remove()
    out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
    if "experts" not in seen:
        # JetMoE: the router returns (slot order, token of each slot, gate of each slot, slots per expert, logits),
        # slots sorted by expert; put each slot's expert and gate back at its (token, k) place.
        order, _tokens, gates, per_expert, _logits = seen["router"]
        expert_of_slot = torch.repeat_interleave(torch.arange(len(per_expert)), torch.tensor(per_expert))
        ids = torch.empty_like(order)
        weights = torch.empty(order.shape, dtype=torch.float32)
        ids[order], weights[order] = expert_of_slot, gates.float()
        return out, ids.reshape(x.shape[0], top_k), weights.reshape(x.shape[0], top_k)
    args, kwargs = seen["experts"]
    values = list(args[1:]) + list(kwargs.values())
    if len(values) >= 2:
        ids, weights = values[0], values[1]
        if ids.is_floating_point():
            ids, weights = weights, ids
        # A block may scale the experts' output after them (Step-3.7's moe_router_scaling_factor): the
        # weights that reach the output are the experts' weights times that factor.
        routed = seen["experts_out"].reshape(x.shape).double()
        scale = float((out.double() * routed).sum() / (routed * routed).sum())
        if abs(scale - 1) > 1e-5:
            assert torch.allclose(routed * scale, out.double(), rtol=1e-5, atol=1e-6), "not a scaled expert output"
            weights = weights * scale
        return out, ids, weights.float()
    # The experts take pre-weighted inputs (Llama 4): the router returns dense scores and logits.
    scores, logits = seen["router"][:2]
    ids = torch.topk(logits, top_k, dim=-1).indices
    return out, ids, scores.gather(1, ids).float()


def make(model_type: str, out_root: Path) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    over = dict(FAMILIES[model_type])
    multimodal = "text_config" in over
    if multimodal:
        over["text_config"] = {**COMMON, **over["text_config"]}
        cfg = AutoConfig.for_model(model_type, **over)
    elif model_type in OWN_SIZES:
        cfg = AutoConfig.for_model(model_type, **over)
    else:
        cfg = AutoConfig.for_model(model_type, **COMMON, **over)
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    if model_type in MODEL_CLASS:
        import transformers

        auto = getattr(transformers, MODEL_CLASS[model_type])
    text = cfg.get_text_config()
    torch.manual_seed(SEED)
    model = (auto._from_config if model_type in MODEL_CLASS else auto.from_config)(cfg, dtype=torch.bfloat16)
    layer, block_name, block = _first_moe_block(model)
    seed = SEED + zlib.crc32(model_type.encode())  # per family: no two fixtures share their weights
    _randomise(block, torch.Generator().manual_seed(seed))
    out_dir = out_root / model_type
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        # The layer's saved names; save_pretrained may rename modules (Step-3.7: language_model.layers -> layers).
        layer_re = re.compile(rf"^[\w.]*?\.(?:layers|blocks)\.{layer}\.")
        kept: dict[str, torch.Tensor] = {}
        files = sorted(Path(tmp).glob("*.safetensors"))
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if layer_re.match(name) and "visual" not in name and "vision" not in name \
                            and not any(s in name for s in NOT_ROUTED):
                        kept[name] = f.get_tensor(name)
        (out_dir / "config.json").write_text(Path(tmp, "config.json").read_text())
        save_file(kept, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        # Ground truth from the saved files: reload, float32, routed experts only.
        ref = auto.from_pretrained(tmp, dtype=torch.float32)
    ref.eval()
    _, _, ref_block = _first_moe_block(ref)
    zeroed = _zero_shared(ref_block)
    x = torch.randn(TOKENS, text.hidden_size, generator=torch.Generator().manual_seed(seed + 1)) * 2.0
    top_k = next((getattr(text, k) for k in ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token")
                  if getattr(text, k, None)), None)
    out, ids, weights = _routing(ref_block, x, top_k)
    save_file({"hidden_states": x.contiguous(), "output": out.contiguous(), "topk_ids": ids.contiguous(),
               "topk_weights": weights.contiguous()}, str(out_dir / "io.safetensors"), metadata={"format": "pt"})
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"{model_type}: layer {layer} ({block_name}), {len(kept)} tensors, {size} bytes; "
          f"shared zeroed: {len(zeroed)} params")
    for name, t in sorted(kept.items())[:4] + sorted(kept.items())[-3:]:
        print(f"    {name} {list(t.shape)} {t.dtype}")
    return {"layer": layer, "block": block_name, "seed": seed, "tensors": len(kept), "bytes": size,
            "shared_zeroed": zeroed, "config_overrides": {**COMMON, **FAMILIES[model_type]}}


def main(argv: list[str] | None = None) -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_types", nargs="*", default=list(FAMILIES))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    made = {t: make(t, args.out) for t in args.model_types}
    versions_path = args.out.parent / "VERSIONS_tiny.json"
    old = json.loads(versions_path.read_text()) if versions_path.is_file() else {}
    versions = {
        "producer": "tools/make_transformers_tiny.py",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "safetensors": safetensors.__version__, "python": platform.python_version(),
        "saved_dtype": "bfloat16", "reference_dtype": "float32", "tokens": TOKENS,
        "seed": f"{SEED} + crc32(model_type)",
        "output": "the model's first MoE block, reloaded with from_pretrained in float32, shared-expert "
                  "parameters zeroed (routed experts only); topk_ids/topk_weights are the inputs transformers "
                  "passed to its experts module (Llama 4: top-k of the router logits, weights from its scores; "
                  "JetMoE: put back from its router's expert-sorted slots; times a factor the block applies after "
                  "its experts, Step-3.7); JetMoE's output bias is zeroed too",
        "families": {**old.get("families", {}), **made},
    }
    versions_path.write_text(json.dumps(versions, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
