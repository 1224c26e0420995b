"""tools/bench.py, bench_cpu.py and kernel_identity.py read the registry; bench.py keeps every measured cell.

The schemes, their keys and tolerances come from the scheme specs (a spec added in a user spec
dir is benchmarked with no edit to the tools); bench.py writes each cell to bench.jsonl as it is
measured, so a run cut off keeps its finished cells, and ``--resume`` measures only the others.
Timing is replaced by a counter (each measurement a new value), so a cell measured again is seen
as a changed number, and no test depends on how long anything takes.
"""

import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest

from moe_registry.spec.loader import SPEC_PATH_ENV, load_registry

ROOT = Path(__file__).resolve().parents[1]
AWQ = "uint4 scale:float16:group(128):static zp:group"
# a scheme of keys no shipped spec binds (per-channel AWQ), with its own tolerance
USER_SCHEME = """\
scheme: test-w4a16-channel
summary: per-channel 4-bit weights with zero points, for the tools' tests
detect:
  quant_method: {equals: test-awq-channel}
weight: uint4 scale:float16:channel:static zp:group
activation: unquantized
features: {zero_point: true}
checkpoint:
  format: awq-gemm
  tensors:
    qweight: {dtype: int32, shape: [in, out / 8]}
    qzeros: {dtype: int32, shape: [1, out / 8]}
    scales: {dtype: float16, shape: [1, out]}
kernels: [triton-fused-moe, torch-cpu-packed, torch-reference]
tolerance: {float16: 3.0e-2, bfloat16: 4.0e-2, float32: 3.0e-2}
"""


@pytest.fixture
def bench(monkeypatch):
    """tools/bench.py with the shipped specs only, timings from a counter, no profiler."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)
    import bench

    counter = itertools.count(1)
    monkeypatch.setattr(bench, "_median_time", lambda fn, *args, **kwargs: (fn(), next(counter) * 1e-3)[1])
    monkeypatch.setattr(bench, "kernel_times", lambda step, calls, device, repeats=3: (1e-6, 2e-6))
    return bench


def user_spec(tmp_path: Path, monkeypatch, name: str, text: str) -> None:
    d = tmp_path / "user-specs" / "schemes"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.yaml").write_text(text)
    monkeypatch.setenv(SPEC_PATH_ENV, str(d.parent))


def run(bench, out: Path, *args: str) -> int:
    return bench.main(["--dry-run", "--out", str(out), *args])


def progress_rows(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert "ceilings" in lines[0] and "env" in lines[0]
    return [line["row"] for line in lines[1:]]


def final_rows(out: Path) -> dict[tuple[str, str, int], dict]:
    return {(r["shape"], r["scheme"], r["m"]): r for r in json.loads((out / "bench.json").read_text())["rows"]}


# ---------------------------------------------------------------------------------------------
# the schemes are the registry's


def test_bench_schemes_are_the_specs_that_list_the_kernel(bench):
    registry = load_registry()
    schemes = bench.registry_schemes()
    assert set(schemes) == {n for n, loaded in registry.schemes.items() if bench.KERNEL in loaded.spec.kernels}
    for name, scheme in schemes.items():
        assert scheme.tolerance == registry.scheme(name).tolerance
    # keys bound with group 128 (the spec allows it), act-order off; the matrix unit from the activation key
    assert schemes["awq-w4a16"].keys == (AWQ, "unquantized") and schemes["awq-w4a16"].unit == "bf16"
    assert schemes["gptq-w4a16"].bindings == {"group": 128, "act_order": False}
    assert schemes["gptq-w8a16"].weight == "uint8b128 scale:float16:group(128):static"
    assert schemes["quark-w8a8-int8"].unit == "int8" and schemes["fp8-block128"].unit == "fp8"
    assert schemes["modelopt-mxfp8"].unit == "bf16"
    # the default runs every distinct key pair once
    default = bench.default_schemes(schemes)
    assert sorted(schemes[n].keys for n in default) == sorted({s.keys for s in schemes.values()})
    assert {"awq-w4a16", "gptq-w4a16", "unquantized"} <= set(default)
    assert "gptq-v2-w4a16" not in default  # the same keys as gptq-w4a16


def test_a_scheme_spec_added_is_benchmarked(bench, tmp_path, monkeypatch, capsys):
    user_spec(tmp_path, monkeypatch, "test-w4a16-channel", USER_SCHEME)
    schemes = bench.registry_schemes()
    added = schemes["test-w4a16-channel"]
    assert added.keys == ("uint4 scale:float16:channel:static zp:group", "unquantized")
    assert added.tolerance_for("bfloat16") == 4e-2
    assert "test-w4a16-channel" in bench.default_schemes(schemes)
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "test-w4a16-channel" in capsys.readouterr().out
    # run by default, next to the shipped ones
    monkeypatch.setattr(bench, "bench_one", _spy_bench_one(bench, calls := []))
    assert run(bench, tmp_path / "out", "--m", "1") == 0
    assert [name for name, _ in calls] == bench.default_schemes(schemes)
    assert ("tiny", "test-w4a16-channel", 1) in final_rows(tmp_path / "out")


def test_a_row_past_the_specs_tolerance_fails_the_run(bench, tmp_path, monkeypatch, capsys):
    """The check uses the spec's tolerance, not one of the tool's: a user spec overriding
    awq-w4a16 with a tolerance no quantized layer meets makes the same run fail."""
    assert run(bench, tmp_path / "shipped", "--schemes", "awq-w4a16", "--m", "1") == 0
    rel = final_rows(tmp_path / "shipped")[("tiny", "awq-w4a16", 1)]["rel_error"]
    assert 0 < rel <= load_registry().scheme("awq-w4a16").tolerance["float16"]
    strict = (ROOT / "specs/schemes/awq-w4a16.yaml").read_text().replace(
        "tolerance: {float16: 1.0e-2", f"tolerance: {{float16: {rel / 2:.3e}")
    assert strict != (ROOT / "specs/schemes/awq-w4a16.yaml").read_text()
    user_spec(tmp_path, monkeypatch, "awq-w4a16", strict)
    capsys.readouterr()
    assert run(bench, tmp_path / "strict", "--schemes", "awq-w4a16", "--m", "1") == 1
    assert "tiny awq-w4a16 M=1: relative error" in capsys.readouterr().err


def test_unknown_scheme_names_are_one_line_listing_the_known(bench, tmp_path, capsys):
    assert run(bench, tmp_path, "--schemes", "awq", "nonsense") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "unknown scheme 'awq' (did you mean 'awq-w4a16'?), 'nonsense';" in err
    assert "known: " + ", ".join(bench.registry_schemes()) in err
    assert not (tmp_path / "bench.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# every cell kept as it is measured; --resume


def _spy_bench_one(bench, calls: list):
    real = bench.bench_one

    def spy(shape, scheme, ms, *args, **kwargs):
        calls.append((scheme.name, list(ms)))
        yield from real(shape, scheme, ms, *args, **kwargs)

    return spy


def test_a_run_cut_off_keeps_its_finished_cells_and_resume_measures_the_rest(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    cells = ["--schemes", "unquantized", "gptq-w4a16", "--m", "1", "8"]
    measured = []

    def killed_at_the_third_cell(step, calls, device, repeats=3):
        measured.append(1)
        if len(measured) == 3:
            raise KeyboardInterrupt  # what a time limit's kill leaves: no final JSON
        return 1e-6, 2e-6

    monkeypatch.setattr(bench, "kernel_times", killed_at_the_third_cell)
    with pytest.raises(KeyboardInterrupt):
        run(bench, out, *cells)
    assert not (out / "bench.json").exists()
    kept = progress_rows(out)
    # each cell carries the GPU's state after its timing: none on the CPU
    assert [json.loads(line)["gpu"] for line in (out / "bench.jsonl").read_text().splitlines()[1:]] == [None, None]
    assert [(r["scheme"], r["m"]) for r in kept] == [("unquantized", 1), ("unquantized", 8)]
    header = json.loads((out / "bench.jsonl").read_text().splitlines()[0])

    monkeypatch.setattr(bench, "kernel_times", lambda step, calls, device, repeats=3: (1e-6, 2e-6))
    monkeypatch.setattr(bench, "bench_one", _spy_bench_one(bench, calls := []))
    assert run(bench, out, *cells, "--resume") == 0
    assert calls == [("gptq-w4a16", [1, 8])]  # unquantized was not built again
    rows = final_rows(out)
    assert set(rows) == {("tiny", s, m) for s in ("unquantized", "gptq-w4a16") for m in (1, 8)}
    for r in kept:  # the cells measured before are there as they were measured
        assert {k: rows[("tiny", r["scheme"], r["m"])][k] for k in r} == r
    # with the ceilings of the first run (measuring them again would give other numbers here)
    assert json.loads((out / "bench.json").read_text())["ceilings"] == header["ceilings"]
    assert [(r["scheme"], r["m"]) for r in progress_rows(out)] == [
        ("unquantized", 1), ("unquantized", 8), ("gptq-w4a16", 1), ("gptq-w4a16", 8)]


def test_resume_refuses_a_progress_file_broken_mid_way(bench, tmp_path, capsys):
    """Only the last line of bench.jsonl may be cut off (by a kill); a broken line before it is named."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.jsonl").write_text('{"env": {}, "ceilings": {}}\n{"row": {"sh\n{"row": {}}\n')
    assert run(bench, out, "--schemes", "unquantized", "--m", "1", "--resume") == 2
    assert capsys.readouterr().err.strip() == f"bench.py: {out / 'bench.jsonl'}:2: not a JSON line"


def test_resume_skips_present_cells_and_adds_new_ones(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run(bench, out, "--schemes", "awq-w4a16", "--m", "1") == 0
    first = final_rows(out)[("tiny", "awq-w4a16", 1)]
    final_format = set(first)

    monkeypatch.setattr(bench, "bench_one", _spy_bench_one(bench, calls := []))
    assert run(bench, out, "--schemes", "awq-w4a16", "unquantized", "--m", "1", "8", "--resume") == 0
    assert calls == [("awq-w4a16", [8]), ("unquantized", [1, 8])]
    rows = final_rows(out)
    assert rows[("tiny", "awq-w4a16", 1)] == first
    assert len(rows) == 4 and all(set(r) == final_format for r in rows.values())

    # everything present: nothing is measured, and a finished bench.json alone is enough to resume from
    (out / "bench.jsonl").unlink()
    calls.clear()
    assert run(bench, out, "--schemes", "awq-w4a16", "--m", "1", "--resume") == 0
    assert calls == [] and final_rows(out) == rows

    # without --resume the cell is measured again (the counter gives it another time)
    assert run(bench, out, "--schemes", "awq-w4a16", "--m", "1") == 0
    assert calls == [("awq-w4a16", [1])]
    again = final_rows(out)
    assert set(again) == {("tiny", "awq-w4a16", 1)} and again[("tiny", "awq-w4a16", 1)]["us"] != first["us"]


def test_a_cells_tokens_and_routing_are_the_same_resumed_or_not(bench, tmp_path, monkeypatch):
    # a resumed run measures its cells with the inputs an uncut run gives them (same experts hit,
    # same bytes), and the tuner and the profiler time the same inputs at that M
    seen: dict[str, dict[int, tuple]] = {}
    calls = bench._calls

    def spy(kernels, x, tw, ti):
        seen.setdefault(run_name, {})[x.shape[0]] = (x.clone(), ti.clone())
        return calls(kernels, x, tw, ti)

    monkeypatch.setattr(bench, "_calls", spy)
    run_name = "whole"
    assert run(bench, tmp_path / "a", "--schemes", "unquantized", "--m", "1", "8") == 0
    run_name = "resumed"
    assert run(bench, tmp_path / "b", "--schemes", "unquantized", "--m", "8") == 0
    (x_whole, ti_whole), (x_resumed, ti_resumed) = seen["whole"][8], seen["resumed"][8]
    assert bench.torch.equal(x_whole, x_resumed) and bench.torch.equal(ti_whole, ti_resumed)
    shape = bench.DRY_SHAPES["tiny"]
    x, _, ti = bench.cell_inputs(shape, 8, x_whole.dtype, x_whole.device)
    assert bench.torch.equal(x, x_whole) and bench.torch.equal(ti, ti_whole)
    assert not bench.torch.equal(seen["whole"][1][1], ti_whole[:1])  # (M = 1 is a draw of its own)


def test_the_reference_over_the_experts_hit_alone_is_the_whole_layers(bench):
    # the tools' reference dequantises only the experts a routing reaches (DeepSeek-V3's 256 in float32 would
    # not fit beside the kernel's copies): its output is the whole layer's, on ids that skip experts
    from moe_registry_kernels.reference import ReferenceExperts

    from moe_registry.core.keys import parse_quant_key
    from moe_registry.layer.experts import ExpertsConfig

    torch = bench.torch
    shape = bench.Shape("gappy", 16, 2, 128, 64)
    base = bench.make_weights(shape, parse_quant_key(AWQ), parse_quant_key("unquantized"), torch.float32,
                              torch.device("cpu"), seed=0)
    x = torch.randn(6, 128)
    tw = torch.rand(6, 2)
    ti = torch.tensor([[3, 11], [11, 14], [0, 3], [14, 7], [7, 0], [3, 14]], dtype=torch.int32)
    want = ReferenceExperts(base, ExpertsConfig()).apply(x, tw, ti).float()
    for chunk in (32, 2):  # the five experts hit at once, and two at a time
        got = bench.reference_output(base, ExpertsConfig(), x, tw, ti, chunk=chunk)
        assert float((got - want).norm() / want.norm()) < 1e-6
    # the ids are really mapped: the same routing read as local ids would be another output
    wrong = ReferenceExperts(base.subset(torch.arange(5)), ExpertsConfig()).apply(x, tw, ti % 5).float()
    assert float((wrong - want).norm() / want.norm()) > 0.1


def test_resume_refuses_cells_measured_on_another_device(bench, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.jsonl").write_text(json.dumps({"env": {"device": "NVIDIA H100 80GB HBM3", "dry_run": False},
                                                 "ceilings": {}}) + "\n")
    monkeypatch.setattr(bench, "bench_one", _spy_bench_one(bench, calls := []))
    assert run(bench, out, "--schemes", "awq-w4a16", "--m", "1", "--resume") == 2
    assert "was measured on NVIDIA H100 80GB HBM3" in capsys.readouterr().err and calls == []


# ---------------------------------------------------------------------------------------------
# bench_cpu.py


def test_bench_cpu_rows_are_the_quantized_key_pairs_of_the_specs(bench, tmp_path, monkeypatch):
    import bench_cpu

    def pairs() -> dict[tuple[str, str], list[str]]:
        return {(str(w), str(a)): names for names, w, a in bench_cpu.key_pairs("torch-cpu-packed")}

    shipped = pairs()
    registry = load_registry()
    listing = {n for n, loaded in registry.schemes.items() if "torch-cpu-packed" in loaded.spec.kernels}
    assert {n for names in shipped.values() for n in names} == listing  # every one quantized and claimed
    assert shipped[(AWQ, "unquantized")] == ["autoround-w4a16-asym", "awq-w4a16", "compressed-tensors-w4a16-asym",
                                             "gptq-v2-w4a16-asym", "gptq-w4a16-asym"]
    user_spec(tmp_path, monkeypatch, "test-w4a16-channel", USER_SCHEME)
    assert pairs()[("uint4 scale:float16:channel:static zp:group", "unquantized")] == ["test-w4a16-channel"]


def test_kernel_identity_runs_and_its_row_file_holds_every_case(tmp_path):
    """tools/kernel_identity.py on the interpreter, the package against itself: every compared case equal, and
    identity.jsonl (appended chunk by chunk, for runs cut off at a time limit) holds each case's row."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(root / "tools" / "kernel_identity.py"), "--old", str(root / "kernels"),
                           "--out", str(tmp_path), "--device", "cpu", "--limit", "2", "--no-models", "--workers", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "identity.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["equal"] and r["old"] == r["new"] for r in rows)
    summary = json.loads((tmp_path / "identity.json").read_text())["summary"]
    assert (summary["compared"], summary["equal"], summary["errors"]) == (2, 2, [])


def test_bench_ep_runs_under_torchrun_and_writes_each_cell_as_it_goes(tmp_path):
    """tools/bench_ep.py with two gloo ranks on the CPU (--dry-run): a row per scheme x M in bench_ep.jsonl, the
    EP = 1 and EP = 2 times and the three parts measured, the ranks' partial sums within the scheme's tolerance."""
    from torchrun_launch import torchrun

    proc = torchrun(2, str(ROOT / "tools" / "bench_ep.py"), "--dry-run", "--tokens", "1", "3", "--seconds", "0.01",
                    "--schemes", "unquantized", "awq-w4a16", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "bench_ep.jsonl").read_text().splitlines()]
    assert [(r["scheme"], r["m"], r["world"]) for r in rows] == [
        ("unquantized", 1, 2), ("unquantized", 3, 2), ("awq-w4a16", 1, 2), ("awq-w4a16", 3, 2)]
    for r in rows:
        assert all(r[k] > 0 for k in ("ep1_us", "ep_us", "dispatch_us", "experts_us", "combine_us",
                                      "a2a_dispatch_eager_us", "agrs_dispatch_eager_us", "link_busbw_gbps"))
        assert r["relative_error"] < 1e-2
    cells = json.loads((tmp_path / "bench_ep.json").read_text())["cells"]
    assert len(cells) == 4 and cells[0]["ep1_tokens_per_s"] == pytest.approx(1e6 / rows[0]["ep1_us"])
    assert "EPn us" in proc.stdout


def test_bench_ep_outside_torchrun_says_how_to_start_it():
    import subprocess
    import sys

    from torchrun_launch import clean_env

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_ep.py"), "--dry-run"], capture_output=True,
                          text=True, timeout=120, env=clean_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: start it with torchrun --nproc-per-node N (one process per GPU)")


# ---------------------------------------------------------------------------------------------
# per byte of weights against the int4 / int8 baselines (tools/per_byte.py)


def _bench_lines(path: Path, cells: dict[tuple[str, str, int], tuple[float, float]]) -> Path:
    """A bench.jsonl of these (shape, scheme, M) -> (µs, bytes moved) cells, as tools/bench.py writes it."""
    lines = [json.dumps({"env": {"device": "test"}, "ceilings": {}})]
    for (shape, scheme, m), (us, moved) in cells.items():
        lines.append(json.dumps({"row": {"shape": shape, "scheme": scheme, "m": m, "us": us, "bytes_moved": moved}}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _tool(monkeypatch, name: str):  # type: ignore[no-untyped-def]
    """A module of tools/, imported with the built-in specs only."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)
    return importlib.import_module(name)


@pytest.fixture
def per_byte(monkeypatch):
    return _tool(monkeypatch, "per_byte")


def test_per_byte_compares_each_scheme_with_the_baseline_of_its_width(per_byte, tmp_path, capsys):
    """MXFP4 (4-bit) against GPTQ int4 and MXFP8 (8-bit) against GPTQ int8, cell by cell, bytes per µs
    over the baseline's; 16-bit weights and cells the baseline lacks are left out; --below lists the
    slow cells with their times."""
    run = _bench_lines(tmp_path / "bench.jsonl", {
        ("S", "gptq-w4a16", 1): (10.0, 100.0), ("S", "gptq-w4a16", 8): (20.0, 400.0),
        ("S", "mxfp4", 1): (12.0, 108.0), ("S", "mxfp4", 8): (20.0, 420.0), ("S", "mxfp4", 64): (50.0, 900.0),
        ("S", "gptq-w8a16", 1): (10.0, 200.0), ("S", "modelopt-mxfp8", 1): (10.0, 210.0),
        ("S", "unquantized", 1): (30.0, 400.0)})
    assert per_byte.main([str(run), "--below", "0.95"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["scheme", "S", "M1/8"]
    assert out.splitlines()[1].split() == ["modelopt-mxfp8", "1.05/-"]
    assert out.splitlines()[2].split() == ["mxfp4", "0.90/1.05"]
    assert "1 cells below 0.95:" in out and "mxfp4" in out.splitlines()[-1]
    assert out.splitlines()[-1].endswith("0.900  12.0 us against gptq-w4a16 10.0 us")
    assert "unquantized" not in out
    assert per_byte.main([str(run), "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert {(c["scheme"], c["m"], c["baseline"], round(c["ratio"], 3)) for c in cells} == {
        ("mxfp4", 1, "gptq-w4a16", 0.9), ("mxfp4", 8, "gptq-w4a16", 1.05), ("modelopt-mxfp8", 1, "gptq-w8a16", 1.05)}


def test_per_byte_names_what_it_cannot_compare(per_byte, tmp_path, capsys):
    run = _bench_lines(tmp_path / "bench.jsonl", {("S", "mxfp4", 1): (12.0, 108.0)})
    assert per_byte.main([str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        "per_byte.py: baseline 'gptq-w4a16' is not in this run; measure it in the same run")
    assert per_byte.main([str(run), "--baselines", "gptq-w4a"]) == 2
    assert "baseline 'gptq-w4a': not a quantised scheme spec the benchmark runs" in capsys.readouterr().err
    assert per_byte.main([str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.strip().endswith("none.jsonl: no such file or directory")
    (tmp_path / "bad.jsonl").write_text('{"env": {}}\n{"row": {"shape"\n{"env": {}}\n')
    assert per_byte.main([str(tmp_path / "bad.jsonl")]) == 2
    assert capsys.readouterr().err.strip().endswith("bad.jsonl:2: not a JSON line")


def test_per_byte_reads_a_run_cut_off_by_a_kill(per_byte, tmp_path, capsys):
    """A last line cut off mid-write (tools/bench.py writes each cell as it is measured) is left out."""
    run = _bench_lines(tmp_path / "bench.jsonl", {("S", "gptq-w4a16", 1): (10.0, 100.0),
                                                   ("S", "mxfp4", 1): (10.0, 110.0)})
    run.write_text(run.read_text() + '{"row": {"shape": "S", "sch')
    assert per_byte.main([str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["mxfp4", "1.10"]


def test_kernel_times_leave_cupti_torn_down_after_their_profile(monkeypatch):
    """The GEMM profile asks Kineto to tear CUPTI down when it ends (left attached, it slowed every
    layer timed after it: H100, Qwen3 M = 1, 18.1 -> 20.9 us); a user's own setting is kept."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench
    import torch

    calls = []
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    gemm_s, _ = bench.kernel_times(lambda: calls.append(torch.ones(2, 2) @ torch.ones(2, 2)), 1,
                                   torch.device("cpu"), repeats=2)
    assert os.environ["TEARDOWN_CUPTI"] == "1" and len(calls) == 3 and gemm_s > 0
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    bench.kernel_times(lambda: None, 1, torch.device("cpu"), repeats=1)
    assert os.environ["TEARDOWN_CUPTI"] == "0"


def test_prepare_peer_names_a_harness_folder_that_lacks_the_scripts(tmp_path: Path) -> None:
    """tools/prepare_peer.sh refuses a folder without the harness in one line, before fetching anything."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["bash", str(root / "tools" / "prepare_peer.sh"), str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    wanted = f"prepare_peer.sh: {tmp_path}/vllm_peer_bench.py: missing (wanted the peer harness folder)"
    assert r.stderr.strip() == wanted


def test_bench_untuned_times_each_tile_choice_and_names_the_one_the_kernel_picks(tmp_path, monkeypatch, capsys):
    # a dry run on the tiny shape: the defaults, and a tuned entry for this very shape (another tile), each timed;
    # no nearest tuned shape (the device has no table), and the kernel's own pick there is the defaults
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench_untuned
    from moe_registry_kernels.triton.api import config_file, shape_key

    # each choice still runs (the reference check, the timing's call); the interpreter's times say nothing
    monkeypatch.setattr(bench_untuned.tune.bench, "_median_time", lambda fn, *args, **kwargs: (fn(), 1e-3)[1])

    shape = bench_untuned.bench.DRY_SHAPES["tiny"]
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    table = {shape_key(shape.experts, shape.top_k, n, k): {"1": tile}
             for n, k in ((2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate))}
    gptq = bench_untuned.bench.registry_schemes()["gptq-w4a16"]
    (tuned / config_file(gptq.weight, gptq.activation, "dry-run").name).write_text(json.dumps(table))
    assert bench_untuned.main(["--dry-run", "--schemes", "gptq-w4a16", "--m", "1", "--tuned", str(tuned),
                               "--out", str(tmp_path)]) == 0
    [row] = [json.loads(line) for line in (tmp_path / "untuned.jsonl").read_text().splitlines()]
    assert set(row["us"]) == {"defaults", "tuned"}
    assert row["configs"]["tuned"][0]["BLOCK_N"] == 32 != row["configs"]["defaults"][0]["BLOCK_N"]
    assert all(err < 1e-2 for err in row["rel_err"].values())
    assert "| tiny | `gptq-w4a16` | 1 | 0.25 |" in capsys.readouterr().out
    assert bench_untuned.runs_now(row) == "defaults"
    row["configs"] = {name: row["configs"]["tuned"] for name in row["configs"]}  # none is this code's pick
    assert bench_untuned.runs_now(row) is None and "| other tiles | - |" in bench_untuned.markdown_row(row)


def test_bench_untuned_names_a_missing_tuned_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench_untuned

    assert bench_untuned.main(["--dry-run", "--tuned", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"bench_untuned.py: --tuned {tmp_path / 'nowhere'}: no such directory "
                                               "(wanted a tools/tune.py run's --out)")
    assert not (tmp_path / "untuned.jsonl").exists()


def test_bench_model_hands_transformers_a_local_copy_of_a_hub_kernel(tmp_path, monkeypatch):
    """--hub-kernels: transformers' FineGrainedFP8 integration loads the kernel package from the folder (where it
    would download kernels-community/finegrained-fp8), and a folder without its index is one line."""
    import sys

    pytest.importorskip("transformers")
    from transformers.integrations import finegrained_fp8, hub_kernels

    bench_model = _tool(monkeypatch, "bench_model")
    with pytest.raises(SystemExit, match=rf"^--hub-kernels {tmp_path}: no kernels.json there"):
        bench_model.install_hub_kernels(tmp_path)
    package = tmp_path / "local_fp8_kernel"
    package.mkdir()
    (package / "__init__.py").write_text("def matmul_2d(*a, **k): return '2d'\n"
                                         "def matmul_batched(*a, **k): return 'batched'\n"
                                         "def matmul_grouped(*a, **k): return 'grouped'\n")
    (tmp_path / "kernels.json").write_text(json.dumps(
        {"finegrained-fp8": {"package": "local_fp8_kernel", "source": "example@0123"}}))
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, "finegrained-fp8", None)  # put back afterwards
    monkeypatch.setattr(finegrained_fp8, "is_kernels_available", finegrained_fp8.is_kernels_available)
    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", None)
    monkeypatch.setattr(sys, "path", list(sys.path))  # install_hub_kernels puts the folder first
    bench_model.install_hub_kernels(tmp_path)
    kernel = finegrained_fp8.load_finegrained_fp8_kernel()
    assert (kernel.matmul(), kernel.batched_matmul(), kernel.grouped_matmul()) == ("2d", "batched", "grouped")
    assert bench_model.hub_kernels(tmp_path) == {"finegrained-fp8": {"package": "local_fp8_kernel",
                                                                     "source": "example@0123"}}


def test_bench_model_stops_a_sides_whole_process_group(tmp_path, monkeypatch):
    """A side cut off by its time limit, or ending, takes the processes it started with it (torch.compile's
    workers): none is left to share the host with the next side."""
    import sys
    import time

    bench_model = _tool(monkeypatch, "bench_model")
    script = ("import subprocess, sys, time\n"
              "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(tmp_path / 'pid')!r}, 'w').write(str(worker.pid))\n"
              "time.sleep(float(sys.argv[1]))\n")

    def alive(pid: int) -> bool:
        # a killed worker is a zombie until its reaper (here: init) collects it
        stat = Path(f"/proc/{pid}/stat")
        return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"

    for sleep, timeout, wanted in ((60, 2.0, None), (0, 30.0, 0)):
        (tmp_path / "pid").unlink(missing_ok=True)
        started = time.perf_counter()
        code = bench_model.run_side([sys.executable, "-c", script, str(sleep)], tmp_path / "side.log", timeout)
        assert code == wanted and time.perf_counter() - started < 20
        worker = int((tmp_path / "pid").read_text())
        deadline = time.perf_counter() + 5
        while alive(worker) and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert not alive(worker), f"worker {worker} outlived its side"


def test_bench_model_measures_only_the_sides_asked_for(tmp_path, monkeypatch):
    """--sides: a later call can measure one side again (each side of each format is its own child process)."""
    bench_model = _tool(monkeypatch, "bench_model")
    ran = []
    monkeypatch.setattr(bench_model, "make_checkpoint", lambda model, fmt, work, *a, **k: work / fmt)
    monkeypatch.setattr(bench_model, "environment", lambda args: {})
    monkeypatch.setattr(bench_model, "markdown", lambda record: "")
    monkeypatch.setattr(bench_model, "_child", lambda args, path, fmt, side, record: ran.append((fmt, side)))
    base = ["--format", "bf16", "gptq", "--device", "cuda", "--transformers-experts", "grouped_mm", "batched_mm",
            "--out", str(tmp_path)]
    assert bench_model.main([*base, "--sides", "transformers"]) == 0
    assert ran == [("bf16", "transformers:grouped_mm"), ("bf16", "transformers:batched_mm"), ("gptq", "transformers")]
    ran.clear()
    assert bench_model.main([*base, "--sides", "registry"]) == 0
    assert ran == [("bf16", "registry"), ("gptq", "registry")]


def test_gpu_state_reads_nvidia_smis_line(bench):
    """The SM clock, power and temperature after a cell, as nvidia-smi's CSV gives them; anything else is None."""
    assert bench.parse_gpu_state("1980, 412.35, 51\n") == {"sm_mhz": 1980.0, "power_w": 412.35, "temp_c": 51.0}
    assert bench.parse_gpu_state("1755, [N/A], 60") is None
    assert bench.parse_gpu_state("1980, 400") is None
    assert bench.gpu_state(bench.torch.device("cpu")) is None


def _int4_call(seed: int, layers: int = 1):
    """A step calling ``layers`` small GPTQ int4 Triton layers once each on 3 tokens routed top-2 (interpreter)."""
    import torch
    from moe_registry_kernels import quant_ref
    from moe_registry_kernels.triton.experts import TritonExperts

    from moe_registry.core.keys import parse_quant_key
    from moe_registry.layer.experts import ExpertsConfig

    weights = quant_ref.make_random_expert_weights(parse_quant_key("uint4b8 scale:float16:group(32):static"),
                                                   parse_quant_key("unquantized"), num_experts=4, hidden=64,
                                                   intermediate=64, dtype=torch.float16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g).to(torch.float16)
    ids = torch.tensor([[0, 1], [2, 1], [3, 0]], dtype=torch.int32)
    tw = torch.rand(3, 2, generator=g) + 0.1
    experts = [TritonExperts(weights, ExpertsConfig()) for _ in range(layers)]
    return lambda: [e.apply(x, tw, ids) for e in experts]


def test_the_gemm_launches_a_step_made_run_again_alone(bench):
    """bench.py times the GEMMs alone on a GPU by replaying, in a CUDA graph, the GEMM launches one layer call made
    (record_gemm_launches, replay): the recorded launches are the two GEMMs of the call, each kernel run as
    recorded, and run again they write the same outputs into the call's own buffers (here through Triton's
    interpreter: the graph around them is the GPU's)."""
    import torch

    call = _int4_call(3)
    outs: list = []
    launches = bench.record_gemm_launches(lambda: outs.extend(call()))
    assert [kernel.fn.__name__ for kernel, *_ in launches] == ["_fused_moe_kernel"] * 2
    written = [args[7] for _, _, args, _ in launches]  # c_ptr: each GEMM's output
    before = [c.clone() for c in written]
    for c in written:
        c.fill_(float("nan"))
    bench.replay(launches)()
    for c, was in zip(written, before, strict=True):
        assert torch.equal(c, was)
    assert outs[0].isfinite().all()


def test_the_gemm_launches_split_into_each_gemms(bench):
    """gemm_graph_seconds times each GEMM alone from the launches of several layer calls: GEMM1's are every
    call's first (its output is the second's input), GEMM2's every second; a count other than two a call gives
    no split."""
    launches = bench.record_gemm_launches(_int4_call(5, layers=2))
    first, second = bench.launches_by_gemm(launches, 2)
    assert first == [launches[0], launches[2]] and second == [launches[1], launches[3]]
    for g1, g2 in zip(first, second, strict=True):
        assert g1[2][7].data_ptr() == g2[2][0].data_ptr()  # GEMM1's output (c_ptr) is GEMM2's input (a_ptr)
    assert bench.launches_by_gemm(launches, 3) == ()


def test_the_gemm_graphs_time_each_gemm_alone_then_both(bench, monkeypatch):
    """gemm_graph_seconds: after COOL_SECONDS idle, GEMM1's launches alone, then GEMM2's (as the peer harness times
    its two), then the step's GEMM launches together, each per layer call (here a burst of launches stands for as
    many microseconds as it holds launches); no split where the calls made other than two launches each."""
    recorded: list = []
    events: list = []
    monkeypatch.setattr(bench, "record_gemm_launches", lambda step: recorded)
    monkeypatch.setattr(bench, "replay", lambda launches: lambda: launches)
    monkeypatch.setattr(bench, "burst_seconds", lambda run, device: events.append(run()) or float(len(run())))
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: events.append(("idle", seconds)))
    recorded[:] = ["g1", "g2", "g1", "g2"]
    assert bench.gemm_graph_seconds(None, 2, None) == (2.0, 1.0, 1.0)
    assert events == [("idle", bench.COOL_SECONDS), ["g1", "g1"], ["g2", "g2"], recorded]
    assert bench.COOL_SECONDS >= 0.5
    recorded[:] = ["g1", "g2", "g1"]
    assert bench.gemm_graph_seconds(None, 2, None) == (1.5, None, None)


def test_a_gpu_cell_times_the_gemms_before_the_layers_sustained_replays(bench, monkeypatch):
    """gpu_cell_seconds: the GEMM bursts first (the layer's 0.3 s of back-to-back replays would leave the GPU at
    its power limit for them), then the layer's graph of at least GRAPH_CALLS calls, the weight copies in turn;
    the layer's time per call."""
    from types import SimpleNamespace

    order: list = []
    calls: list = []
    layers = [SimpleNamespace(apply=lambda x, tw, ti, n=n: calls.append(n)) for n in range(3)]
    monkeypatch.setattr(bench, "gemm_graph_seconds",
                        lambda step, per_step, device: order.append(("gemms", per_step)) or (3.0, 2.0, 1.0))
    monkeypatch.setattr(bench, "capture_graph", lambda step: SimpleNamespace(replay=step))

    def median(fn, seconds, device):
        order.append(("layer", seconds))
        fn()
        return 9.0

    monkeypatch.setattr(bench, "_median_time", median)
    layer_s, gemms = bench.gpu_cell_seconds(layers, None, None, None, None)
    assert order == [("gemms", 3), ("layer", 0.3)]
    assert calls == [0, 1, 2] * 3 and len(calls) >= bench.GRAPH_CALLS
    assert layer_s == 9.0 / 9 and gemms == (3.0, 2.0, 1.0)


@pytest.mark.parametrize(("run_ms", "reps"), [(0.4, 8), (3.0, 1), (5.0, 1), (1e-4, 400)])
def test_a_burst_is_a_graph_of_about_three_ms_timed_replay_by_replay(bench, monkeypatch, run_ms, reps):
    """burst_seconds times as the side-by-side harness times a peer: a graph holding about 3 ms of runs (at least
    one, at most 400), replayed once untimed, then 15 replays each timed alone; the median per run. Here each run
    takes ``run_ms`` and the graph runs its steps when replayed."""
    from types import SimpleNamespace

    runs: list = []
    replays = []

    def timed(fn, device):
        before = len(runs)
        fn()
        return (len(runs) - before) * run_ms * 1e-3

    def graph(step):
        def replay():
            replays.append(1)
            step()
        return SimpleNamespace(replay=replay)

    monkeypatch.setattr(bench, "time_call", timed)
    monkeypatch.setattr(bench, "capture_graph", graph)
    assert bench.burst_seconds(lambda: runs.append(1), None) == pytest.approx(run_ms * 1e-3)
    assert len(replays) == 1 + bench.BURST_REPLAYS == 16
    assert len(runs) == 2 + reps * len(replays)  # a warm run and the timed one first


def test_a_bench_record_from_before_the_per_gemm_times_reads_as_a_row(bench):
    """Records written before bench.py timed each GEMM alone read back without those times."""
    old = {"shape": "Qwen3-30B-A3B", "scheme": "gptq-w4a16", "m": 8, "us": 60.0, "roofline_us": 30.0,
           "bytes_moved": 1.0, "flops": 1.0, "rel_error": 0.003, "gemm_us": 57.0, "gemm_roofline_us": 30.0,
           "glue_us": 4.0, "pct_roofline": 50.0}
    row = bench.row_from_record(old)
    assert (row.gemm_us, row.gemm1_us, row.gemm2_us) == (57.0, None, None)
    timed = dataclasses.replace(row, gemm1_us=40.0, gemm2_us=17.0)
    assert bench.row_from_record(bench.row_record(timed)) == timed
