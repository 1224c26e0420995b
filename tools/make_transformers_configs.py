"""Write tests/fixtures/transformers/configs/<model_type>/{config.json,expected.json} from transformers itself.

Run by hand in a venv with transformers 5.x and torch (not in CI):

    python tools/make_transformers_configs.py [model_type ...]

For every MoE decoder model type transformers ships (a config class with an expert-count attribute,
directly or in its text config), the default config is saved with ``save_pretrained``. expected.json
holds the MoE shape as transformers itself builds it: the model is instantiated on the meta device
(no memory, no weights) and each decoder layer's modules are read -- which layers hold routed experts,
how many, their intermediate size, the shared-expert MLP beside them -- so the layer pattern comes
from the modeling code, not from our reading of it. Top-k, scoring and renormalisation come from the
config class's attributes and the modeling code's fixed choices (ROUTING below, read from each
family's modeling_*.py).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import re
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/transformers"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
SUBCONFIGS = ("text_config", "ffn_config", "thinker_config", "language_config", "llm_config")
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "num_shared_expert")
# Not decoder language models (encoder-decoder, vision backbones, token classifiers, speech talkers).
NOT_DECODERS = {"nllb-moe", "switch_transformers", "vitpose_backbone", "openai_privacy_filter"}


def _has_experts(d: dict) -> bool:
    return any(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d.get(k) > 0 for k in EXPERT_KEYS)


def moe_model_types() -> list[str]:
    """Model types whose default config (or a sub-config) declares routed experts; text/vision/audio
    sub-configs of a multimodal model are covered by their parent."""
    found = []
    for mt in sorted(CONFIG_MAPPING.keys()):
        if mt in NOT_DECODERS or re.search(r"_(text|vision|audio)(_|$)|_encoder$|talker", mt):
            continue
        try:
            d = CONFIG_MAPPING[mt]().to_dict()
        except Exception:  # noqa: BLE001 - configs that need arguments are not MoE decoders we can default
            continue
        if d.get("is_encoder_decoder"):
            continue
        if _has_experts(d) or any(isinstance(d.get(k), dict) and _has_experts(d[k]) for k in SUBCONFIGS):
            found.append(mt)
    return found


# Routing as each family's modeling code fixes it (transformers 5.23, modeling_<type>.py, router forward):
# scoring, renormalize (True/False or the config attribute that decides), correction bias, grouped top-k.
_SOFTMAX_NORM_ATTR = {"scoring": "softmax", "renormalize": "norm_topk_prob", "correction_bias": False}
_SOFTMAX_RENORM = {"scoring": "softmax", "renormalize": True, "correction_bias": False}
_SIGMOID_BIAS = {"scoring": "sigmoid", "renormalize": "norm_topk_prob", "correction_bias": True,
                 "num_expert_group": "n_group", "topk_group": "topk_group",
                 "routed_scaling_factor": "routed_scaling_factor"}
ROUTING: dict[str, dict] = {
    "qwen2_moe": _SOFTMAX_NORM_ATTR, "qwen3_moe": _SOFTMAX_NORM_ATTR, "qwen3_next": _SOFTMAX_NORM_ATTR,
    "qwen3_omni_moe_thinker": _SOFTMAX_NORM_ATTR,
    "olmoe": _SOFTMAX_NORM_ATTR, "flex_olmo": _SOFTMAX_NORM_ATTR,
    "qwen3_vl_moe": _SOFTMAX_RENORM, "qwen3_5_moe": _SOFTMAX_RENORM, "mixtral": _SOFTMAX_RENORM,
    "minimax": _SOFTMAX_RENORM,
    # GraniteMoe: softmax over the top-k logits == softmax, top-k, renormalise
    "granitemoe": _SOFTMAX_RENORM, "granitemoeshared": _SOFTMAX_RENORM, "granitemoehybrid": _SOFTMAX_RENORM,
    "granitemoe_swa": _SOFTMAX_RENORM,
    # DeepSeek-V2: softmax, greedy or group-limited (group max), no renormalisation, routed scaling
    "deepseek_v2": {"scoring": "softmax", "renormalize": False, "correction_bias": False,
                    "num_expert_group": "n_group", "topk_group": "topk_group",
                    "routed_scaling_factor": "routed_scaling_factor"},
    "deepseek_v3": _SIGMOID_BIAS, "deepseek_v32": _SIGMOID_BIAS, "glm4_moe": _SIGMOID_BIAS,
    "glm4_moe_lite": _SIGMOID_BIAS, "glm4v_moe": _SIGMOID_BIAS, "glm_moe_dsa": _SIGMOID_BIAS,
    "dots1": _SIGMOID_BIAS, "solar_open": _SIGMOID_BIAS, "kimi_k25": _SIGMOID_BIAS,
    "exaone_moe": _SIGMOID_BIAS,
    # MiniMax-M2: sigmoid, e_score_correction_bias for selection, always renormalised
    "minimax_m2": {"scoring": "sigmoid", "renormalize": True, "correction_bias": True},
    # ERNIE-4.5: softmax, moe_statics bias for selection, renormalised (sum clamped at moe_norm_min)
    "ernie4_5_moe": {"scoring": "softmax", "renormalize": True, "correction_bias": True},
    # gpt-oss: softmax of the top-k logits == softmax, top-k, renormalise
    "gpt_oss": _SOFTMAX_RENORM,
    # Llama 4: sigmoid of the top-k logits, not renormalised (the weight scales the expert's input)
    "llama4": {"scoring": "sigmoid", "renormalize": False, "correction_bias": False},
    # PhiMoE: sparsemixer (two sequential masked softmaxes with jitter), not softmax top-k
    "phimoe": {"scoring": "sparsemixer", "renormalize": False, "correction_bias": False},
}


ROUTING.update({
    # DBRX: softmax, top-k, kept weights divided by their p-norm, p = ffn_config.moe_normalize_expert_weights
    # (1: renormalise to sum 1; None: not normalised)
    "dbrx": {"scoring": "softmax", "renormalize": lambda t: t.ffn_config.moe_normalize_expert_weights,
             "correction_bias": False},
    # HunYuan-MoE: softmax, top-k, always renormalised
    "hunyuan_v1_moe": _SOFTMAX_RENORM,
    # LFM2-MoE: sigmoid, expert_bias for selection (use_expert_bias), norm_topk_prob, routed scaling
    "lfm2_moe": {"scoring": "sigmoid", "renormalize": "norm_topk_prob", "correction_bias": "use_expert_bias",
                 "routed_scaling_factor": "routed_scaling_factor"},
    # Step-3.5/3.7: sigmoid, correction bias, always renormalised, output times moe_router_scaling_factor
    "step3p5": {"scoring": "sigmoid", "renormalize": True, "correction_bias": True,
                "routed_scaling_factor": "moe_router_scaling_factor"},
    "step3p7": {"scoring": "sigmoid", "renormalize": True, "correction_bias": True,
                "routed_scaling_factor": "moe_router_scaling_factor"},
    # JetMoE: softmax over the top-k logits == softmax, top-k, renormalise
    "jetmoe": _SOFTMAX_RENORM,
    # Kimi-Linear, MiMo-V2-Flash, Nemotron-H: DeepSeek-V3's router (group score = sum of the top-2 biased scores)
    "kimi_linear": _SIGMOID_BIAS, "mimo_v2_flash": _SIGMOID_BIAS, "nemotron_h": _SIGMOID_BIAS,
    "nemo_speechlm": _SIGMOID_BIAS,  # a speech LM whose text_config is a Nemotron-H
    # Mistral 4 / Large 4: softmax, no bias, group score = sum of the group's top-2 scores, routed scaling
    "mistral4": {"scoring": "softmax", "renormalize": "norm_topk_prob", "correction_bias": False,
                 "num_expert_group": "n_group", "topk_group": "topk_group", "group_score": "top2_sum",
                 "routed_scaling_factor": "routed_scaling_factor"},
    "mistral_large4": {"scoring": "softmax", "renormalize": True, "correction_bias": False,
                       "num_expert_group": "n_group", "topk_group": "topk_group", "group_score": "top2_sum",
                       "routed_scaling_factor": "routed_scaling_factor"},
    # LongCat-Flash: softmax over routed + zero-compute experts, correction bias, not renormalised, routed scaling
    "longcat_flash": {"scoring": "softmax", "renormalize": False, "correction_bias": True,
                      "routed_scaling_factor": "routed_scaling_factor"},
    # DeepSeek-V4: scoring_func (sqrtsoftplus), correction bias, always renormalised, routed scaling;
    # the first mlp_layer_types == hash_moe layers pick experts by a token-id table instead
    "deepseek_v4": {"scoring": "scoring_func", "renormalize": True, "correction_bias": True,
                    "routed_scaling_factor": "routed_scaling_factor"},
})
# Words of ROUTING that are plain values even when they are strings (the rest name config attributes).
ROUTING_LITERALS = ("group_score",)

# Default configs transformers' own model cannot be built from, or that declare no experts: the fewest
# overrides that make it build (or, for dots1, the MoE fields of the released dots.llm1 config), and why.
OVERRIDES: dict[str, tuple[dict, str]] = {
    "dbrx": ({"attn_config": {"rope_theta": 10000.0}},
             "DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not define"),
    "hunyuan_v1_moe": ({"head_dim": 128},
                       "the default head_dim is None and the attention computes head_dim ** -0.5; "
                       "128 = hidden_size / num_attention_heads"),
    "lfm2_moe": ({"layer_types": ["full_attention"] * 32},
                 "the default layer_types is None and each decoder layer indexes it; all full attention, "
                 "as LFM2's default config"),
    "dots1": ({"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
               "norm_topk_prob": True, "routed_scaling_factor": 2.5},
              "the default Dots1Config declares no experts (n_routed_experts None); these are the MoE fields of "
              "rednote-hilab/dots.llm1.inst's config.json"),
}
# Model types no auto class builds (a text sub-config): the class that does.
MODEL_CLASS = {"step3p5": "Step3p7TextModel"}


def make_config(mt: str) -> PretrainedConfig:
    """The default config of ``mt`` with its OVERRIDES applied."""
    return CONFIG_MAPPING[mt](**OVERRIDES.get(mt, ({}, ""))[0])


# The default config leaves top-k None (its router cannot run); the value every released checkpoint uses.
TOP_K_WHEN_NONE = {"deepseek_v2": (6, "transformers' default num_experts_per_tok is None; DeepSeek-V2 and "
                                      "V2-Lite ship 6, which the family spec takes as its default")}


def routing(mt: str, text: PretrainedConfig) -> dict:
    """The routing row of expected.json: attribute names in ROUTING are read from the config class."""
    rule = ROUTING.get(mt)
    if rule is None:
        return {}
    out = {}
    for key, value in rule.items():
        if callable(value):
            out[key] = value(text)
        elif isinstance(value, str) and key not in ROUTING_LITERALS and (key != "scoring" or hasattr(text, value)):
            out[key] = getattr(text, value)
        else:
            out[key] = value
    out.setdefault("num_expert_group", 1)
    out.setdefault("topk_group", 1)
    out.setdefault("routed_scaling_factor", 1.0)
    out["num_expert_group"] = out["num_expert_group"] or 1
    out["topk_group"] = out["topk_group"] or 1
    # a number is the p of the p-norm the kept weights are divided by (DBRX); 1 is renormalising to sum 1
    if isinstance(out["renormalize"], float | int) and not isinstance(out["renormalize"], bool):
        out["renormalize_p"] = float(out["renormalize"])
    out["renormalize"] = bool(out["renormalize"])
    out["correction_bias"] = bool(out.get("correction_bias"))
    if int(out["num_expert_group"]) > 1 or "group_score" in rule:
        out.setdefault("group_score", "top2_sum" if out["correction_bias"] else "max")
    return {"routing": out}


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    best: list[torch.nn.Module] = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks") \
                and "vision" not in name and "visual" not in name and "audio" not in name and len(mod) > len(best):
            best = list(mod)
    return best


def _experts(layer: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    for name, mod in layer.named_modules():
        last = name.split(".")[-1]
        if last in ("experts", "routed_experts") and "shared" not in name and "attention" not in name \
                and "self_attn" not in name:
            return name, mod
    for name, mod in layer.named_modules():  # JetMoE: the MoE MLP holds the experts' 3-D weights itself
        if hasattr(mod, "input_linear") and hasattr(mod, "output_linear") and "attn" not in name:
            return name, mod
    return None


def _expert_dims(mod: torch.nn.Module, hidden: int) -> tuple[int, int]:
    """(experts, intermediate) from fused 3-D parameters or a ModuleList of MLPs."""
    params = dict(mod.named_parameters())
    threed = {k: v for k, v in params.items() if v.dim() == 3}
    if threed:
        down = next((v for k, v in threed.items() if "down" in k or "w2" in k or "output" in k), None)
        if down is None:
            raise ValueError(f"no down projection among {sorted(threed)}")
        inter = [s for s in down.shape[1:] if s != hidden] or [hidden]
        # the down projection holds only computing experts (LongCat's gate_up also counts zero-compute ones)
        return int(down.shape[0]), int(inter[0])
    if hasattr(mod, "mlp") and isinstance(getattr(mod, "num_experts", None), int) and \
            isinstance(getattr(mod, "ffn_hidden_size", None), int):
        return mod.num_experts, mod.ffn_hidden_size  # DBRX: w1/v1/w2 as 2-D [experts * ffn_hidden_size, hidden]
    if isinstance(mod, torch.nn.ModuleList) or hasattr(mod, "__len__"):
        first = mod[0]
        for name, lin in first.named_modules():
            if isinstance(lin, torch.nn.Linear) and any(t in name for t in ("down", "w2", "fc2", "wo")):
                return len(mod), int(lin.in_features)
    raise ValueError(f"cannot read expert dims of {type(mod).__name__}")


def _shared(layer: torch.nn.Module, hidden: int) -> int:
    """Total intermediate size of the shared-expert MLP beside the routed experts (0 if none)."""
    for name, mod in layer.named_modules():
        if name.split(".")[-1] in ("shared_experts", "shared_expert", "shared_mlp", "shared_experts_mlp"):
            for sub, lin in mod.named_modules():
                if isinstance(lin, torch.nn.Linear) and any(t in sub for t in ("down", "w2", "fc2", "output")):
                    return int(lin.in_features)
            for pname, p in mod.named_parameters():
                if "down" in pname and p.dim() == 2:
                    return int([s for s in p.shape if s != hidden][0])
    return 0


def _gated(mod: torch.nn.Module) -> bool:
    """act(gate) * up experts (True) or act(up) only (Nemotron-H: up_proj and down_proj, no gate)."""
    names = [n.split(".")[-1] for n, _ in mod.named_parameters()] + [n.split(".")[-1] for n, _ in mod.named_modules()]
    return any(("gate" in n or n in ("w1", "w3", "v1", "input_linear")) for n in names)


def _latent(layer: torch.nn.Module) -> int:
    """Width of the latent space the experts run in (Nemotron-H fc1_latent_proj), 0 if none."""
    for name, mod in layer.named_modules():
        if name.endswith("fc1_latent_proj") and isinstance(mod, torch.nn.Linear):
            return int(mod.out_features)
    return 0


def _router_top_k(layer: torch.nn.Module) -> int | None:
    for _name, mod in layer.named_modules():
        for attr in ("top_k", "num_experts_per_tok", "moe_topk"):
            v = getattr(mod, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _routing_source(layer: torch.nn.Module) -> str:
    """Source of the MoE block's and router's forwards (for the scoring function actually used)."""
    found = _experts(layer)
    src = []
    for name, mod in layer.named_modules():
        if found and (name == found[0].rsplit(".", 1)[0] if "." in found[0] else name == "") or \
                name.split(".")[-1] in ("gate", "router"):
            with contextlib.suppress(OSError, TypeError):
                src.append(inspect.getsource(type(mod).forward))
    return "\n".join(src)


def facts(mt: str) -> dict:
    cfg = make_config(mt)
    text = cfg.get_text_config(decoder=True)
    with torch.device("meta"):
        if mt in MODEL_CLASS:
            model = getattr(transformers, MODEL_CLASS[mt])(cfg)
        else:
            try:
                model = AutoModelForCausalLM.from_config(cfg)
            except Exception:  # noqa: BLE001 - VL/omni models are not in the causal-LM mapping
                model = AutoModel.from_config(cfg)
    layers = _layers(model)
    hidden = int(text.hidden_size)
    moe, dims, shared, top_k, src, extra = [], set(), set(), set(), "", set()
    for i, layer in enumerate(layers):
        found = _experts(layer)
        if found is None:
            continue
        moe.append(i)
        dims.add(_expert_dims(found[1], hidden))
        extra.add((_gated(found[1]), _latent(layer), int(getattr(found[1], "zero_expert_num", 0) or 0)))
        shared.add(_shared(layer, hidden))
        top_k.add(_router_top_k(layer))
        src = src or _routing_source(layer)
    if not moe:
        return {"model_type": mt, "moe": False, "reason": "the default config builds no routed-expert layer"}
    if len(dims) != 1 or len(shared) != 1:
        raise ValueError(f"{mt}: MoE layers differ: experts/intermediate {dims}, shared {shared}")
    (num_experts, inter), = dims
    shared_total = shared.pop()
    count = next((getattr(text, k) for k in SHARED_COUNT_KEYS if isinstance(getattr(text, k, None), int)), None)
    if shared_total and not count:
        count = 1
    k_router = next(iter(top_k))
    k_cfg = getattr(text, "num_experts_per_tok", None)
    (gated, latent, zero), = extra
    experts_form = {**({} if gated else {"gated": False}), **({"latent_size": latent} if latent else {}),
                    **({"zero_experts": zero} if zero else {})}
    if len(layers) != int(text.num_hidden_layers):  # LongCat: two attention sublayers per decoder layer
        experts_form["num_hidden_layers"] = int(text.num_hidden_layers)
    return {
        "model_type": mt, "moe": True, "model_class": type(model).__name__,
        "num_experts": num_experts,
        "top_k": k_router if k_router is not None else k_cfg,
        "hidden": hidden, "intermediate": inter,
        "num_layers": len(layers),
        "moe_layers": moe,
        "shared_experts": int(count or 0) if shared_total else 0,
        "shared_intermediate": (shared_total // int(count)) if shared_total else 0,
        "scoring_in_code": sorted({w for w in ("sigmoid", "softmax") if w in src}),
        **experts_form,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_types", nargs="*")
    ap.add_argument("--out", type=Path, default=OUT, help="fixture root (default: tests/fixtures/transformers)")
    args = ap.parse_args(argv)
    out_root = args.out
    types = args.model_types or sorted(set(moe_model_types()) | set(OVERRIDES) | set(MODEL_CLASS))
    (out_root / "configs").mkdir(parents=True, exist_ok=True)
    for mt in types:
        try:
            f = facts(mt)
        except Exception as err:  # noqa: BLE001 - report and go on with the other model types
            print(f"{mt}: FAILED {type(err).__name__}: {err}", file=sys.stderr)
            continue
        f.update(routing(mt, make_config(mt).get_text_config(decoder=True)))
        if mt in OVERRIDES:
            f["overrides"] = {"values": OVERRIDES[mt][0], "why": OVERRIDES[mt][1]}
        code = f.get("scoring_in_code", [])
        if f.get("routing") and f["routing"]["scoring"] in ("softmax", "sigmoid") and \
                f["routing"]["scoring"] not in code:
            print(f"{mt}: WARNING ROUTING says {f['routing']['scoring']}, modeling code uses {code}", file=sys.stderr)
        if f.get("moe") and f["top_k"] is None and mt in TOP_K_WHEN_NONE:
            f["top_k"], f["top_k_note"] = TOP_K_WHEN_NONE[mt]
        d = out_root / "configs" / mt
        make_config(mt).save_pretrained(d)
        (d / "expected.json").write_text(json.dumps(f, indent=1) + "\n")
        print(mt, json.dumps(f))
    versions = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    (out_root / "VERSIONS.json").write_text(json.dumps(versions, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
