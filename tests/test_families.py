"""Model-family specs against transformers itself: every MoE config transformers ships (saved by
tools/make_transformers_configs.py with save_pretrained) is read with the shape transformers builds
from it, or refused with one line naming the closest families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_registry.core.errors import ConfigError
from moe_registry.situation.config import read_model_config
from moe_registry.situation.describe import Flags, situation_for
from moe_registry.spec.loader import load_registry

ROOT = Path(__file__).resolve().parent / "fixtures/transformers"
CONFIGS = ROOT / "configs"
FIXTURES = sorted(p.name for p in CONFIGS.iterdir() if (p / "expected.json").is_file())
# Model types a family spec names that have no fixture, and why.
NO_FIXTURE = {
    "kimi_k2": ("not a transformers model type (Kimi-K2 checkpoints say kimi_k2; transformers reads "
                "them as deepseek_v3)"),
    "minimax_m1": "not a transformers model type (MiniMax-M1 remote code)",
    "minimax_text_01": "not a transformers model type (MiniMax-Text-01 remote code)",
}


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _expected(model_type: str) -> dict:
    return json.loads((CONFIGS / model_type / "expected.json").read_text())


def _family_of(model_type: str, registry) -> str | None:
    for loaded in registry.families.values():
        if model_type in loaded.spec.match.model_type:
            return loaded.spec.family
    return None


def _supported(registry) -> list[str]:
    return [m for m in FIXTURES if _family_of(m, registry) and _expected(m)["moe"]]


def test_versions_recorded():
    versions = json.loads((ROOT / "VERSIONS.json").read_text())
    assert versions["transformers"].startswith("5.")


def test_every_supported_model_type_has_a_fixture(registry):
    named = {t for f in registry.families.values() for t in f.spec.match.model_type}
    # sub-config types (qwen3_vl_moe_text, ...) are covered by their parent's fixture
    missing = sorted(t for t in named - set(FIXTURES) - set(NO_FIXTURE) if not t.endswith("_text"))
    assert not missing, f"family specs name model types without a transformers fixture: {missing}"


def test_part3_families_are_covered(registry):
    wanted = {"qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v2", "deepseek_v3",
              "deepseek_v32", "kimi_k25", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm_moe_dsa", "minimax",
              "minimax_m2", "ernie4_5_moe", "olmoe", "flex_olmo", "exaone_moe", "solar_open", "granitemoe",
              "granitemoehybrid", "granitemoeshared", "phimoe", "mixtral",
              # built with overrides (expected.json "overrides" says which and why)
              "dbrx", "hunyuan_v1_moe", "lfm2_moe", "step3p5", "dots1",
              "jetmoe", "kimi_linear", "mimo_v2_flash", "mistral4", "mistral_large4", "nemotron_h", "longcat_flash",
              "deepseek_v4", "step3p7"}
    assert wanted <= set(_supported(registry)), sorted(wanted - set(_supported(registry)))


@pytest.mark.parametrize("model_type", FIXTURES)
def test_transformers_config(model_type, registry):
    """Supported: the shape transformers builds; unsupported: one line with the closest families."""
    exp = _expected(model_type)
    path = CONFIGS / model_type
    if not (_family_of(model_type, registry) and exp["moe"]):
        with pytest.raises(ConfigError) as err:
            read_model_config(path, registry)
        msg = str(err.value)
        assert "\n" not in msg and "is not a known MoE family" in msg and "closest known" in msg
        assert repr(json.loads((path / "config.json").read_text())["model_type"]) in msg
        return
    model = read_model_config(path, registry)
    s = model.shape
    got = {"num_experts": s.num_experts, "top_k": s.top_k, "hidden": s.hidden, "intermediate": s.intermediate,
           "num_layers": model.num_layers, "moe_layers": list(model.moe_layers),
           "shared_experts": s.shared_experts, "shared_intermediate": s.shared_intermediate}
    assert got == {k: exp[k] for k in got}
    r = model.routing
    routing = {"scoring": r.get("scoring", "softmax"), "renormalize": bool(r.get("renormalize", False)),
               "correction_bias": bool(r.get("correction_bias", False)),
               "num_expert_group": int(r.get("num_expert_group", 1) or 1),
               "topk_group": int(r.get("topk_group", 1) or 1),
               "routed_scaling_factor": float(r.get("routed_scaling_factor", 1.0))}
    assert routing == {k: exp["routing"][k] for k in routing}
    if "group_score" in exp["routing"]:  # how a group is scored, as the modeling code does it
        default = "top2_sum" if routing["correction_bias"] else "max"
        assert r.get("group_score", default) == exp["routing"]["group_score"]
    if "renormalize_p" in exp["routing"]:
        assert float(r["renormalize"]) == exp["routing"]["renormalize_p"]
    # expert forms no kernel here runs: reported exactly when transformers builds them
    reasons = " ".join(model.not_runnable)
    assert ("not gated" in reasons) == (exp.get("gated") is False)
    assert ("latent space" in reasons) == bool(exp.get("latent_size"))
    assert (f"{exp.get('zero_experts')} zero-compute" in reasons) == bool(exp.get("zero_experts"))
    assert ("routing.scoring" in reasons) == (routing["scoring"] not in ("softmax", "sigmoid"))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "glm4_moe_lite", "qwen2_moe"])
def test_explain_reports_the_fixture(model_type, registry):
    s = situation_for(CONFIGS / model_type, registry, Flags(platform="cpu"))
    exp = _expected(model_type)
    assert s.layer == exp["moe_layers"][0] and s.runtime.shape is not None
    assert s.runtime.shape.num_experts == exp["num_experts"]


def test_qwen3_moe_spelled_either_way(registry, tmp_path):
    cfg = json.loads((CONFIGS / "qwen3_moe/config.json").read_text())
    assert "num_local_experts" in cfg          # what transformers 5 writes
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_model_config(tmp_path, registry).shape.num_experts == _expected("qwen3_moe")["num_experts"]


def test_unknown_family_names_the_closest(registry, tmp_path):
    cfg = json.loads((CONFIGS / "qwen3_moe/config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "qwen3_mo", ["Qwen3MoForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type: 'qwen3_mo' is not a known MoE family "
                                          r"\(architectures \['Qwen3MoForCausalLM'\]\); closest known: qwen-moe"):
        read_model_config(tmp_path, registry)


def test_layer_words(registry, tmp_path):
    """per_layer, first_dense/last/step and indices each decide the MoE layers."""
    cfg = json.loads((CONFIGS / "glm4_moe_lite/config.json").read_text())
    cfg["num_hidden_layers"], cfg["mlp_layer_types"] = 4, ["dense", "sparse", "dense", "sparse"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_model_config(tmp_path, registry).moe_layers == (1, 3)
    cfg["mlp_layer_types"] = ["sparse"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mlp_layer_types: got \\['sparse'\\]; wanted one entry per layer \\(4\\)"):
        read_model_config(tmp_path, registry)
    ernie = json.loads((CONFIGS / "ernie4_5_moe/config.json").read_text())
    ernie.update(num_hidden_layers=10, moe_layer_start_index=2, moe_layer_end_index=7, moe_layer_interval=2)
    (tmp_path / "config.json").write_text(json.dumps(ernie))
    assert read_model_config(tmp_path, registry).moe_layers == (3, 5, 7)


def test_explain_shows_shared_experts(capsys):
    from moe_registry.cli import main as cli

    assert cli.main(["explain", str(CONFIGS / "qwen2_moe"), "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "shared      1 x 5632 (dense MLP, not run here)" in out
    assert cli.main(["explain", str(CONFIGS / "qwen3_moe"), "--platform", "cpu"]) == 0
    assert "shared " not in capsys.readouterr().out


def test_overrides_are_recorded():
    """Configs built from a default config plus overrides say which and why."""
    for model_type in ("dbrx", "hunyuan_v1_moe", "lfm2_moe", "dots1"):
        over = _expected(model_type)["overrides"]
        cfg = json.loads((CONFIGS / model_type / "config.json").read_text())
        for key, value in over["values"].items():
            got = cfg[key]
            assert (got == value) if not isinstance(value, dict) else value.items() <= got.items(), model_type
        assert over["why"]


def test_not_runnable_explained_and_refused(capsys):
    """explain shows why no kernel here runs the experts; run (build) refuses with one line."""
    from moe_registry.cli import main as cli
    from moe_registry.core.errors import SelectionError
    from moe_registry.layer.build import build

    # a kernel runs the 512 real experts, but not the zero-compute ones beside them: refused (exit 1)
    assert cli.main(["explain", str(CONFIGS / "longcat_flash"), "--platform", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "256 zero-compute (identity) experts are routed beside the 512 experts" in out
    # relu2 also turns every kernel down (exit 1, refused); the report says why in both places
    assert cli.main(["explain", str(CONFIGS / "nemotron_h"), "--platform", "cpu", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)["report"]
    assert any("not gated" in r for r in report["not_runnable"])
    assert any("activation 'relu2'" in r for r in report["not_runnable"])
    with pytest.raises(SelectionError) as err:
        build(CONFIGS / "deepseek_v4", platform="cpu")
    msg = str(err.value)
    assert "\n" not in msg and "not run here: routing.scoring 'sqrtsoftplus'" in msg
    assert cli.main(["explain", str(CONFIGS / "mistral4"), "--platform", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["not_runnable"] == []


def test_expert_form_words(registry, tmp_path):
    """latent_size, renormalize p and dotted field paths are read from the config."""
    cfg = json.loads((CONFIGS / "nemotron_h/config.json").read_text())
    cfg["moe_latent_size"] = 1024
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert any("latent space of 1024 between projections from and back to hidden 4096" in r
               for r in read_model_config(tmp_path, registry).not_runnable)
    dbrx = json.loads((CONFIGS / "dbrx/config.json").read_text())
    assert read_model_config(CONFIGS / "dbrx", registry).not_runnable == ()
    dbrx["ffn_config"].update(moe_normalize_expert_weights=2.0, moe_num_experts=16)
    (tmp_path / "config.json").write_text(json.dumps(dbrx))
    model = read_model_config(tmp_path, registry)
    assert model.shape.num_experts == 16
    assert model.not_runnable == ("routing.renormalize: the kept weights are divided by their 2.0-norm; only 1 "
                                  "(weights summing to 1) is run here",)
    dbrx["ffn_config"]["moe_normalize_expert_weights"] = None
    (tmp_path / "config.json").write_text(json.dumps(dbrx))
    assert read_model_config(tmp_path, registry).routing["renormalize"] is False
