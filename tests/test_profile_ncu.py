"""tools/profile_ncu.py: Nsight Compute's raw CSV read into per-kernel profiles, and the child that
the profiler runs (here on the CPU, where it builds and calls the layer without a profiler range).

The CSV below is laid out as ``ncu --csv --page raw --print-units base`` writes it: notes first,
a header of fixed columns then one column per metric, a units row, one row per kernel, numbers
with thousands separators."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_ncu  # noqa: E402

FIXED = ['"ID"', '"Process ID"', '"Process Name"', '"Host Name"', '"Kernel Name"', '"Context"', '"Stream"',
         '"Block Size"', '"Grid Size"', '"Device"', '"CC"']
METRICS = ["gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
           "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
           "launch__registers_per_thread", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
           "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_wait_not_issued_per_issue_active.ratio", "lts__t_sector_hit_rate.pct",
           "dram__bytes.sum.per_second"]
UNITS = ["nsecond", "%", "%", "%", "register/thread", "%", "%", "inst", "inst", "inst", "inst", "inst", "%",
         "byte/second"]


def _row(values: list[str]) -> str:
    return ",".join(f'"{v}"' for v in values)


def raw_csv(kernels: list[tuple[str, list[str]]]) -> str:
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3)", ",".join(FIXED) + "," + _row(METRICS),
             _row([""] * len(FIXED) + UNITS)]
    for i, (name, values) in enumerate(kernels):
        lines.append(_row([str(i), "4242", "python3", "127.0.0.1", name, "1", "7", "(128, 1, 1)", "(96, 1, 1)", "0",
                           "9.0", *values]))
    return "\n".join([*lines, "==PROF== Disconnected from process 4242"]) + "\n"


ALIGN = ("_align_kernel", ["3,072", "2.5", "5.1", "10.0", "32", "0", "0", "1.5", "0.5", "0.1", "1", "9", "80",
                           "4,096"])
GEMM1 = ("_fused_moe_kernel", ["41,500", "61.25", "78.5", "18.75", "168", "22.5", "0", "2.5", "7.25", "0.75", "1",
                               "99", "34.24", "3,113,867,310,012.06"])
GEMM2 = ("_fused_moe_kernel", ["30,000.5", "55", "70", "20", "128", "n/a", "35.5", "6", "1", "3", "1", "0", "n/a",
                               "1,000,000,000"])


def test_raw_csv_becomes_one_profile_per_kernel_gemms_labelled_in_order():
    kernels = profile_ncu.parse_raw_csv(raw_csv([ALIGN, GEMM1, GEMM2]))
    labels = profile_ncu.label_kernels(kernels)
    assert labels == ["_align_kernel", "gemm1", "gemm2"]
    align, g1, g2 = (profile_ncu.kernel_profile(k, "Qwen3-30B-A3B", "gptq-w4a16", 8, label)
                     for k, label in zip(kernels, labels, strict=True))
    # nanoseconds (thousands separators and all) -> microseconds
    assert (align.us, g1.us, g2.us) == (pytest.approx(3.072), pytest.approx(41.5), pytest.approx(30.0005))
    assert (g1.dram_pct, g1.issue_pct, g1.occupancy_pct, g1.registers) == (61.25, 78.5, 18.75, 168)
    # L2's hit rate, and the megabytes DRAM moved: its throughput (bytes a second) times the kernel's time
    assert (g1.l2_hit_pct, g1.dram_mb, g2.l2_hit_pct) == (34.24, pytest.approx(3113.867310012 * 41.5e-3), None)
    assert g2.dram_mb == pytest.approx(30.0005e-3)
    # the busiest tensor pipe; a pipe reading n/a is left out
    assert (g1.tensor_pct, g2.tensor_pct) == (22.5, 35.5)
    # stall reasons largest first; "selected" (issuing) and the not-issued variants are not stalls
    assert list(g1.stalls.items()) == [("wait", 7.25), ("long_scoreboard", 2.5), ("barrier", 0.75)]
    assert g2.top_stalls(2) == "long_scoreboard 6.0 barrier 3.0"
    assert (g1.shape, g1.scheme, g1.m, g1.kernel) == ("Qwen3-30B-A3B", "gptq-w4a16", 8, "gemm1")


def test_metrics_an_ncu_version_lacks_are_none_and_shown_as_dashes(capsys):
    header = ",".join(FIXED) + "," + _row(["gpu__time_duration.sum"])
    text = "\n".join([header, _row([""] * len(FIXED) + ["usecond"]),
                      _row(["0", "1", "p", "h", "_fused_moe_kernel", "1", "7", "b", "g", "0", "9.0", "12.5"])])
    (kernel,) = profile_ncu.parse_raw_csv(text)
    p = profile_ncu.kernel_profile(kernel, "Mixtral-8x7B", "fp8-block128", 4096, "gemm1")
    assert p.us == 12.5  # already in microseconds
    assert (p.dram_pct, p.issue_pct, p.tensor_pct, p.occupancy_pct, p.registers, p.stalls, p.l2_hit_pct,
            p.dram_mb) == (None, None, None, None, None, {}, None, None)
    profile_ncu.print_table([p])
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[-9:] == ["gemm1", "12.5", "-", "-", "-", "-", "-", "-", "-"]


def test_output_without_a_header_is_no_kernels():
    assert profile_ncu.parse_raw_csv("==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM\n") == []


def test_a_cell_ncu_profiled_nothing_of_is_one_line_naming_it(monkeypatch):
    def fake_run(command, **kwargs):
        assert command[:3] == ["/x/ncu", "--csv", "--page"] and command[-4:] == [
            profile_ncu.CHILD_FLAG, "qwen3", "mxfp4", "64"]
        return subprocess.CompletedProcess(command, 1, stdout="==PROF== Connected\n",
                                           stderr="==ERROR== Failed to initialize the profiler: LibraryNotLoaded\n")

    monkeypatch.setattr(profile_ncu.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as error:
        profile_ncu.profile_cell("/x/ncu", "qwen3", "mxfp4", 64)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("ncu profiled no kernel of qwen3 mxfp4 M=64 (exit 1): ")
    assert "LibraryNotLoaded" in message


def test_the_profiler_command_reads_sections_with_clocks_left_alone():
    command = profile_ncu.ncu_command("ncu", "mixtral", "gptq-w4a16", 8)
    assert command[command.index("--clock-control") + 1] == "none"
    assert command[command.index("--profile-from-start") + 1] == "off"
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--section"] == list(profile_ncu.SECTIONS)
    assert command[-4:] == [profile_ncu.CHILD_FLAG, "mixtral", "gptq-w4a16", "8"]


@pytest.mark.parametrize("scheme", ["gptq-w4a16", "mxfp4", "fp8-block128"])
def test_the_child_builds_and_calls_the_layer_on_the_cpu(scheme):
    # warm-up calls, then the one the profiler would see
    assert profile_ncu.run_cell("qwen3", scheme, 3, calls=2) == 3


def test_without_a_gpu_or_ncu_the_tool_says_so(capsys):
    assert profile_ncu.main(["--schemes", "gptq-w4a16"]) == 2
    assert capsys.readouterr().err.strip() == "profile_ncu.py: needs a CUDA GPU and Nsight Compute (ncu) on the PATH"


def test_an_unknown_scheme_is_named(capsys):
    assert profile_ncu.main(["--schemes", "gptq-w5a16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("profile_ncu.py: ") and "gptq-w5a16" in err


def _profile(scheme: str, m: int, kernel: str, us: float) -> profile_ncu.KernelProfile:
    return profile_ncu.KernelProfile("Qwen3-30B-A3B", scheme, m, kernel, us, 60.0, 50.0, 20.0, 18.0, 128,
                                     {"wait": 1.25, "long_scoreboard": 1.0})


def _write(path: Path, profiles: list) -> None:
    import dataclasses
    path.write_text("".join(json.dumps(dataclasses.asdict(p)) + "\n" for p in profiles))


def test_show_prints_a_written_file_again_gemms_only_on_request(tmp_path, capsys):
    written = [_profile("mxfp4", 8, "_align_one_launch", 5.0), _profile("mxfp4", 8, "gemm1", 55.5)]
    _write(tmp_path / "profile.jsonl", written)
    assert profile_ncu.load_profiles(tmp_path / "profile.jsonl") == written
    assert profile_ncu.main(["--show", str(tmp_path / "profile.jsonl"), "--gemms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2  # header and gemm1: the alignment kernel is left out
    assert lines[1].split()[:6] == ["Qwen3-30B-A3B", "mxfp4", "8", "gemm1", "55.5", "60"]
    assert lines[1].endswith("wait 1.2 long_scoreboard 1.0")


def test_a_profile_written_before_the_memory_columns_reads_back_without_them(tmp_path, capsys):
    """Profiles from before L2's hit rate and DRAM's megabytes were read load with None there, shown as dashes."""
    old = {"shape": "Mixtral-8x7B", "scheme": "awq-w4a16", "m": 8, "kernel": "gemm1", "us": 165.2, "dram_pct": 55.0,
           "issue_pct": 44.0, "tensor_pct": 10.0, "occupancy_pct": 18.0, "registers": 164, "stalls": {"wait": 2.0}}
    (tmp_path / "profile.jsonl").write_text(json.dumps(old) + "\n")
    (profile,) = profile_ncu.load_profiles(tmp_path / "profile.jsonl")
    assert (profile.us, profile.l2_hit_pct, profile.dram_mb) == (165.2, None, None)
    assert profile_ncu.main(["--show", str(tmp_path / "profile.jsonl")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[4:8] == ["165.2", "55", "-", "-"]


def test_show_names_the_line_that_is_not_a_profile(tmp_path, capsys):
    _write(tmp_path / "profile.jsonl", [_profile("mxfp4", 8, "gemm1", 55.5)])
    with (tmp_path / "profile.jsonl").open("a") as f:
        f.write('{"shape": "Qwen3-30B-A3B"}\n')
    assert profile_ncu.main(["--show", str(tmp_path / "profile.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"profile_ncu.py: {tmp_path / 'profile.jsonl'}:2: not a kernel profile of this tool (")


def test_resume_profiles_only_the_cells_not_in_the_file(tmp_path, monkeypatch, capsys):
    _write(tmp_path / profile_ncu.PROGRESS, [_profile("gptq-w4a16", 8, "gemm1", 42.0)])
    asked = []

    def fake_cell(ncu, shape, scheme, m, peer=None):
        asked.append((shape, scheme, m))
        return [_profile(scheme, m, "gemm1", 80.0)]

    monkeypatch.setattr(profile_ncu, "find_ncu", lambda: "/x/ncu")
    monkeypatch.setattr(profile_ncu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile_ncu, "profile_cell", fake_cell)
    argv = ["--schemes", "gptq-w4a16", "--m", "8", "64", "--out", str(tmp_path), "--resume"]
    assert profile_ncu.main(argv) == 0
    assert asked == [("qwen3", "gptq-w4a16", 64)]
    assert "qwen3 gptq-w4a16 M=8: in " in capsys.readouterr().out
    # the file keeps the earlier cell and gains the new one
    assert [(p.m, p.us) for p in profile_ncu.load_profiles(tmp_path / profile_ncu.PROGRESS)] == [(8, 42.0), (64, 80.0)]
    # without --resume every cell is profiled again
    asked.clear()
    assert profile_ncu.main(argv[:-1]) == 0
    assert asked == [("qwen3", "gptq-w4a16", 8), ("qwen3", "gptq-w4a16", 64)]
    # ... into a file of its own (no cell twice)
    assert [(p.m, p.us) for p in profile_ncu.load_profiles(tmp_path / profile_ncu.PROGRESS)] == [(8, 80.0), (64, 80.0)]


def _bench_row(shape: str, scheme: str, m: int, pct: float) -> dict:
    return {"shape": shape, "scheme": scheme, "m": m, "pct_roofline": pct}


def test_below_keeps_the_cells_a_bench_run_measured_under_the_target_and_those_it_did_not_measure():
    rows = [_bench_row("Qwen3-30B-A3B", "mxfp4", 8, 55.0), _bench_row("Qwen3-30B-A3B", "mxfp4", 64, 85.0),
            _bench_row("Mixtral-8x7B", "mxfp4", 8, 84.9)]
    asked = [("qwen3", "mxfp4", 8), ("qwen3", "mxfp4", 64), ("mixtral", "mxfp4", 8), ("dsv2lite", "mxfp4", 8)]
    assert profile_ncu.cells_below(asked, rows, 85.0) == [("qwen3", "mxfp4", 8), ("mixtral", "mxfp4", 8),
                                                          ("dsv2lite", "mxfp4", 8)]


def test_below_without_a_bench_run_there_is_one_line(tmp_path, capsys):
    assert profile_ncu.main(["--bench", str(tmp_path), "--below", "85"]) == 2
    assert capsys.readouterr().err.strip() == (f"profile_ncu.py: --bench {tmp_path}: no bench.jsonl or bench.json "
                                               "with rows there")


def test_below_names_how_many_cells_miss_before_it_needs_a_gpu(tmp_path, capsys):
    lines = [{"env": {}, "ceilings": {}}, {"row": _bench_row("Qwen3-30B-A3B", "gptq-w4a16", 8, 61.0)},
             {"row": _bench_row("Qwen3-30B-A3B", "gptq-w4a16", 64, 90.0)}]
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert profile_ncu.main(["--bench", str(tmp_path), "--below", "85", "--m", "8", "64"]) == 2
    out = capsys.readouterr()
    assert out.out.strip() == f"1 of 2 cells under 85% of roofline in {tmp_path}"
    assert "needs a CUDA GPU" in out.err


def test_bench_and_below_go_together(capsys):
    with pytest.raises(SystemExit):
        profile_ncu.main(["--below", "85"])
    assert "--bench and --below go together" in capsys.readouterr().err


def test_the_peer_command_profiles_its_two_gemms_after_its_warm_layer():
    """--peer: ncu over the harness's one case of the cell, our scheme's peer pair on the shape's peer name, its
    GEMM1 and GEMM2 after the two launches of the warm layer, clocks left alone as for ours."""
    command = profile_ncu.peer_command("ncu", "marlin", "mixtral", "awq-w4a16", 8)
    assert command[command.index("--clock-control") + 1] == "none"
    assert command[command.index("-k") + 1] == "regex:Marlin"
    assert (command[command.index("--launch-skip") + 1], command[command.index("--launch-count") + 1]) == ("2", "2")
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--section"] == list(profile_ncu.SECTIONS)
    assert command[-3:] == [str(profile_ncu.PEER_DIR / "marlin_peer_bench.py"), "--ncu-case",
                            "mixtral-8x7b,int4_w4a16_zp,8"]
    triton = profile_ncu.peer_command("ncu", "triton", "qwen3", "fp8-block128", 4096)
    assert triton[triton.index("-k") + 1] == "regex:fused_moe_kernel"
    assert triton[-3:] == [str(profile_ncu.PEER_DIR / "vllm_peer_bench.py"), "--ncu-case",
                           "qwen3-30b-a3b,fp8_w8a8_block128,4096"]
    with pytest.raises(ValueError, match="^no peer scheme of the same weights as mxfp4 "):
        profile_ncu.peer_command("ncu", "triton", "qwen3", "mxfp4", 8)


def test_the_peers_kernels_are_labelled_by_side_and_a_failure_names_the_peer(monkeypatch):
    """The peer's two profiled launches read as ``<peer> gemm1`` and ``<peer> gemm2`` (their kernel names are
    not ours); a case ncu profiled nothing of is one line naming whose cell it was."""
    outputs = [raw_csv([GEMM1, GEMM2]), "==PROF== Connected\n"]

    def fake_run(command, **kwargs):
        assert "--ncu-case" in command
        return subprocess.CompletedProcess(command, 0, stdout=outputs.pop(0), stderr="no kernel matched")

    monkeypatch.setattr(profile_ncu.subprocess, "run", fake_run)
    cell = profile_ncu.profile_cell("/x/ncu", "qwen3", "fp8-block128", 8, "triton")
    assert [p.kernel for p in cell] == ["triton gemm1", "triton gemm2"]
    assert [profile_ncu.side(p) for p in cell] == ["triton", "triton"]
    assert cell[0].us == pytest.approx(41.5)
    with pytest.raises(RuntimeError, match="^ncu profiled no kernel of the triton peer's qwen3 fp8-block128 M=8 "):
        profile_ncu.profile_cell("/x/ncu", "qwen3", "fp8-block128", 8, "triton")


def test_with_a_peer_each_cell_takes_ours_then_the_peers_and_resume_skips_each_side_it_has(tmp_path, monkeypatch,
                                                                                          capsys):
    """--peer: each cell's kernels, then the peer's; --resume skips a side the file holds for the cell (ours at
    M = 8 here), not the cell; --show --gemms keeps both sides' GEMMs; a missing harness script, or a scheme the
    peer has no pair of, is one line before any GPU work."""
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    (peer_dir / "marlin_peer_bench.py").write_text("")
    monkeypatch.setattr(profile_ncu, "PEER_DIR", peer_dir)
    out = tmp_path / "out"
    out.mkdir()
    _write(out / profile_ncu.PROGRESS, [_profile("awq-w4a16", 8, "gemm1", 42.0)])
    asked = []

    def fake_cell(ncu, shape, scheme, m, peer=None):
        asked.append((m, peer))
        return [_profile(scheme, m, f"{peer} gemm1" if peer else "gemm1", 80.0)]

    monkeypatch.setattr(profile_ncu, "find_ncu", lambda: "/x/ncu")
    monkeypatch.setattr(profile_ncu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile_ncu, "profile_cell", fake_cell)
    argv = ["--schemes", "awq-w4a16", "--m", "8", "64", "--out", str(out), "--peer", "marlin", "--resume"]
    assert profile_ncu.main(argv) == 0
    assert asked == [(8, "marlin"), (64, None), (64, "marlin")]
    capsys.readouterr()
    # --show --gemms keeps both sides' GEMMs
    assert profile_ncu.main(["--show", str(out / profile_ncu.PROGRESS), "--gemms"]) == 0
    assert [line.split()[3:5] for line in capsys.readouterr().out.splitlines()[1:]] == [
        ["gemm1", "42.0"], ["marlin", "gemm1"], ["gemm1", "80.0"], ["marlin", "gemm1"]]
    # without the harness's script: one line, before any GPU work
    (peer_dir / "marlin_peer_bench.py").unlink()
    assert profile_ncu.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"profile_ncu.py: --peer marlin: no {peer_dir / 'marlin_peer_bench.py'}")
    # a scheme the peer has no pair of: one line
    (peer_dir / "marlin_peer_bench.py").write_text("")
    assert profile_ncu.main(["--schemes", "mxfp4", "--out", str(out), "--peer", "marlin"]) == 2
    assert capsys.readouterr().err.startswith("profile_ncu.py: --peer marlin: no peer scheme of the same weights")
