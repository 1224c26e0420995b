"""Routing against transformers itself: for every config the project reads (the default config of every MoE
model type transformers ships, saved by tools/make_transformers_configs.py, and the real published configs in
examples/configs and tests/fixtures), transformers' model is built on the meta device from the same config.json
and each routing value our reader produces is compared with what transformers' MoE layer holds: top-k,
renormalisation, expert groups and group top-k, routed scaling factor, the correction bias, the scoring
function and group score in the router's code, the shared experts and their gate. And every default a family
spec gives an absent field is what transformers' config class gives it (the field left out, the class built).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the dev extra installs it: the ground truth, so this file fails without it
from transformers import AutoConfig, AutoModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from moe_registry.cli import main as cli
from moe_registry.core.errors import ConfigError
from moe_registry.situation.config import ModelConfig, match_family, read_model_config
from moe_registry.spec.loader import load_registry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import make_transformers_configs as maker  # noqa: E402

TRANSFORMERS_CONFIGS = ROOT / "tests/fixtures/transformers/configs"
REGISTRY = load_registry()

# Model types (and architectures) a family spec names that transformers has no config class for, and why: the
# test cannot build them, so it says so here rather than skipping them quietly.
NOT_IN_TRANSFORMERS = {
    "kimi_k2": "Kimi-K2's model_type; transformers reads it by its architecture DeepseekV3ForCausalLM, with "
               "DeepseekV3Config (the spec names that class for it)",
    "minimax_m1": "MiniMax-M1 remote code only", "minimax_text_01": "MiniMax-Text-01 remote code only",
    "MiniMaxM1ForCausalLM": "MiniMax-M1 remote code only", "PhiMoEForCausalLM": "the remote-code spelling of Phimoe",
}


def _family(cfg: Mapping[str, Any]):
    try:
        return match_family(cfg, REGISTRY, "config.json")
    except ConfigError:
        return None


def _transformers_fixtures() -> list[str]:
    out = []
    for d in sorted(TRANSFORMERS_CONFIGS.iterdir()):
        exp = json.loads((d / "expected.json").read_text())
        if exp["moe"] and _family(json.loads((d / "config.json").read_text())) is not None:
            out.append(str(d.relative_to(ROOT)))
    return out


# Keys that change nothing transformers builds or our reader routes: configs equal without them are one case.
NOT_ROUTING = ("quantization_config", "torch_dtype", "dtype", "transformers_version", "_name_or_path")


def _published() -> list[str]:
    """The real configs, one of each distinct model (quantized copies of one model are one case)."""
    found = sorted({*ROOT.glob("examples/configs/*/*/config.json"), *ROOT.glob("tests/fixtures/**/config.json")})
    seen, out = set(), []
    for p in found:
        cfg = json.loads(p.read_text())
        key = json.dumps({k: v for k, v in cfg.items() if k not in NOT_ROUTING}, sort_keys=True)
        if TRANSFORMERS_CONFIGS not in p.parents and _family(cfg) is not None and key not in seen:
            seen.add(key)
            out.append(str(p.parent.relative_to(ROOT)))
    return out


def _model_type(config_dir: str) -> str:
    return str(json.loads((ROOT / config_dir / "config.json").read_text()).get("model_type"))


CONFIG_DIRS = _transformers_fixtures() + _published()
BUILT = [d for d in CONFIG_DIRS if _model_type(d) in CONFIG_MAPPING]
NOT_BUILT = [d for d in CONFIG_DIRS if _model_type(d) not in CONFIG_MAPPING]  # NOT_IN_TRANSFORMERS says why
# MoE layers whose router is not the family's: DeepSeek-V4's first hash_moe layers pick experts from a token-id
# table (no scores, no bias); the family is refused as a whole (sqrtsoftplus scoring), its later layers compared.
OTHER_ROUTER = {"deepseek_v4": "DeepseekV4HashRouter"}


def test_the_configs_cover_every_family_and_the_published_ones():
    families = {_family(json.loads((ROOT / d / "config.json").read_text())).family for d in CONFIG_DIRS}
    assert families == set(REGISTRY.families), sorted(set(REGISTRY.families) - families)
    assert "examples/configs/deepseek/deepseek-v3" in CONFIG_DIRS and len(_published()) >= 30


# ------------------------------------------------------------ transformers' model, on the meta device


def _config_dict(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)  # from_config does not quantize; the routing is the same
    return cfg


def _model_class(model_type: str) -> type:
    name = (maker.MODEL_CLASS.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
            or MODEL_MAPPING_NAMES[model_type])
    return getattr(transformers, name)


@functools.cache
def _decoder_layer(text: str, path: Path, index: int) -> tuple[Any, torch.nn.Module]:
    """transformers' decoder layer ``index`` of the config at ``path`` (``text``, its JSON without the
    quantization config, is the cache key: quantized copies of a model build once), on the meta device, built
    as the model builds it: its decoder-layer class (the first of the model's ``_no_split_modules`` that takes
    (config, layer_idx) and holds routed experts), else the whole model (multimodal models). With the text
    config."""
    config = AutoConfig.from_pretrained(path)
    text_config = config.get_text_config(decoder=True)
    model_cls = _model_class(config.model_type)
    module = importlib.import_module(model_cls.__module__)
    with torch.device("meta"):
        for name in model_cls._no_split_modules or []:
            layer_cls = getattr(module, name, None)
            try:
                layer = layer_cls(text_config, index) if layer_cls is not None else None
            except (TypeError, AttributeError):  # a vision or audio layer class: (config) alone
                continue
            if layer is not None and maker._experts(layer) is not None:
                return text_config, layer
        try:
            model = model_cls(config)
        except ValueError:  # a text model class handed the composite config
            model = AutoModel.from_config(config)
    return text_config, maker._layers(model)[index]


def _truth(path: Path, layer: int) -> dict[str, Any]:
    """What transformers' MoE layer ``layer`` runs with, read from its modules and its router's code."""
    text_config, block = _decoder_layer(json.dumps(_config_dict(path), sort_keys=True), path, layer)
    attrs: dict[str, Any] = {}
    for _, mod in block.named_modules():
        for name in ("top_k", "num_experts_per_tok", "moe_topk", "norm_topk_prob", "num_group", "n_group",
                     "topk_group", "routed_scaling_factor", "router_scaling_factor", "moe_router_scaling_factor",
                     "moe_normalize_expert_weights", "topk_method"):
            value = getattr(mod, name, None)
            if value is not None and not callable(value) and not isinstance(value, torch.nn.Module):
                attrs.setdefault(name, value)
    bias = any(n.split(".")[-1] in ("e_score_correction_bias", "expert_bias")
               for n, _ in [*block.named_buffers(), *block.named_parameters()])
    hidden = int(text_config.hidden_size)
    return {"attrs": attrs, "correction_bias": bias, "source": _moe_source(block),
            "classes": {type(m).__name__ for m in block.modules()},
            "scoring_func": getattr(text_config, "scoring_func", None),
            "shared_total": maker._shared(block, hidden),
            "shared_gate": any(n.split(".")[-1] == "shared_expert_gate" for n, _ in block.named_modules())}


def _moe_source(block: torch.nn.Module) -> str:
    """The code of every class in the layer's MoE block (the experts' parent module and its routers), where
    the scoring function and the group score are written; attention's softmax is outside it."""
    found = maker._experts(block)
    assert found is not None, "no routed experts in this layer"
    prefix = found[0].rsplit(".", 1)[0] if "." in found[0] else ""
    moe = block.get_submodule(prefix) if prefix else block
    classes = {type(m) for m in moe.modules()} | {type(m) for n, m in block.named_modules()
                                                   if n.split(".")[-1] in ("gate", "router")}
    return "\n".join(_source(c) for c in sorted(classes, key=lambda c: c.__qualname__)
                     if c.__module__.startswith("transformers.models"))


@functools.cache
def _source(cls: type) -> str:
    return inspect.getsource(cls)  # slow (it parses the module file): once a class


def _ours(model: ModelConfig) -> dict[str, Any]:
    return {v.word: v.value for v in model.routing_values}


@pytest.mark.parametrize("config_dir", NOT_BUILT)
def test_configs_transformers_cannot_build_say_why(config_dir):
    assert _model_type(config_dir) in NOT_IN_TRANSFORMERS
    assert read_model_config(ROOT / config_dir, REGISTRY).routing_values


@pytest.mark.parametrize("config_dir", BUILT)
@pytest.mark.parametrize("which", ["first", "last"])
def test_routing_is_what_transformers_runs(config_dir, which):
    """The first and the last MoE layer of transformers' model run what our reader says."""
    path = ROOT / config_dir
    model = read_model_config(path, REGISTRY)
    ours = _ours(model)
    layer = model.moe_layers[0 if which == "first" else -1]
    truth = _truth(path, layer)
    if OTHER_ROUTER.get(_model_type(config_dir)) in truth["classes"]:
        assert which == "first" and model.not_runnable
        return
    a = truth["attrs"]
    top_k = next((a[k] for k in ("top_k", "num_experts_per_tok", "moe_topk") if k in a), None)
    if top_k is None:  # transformers' default config leaves top-k None: its router cannot run; the spec's default
        assert model.shape.top_k == maker.TOP_K_WHEN_NONE[_model_type(config_dir)][0]
    else:
        assert ours["top_k"] == model.shape.top_k == top_k
    if "norm_topk_prob" in a:
        assert bool(ours["renormalize"]) is bool(a["norm_topk_prob"])
    if "moe_normalize_expert_weights" in a:  # DBRX: the p of the p-norm, None for none
        p = a["moe_normalize_expert_weights"]
        assert ours["renormalize"] == (False if p is None else p)
    grouped = a.get("topk_method", "noaux_tc") != "greedy"  # DeepSeek-V2's greedy ignores n_group
    groups = next((a[k] for k in ("num_group", "n_group") if k in a), None)
    assert ours["num_expert_group"] == (groups if groups and grouped else 1)
    assert ours["topk_group"] == (a["topk_group"] if a.get("topk_group") and grouped else 1)
    scale = next((a[k] for k in ("routed_scaling_factor", "router_scaling_factor", "moe_router_scaling_factor")
                  if k in a), 1.0)
    assert ours["routed_scaling_factor"] == scale
    assert ours["correction_bias"] is truth["correction_bias"]
    src = truth["source"]
    if ours["scoring"] in ("softmax", "sigmoid"):
        assert ours["scoring"] in src, f"{ours['scoring']} is not in the router's code"
        other = "sigmoid" if ours["scoring"] == "softmax" else "softmax"
        # both may appear (Llama 4: sigmoid of the top-k of logits); only the other one is a wrong scoring
        assert other not in src or ours["scoring"] in src
    elif truth["scoring_func"] is not None:  # the config names it and the router reads it (DeepSeek-V4)
        assert ours["scoring"] == truth["scoring_func"]
    else:  # a routing of its own (PhiMoE's sparsemixer)
        assert ours["scoring"] in src
    if ours["num_expert_group"] > 1:
        assert ("topk(2" in src) == (ours["group_score"] == "top2_sum")
    assert ours["shared_experts"] * ours["shared_intermediate"] == truth["shared_total"]
    if ours["shared_experts"]:
        assert ours["shared_expert_gate"] is truth["shared_gate"]


# ------------------------------------------------------------ defaults: the field left out


def _family_cases() -> list[tuple[str, str, str]]:
    """(family, model type with a saved default config, routing word or field) for every default a family
    spec gives a field that transformers' config class also reads."""
    cases = []
    for name, loaded in sorted(REGISTRY.families.items()):
        fam = loaded.spec
        words = {"top_k": fam.fields["top_k"], **{k: fam.fields[k] for k in ("shared_experts",) if k in fam.fields},
                 **fam.routing}
        for mt in fam.match.model_type:
            if not (TRANSFORMERS_CONFIGS / mt / "config.json").is_file():
                continue
            cases += [(name, mt, word) for word, ref in words.items() if ref.from_]
    return cases


def _drop(cfg: dict[str, Any], names: list[str], roots: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    for root in [out, *(out[r] for r in roots if isinstance(out.get(r), dict))]:
        for name in names:
            *parents, last = name.split(".")
            holder: Any = root
            for part in parents:
                holder = holder.get(part) if isinstance(holder, dict) else None
            if isinstance(holder, dict):
                holder.pop(last, None)
    return out


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


@pytest.mark.parametrize(("family", "model_type", "word"), _family_cases())
def test_absent_field_takes_transformers_default(family, model_type, word, tmp_path):
    fam = REGISTRY.families[family].spec
    ref = fam.fields[word] if word in fam.fields else fam.routing[word]
    cfg = _drop(json.loads((TRANSFORMERS_CONFIGS / model_type / "config.json").read_text()), ref.from_,
                fam.config_root)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    text = AutoConfig.from_pretrained(tmp_path).get_text_config(decoder=True)
    read = [n for n in ref.from_ if hasattr(text, n.split(".")[0])]
    expected = json.loads((TRANSFORMERS_CONFIGS / model_type / "expected.json").read_text())
    if not read:  # a remote-code name transformers' class does not read: its modeling code decides alone
        theirs = expected["shared_experts"] if word == "shared_experts" else expected["routing"][word]
    else:
        theirs = _attr(text, read[0])
    if theirs is None and word == "top_k":  # transformers' router cannot run without one
        if ref.default is None:
            with pytest.raises(ConfigError, match=f"top_k: field {ref.from_[0]} is missing"):
                read_model_config(tmp_path, REGISTRY)
            return
        theirs = expected["top_k"]  # the spec's default, recorded with why in expected.json (top_k_note)
        assert expected["top_k_note"]
    elif theirs is None:  # transformers' None: no groups, no normalisation, no shared experts
        theirs = {"num_expert_group": 1, "topk_group": 1, "renormalize": False, "shared_experts": 0}[word]
    model = read_model_config(tmp_path, REGISTRY)
    ours = _ours(model)[word] if word != "shared_experts" else model.shape.shared_experts
    if word == "shared_experts" and not model.shape.shared_intermediate:
        return  # no shared experts either way: their size is 0
    assert ours == theirs, f"{ref.from_} absent: ours {ours!r}, transformers' {type(text).__name__} {theirs!r}"
    source = next(v for v in model.routing_values if v.word == word)
    assert source.origin in ("class-default", "spec-default")
    if source.origin == "class-default":
        assert source.config_class == type(text).__name__


def test_every_config_class_default_is_transformers():
    """Each class a family spec names exists in transformers, reads the model types listed, and has the
    defaults written (built with no arguments)."""
    checked = 0
    for loaded in REGISTRY.families.values():
        for cls_name, cls in loaded.spec.config_classes.items():
            built = getattr(transformers, cls_name)()
            for field, value in cls.defaults.items():
                assert _attr(built, field) == value, f"{cls_name}.{field}: spec {value!r}, transformers " \
                                                     f"{_attr(built, field)!r}"
                checked += 1
            for name in cls.model_types:
                if name in NOT_IN_TRANSFORMERS:
                    continue
                if name in CONFIG_MAPPING:
                    text = CONFIG_MAPPING[name]().get_text_config(decoder=True)
                else:  # an architecture
                    text = getattr(transformers, name).config_class().get_text_config(decoder=True)
                assert type(text).__name__ == cls_name, (name, type(text).__name__, cls_name)
    assert checked > 100


def test_every_model_type_has_a_config_class_or_a_reason():
    for loaded in REGISTRY.families.values():
        fam = loaded.spec
        listed = {n for cls in fam.config_classes.values() for n in cls.model_types}
        missing = [mt for mt in fam.match.model_type if mt not in listed and mt not in NOT_IN_TRANSFORMERS]
        assert not missing, f"family {fam.family}: model types without a transformers config class: {missing}"


# ------------------------------------------------------------ the cases that were wrong


def _deepseek_v3(tmp_path: Path, **changes: Any) -> Path:
    cfg = json.loads((ROOT / "examples/configs/deepseek/deepseek-v3/config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_kimi_k2_without_routed_scaling_factor_takes_deepseek_v3_default(tmp_path):
    path = _deepseek_v3(tmp_path, model_type="kimi_k2", n_routed_experts=384, n_group=1, topk_group=1,
                        routed_scaling_factor=None)
    model = read_model_config(path, REGISTRY)
    assert model.routing["routed_scaling_factor"] == transformers.DeepseekV3Config().routed_scaling_factor == 2.5
    value = next(v for v in model.routing_values if v.word == "routed_scaling_factor")
    assert value.source == "routed_scaling_factor absent: transformers' DeepseekV3Config default"


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "kimi_k25", "glm4_moe", "deepseek_v3"])
def test_norm_topk_prob_absent_renormalises_as_transformers_does(model_type, tmp_path):
    cfg = json.loads((TRANSFORMERS_CONFIGS / model_type / "config.json").read_text())
    fam = _family(cfg)
    cfg = _drop(cfg, ["norm_topk_prob"], fam.config_root)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_model_config(tmp_path, REGISTRY).routing["renormalize"] is True


# ------------------------------------------------------------ values read but never checked


BAD_ROUTING = [
    ({"n_group": 0}, "n_group: got 0; wanted a positive integer (the number of expert groups)"),
    ({"topk_group": 9}, "topk_group: got 9; wanted an integer in [1, 8] (the groups kept, of 8)"),
    ({"n_group": 3}, "n_group: got 3; wanted a divisor of the 256 experts (groups of equal size)"),
    ({"n_group": 64, "topk_group": 1}, "num_experts_per_tok: got 8; wanted at most 4, the experts in the 1 chosen "
                                       "group(s) of 4"),
    ({"routed_scaling_factor": -2.5}, "routed_scaling_factor: got -2.5; wanted a positive number (the routed "
                                      "experts' output is multiplied by it)"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor: got '2.5'; wanted a positive number"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob: got 'false'; wanted true or false"),
    ({"n_group": True}, "n_group: got True; wanted a positive integer"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_ROUTING, ids=[m.split(":")[0] + str(i)
                                                                  for i, (_, m) in enumerate(BAD_ROUTING)])
def test_bad_routing_value_is_one_line_naming_file_and_field(changes, message, tmp_path, capsys):
    path = _deepseek_v3(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        read_model_config(path, REGISTRY)
    assert str(err.value).startswith(f"{path / 'config.json'}: {message}")
    assert "\n" not in str(err.value)
    assert cli.main(["explain", str(path), "--platform", "cpu"]) == 2
    assert message in capsys.readouterr().err
