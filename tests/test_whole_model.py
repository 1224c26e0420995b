"""Whole models: ``load_model`` against transformers' own model on the same weights.

Each family with a tiny fixture whose transformers causal-LM class routes through the experts contract gets a
tiny random whole model (3 decoder layers: at least two MoE layers, a dense first layer and shared experts where
the family has them), written by transformers' ``save_pretrained`` in a temporary dir from the tiny fixture's
config.json (tools/make_transformers_whole.py; seeded, so the same weights every run).

Tolerances (relative error of the logits, ‖ours − transformers‖ / ‖transformers‖):

- torch reference, float32: 1e-5. Both sides compute in float32 from the same bfloat16-exact weights and
  differ only in summation order (measured ~1e-7 through three layers); a wrong layer, a misread expert or
  a routing pair dropped is O(1e-1) or more.
- the CPU default kernel (the oracle's choice) in the checkpoint's bfloat16: within 3x transformers' own
  bfloat16 model's error against float32 (tokens: near ties within the scheme's bfloat16 tolerance, 1.5e-2).
Greedy generation of 16 tokens gives transformers' tokens; where one differs the two best logits there must be
within the tolerance of each other (a near tie, not a wrong model).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")  # the dev extra installs it; the core does not need it

from make_transformers_whole import make_whole_model  # noqa: E402  (tools/, on sys.path from conftest)

from moe_registry.core.errors import CheckpointError, ConfigError  # noqa: E402
from moe_registry.layer.build import build  # noqa: E402
from moe_registry.layer.resident import reachable_tensor_bytes  # noqa: E402
from moe_registry.whole.experts_module import RegistryExperts, drop_foreign  # noqa: E402
from moe_registry.whole.load import generating_class, load_model  # noqa: E402

FP32_TOL = 1e-5
BF16_TOL = 1.5e-2  # the unquantized scheme's bfloat16 tolerance
NEW_TOKENS = 16
# Families of the tiny fixtures run whole (glm4v_moe and qwen3_vl_moe as transformers' image-text-to-text models,
# from token ids; llama4_text's block calls its experts with scaled rows). Not here: jetmoe (its experts are
# attention heads and an MoE its block calls in neither form: load_model refuses it, tested below); kimi_linear and
# step3p7 (transformers converts some of their non-expert
# tensors at load, attention convs and the vision tower's fused projections: load_model refuses them, naming the
# tensor, tested below).
FAMILIES = ["dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo",
            "glm4_moe", "glm4_moe_lite", "glm4v_moe", "gpt_oss", "granitemoe", "hunyuan_v1_moe", "lfm2_moe",
            "llama4_text", "mimo_v2_flash", "minimax_m2", "mistral4", "mixtral", "olmoe", "qwen2_moe", "qwen3_5_moe",
            "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "solar_open"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    made: dict[tuple[str, tuple[tuple[str, int], ...]], Path] = {}

    def get(name: str, **fields: int) -> Path:
        key = (name, tuple(sorted(fields.items())))
        if key not in made:
            made[key] = make_whole_model(name, tmp_path_factory.mktemp("whole") / name, layers=3, **fields)
        return made[key]
    return get


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _prompt() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _reference(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    auto = generating_class(transformers, transformers.AutoConfig.from_pretrained(str(path)))
    return auto.from_pretrained(str(path), dtype=dtype).eval()


def _assert_same_greedy(ours: torch.nn.Module, ref: torch.nn.Module, prompt: torch.Tensor, tol: float) -> None:
    """Greedy tokens equal transformers'; a differing token is only allowed at a near tie of the top two logits."""
    kw = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    got = ours.generate(prompt, **kw)
    want = ref.generate(prompt, **kw)
    if torch.equal(got, want):
        return
    first = int((got[0, :want.shape[1]] != want[0, :got.shape[1]]).nonzero()[0])
    with torch.no_grad():
        logits = ref(want[:, :first]).logits[0, -1]
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) <= tol * float(logits.norm()), (first, got.tolist(), want.tolist())


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(name: str, whole) -> None:  # type: ignore[no-untyped-def]
    path = whole(name)
    ours = load_model(path, dtype="float32", kernel="torch-reference")
    report = ours.moe_registry_report
    assert len(report.layers) >= 2 and all(p.kernel == "torch-reference" for p in report.layers)
    assert all(isinstance(m, RegistryExperts) for m in ours.modules() if m.__class__.__name__.endswith("Experts"))
    ref = _reference(path)
    prompt = _prompt()
    with torch.no_grad():
        assert _rel(ours(prompt).logits, ref(prompt).logits) < FP32_TOL
    _assert_same_greedy(ours, ref, prompt[:1], FP32_TOL)


# gpt_oss is not among them: in bfloat16 its second layer's router picks another expert for one token than the
# float32 model does (a near tie), which costs ~0.1 of the logits, 4x transformers' own bfloat16 error
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3", "llama4_text"])
def test_cpu_default_kernel_in_bfloat16_matches_transformers(name: str, whole) -> None:  # type: ignore[no-untyped-def]
    """Nothing pinned, the checkpoint's dtype (bfloat16): each layer runs the kernel the oracle picks for it. Against
    transformers' float32 logits, ours are within 3x the error of transformers' own bfloat16 model (bfloat16
    rounding of every activation, and a top-k pick that flips on a near tie, are the budget; a wrong expert or
    layer is O(1)); greedy tokens equal transformers' bfloat16 model's up to near ties."""
    path = whole(name)
    ours = load_model(path)
    report = ours.moe_registry_report
    assert report.dtype == "bfloat16"
    for plan in report.layers:
        assert plan.kernel == build(path, layer=plan.layer, platform="cpu").report.chosen
    ref, truth = _reference(path, torch.bfloat16), _reference(path)
    prompt = _prompt()
    with torch.no_grad():
        want = truth(prompt).logits
        assert _rel(ours(prompt).logits, want) <= 3 * _rel(ref(prompt).logits, want)
    _assert_same_greedy(ours, ref, prompt[:1], BF16_TOL)


def test_report_counts_the_experts_bytes(whole) -> None:  # type: ignore[no-untyped-def]
    """The report's checkpoint bytes are the expert tensors' bytes in the file; its resident bytes what the kernels
    reach; the text groups identical layers."""
    path = whole("qwen2_moe")
    model = load_model(path, dtype="float32")
    report = model.moe_registry_report
    assert [p.layer for p in report.layers] == [0, 1, 2]
    stored = load_file(str(path / "model.safetensors"))
    expert_bytes = sum(t.numel() * t.element_size() for k, t in stored.items() if ".mlp.experts." in k)
    assert report.experts_checkpoint_bytes == expert_bytes
    modules = [m for m in model.modules() if isinstance(m, RegistryExperts)]
    assert report.experts_resident_bytes == sum(reachable_tensor_bytes(m.kernel) for m in modules) > 0
    text = report.to_text()
    assert "MoE layers 0-2: scheme unquantized, kernel torch-cpu-grouped" in text and "experts hold" in text
    assert json.loads(report.to_json())["experts_checkpoint_bytes"] == expert_bytes
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = model.generate(_prompt()[:1], max_new_tokens=4, do_sample=True, top_k=5, pad_token_id=0)
    assert out.shape == (1, 16)


def test_an_unquantized_model_holds_its_experts_once_on_the_cpu(whole) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 checkpoint on the CPU (torch-cpu-grouped runs it in bfloat16): the experts stay as stored, so
    they hold the checkpoint's bytes, not three times them (a float32 copy beside the bfloat16 one)."""
    report = load_model(whole("qwen3_moe")).moe_registry_report
    assert {p.kernel for p in report.layers} == {"torch-cpu-grouped"} and report.dtype == "bfloat16"
    assert report.experts_resident_bytes <= 1.01 * report.experts_checkpoint_bytes, report.to_text()


def test_foreign_expert_ids_add_nothing() -> None:
    """ids >= num_experts (transformers' expert-parallel sentinel) get weight 0 on an expert their row lacks."""
    ids = torch.tensor([[0, 8, 9], [3, 1, 2], [8, 8, 5]])
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.4, 0.4, 0.2]])
    got_ids, got_w = drop_foreign(ids, weights, 8)
    assert torch.equal(got_ids[1], ids[1]) and torch.equal(got_w[1], weights[1])
    assert torch.equal(got_w, torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 0.2]]))
    for row in got_ids:
        assert len(set(row.tolist())) == 3 and int(row.max()) < 8


def test_foreign_ids_through_the_model_module(whole) -> None:  # type: ignore[no-untyped-def]
    """A layer's experts with one slot per token sent to another rank equal the same layer without that slot
    (the module under transformers' expert parallelism, which marks it ``_is_expert_parallel``)."""
    model = load_model(whole("qwen3_moe"), dtype="float32", kernel="torch-reference")
    experts = next(m for m in model.modules() if isinstance(m, RegistryExperts))
    experts._is_expert_parallel = True
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0], [2, 5]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    alone = experts(x, ids[:, :1], w[:, :1])
    with_foreign = experts(x, torch.cat([ids[:, :1], torch.full((5, 1), 8)], 1), w)
    assert _rel(with_foreign, alone) < 1e-6


# --- bad input: one line naming what is wrong ---------------------------------------------------------------


def test_unknown_family_names_the_closest(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(whole("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "qwen3_mo", ["Qwen3MoForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"'qwen3_mo' is not a known MoE family .*closest known: qwen-moe"):
        load_model(d)


def test_missing_tensor_names_the_tensor_and_its_file(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(whole("qwen3_moe"), tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.self_attn\.k_proj\.weight: missing from the "
                                              r"checkpoint \(expected in model\.safetensors in .*\)$"):
        load_model(d)


def test_layers_disagreeing_with_the_checkpoint_name_the_layer(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(whole("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"the checkpoint holds layer 2 \(model\.layers\.2\..*\), but config\.json "
                                          r"has 2 layers"):
        load_model(d)


@pytest.mark.parametrize("name,field", [("deepseek_v3", "num_nextn_predict_layers"), ("minimax_m2", "num_mtp_modules")])
def test_a_multi_token_prediction_layer_is_left_as_transformers_leaves_it(name: str, field: str, whole,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    """DeepSeek-V3 and GLM-4.5 ship their multi-token-prediction layer after the decoder's (DeepSeek-V3: layer 61
    of a 61-layer config, ``num_nextn_predict_layers`` 1; MiniMax-M2 three, ``num_mtp_modules``), which
    transformers' model does not load: ours loads the same model (transformers' logits), reports those tensors
    unused, and still refuses a layer past them (the family spec's ``mtp_layers`` counts them)."""
    d = _copy(whole(name), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg[field] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(d / "model.safetensors"))
    last = f"model.layers.{layers - 1}."
    mtp = {k.replace(last, f"model.layers.{layers}."): v.clone() for k, v in tensors.items() if k.startswith(last)}
    mtp[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(cfg["hidden_size"], 2 * cfg["hidden_size"])
    save_file({**tensors, **mtp}, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(d, dtype="float32", kernel="torch-reference")
    report = ours.moe_registry_report
    assert set(mtp) <= set(report.ignored) and report.unloaded_layers == (layers,)
    assert f"checkpoint layer {layers}: multi-token prediction, left unloaded" in report.to_text()
    with torch.no_grad():
        assert _rel(ours(_prompt()).logits, _reference(d)(_prompt()).logits) < FP32_TOL
    past = {k.replace(f"model.layers.{layers}.", f"model.layers.{layers + 1}."): v.clone() for k, v in mtp.items()}
    save_file({**tensors, **mtp, **past}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"the checkpoint holds layer {layers + 1} \(model\.layers\.{layers + 1}\."):
        load_model(d)
    if name != "deepseek_v3":
        return
    # without the config's count, the class's own ignore pattern (DeepseekV3ForCausalLM: model.layers.61) decides
    cfg[field] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    at_61 = {k.replace(f"model.layers.{layers}.", "model.layers.61."): v.clone() for k, v in mtp.items()}
    save_file({**tensors, **at_61}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert set(at_61) <= set(load_model(d, dtype="float32").moe_registry_report.ignored)
    save_file({**tensors, **mtp}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"the checkpoint holds layer {layers} "):
        load_model(d)


def test_not_enough_memory_is_refused_before_loading(whole, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import moe_registry.whole.load as load
    import moe_registry.whole.memory as memory

    built: list[int] = []
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(load, "build", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"loading .*: needs \d+ bytes \(.* GiB\) on cpu, 1000 bytes \(0\.00 GiB\) "
                                          r"are free$"):
        load_model(whole("qwen3_moe"))
    assert not built  # refused before any layer was built


def test_experts_without_the_contract_are_refused(tmp_path: Path) -> None:
    d = make_whole_model("jetmoe", tmp_path / "jetmoe", layers=2)
    with pytest.raises(ConfigError, match=r"transformers' JetMoeForCausalLM has no experts module taking the experts "
                                          r"contract .*JetMoeMoA"):
        load_model(d)


@pytest.mark.parametrize(("name", "tensor", "into"), [
    ("kimi_linear", r"model\.layers\.0\.self_attn\.k_conv1d\.weight", r"model\.layers\.0\.self_attn\.conv1d\.weight"),
    ("step3p7", r"vision_model\.transformer\.resblocks\.0\.attn\.in_proj_bias",
     r"model\.vision_model\.layers\.0\.self_attn\.q_proj\.bias"),
])
def test_non_expert_tensors_transformers_converts_are_refused_naming_them(name: str, tensor: str, into: str,
                                                                          tmp_path: Path) -> None:
    """transformers rewrites some non-expert tensors at load (merged convs, a vision tower's fused projections);
    load_model loads those as stored only, so it refuses the model naming the first such tensor."""
    d = make_whole_model(name, tmp_path / name, layers=2)
    with pytest.raises(CheckpointError, match=rf"{tensor}: transformers converts it into {into} .*only experts' "
                                              r"tensors are converted by the registry"):
        load_model(d, dtype="float32", kernel="torch-reference")


def test_missing_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"^whole models need transformers \(transformers>=5\.17,<6\), which is not "
                                          r"installed: pip install 'moe-registry\[transformers\]'$"):
        load_model(tmp_path)


def test_transformers_out_of_range_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # the module transformers' lazy loader has in sys.modules now (not necessarily the one imported at collection)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^whole models need transformers>=5\.17,<6; this environment has "
                                          r"transformers 4\.57\.1: pip install 'moe-registry\[transformers\]'$"):
        load_model(tmp_path)


# --- transformers' ExpertsInterface: a model loaded by transformers, its experts on the registry's kernel ---------


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_experts_implementation_registered_in_transformers(name: str, whole) -> None:  # type: ignore[no-untyped-def]
    """``experts_implementation="moe_registry"`` at load (float32: transformers' logits within 1e-5) and
    ``set_experts_implementation`` on a bfloat16 model (the same logits as load_model's bfloat16 model, whose
    experts run on the same kernel from the same weights)."""
    from moe_registry.whole.interface import NAME, register_experts_implementation

    assert register_experts_implementation() == NAME == "moe_registry"
    path = whole(name)
    prompt = _prompt()
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             experts_implementation=NAME).eval()
    with torch.no_grad():
        assert _rel(ours(prompt).logits, _reference(path)(prompt).logits) < FP32_TOL
    held = [m.__dict__["_moe_registry_experts"] for m in ours.modules() if "_moe_registry_experts" in m.__dict__]
    assert len(held) >= 2 and all(h.report.chosen == "torch-cpu-grouped" for h in held)
    model = _reference(path, torch.bfloat16)
    model.set_experts_implementation(NAME)
    loaded = load_model(path)
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, loaded(prompt).logits)


def test_experts_implementation_refuses_experts_it_cannot_run(whole) -> None:  # type: ignore[no-untyped-def]
    from moe_registry.whole.interface import NAME, register_experts_implementation

    register_experts_implementation()
    model = _reference(whole("gpt_oss"), torch.bfloat16)
    model.set_experts_implementation(NAME)
    with pytest.raises(ConfigError, match=r"experts_implementation='moe_registry': GptOssExperts has its own gate "
                                          r"function or expert biases; load the checkpoint with moe_registry\."
                                          r"load_model instead"):
        model(_prompt())


# --- moe-registry generate ----------------------------------------------------------------------------------------


def test_generate_command_prints_tokens_speeds_and_experts_memory(whole, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from moe_registry.cli.main import main

    path = whole("qwen3_moe")
    code = main(["generate", str(path), "--input-ids", "5,6,7,8", "--max-new-tokens", "6", "--dtype", "float32",
                 "--kernel", "torch-reference", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    ref = _reference(path)
    want = ref.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                        pad_token_id=0)[0, 4:].tolist()
    assert out["new_ids"] == want and out["prompt_ids"] == [5, 6, 7, 8] and out["text"] is None
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0 and out["decode_tokens"] == 5
    assert out["experts_resident_bytes"] == out["report"]["experts_resident_bytes"] > 0
    assert main(["generate", str(path), "--input-ids", "5,6", "--max-new-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "new token ids: [" in text and "tokens/s" in text and "bytes resident" in text


@pytest.mark.parametrize(("flags", "message"), [
    (["--prompt", "hello"], r"--prompt: .* has no tokenizer \(tokenizer\.json, .*\); give token ids with --input-ids"),
    (["--input-ids", "1,x"], r"--input-ids: got '1,x'; wanted integers separated by commas"),
    (["--input-ids", "1,128"], r"--input-ids: got '1,128'; wanted token ids in \[0, 128\)"),
    (["--input-ids", "1", "--max-new-tokens", "0"], r"--max-new-tokens: got 0; wanted >= 1"),
])
def test_generate_command_bad_input(flags: list[str], message: str, whole,  # type: ignore[no-untyped-def]
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from moe_registry.cli.main import main

    assert main(["generate", str(whole("qwen3_moe")), *flags, "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert re.search(message, err), err


# --- a quantized whole model: quantized experts on the kernel, quantized attention dequantised once -------------


def _gptq_whole(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src`` with every decoder projection (attention and experts) in GPTQ 4-bit, one group per row; returns the
    dequantised weights by checkpoint name (what the codes mean: (code - 8) * scale, computed here)."""
    from moe_registry.testing.packers import pack_gptq

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    meant: dict[str, torch.Tensor] = {}
    for name in [n for n, t in tensors.items() if n.endswith("_proj.weight") and t.dim() == 2]:
        w = tensors.pop(name).float()
        packed = pack_gptq(w, 4, -1)
        prefix = name.removesuffix(".weight")
        tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
        scale = packed["scales"].float()[packed["g_idx"].long()].t()  # [out, in]
        meant[name] = ((torch.round(w / scale) + 8).clamp(0, 15) - 8) * scale
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
                                  "sym": True, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return meant


def test_gptq_whole_model_matches_transformers_on_the_dequantised_weights(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Experts run GPTQ on the kernel (packed), attention is dequantised once; the reference is transformers'
    float32 model holding the dequantised weights: logits within 1e-5 (both compute in float32 from the same
    real weights), greedy tokens equal."""
    src = whole("qwen3_moe")
    meant = _gptq_whole(src, tmp_path / "gptq")
    ours = load_model(tmp_path / "gptq", dtype="float32", kernel="torch-reference")
    report = ours.moe_registry_report
    assert {p.scheme for p in report.layers} == {"gptq-w4a16"}
    dequantised = [t for t in report.non_expert if t.how.startswith("dequantised once from gptq-w4a16")]
    assert len(dequantised) == 1 and len(dequantised[0].names) == 12  # q, k, v, o in each of 3 layers
    ref = _gptq_reference(src, meant)
    prompt = _prompt()
    with torch.no_grad():
        assert _rel(ours(prompt).logits, ref(prompt).logits) < FP32_TOL
    _assert_same_greedy(ours, ref, prompt[:1], FP32_TOL)


def test_gptq_whole_model_default_kernel_holds_packed_experts(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Nothing pinned: the oracle's CPU kernel for GPTQ keeps the experts packed (at most 1.25x the checkpoint's
    expert bytes) and the logits are the dequantised reference's within the scheme's float32 tolerance
    (intermediate 32: the packed CPU kernel's least)."""
    src = whole("qwen3_moe", moe_intermediate_size=32)
    meant = _gptq_whole(src, tmp_path / "gptq")
    ours = load_model(tmp_path / "gptq", dtype="float32")
    report = ours.moe_registry_report
    for plan in report.layers:
        assert plan.kernel == build(tmp_path / "gptq", layer=plan.layer, platform="cpu", dtype="float32").report.chosen
    assert "torch-reference" not in {p.kernel for p in report.layers}
    assert 0 < report.experts_resident_bytes <= 1.25 * report.experts_checkpoint_bytes, report.to_text()
    ref = _gptq_reference(src, meant)
    prompt = _prompt()
    with torch.no_grad():
        assert _rel(ours(prompt).logits, ref(prompt).logits) < 1e-2


def test_a_compiled_decode_step_holds_each_layers_experts_as_one_op(whole) -> None:  # type: ignore[no-untyped-def]
    """Under torch.compile (transformers compiles the decode step of its static cache; here on the CPU, as it does
    when its compile config says every device) each layer's experts are one opaque op: whatever Python the kernel
    runs, the step is one graph with no break, and its tokens and logits are the eager step's."""
    from transformers import CompileConfig

    from moe_registry.whole import experts_module

    model = load_model(whole("qwen3_moe"), dtype="float32")
    kw = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0,
          "cache_implementation": "static", "return_dict_in_generate": True, "output_logits": True}
    prompt = _prompt()[:1]
    eager = model.generate(prompt, disable_compile=True, **kw)
    every_device = CompileConfig()
    every_device._compile_all_devices = True
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        compiled = model.generate(prompt, compile_config=every_device, **kw)
        assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1, dict(counters)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    assert _rel(torch.stack(compiled.logits), torch.stack(eager.logits)) < 1e-5
    # the op finds a layer's module by its number: a copy's modules answer to numbers of their own
    layers = [m for m in model.modules() if isinstance(m, RegistryExperts)]
    copies = [m for m in copy.deepcopy(model).modules() if isinstance(m, RegistryExperts)]
    assert len(copies) == len(layers) >= 2
    assert all(c.number != m.number and experts_module._BY_NUMBER[c.number] is c
               for c, m in zip(copies, layers, strict=True))


EMULATED_INT8 = "int8 scale:float32:group(32):dynamic"


def test_gptq_attention_runs_packed_on_the_experts_kernel(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A kernel with a one-projection form (torch-cpu-dot8's linear_impl) runs the checkpoint's quantized attention
    linears too, packed: each is a RegistryLinear holding at most 1.25x its checkpoint bytes, its output the
    dequantised linear's within the kernel's tolerance (its int8 activations, 2e-2), and the load report says so,
    activations included; transformers' own bias is added. The model's logits stay within the kernel's tolerance of
    the dequantised reference's."""
    from moe_registry.whole.dense_linear import RegistryLinear

    src = whole("qwen3_moe", moe_intermediate_size=32)
    meant = _gptq_whole(src, tmp_path / "gptq")
    ours = load_model(tmp_path / "gptq", dtype="float32", kernel="torch-cpu-dot8")
    report = ours.moe_registry_report
    packed = [t for t in report.non_expert if t.how.startswith("run packed on torch-cpu-dot8's one-projection form "
                                                                 "from gptq-w4a16 ")]
    assert len(packed) == 1 and len(packed[0].names) == 12, report.to_text()
    assert f"activations quantised to {EMULATED_INT8}" in packed[0].how
    assert f"12 other tensors {packed[0].how}" in report.to_text()
    stored = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in packed[0].names:
        module = name.removesuffix(".weight")
        linear = ours.get_submodule(module)
        assert isinstance(linear, RegistryLinear) and linear.bias is None
        checkpoint_bytes = sum(t.nbytes for k, t in stored.items() if k.startswith(module + "."))
        assert 0 < linear.resident_bytes <= 1.25 * checkpoint_bytes
        x = torch.randn(3, 5, linear.in_features, generator=g)
        want = x @ meant[name].T
        assert _rel(linear(x), want) < 2e-2
    ref = _gptq_reference(src, meant)
    prompt = _prompt()
    with torch.no_grad():
        assert _rel(ours(prompt).logits, ref(prompt).logits) < 2e-2


def test_a_linear_the_kernel_refuses_is_dequantised_with_the_reason(whole, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where the kernel's one-projection form refuses a linear, it is dequantised once instead and the load report
    carries the refusal; the logits are then the reference's within the experts' tolerance."""
    from moe_registry_kernels import cpu_dot8

    def refuse(self, weights, weight_key, activation_key):  # type: ignore[no-untyped-def]
        raise ValueError("no such rows here")

    monkeypatch.setattr(cpu_dot8.Dot8Linear, "__init__", refuse)
    src = whole("qwen3_moe", moe_intermediate_size=32)
    meant = _gptq_whole(src, tmp_path / "gptq")
    ours = load_model(tmp_path / "gptq", dtype="float32", kernel="torch-cpu-dot8")
    (load,) = [t for t in ours.moe_registry_report.non_expert if "gptq-w4a16" in t.how]
    assert load.how == ("dequantised once from gptq-w4a16 (weights; activations run unquantized; torch-cpu-dot8's "
                        "one-projection form refused it: no such rows here)")
    assert torch.equal(ours.get_submodule("model.layers.0.self_attn.q_proj").weight,
                       meant["model.layers.0.self_attn.q_proj.weight"])


def _gptq_reference(src: Path, meant: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' float32 model of ``src`` holding the dequantised weights ``meant``."""
    ref = _reference(src)
    state = ref.state_dict()
    with torch.no_grad():
        for name, w in meant.items():
            if ".experts." not in name:
                state[name].copy_(w)
        for layer in range(3):  # transformers' fused experts [E, 2I, H] / [E, H, I] from the per-expert ones
            experts = ref.model.layers[layer].mlp.experts
            for e in range(8):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                experts.gate_up_proj[e].copy_(torch.cat([meant[p + "gate_proj.weight"], meant[p + "up_proj.weight"]]))
                experts.down_proj[e].copy_(meant[p + "down_proj.weight"])
    return ref


# --- on the GPU (the device machine: pytest -m gpu tests/test_whole_model.py) ---------------------------------------


@pytest.mark.gpu
def test_gptq_whole_model_on_cuda(whole, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The oracle's GPU kernel runs the GPTQ experts (packed, at most 1.25x the checkpoint's expert bytes) in
    float16; logits within the scheme's float16 tolerance (1e-2) of the float32 dequantised reference, greedy
    tokens equal up to near ties."""
    src = whole("qwen3_moe", moe_intermediate_size=32)
    meant = _gptq_whole(src, tmp_path / "gptq")
    ours = load_model(tmp_path / "gptq", device="cuda", dtype="float16")
    report = ours.moe_registry_report
    assert report.device.startswith("cuda") and "torch-reference" not in {p.kernel for p in report.layers}
    assert 0 < report.experts_resident_bytes <= 1.25 * report.experts_checkpoint_bytes, report.to_text()
    ref = _gptq_reference(src, meant)
    prompt = _prompt()
    with torch.no_grad():
        assert _rel(ours(prompt.cuda()).logits.float().cpu(), ref(prompt).logits) < 1e-2
    _assert_same_greedy(ours, ref.cuda(), prompt[:1].cuda(), 1e-2)


@pytest.mark.gpu
def test_experts_implementation_on_cuda(whole) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 model loaded by transformers on the GPU, its experts switched to the registry's kernel: the
    logits of load_model's model on the same weights and device within 1e-3 (the same kernel from the same
    weights; a split-K tile may sum in another order from call to call)."""
    from moe_registry.whole.interface import NAME, register_experts_implementation

    register_experts_implementation()
    path = whole("qwen3_moe", moe_intermediate_size=32)
    model = _reference(path, torch.bfloat16).cuda()
    model.set_experts_implementation(NAME)
    loaded = load_model(path, device="cuda")
    prompt = _prompt().cuda()
    with torch.no_grad():
        assert _rel(model(prompt).logits, loaded(prompt).logits) < 1e-3


def test_load_model_reads_the_config_and_the_headers_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MoE layer is built from the one config and header index load_model read, not read again per layer."""
    from moe_registry.checkpoint import tensor_index
    from moe_registry.situation import config as config_module

    d = make_whole_model("qwen3_moe", tmp_path / "qwen3_moe", layers=3)
    headers: list[Path] = []
    configs: list[Path] = []
    real_header, real_config = tensor_index.read_header, config_module.read_model_config

    def header(path: Path):  # type: ignore[no-untyped-def]
        headers.append(path)
        return real_header(path)

    def config(*args, **kwargs):  # type: ignore[no-untyped-def]
        configs.append(args[0])
        return real_config(*args, **kwargs)

    monkeypatch.setattr(tensor_index, "read_header", header)
    for module in ("moe_registry.whole.load", "moe_registry.layer.build"):
        monkeypatch.setattr(f"{module}.read_model_config", config)
    model = load_model(d)
    layers = [m for m in model.modules() if isinstance(m, RegistryExperts)]
    assert len(layers) >= 2 and len(configs) == 1
    assert sorted(headers) == sorted(set(headers)) and headers
