"""``run`` refuses bad input before expensive work: flag values, files, the config and the flags' situation, the
``--inputs`` file's names and shape (its header) and a missing router (the checkpoint's headers) before torch is
imported (shown in a fresh process: torch is not in ``sys.modules`` after the error); the token budget before the
layer is built, which may compile its kernel for minutes (shown with ``build`` and the extension loader replaced by
spies that fail the test if called). Each error by its message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_registry.cli import main as cli
from moe_registry.cli import run as run_module

# one process calls main() for every argv in turn (after each: its stderr, exit code and whether torch is loaded)
CHILD = """
import contextlib, io, json, sys
from moe_registry.cli.main import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    out.append({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(out))
"""


def _flag_cases(model: Path, tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments after ``run``, the error's start)."""
    m = str(model)
    return [
        ([m, "--tokens", "0"], "error: --tokens: got 0; wanted at least 1"),
        ([m, "--tokens", "1000000000"], "error: --tokens: got 1000000000; wanted an integer in [1, 65536]"),
        ([m, "--repeat", "0"], "error: --repeat: got 0; wanted at least 1"),
        ([m, "--threads", "0"], "error: --threads: got 0; wanted at least 1"),
        ([m, "--max-tokens", "-7"], "error: --max-tokens: got -7; wanted at least 1"),
        ([m, "--tp", "0"], "error: --tp: got 0; wanted a positive integer"),
        ([m, "--ep", "2"], "error: --ep 2: run is one process and joins no process group; start 2 ranks (e.g. "
                           "`torchrun --nproc-per-node 2 ...`) that each call moe_registry.build(..., ep=2, "
                           "all2all='allgather_reducescatter') (use `moe-registry explain --ep 2` to see the kernel "
                           "choice)"),
        ([m, "--all2all", "pplx"], "error: --all2all pplx: an all2all dispatches between expert-parallel ranks; run "
                                   "is one process (ep=1), so only 'none' applies"),
        ([m, "--inputs", f"{tmp}/nope.safetensors"], f"error: {tmp}/nope.safetensors: no such file or directory"),
        ([m, "--save-output", f"{tmp}/no/dir/out.safetensors"],
         f"error: --save-output: {tmp}/no/dir is not a directory; create it first (nothing was run)"),
        ([m, "--layer", "99"], "error: --layer: layer 99 has no MoE (MoE layers: 0, 1)"),
        ([m, "--kernel", "torch-refrence"], "error: --kernel: unknown kernel 'torch-refrence' (did you mean "
                                            "'torch-reference'?); known: "),
        ([f"{tmp}/no-model"], f"error: {tmp}/no-model: no such file or directory"),
    ]


def _inputs_cases(model: Path, tmp: Path) -> list[tuple[list[str], str]]:
    """--inputs files whose header is wrong for the layer (hidden 256): refused from the header alone."""
    files = {"wrong-hidden": {"hidden_states": torch.zeros(3, 255)},
             "misspelt": {"hidden_states": torch.zeros(3, 256), "topk_idz": torch.zeros(3, 4, dtype=torch.int32),
                          "topk_weights": torch.zeros(3, 4)},
             "ids-only": {"hidden_states": torch.zeros(3, 256), "topk_ids": torch.zeros(3, 4, dtype=torch.int32)},
             "no-hidden": {"x": torch.zeros(3, 256)}}
    for name, tensors in files.items():
        save_file(tensors, str(tmp / f"{name}.safetensors"))
    m, f = str(model), f"{tmp}/{{}}.safetensors"
    return [
        ([m, "--inputs", f.format("wrong-hidden")],
         f"error: {f.format('wrong-hidden')}: hidden_states shape [3, 255]; expected [tokens, 256]"),
        ([m, "--inputs", f.format("misspelt")],
         f"error: {f.format('misspelt')}: unknown tensor 'topk_idz' (did you mean topk_ids?); wanted hidden_states, "
         "optionally with both topk_ids and topk_weights"),
        ([m, "--inputs", f.format("ids-only")],
         f"error: {f.format('ids-only')}: give both topk_ids and topk_weights, or neither"),
        ([m, "--inputs", f.format("no-hidden")], f"error: {f.format('no-hidden')}: no tensor named hidden_states "
                                                 "(found x)"),
    ]


def test_flag_file_and_config_errors_come_before_torch_is_imported(example, tmp_path: Path) -> None:
    model = example("deepseek-fp8-block")
    no_router, routers = _without_router(example, "deepseek-fp8-block", tmp_path)
    hidden_only = tmp_path / "hidden-only.safetensors"
    save_file({"hidden_states": torch.zeros(3, 256)}, str(hidden_only))
    missing = f"error: {routers[0]}: missing; run routes the tokens with the layer's router"
    cases = _flag_cases(model, tmp_path) + _inputs_cases(model, tmp_path) + [
        ([str(no_router)], missing), ([str(no_router), "--inputs", str(hidden_only)], missing)]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([["run", *argv] for argv, _ in cases])],
                          capture_output=True, text=True, timeout=120, check=True)
    for (_, message), got in zip(cases, json.loads(done.stdout), strict=True):
        assert got["code"] == 2 and got["err"].startswith(message) and got["err"].count("\n") == 1, (message, got)
        assert not got["torch"], f"torch was imported before refusing: {message}"


def _without_router(example, name: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of an example checkpoint without its routers; returns it and the router tensors it lost."""
    d = tmp_path / f"{name}-no-router"
    shutil.copytree(example(name), d)
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    routers = sorted(n for n in tensors if n.endswith(".gate.weight") and ".experts." not in n)
    assert routers
    save_file({n: t for n, t in tensors.items() if n not in routers}, str(path), metadata={"format": "pt"})
    return d, routers


@pytest.fixture
def no_build(monkeypatch) -> None:
    """Building the layer, or compiling any extension, fails the test."""
    from moe_registry_kernels import cpu_build

    def fail(*_: object, **__: object) -> None:
        raise AssertionError("the layer was built (or a kernel compiled) before the input was checked")

    monkeypatch.setattr(run_module, "build", fail)
    monkeypatch.setattr(cpu_build, "load_extension", fail)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["run", *argv])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_missing_router_is_refused_before_the_kernel_is_built(example, tmp_path, capsys, no_build) -> None:
    """The fp8 checkpoint's CPU kernel is compiled on first use: without its router, run says so (and how to run it
    from the command line: --inputs with the routing) without building anything."""
    d, routers = _without_router(example, "deepseek-fp8-block", tmp_path)
    code, out, err = _run(capsys, str(d), "--platform", "cpu")
    assert (code, out) == (2, "")
    assert err == (f"error: {routers[0]}: missing; run routes the tokens with the layer's router. Give the routing "
                   "instead: --inputs FILE, a safetensors file with hidden_states [tokens, 256], topk_ids and "
                   "topk_weights [tokens, 4] (in Python: layer.kernel(hidden_states, topk_weights, topk_ids))\n")


def test_bad_inputs_and_budget_are_refused_before_the_kernel_is_built(example, tmp_path, capsys, no_build) -> None:
    model = str(example("deepseek-fp8-block"))
    bad = tmp_path / "in.safetensors"
    save_file({"hidden_states": torch.randn(3, 255)}, str(bad))
    assert _run(capsys, model, "--platform", "cpu", "--inputs", str(bad)) == (
        2, "", f"error: {bad}: hidden_states shape [3, 255]; expected [tokens, 256]\n")
    assert _run(capsys, model, "--platform", "cpu", "--tokens", "16", "--max-tokens", "8") == (
        2, "", "error: --max-tokens: 16 tokens to run; the token budget is 8\n")


def test_a_checkpoint_without_a_router_runs_with_the_routing_in_inputs(example, tmp_path, capsys) -> None:
    """The advice works: the same router-less checkpoint runs when --inputs carries topk_ids and topk_weights."""
    d, _ = _without_router(example, "mixtral-awq", tmp_path)
    hidden = int(json.loads((d / "config.json").read_text())["hidden_size"])
    inputs = tmp_path / "in.safetensors"
    save_file({"hidden_states": torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)),
               "topk_ids": torch.tensor([[0, 1], [2, 3], [1, 7]], dtype=torch.int32),
               "topk_weights": torch.full((3, 2), 0.5)}, str(inputs))
    code, out, err = _run(capsys, str(d), "--platform", "cpu", "--inputs", str(inputs), "--repeat", "1", "--json")
    assert code == 0, err
    result = json.loads(out)["result"]
    assert result["tokens"] == 3 and result["ok"] is True


HEADER_CASES = {
    "offsets-past-the-data": ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 64]}}, 8,
                              r"tensor 't': entry .* is not \{dtype, shape, data_offsets \[begin, end\] within "
                              r"the data\}"),
    "bytes-disagree-with-shape": ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8,
                                  r"tensor 't': 8 bytes for F32 shape \[3\]"),
    "negative-dim": ({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, 0, r"tensor 't': entry"),
    "not-a-table": ([1, 2], 0, r"the header is a JSON list, not a table of tensors"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_a_header_safetensors_would_refuse_is_refused_without_torch(tmp_path: Path, case: str) -> None:
    """The index reads headers without torch, so it must refuse what safetensors' own reader refuses: a header
    whose entries do not describe the data after it."""
    from safetensors import safe_open

    from moe_registry.checkpoint.tensor_index import open_checkpoint
    from moe_registry.core.errors import CheckpointError

    table, data, message = HEADER_CASES[case]
    text = json.dumps(table).encode()
    (tmp_path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + bytes(data))
    with pytest.raises(Exception):  # noqa: B017, PT011  (safetensors' own error types vary by version)
        safe_open(str(tmp_path / "model.safetensors"), framework="pt")
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: cannot read safetensors header: {message}"):
        open_checkpoint(tmp_path)


def test_the_index_matches_safetensors_on_a_real_checkpoint(example) -> None:
    """Names, dtypes and shapes from the torch-free header read equal safetensors' own."""
    from safetensors import safe_open

    from moe_registry.checkpoint.tensor_index import open_checkpoint

    model = example("deepseek-fp8-block")
    index = open_checkpoint(model)
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        want = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    assert {n: i.shape for n, i in index.tensors.items()} == want
    assert index.load(next(iter(want))).shape == next(iter(want.values()))
