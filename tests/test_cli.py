"""The command line as a user meets it: one exit-code table for every verb, errors as one line (or
one JSON object under --json), --version, help with examples, "did you mean", flags honoured or
refused, validate's report, the output formats, and the README's claims about the program."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

import moe_registry
from moe_registry.cli import main as cli
from moe_registry.core.errors import ConfigError
from moe_registry.spec.loader import SPEC_PATH_ENV

ROOT = Path(__file__).resolve().parent.parent
AWQ_CONFIG = str(ROOT / "examples" / "mixtral-8x7b-awq" / "config.json")
DEEPSEEK = str(ROOT / "examples" / "configs" / "deepseek" / "deepseek-v3")
KNOWN = ("known: torch-cpu-dot8, torch-cpu-grouped, torch-cpu-native, torch-cpu-packed, torch-reference, "
         "triton-batched-moe, triton-fused-moe")
NO_GPU = not torch.cuda.is_available()


@pytest.fixture(autouse=True)
def builtin_specs_only(monkeypatch):
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's SystemExit counts as a return."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- 1. one exit-code table

BAD_INPUT = [
    (["explain", "/nonexistent/cfg"], "/nonexistent/cfg: no such file or directory"),
    (["run", "/nonexistent/cfg"], "/nonexistent/cfg: no such file or directory"),
    (["list", "schemes", "--spec-dir", "/nonexistent/specs"], "/nonexistent/specs: spec dir does not exist"),
    (["matrix", "--spec-dir", "/nonexistent/specs"], "/nonexistent/specs: spec dir does not exist"),
    (["explain", AWQ_CONFIG, "--spec-dir", "/nonexistent/specs"], "/nonexistent/specs: spec dir does not exist"),
    (["explain", AWQ_CONFIG, "--platform", "cpu", "--prefer", "torch-refrence"],
     f"--prefer: unknown kernel 'torch-refrence' (did you mean 'torch-reference'?); {KNOWN}"),
    (["run", AWQ_CONFIG, "--platform", "cpu", "--prefer", "torch-refrence"],
     f"--prefer: unknown kernel 'torch-refrence' (did you mean 'torch-reference'?); {KNOWN}"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUT)
def test_bad_input_is_exit_2_in_every_verb(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_validate_bad_input_is_exit_2(capsys, tmp_path):
    code, out, err = run_cli(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and err == ""
    assert out == f"{tmp_path / 'nope.yaml'}: no such file or directory\n"


@pytest.mark.parametrize("verb", ["explain", "run"])
def test_pinned_kernel_that_cannot_run_is_exit_1_in_both_verbs(capsys, verb, example):
    target = str(example("mixtral-awq")) if verb == "run" else AWQ_CONFIG
    code, out, err = run_cli(capsys, verb, target, "--platform", "cpu", "--kernel", "triton-fused-moe")
    assert code == 1
    assert err == "error: pinned kernel triton-fused-moe cannot run this: platform cpu; kernel runs on cuda >=8.0\n"
    assert "triton-fused-moe    rejected  platform cpu; kernel runs on cuda >=8.0" in out  # the report, first


def test_usage_errors_are_exit_2(capsys):
    for argv in (["explain"], ["list", "nothing"], ["schema", "kernal"], ["explain", AWQ_CONFIG, "--tp", "x"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "" and "error:" in err, argv


def test_unexpected_exception_is_one_line_exit_3(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "cmd_list", boom)
    code, out, err = run_cli(capsys, "list", "schemes")
    assert code == 3 and out == ""
    assert err == ("internal error: RuntimeError: boom second line (please report it; MOE_REGISTRY_DEBUG=1 "
                   "shows the traceback)\n")
    code, out, err = run_cli(capsys, "list", "schemes", "--json")
    assert code == 3 and err == "" and json.loads(out)["exit_code"] == 3


@pytest.mark.skipif(not NO_GPU, reason="needs a machine without a GPU")
def test_run_on_an_absent_gpu_is_one_line(capsys, example):
    code, out, err = run_cli(capsys, "run", str(example("mixtral-awq")), "--platform", "cuda:9.0")
    assert (code, out) == (2, "")
    assert err == (f"error: --platform cuda:9.0: not available on this machine (this torch {torch.__version__} "
                   "sees no CUDA/ROCm GPU); run on the CPU (platform cpu), or use explain to see what would run "
                   "there\n")


@pytest.mark.skipif(not NO_GPU, reason="needs a machine without a GPU")
def test_load_layer_on_an_absent_gpu_raises_the_projects_error(example):
    with pytest.raises(ConfigError) as info:
        moe_registry.load_layer(example("mixtral-awq"), device="cuda")
    assert str(info.value).startswith("device='cuda': not available on this machine")
    assert len(str(info.value).splitlines()) == 1


# ---------------------------------------------------------------- 2. --json errors on every verb


@pytest.mark.parametrize("argv,code", [
    (["explain", "/nonexistent/cfg"], 2),
    (["explain", AWQ_CONFIG, "--platform", "cpu", "--kernel", "triton-fused-moe"], 1),
    (["run", "/nonexistent/cfg"], 2),
    (["list", "schemes", "--spec-dir", "/nonexistent/specs"], 2),
    (["validate", "/nonexistent/x.yaml"], 2),
    (["matrix", "--spec-dir", "/nonexistent/specs"], 2),
    (["schema", "nothing"], 2),
    (["explain", AWQ_CONFIG, "--bogus"], 2),
])
def test_json_errors(capsys, argv, code):
    got, out, err = run_cli(capsys, *argv, "--json")
    assert got == code and err == ""
    assert len(out.splitlines()) == 1
    data = json.loads(out)
    assert data["exit_code"] == code and isinstance(data["error"], str) and data["error"]
    if code == 1:
        assert data["report"]["chosen_kernel"] is None  # a refusal carries its reasons


# ---------------------------------------------------------------- 3. version


def test_version(capsys):
    from importlib.metadata import version

    assert moe_registry.__version__ == version("moe-registry")
    code, out, _ = run_cli(capsys, "--version")
    assert (code, out) == (0, f"moe-registry {moe_registry.__version__}\n")


# ---------------------------------------------------------------- 4. help and "did you mean"


def test_every_verb_and_option_has_help_with_an_example():
    parser = cli.build_parser()
    assert "examples:" in (parser.epilog or "")
    for name, sub in parser.subparsers_by_name.items():
        assert "examples:" in (sub.epilog or "") and f"moe-registry {name}" in sub.epilog, name
        assert "exit codes:" in sub.epilog
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    assert "xpu" not in parser.subparsers_by_name["explain"].format_help(), "no kernel runs on xpu"


@pytest.mark.parametrize("argv,hint", [
    (["explian", AWQ_CONFIG], "(did you mean 'explain'?)"),
    (["explain", AWQ_CONFIG, "--platfrom", "cpu"], "(did you mean '--platform'?)"),
    (["run", AWQ_CONFIG, "--repet", "3"], "(did you mean '--repeat'?)"),
    (["list", "kernals"], "(did you mean 'kernel'?)"),
    (["explain", AWQ_CONFIG, "--dtype", "bfloat61"], "(did you mean 'bfloat16'?)"),
])
def test_did_you_mean(capsys, argv, hint):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert hint in err.splitlines()[-1]


def test_unknown_prefer_is_an_error_not_a_fallback(capsys):
    code, out, err = run_cli(capsys, "explain", AWQ_CONFIG, "--platform", "cpu", "--prefer", "nope")
    assert (code, out, err) == (2, "", f"error: --prefer: unknown kernel 'nope'; {KNOWN}\n")


def test_unknown_all2all_lists_the_backends_once(capsys):
    code, out, err = run_cli(capsys, "explain", AWQ_CONFIG, "--platform", "cpu", "--all2all", "plx")
    assert (code, out) == (2, "")
    assert err == ("error: --all2all: unknown all2all backend 'plx' (did you mean 'pplx'?); known: "
                   "allgather_reducescatter, deepep_high_throughput, deepep_low_latency, naive, none, pplx\n")


def test_spec_field_typos_get_a_suggestion(capsys, tmp_path):
    spec = tmp_path / "k.yaml"
    spec.write_text("kernel: k1\nsummary: x\nimpl: a.b:C\nplatforms: [{device: cpu, capabilty: '>=1.0'}]\n"
                    "dtypes: [bfloat16]\nkeys: []\nshapes:\n  hidden: {multipl_of: 8}\n")
    code, out, _ = run_cli(capsys, "validate", str(spec))
    assert code == 2
    lines = out.splitlines()
    assert f"{spec}:4: platforms.0.capabilty: unknown field (did you mean 'capability'?)" in lines
    assert f"{spec}:8: shapes.hidden.multipl_of: unknown field (did you mean 'multiple_of'?)" in lines
    assert lines[-1] == "4 problems in 1 file"  # also: keys may not be empty, activations is missing


@pytest.mark.parametrize("singular,plural", [("scheme", "schemes"), ("kernel", "kernels"), ("family", "families")])
def test_list_and_schema_take_singular_and_plural(capsys, singular, plural):
    outputs = []
    for verb in ("list", "schema"):
        for word in (singular, plural):
            code, out, _ = run_cli(capsys, verb, word, "--json")
            assert code == 0
            outputs.append(json.loads(out))
    assert outputs[0] == outputs[1] and outputs[2] == outputs[3]
    assert outputs[2]["title"] in ("SchemeSpec", "KernelSpec", "ModelFamilySpec")


# ---------------------------------------------------------------- 5. names and paths


def test_typo_in_kernel_is_an_error_without_a_report(capsys):
    code, out, err = run_cli(capsys, "explain", AWQ_CONFIG, "--platform", "cpu", "--kernel", "triton-fused")
    assert (code, out) == (2, "")
    assert err == f"error: --kernel: unknown kernel 'triton-fused' (did you mean 'triton-fused-moe'?); {KNOWN}\n"


def test_spec_dir_that_is_a_file(capsys):
    code, out, err = run_cli(capsys, "explain", AWQ_CONFIG, "--spec-dir", str(ROOT / "README.md"))
    assert (code, out, err) == (2, "", f"error: {ROOT / 'README.md'}: spec dir is not a directory\n")


# ---------------------------------------------------------------- 6. run's flags


@pytest.mark.parametrize("flags,message", [
    (["--dp", "2"], "--dp 2: run is one process and joins no process group; start 2 ranks (e.g. `torchrun "
                    "--nproc-per-node 2 ...`) that each run their own tokens (use `moe-registry explain --dp 2` to "
                    "see the kernel choice)"),
    (["--ep", "4"], "--ep 4: run is one process and joins no process group; start 4 ranks (e.g. `torchrun "
                    "--nproc-per-node 4 ...`) that each call moe_registry.build(..., ep=4, "
                    "all2all='allgather_reducescatter') (use `moe-registry explain --ep 4` to see the kernel choice)"),
    (["--all2all", "naive"], "--all2all naive: an all2all dispatches between expert-parallel ranks; run is one "
                             "process (ep=1), so only 'none' applies"),
    (["--repeat", "0"], "--repeat: got 0; wanted at least 1"),
    (["--threads", "0"], "--threads: got 0; wanted at least 1"),
    (["--tokens", "16", "--max-tokens", "8"], "--max-tokens: 16 tokens to run; the token budget is 8"),
    (["--save-output", "/nonexistent/dir/out.safetensors"],
     "--save-output: /nonexistent/dir is not a directory; create it first (nothing was run)"),
])
def test_run_refuses_what_it_cannot_honour(capsys, example, flags, message):
    code, out, err = run_cli(capsys, "run", str(example("mixtral-awq")), "--platform", "cpu", *flags)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_run_reports_spread_and_threads(capsys, example):
    before = torch.get_num_threads()
    code, out, _ = run_cli(capsys, "run", str(example("mixtral-awq")), "--platform", "cpu", "--tokens", "4",
                           "--max-tokens", "4", "--repeat", "3", "--threads", "1", "--json")
    assert code == 0
    data = json.loads(out)
    r = data["result"]
    assert r["repeat"] == 3 and r["threads"] == 1 and data["exit_code"] == 0
    assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert data["report"]["runtime"]["max_tokens"] == 4
    assert torch.get_num_threads() == before, "the thread count is restored"
    code, out, _ = run_cli(capsys, "run", str(example("mixtral-awq")), "--platform", "cpu", "--repeat", "2",
                           "--threads", "1")
    assert code == 0
    assert re.search(r"^time        [\d.]+ ms per call \(median of 2 after warm-up;\s+middle\s+half\s+[\d.]+-[\d.]+,"
                     r"\s+min\s+[\d.]+,\s+max", out, re.M)
    assert "device      cpu (1 CPU threads)" in out


# ---------------------------------------------------------------- 7. validate


def test_validate_reports_every_problem_once_on_stdout(capsys, tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("scheme: my-s\nsummary: x\ndetect:\n  quant_method: {equals: my}\n"
                    "bind:\n  group: {from: group_size, one_of: [64, 128]}\n"
                    "weight: uint4b8 scale:float16:group($group):statc\nactivation: int9\n"
                    "checkpoint:\n  format: gptq\n  tensors:\n    qweight: {dtype: int32, shape: [in / 8, out]}\n"
                    "kernels: [torch-reference]\n")
    code, out, err = run_cli(capsys, "validate", str(spec), str(spec))
    assert code == 2 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{spec}:7: weight: bad scale mode 'statc'; wanted static or dynamic"  # once, not per binding
    assert lines[1].startswith(f"{spec}:8: activation: unknown scalar type 'int9'")  # and the next problem too
    assert lines[2:] == ["2 problems in 1 file"]
    code, out, err = run_cli(capsys, "validate", str(spec), "--json")
    data = json.loads(out)
    assert code == 2 and err == "" and data["exit_code"] == 2 and data["files"] == 1
    assert [p["field"] for p in data["problems"]] == ["weight", "activation"]
    assert [p["line"] for p in data["problems"]] == [7, 8]


def test_validate_counts_files(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, "validate", str(tmp_path / "empty"))
    assert (code, out, err) == (2, f"validate: no spec files found in {tmp_path / 'empty'}\n", "")
    kernels = len(list((ROOT / "specs" / "kernels").glob("*.yaml")))
    code, out, _ = run_cli(capsys, "validate", str(ROOT / "specs" / "kernels"), "--json")
    assert code == 0 and json.loads(out) == {"files": kernels, "problems": []}
    code, out, _ = run_cli(capsys, "validate", str(ROOT / "specs" / "kernels"))
    assert (code, out) == (0, f"{kernels} files, all valid\n")


# ---------------------------------------------------------------- 8. output formats


def test_markdown_escapes_pipes_and_shows_bindings(capsys):
    code, out, _ = run_cli(capsys, "explain", AWQ_CONFIG, "--platform", "cpu", "--markdown", "--verbose")
    assert code == 0
    assert "| bindings | group=128 |" in out
    # modelopt-mxfp8's reason joins alternatives with ' | ': escaped, so its row keeps three cells
    row = next(line for line in out.splitlines() if line.startswith("| `modelopt-mxfp8` |"))
    assert "wanted 'modelopt' \\| quant_method" in row
    assert row.replace("\\|", "").count("|") == 4


def test_text_lines_fit_in_100_columns_and_labels_align(capsys, tmp_path):
    user = tmp_path / "user" / "schemes"
    user.mkdir(parents=True)
    awq = (ROOT / "specs" / "schemes" / "awq-w4a16.yaml").read_text()
    (user / "awq-w4a16.yaml").write_text(awq.replace("quant_method: {one_of: [awq, awq_marlin], case: insensitive}",
                                                     "quant_method: {equals: other}"))
    code, out, _ = run_cli(capsys, "explain", AWQ_CONFIG, "--platform", "cpu", "--verbose",
                           "--spec-dir", str(tmp_path / "user"))
    assert code == 1  # nothing matches any more
    lines = out.splitlines()
    # only a single unbreakable word (a long path: pytest-xdist's tmp dirs are long) may pass 100 columns
    assert all(len(line) <= 100 or len(line.split()) == 1 for line in lines), lines
    assert any(len(line) > 60 for line in lines)  # wrapping is not achieved by printing nothing
    head = lines[:lines.index("")]
    assert any(line.startswith("override  ") for line in head)
    assert len({len(re.match(r"^(\S*\s+)", line).group(1)) for line in head}) == 1, head  # one value column


def test_turned_down_schemes_count_and_nearest(capsys):
    from moe_registry.spec.loader import load_registry

    others = len(load_registry([]).schemes) - 1  # every scheme but the one chosen
    code, out, _ = run_cli(capsys, "explain", DEEPSEEK, "--platform", "cpu")
    assert code == 0
    tail = out.split(f"schemes turned down ({others}; the 3 nearest shown, --verbose lists all):\n")[1]
    assert len([line for line in tail.splitlines() if line.startswith("  - ")]) == 3
    code, out, _ = run_cli(capsys, "explain", DEEPSEEK, "--platform", "cpu", "--verbose")
    tail = out.split(f"schemes turned down ({others}):\n")[1]
    assert len([line for line in tail.splitlines() if line.startswith("  - ")]) == others


# ---------------------------------------------------------------- 9. README against the program


def readme() -> str:
    """The README and the reference pages it links to, where the flags, files and examples are written."""
    return "\n".join((ROOT / page).read_text() for page in ("README.md", "docs/cli.md", "docs/extending.md"))


def test_readme_explain_sample_is_the_programs_output(capsys, monkeypatch):
    block = readme().split("## What `explain` shows\n\n```text\n")[1].split("```")[0]
    command, expected = block.split("\n", 1)
    monkeypatch.chdir(ROOT)  # the path as the README gives it: lines wrap where the user's would
    code, out, _ = run_cli(capsys, *command.removeprefix("$ moe-registry ").split())
    assert code == 0
    assert out == expected


def test_readme_add_a_scheme_example_validates(capsys, tmp_path):
    block = readme().split("## Add a scheme")[1].split("```yaml\n")[1].split("```")[0]
    assert "$group" not in block and "bind:" not in block  # no binding that nothing uses
    (tmp_path / "my-w8a8.yaml").write_text(block)
    code, out, _ = run_cli(capsys, "validate", str(tmp_path))
    assert (code, out) == (0, "1 file, all valid\n")


def test_build_returns_what_the_readme_says(example, caplog):
    from moe_registry.formats.weights import ExpertWeights
    from moe_registry.layer import build as builder
    from moe_registry.layer.modular import FusedMoEKernel
    from moe_registry.oracle.contract import Report

    assert "returns a\n`LayerBuild`: `.report`" in readme()
    builder._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="moe_registry"):
        b = moe_registry.build(example("mixtral-awq"), platform="cpu")
    assert isinstance(b.report, Report) and isinstance(b.weights, ExpertWeights)
    assert isinstance(b.kernel, FusedMoEKernel) and b.tolerance == b.built.tolerance
    logged = [r.message for r in caplog.records if "runs on kernel" in r.message]
    assert logged == ["moe-registry: scheme awq-w4a16 runs on kernel torch-cpu-native (cpu, float16)"]
    assert f"`{logged[0]}`" in readme()
    with pytest.raises(ConfigError, match="--kernel: unknown kernel 'nope'"):
        moe_registry.build(example("mixtral-awq"), platform="cpu", kernel="nope")


def test_runtime_file_dtype_default_matches_explain(capsys, tmp_path):
    runtime = tmp_path / "runtime.json"
    runtime.write_text(json.dumps({"platform": "cpu", "model": AWQ_CONFIG}))
    _, direct, _ = run_cli(capsys, "explain", AWQ_CONFIG, "--platform", "cpu", "--json")
    _, via_file, _ = run_cli(capsys, "explain", str(runtime), "--json")
    assert json.loads(direct)["runtime"]["dtype"] == json.loads(via_file)["runtime"]["dtype"] == "float16"
    assert "| `dtype` | the model's `torch_dtype` when `model` is given" in readme()


def test_readme_documents_the_exit_codes():
    text = readme()
    for code in ("| 0 | ok |", "| 1 | refused", "| 2 | bad input", "| 3 | internal error"):
        assert code in text
