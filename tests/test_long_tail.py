"""The long tail of real inputs: values read but never checked (duplicate JSON keys, run's inputs and
output file, zero fp8 scales), and the scale of what producers write (ignore lists of 100,000 names).

Each case runs the CLI (``moe_registry.cli.main.main``) on a committed producer fixture, changed the one way
the case names, and asserts the exit code and the one-line message."""

from __future__ import annotations

import itertools
import json
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_registry.cli.main import main
from moe_registry.oracle.scope_index import pattern_index, pattern_matches

FIXTURES = Path(__file__).parent / "fixtures"
FP8_BLOCK = FIXTURES / "fp8" / "transformers-fp8-block"  # Qwen3-MoE, hidden 128, 4 experts, top-2
HIDDEN = 128
RUN = ("--layer", "0", "--kernel", "torch-reference", "--tokens", "2", "--repeat", "1", "--threads", "1")


def cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out.splitlines(), cap.err.splitlines()


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- duplicate JSON keys


def test_duplicate_key_with_different_values_is_refused(capsys, tmp_path: Path) -> None:
    d = copy_model(FP8_BLOCK, tmp_path / "m")
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"num_experts_per_tok": 2,', '"num_experts_per_tok": 2, '
                                                '"num_experts_per_tok": 3,'))
    code, _, err = cli(capsys, "explain", str(d), "--platform", "cpu")
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: {d}/config.json: key 'num_experts_per_tok' is given twice with different "
                      "values (2, then 3); wanted it once")


def test_duplicate_key_nested_and_typed(capsys, tmp_path: Path) -> None:
    """``true`` and ``1`` compare equal in Python but are different JSON values."""
    d = copy_model(FP8_BLOCK, tmp_path / "m")
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"dequantize": false,', '"dequantize": false, "dequantize": 0,'))
    code, _, err = cli(capsys, "explain", str(d), "--platform", "cpu")
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(r"error: .*/config\.json: key 'dequantize' is given twice with different values "
                        r"\(False, then 0\); wanted it once", err[0]), err


def test_duplicate_key_with_the_same_value_is_kept(capsys, tmp_path: Path) -> None:
    """The same value twice means one thing to every JSON reader: explained as if given once."""
    d = copy_model(FP8_BLOCK, tmp_path / "m")
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"num_experts_per_tok": 2,', '"num_experts_per_tok": 2, '
                                                '"num_experts_per_tok": 2,'))
    code, once, _ = cli(capsys, "explain", str(FP8_BLOCK), "--platform", "cpu", "--json")
    code_twice, twice, err = cli(capsys, "explain", str(d), "--platform", "cpu", "--json")
    assert code == code_twice == 0, err
    assert "num_experts_per_tok" in once[0]
    assert twice[0].replace(str(d), "M") == once[0].replace(str(FP8_BLOCK), "M")


# ---------------------------------------------------------------- run: inputs and output file


def _inputs(d: Path, **tensors: torch.Tensor) -> str:
    save_file(tensors, str(d / "in.safetensors"))
    return str(d / "in.safetensors")


def test_inputs_with_a_misspelt_routing_tensor_is_refused(capsys, tmp_path: Path) -> None:
    path = _inputs(tmp_path, hidden_states=torch.randn(2, HIDDEN), topk_idx=torch.tensor([[0, 1], [2, 3]]))
    code, _, err = cli(capsys, "run", str(FP8_BLOCK), *RUN, "--inputs", path)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: {path}: unknown tensor 'topk_idx' (did you mean topk_ids?); wanted hidden_states, "
                      "optionally with both topk_ids and topk_weights")


def test_inputs_float8_hidden_states_is_refused(capsys, tmp_path: Path) -> None:
    path = _inputs(tmp_path, hidden_states=torch.randn(2, HIDDEN).to(torch.float8_e4m3fn))
    code, _, err = cli(capsys, "run", str(FP8_BLOCK), *RUN, "--inputs", path)
    assert code == 2 and len(err) == 1, err
    assert err[0] == f"error: {path}: hidden_states dtype float8_e4m3fn; wanted float16, bfloat16 or float32"


def test_save_output_to_a_directory_is_refused_before_running(capsys, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    code, out, err = cli(capsys, "run", str(FP8_BLOCK), *RUN, "--save-output", str(tmp_path / "out"))
    assert code == 2 and len(err) == 1 and not out, err
    assert err[0] == f"error: --save-output: {tmp_path}/out is a directory; wanted a file path (nothing was run)"


def _small_file_limit() -> None:
    """In the child: files may not grow past 4 KiB (the output is larger), and the signal that limit sends is
    ignored, so the write fails with EFBIG as on a full disk it fails with ENOSPC."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_save_output_write_error_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    proc = subprocess.run([sys.executable, "-m", "moe_registry.cli.main", "run", str(FP8_BLOCK), *RUN, "--tokens",
                           "64", "--save-output", str(target)], capture_output=True, text=True,
                          preexec_fn=_small_file_limit, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: --save-output: cannot write {target}: File too large"]
    assert proc.stdout == ""  # nothing reported as run when the result was lost


def test_save_output_round_trips(capsys, tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    code, _, err = cli(capsys, "run", str(FP8_BLOCK), *RUN, "--save-output", str(target))
    assert code == 0, err
    with safe_open(str(target), framework="pt") as f:
        assert list(f.keys()) == ["output"] and list(f.get_tensor("output").shape) == [2, HIDDEN]


# ---------------------------------------------------------------- zero fp8 scales


def test_all_zero_fp8_weight_scale_inv_is_refused(capsys, tmp_path: Path) -> None:
    """A zero block scale multiplies its block to zero: an expert that contributes nothing, never what an
    fp8 quantizer writes (DeepSeek's and transformers' clamp the block maximum above zero), so a zero scale
    is a damaged file. Refused at load, naming the tensor."""
    d = copy_model(FP8_BLOCK, tmp_path / "m")
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    name = next(k for k in sorted(tensors) if k.endswith("scale_inv"))
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(d / "model.safetensors"))
    code, _, err = cli(capsys, "run", str(d), *RUN)
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(rf"error: {re.escape(name)}.*: \d+ of \d+ values are zero \(first at \[0, 0\] = 0\.0\); "
                        r"expected finite scales > 0", err[0]), err


@pytest.mark.parametrize("scale", [1.0, 1e8])
def test_a_correction_bias_that_ties_every_expert_is_a_note(capsys, tmp_path: Path, example, scale: float) -> None:
    """A correction bias of 1e8 swallows the sigmoid scores when added in float32 (transformers adds it so too):
    every expert ties and the bias alone picks them. Legal, so the run goes on, with a note naming the tensor;
    a bias of ordinary size gets none."""
    d = copy_model(example("deepseek-fp8-block"), tmp_path / "m")
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    name = next(k for k in sorted(tensors) if k.endswith("e_score_correction_bias"))
    layer = name.split(".")[2]
    tensors[name] = scale * (1 + torch.rand(tensors[name].shape, generator=torch.Generator().manual_seed(0)))
    save_file(tensors, str(d / "model.safetensors"))
    run = ("run", str(d), "--layer", layer, "--kernel", "torch-reference", "--tokens", "2", "--repeat", "1",
           "--threads", "1")
    code, out, _ = cli(capsys, *run, "--json")
    notes = json.loads(out[0])["result"]["notes"]
    if scale == 1.0:
        assert code == 0 and notes == []
        return
    assert code == 0 and len(notes) == 1
    largest = f"{float(tensors[name].abs().max()):.3g}"
    assert re.fullmatch(rf"{re.escape(name)}: values up to {re.escape(largest)}; in float32 the router's "
                        r"scores \(0\.\.1\) added to it round to steps of 16, so every expert's score is lost "
                        r"to it: the experts tie and the bias alone chooses them, the same for every token",
                        notes[0]), notes
    code, out, _ = cli(capsys, *run)
    assert code == 0 and any(line.startswith("note") and name in line for line in out), out


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- ignore lists of 100,000 names

CT_W4A16 = FIXTURES / "compressed_tensors" / "qwen3-w4a16"
KINDS_AND_ENTRIES = [
    ("exact", ["model.layers.0.mlp", "model.layers.0.mlp.experts.0.gate_proj", "lm_head", "model.layers.1"]),
    ("component", ["experts", "mlp.experts", ".gate_proj.", "layers.0", "self_attn"]),
    ("substring", ["experts.0", "mlp.e", "proj", "zzz", ""]),
    ("glob", ["*experts.0.*", "model.layers.0.mlp.experts.1.up_proj", "*.gate_pro[j]", "lm_head"]),
    ("ct-target", ["re:.*experts\\.[01]\\..*", "model.layers.0.mlp.experts.2.down_proj", "Linear", "Embedding"]),
    ("regex", ["experts\\.3", "^lm_head$", "gate"]),
    ("type", ["Linear", "Conv1d"]),
    ("gptq-dynamic", ["-:.*experts\\.1\\..*", "+:.*down_proj", ".*experts\\.0\\.up_proj"]),
]
NAMES = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in (0, 1) for e in range(4)
         for p in ("gate_proj", "up_proj", "down_proj")] + ["lm_head", "model.layers.0.self_attn.q_proj"]


@pytest.mark.parametrize(("kind", "entries"), KINDS_AND_ENTRIES, ids=[k for k, _ in KINDS_AND_ENTRIES])
def test_pattern_index_agrees_with_the_one_entry_matcher(kind: str, entries: list[str]) -> None:
    """The index finds exactly the entries :func:`pattern_matches` says match, in the config's order."""
    index = pattern_index(list(entries), kind, ("Linear",))
    for name in NAMES:
        want = [i for i, p in enumerate(entries) if pattern_matches(kind, p, name, ("Linear",))]
        assert index.matching(name) == want, (kind, name)
        assert index.first(name) == (entries[want[0]] if want else None), (kind, name)


def test_ignore_list_of_100000_names_is_indexed_not_scanned(monkeypatch, tmp_path: Path) -> None:
    """llm-compressor writes every ignored module by name. Explaining a config whose ignore list holds 100,000
    names compiles each true pattern once (not once per scheme and projection) and never tests a plain name
    against a module one by one: the plain names are dict lookups."""
    from moe_registry.oracle import scope_index

    names = [f"model.layers.{i // 5}.{p}" for i, p in zip(range(100_000), itertools.cycle(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate")), strict=False)]
    ignore = ["lm_head", "re:.*shared_expert_gate$", "re:.*mlp\\.gate$", *names]
    d = copy_model(CT_W4A16, tmp_path / "m")
    cfg = _json(d / "config.json")
    cfg["quantization_config"]["ignore"] = ignore
    (d / "config.json").write_text(json.dumps(cfg))
    compiled: list[str] = []
    one_by_one: list[str] = []
    real_compiled = scope_index._compiled
    monkeypatch.setattr(scope_index, "_compiled", lambda kind, p: compiled.append(p) or real_compiled(kind, p))
    monkeypatch.setattr(scope_index, "pattern_matches", lambda *a: one_by_one.append(a[1]) or False)
    code = main(["explain", str(d / "config.json"), "--platform", "cpu", "--json"])
    assert code == 0
    # once per (list, matcher) the schemes use, not once per scheme and projection (33 x 3)
    assert set(compiled) == {"re:.*mlp\\.gate$", "re:.*shared_expert_gate$"} and len(compiled) <= 8
    assert one_by_one == []
    index = scope_index.pattern_index(ignore, "ct-target", ("Linear",))
    assert len(index.literal) == len(ignore) - 2 and len(index.patterns) == 2
    assert index.first("model.layers.7.self_attn.k_proj") == "model.layers.7.self_attn.k_proj"
    assert index.first("model.layers.7.mlp.experts.0.up_proj") is None


# ---------------------------------------------------------------- real configs once refused

REAL = FIXTURES / "real_configs"  # SOURCES.md names where each comes from


def _explain_json(capsys, target: Path, *flags: str) -> dict:
    code = main(["explain", str(target), "--platform", "cpu", "--json", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_minimax_m2_fp8_spells_the_format_as_its_torch_dtype(capsys) -> None:
    """MiniMax-M2's official FP8 config writes fmt: float8_e4m3fn (DeepSeek-V3 writes e4m3): the same
    128x128 block FP8, run by the fp8-block128 kernels."""
    report = _explain_json(capsys, REAL / "minimax-m2-fp8")
    assert report["family"] == "minimax-m2"
    assert report["scheme"]["name"] == "fp8-block128" and report["chosen_kernel"] == "torch-cpu-dot8"
    fmt = [c for c in report["schemes"][0]["checks"] if c["field"] == "fmt"]
    assert fmt[0]["passed"] and fmt[0]["seen"] == "float8_e4m3fn"


def _hunyuan(d: Path, **change: object) -> Path:
    cfg = _json(REAL / "hunyuan-a13b" / "config.json")
    cfg.update(change)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_hunyuan_per_layer_top_k_is_read_per_layer(capsys, tmp_path: Path) -> None:
    """Hunyuan-A13B writes moe_topk as one entry per layer; transformers' gate reads moe_topk[layer_idx]."""
    report = _explain_json(capsys, REAL / "hunyuan-a13b")
    assert report["family"] == "hunyuan-moe" and report["scheme"]["name"] == "unquantized"
    assert report["runtime"]["shape"]["top_k"] == 8 and report["runtime"]["shape"]["num_experts"] == 64
    assert report["chosen_kernel"]
    d = _hunyuan(tmp_path / "m", moe_topk=[8] * 5 + [4] + [8] * 26)
    assert _explain_json(capsys, d, "--layer", "5")["runtime"]["shape"]["top_k"] == 4
    assert _explain_json(capsys, d, "--layer", "6")["runtime"]["shape"]["top_k"] == 8


@pytest.mark.parametrize(("name", "change", "expected"), [
    ("short-list", {"moe_topk": [8] * 31}, r"error: .*/config\.json: moe_topk or num_experts_per_tok: a list of 31 "
     r"entries; wanted one per layer \(32\) or one integer"),
    ("zero-entry", {"moe_topk": [8] * 3 + [0] + [8] * 28}, r"error: .*/config\.json: moe_topk or num_experts_per_tok"
     r"\[3\]: got 0; wanted a positive integer"),
    ("above-experts", {"moe_topk": [8] * 3 + [65] + [8] * 28}, r"error: .*/config\.json: layer 3: top-k 65 is more "
     r"than its 64 experts"),
])
def test_hunyuan_per_layer_list_errors(capsys, tmp_path: Path, name: str, change: dict, expected: str) -> None:
    d = _hunyuan(tmp_path / "m", **change)
    if name == "above-experts":
        (d / "config.json").write_text(json.dumps({**_json(d / "config.json"), "num_experts": [64] * 32}))
    code, _, err = cli(capsys, "explain", str(d), "--platform", "cpu")
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(expected, err[0]), err


def test_minimax_m2_counts_its_multi_token_prediction_modules(tmp_path: Path) -> None:
    """MiniMax-M2's config names three MTP modules (num_mtp_modules), which its checkpoint may hold as layers 62-64
    beyond its 62 decoder layers: the family spec's mtp_layers reads them; a bad count is named."""
    from moe_registry.core.errors import ConfigError
    from moe_registry.situation.config import read_model_config
    from moe_registry.spec.loader import load_registry

    registry = load_registry(())
    config = read_model_config(REAL / "minimax-m2-fp8", registry)
    assert (config.num_layers, config.mtp_layers) == (62, 3)
    d = tmp_path / "m"
    d.mkdir()
    real = _json(REAL / "minimax-m2-fp8" / "config.json")
    (d / "config.json").write_text(json.dumps({**real, "num_mtp_modules": -1}))
    with pytest.raises(ConfigError, match=r"config\.json: num_mtp_modules: got -1; wanted a positive integer"):
        read_model_config(d, registry)


def test_compressed_tensors_in_text_config_without_input_activations(capsys, tmp_path: Path) -> None:
    """Kimi-K2.6-style: the quantization_config inside text_config, and input_activations left out (compressed-
    tensors' QuantizationScheme defaults it to None, the same as the null other releases write)."""
    report = _explain_json(capsys, REAL / "kimi-k2.6-int4")
    assert report["family"] == "deepseek" and report["scheme"]["name"] == "compressed-tensors-w4a16"
    assert report["chosen_kernel"] == "torch-cpu-dot8"  # bfloat16 (the config's dtype) on the CPU
    checks = {c["field"]: c for c in report["schemes"][0]["checks"]}
    assert checks["config_groups.group_0.input_activations"]["message"].endswith("(default)")
    cfg = _json(REAL / "kimi-k2.6-int4" / "config.json")  # quantized activations stay another scheme
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _explain_json(capsys, tmp_path)["scheme"]["name"] != "compressed-tensors-w4a16"


AUTOROUND = FIXTURES / "autoround" / "qwen3-autoround-w4-sym" / "checkpoint"  # written by auto-round itself
AUTOROUND_ASYM = FIXTURES / "autoround" / "qwen3-autoround-w4-asym" / "checkpoint"
ONE_OTHER = " (1 other scheme claims it too, --verbose lists it)"


@pytest.mark.parametrize(("checkpoint", "scheme", "weight_key"), [
    (AUTOROUND, "autoround-w4a16", "uint4b8 scale:float16:group(32):static"),
    (AUTOROUND_ASYM, "autoround-w4a16-asym", "uint4 scale:float16:group(32):static zp:group")])
def test_autoround_gptq_packing_runs_on_the_gptq_kernels(capsys, checkpoint: Path, scheme: str,
                                                         weight_key: str) -> None:
    report = _explain_json(capsys, checkpoint)
    assert report["scheme"]["name"] == scheme
    assert report["scheme"]["weight_key"] == weight_key
    assert report["chosen_kernel"] in report["eligible_kernels"]


@pytest.mark.parametrize("packing", ["auto_round:auto_awq", "auto_round:gptqmodel", "auto_round:fp8"])
def test_autoround_packing_no_kernel_runs_is_refused_naming_it(capsys, tmp_path: Path, packing: str) -> None:
    cfg = _json(AUTOROUND / "config.json")
    cfg["quantization_config"]["packing_format"] = packing
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli(capsys, "explain", str(tmp_path / "config.json"), "--platform", "cpu")
    assert code == 1, err
    assert err == ["error: config.json:quantization_config: quant_method 'auto-round': no scheme matches this config; "
                   "the nearest scheme claiming it, autoround-w4a16, turns it down: packing_format = "
                   f"{packing!r}; wanted one of 'auto_round:auto_gptq'{ONE_OTHER}"]
    # the report wraps long lines: compare with its whitespace folded
    assert f"- autoround-w4a16 packing_format = {packing!r}; wanted one of 'auto_round:auto_gptq'" in " ".join(
        " ".join(out).split())


def test_autoround_asymmetric_in_another_packing_is_refused_naming_what_the_claimant_wants(capsys,
                                                                                           tmp_path: Path) -> None:
    """Asymmetric int4 in the auto_awq packing: no scheme claims it, and the error line says so in the nearest
    claimant's words (its packing), not with an unrelated method's near miss."""
    cfg = _json(AUTOROUND_ASYM / "config.json")
    cfg["quantization_config"].update(packing_format="auto_round:auto_awq")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli(capsys, "explain", str(tmp_path / "config.json"), "--platform", "cpu")
    assert code == 1 and err == [
        "error: config.json:quantization_config: quant_method 'auto-round': no scheme matches this config; the "
        "nearest scheme claiming it, autoround-w4a16-asym, turns it down: packing_format = 'auto_round:auto_awq'; "
        f"wanted one of 'auto_round:auto_gptq'{ONE_OTHER}"], err
    assert out[out.index("schemes turned down (35; the 3 nearest shown, --verbose lists all):") + 1].startswith(
        "  - autoround-w4a16-asym ")


def test_a_method_claimed_by_many_schemes_names_the_nearest_and_counts_the_rest(capsys, tmp_path: Path) -> None:
    cfg = _json(AUTOROUND / "config.json")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 32, "sym": True,
                                  "desc_act": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli(capsys, "explain", str(tmp_path / "config.json"), "--platform", "cpu")
    assert code == 1 and len(err) == 1, err
    assert re.fullmatch(r"error: config\.json:quantization_config: quant_method 'gptq': no scheme matches this "
                        r"config; the nearest scheme claiming it, gptq-\S+, turns it down: bits = 3; wanted .*"
                        r" \(\d+ other schemes claim it too, --verbose lists them\)", err[0]), err


def test_compressed_tensors_group_named_freely_without_strategy(capsys, tmp_path: Path) -> None:
    """llm-compressor names config groups after recipes, and compressed-tensors' QuantizationArgs infers
    strategy (group_size given: group), so a writer may leave it out: the group whose targets name the expert
    projections is read, whatever its name; another group's targets (attention only) leave it unquantized."""
    d = copy_model(CT_W4A16, tmp_path / "m")
    cfg = _json(d / "config.json")
    groups = cfg["quantization_config"]["config_groups"]
    experts = groups.pop("group_0")
    del experts["weights"]["strategy"]
    groups["attention"] = {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "int"}}
    groups["experts_int4"] = experts
    (d / "config.json").write_text(json.dumps(cfg))
    report = _explain_json(capsys, d)
    assert report["scheme"]["name"] == "compressed-tensors-w4a16" and report["scheme"]["bindings"]["group"] == 32
    checks = report["schemes"][0]["checks"]
    assert checks[0]["message"] == ("config_groups entry 'experts_int4' targets model.layers.0.mlp.experts.0.gate_proj "
                                    "(read as config_groups.group_0)")
    assert any(c["message"] == "config_groups.group_0.weights.strategy = 'group' (default)" for c in checks)
    code, _, err = cli(capsys, "run", str(d), *RUN[:2], "--tokens", "2", "--repeat", "1", "--threads", "1",
                       "--kernel", "torch-reference")
    assert code == 0, err
