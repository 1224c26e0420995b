"""tools/bench_cpu_peer.py without llama.cpp: ggml's benchmark stood in for by a script printing its lines (the
layer is 2 x gate/up + down, per type, per token count; repacked types and the others in their own runs), a
missing binary refused in one line, and the ratio table keeping each side's best round with its load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_cpu_peer  # noqa: E402

LINE = ("  MUL_MAT_ID(type_a={t},type_b=f32,n_mats=128,n_used=8,b={b},m={m},n={n},k={k},amax=1.000000,m_v=0):"
        "     636 runs -  {us} us/run -  25.17 MFLOP/run -  10.50 GFLOPS")


def fake_peer(tmp_path: Path) -> Path:
    """A test-backend-ops that prints, per type asked, gate/up and down lines for M = 1 and 16, and logs its env."""
    lines = []
    for t, base in (("q4_0", 100), ("q4_K", 200), ("q8_0", 300)):
        for n in (1, 16):
            lines.append(LINE.format(t=t, b=1, m=768, n=n, k=2048, us=base * n))
            lines.append(LINE.format(t=t, b=0, m=2048, n=n, k=768, us=base * n // 2))
    script = tmp_path / "test-backend-ops"
    body = "\n".join(f"echo '{line}' | grep -E \"type_a=($TYPES),\"" for line in lines)
    script.write_text("#!/bin/sh\nTYPES=$(echo \"$7\" | sed -E 's/type_a=\\(([^)]*)\\).*/\\1/')\n"
                      f"echo \"$TYPES repack=${{TBO_REPACK:-0}} threads=$TBO_THREADS\" >> {tmp_path}/calls\n"
                      f"{body}\nexit 0\n")
    script.chmod(0o755)
    return tmp_path


def test_peer_layers_sum_two_gate_up_ops_and_one_down(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path)
    got = bench_cpu_peer.peer_layers(peer, 2, ["q4_0", "q4_K", "q8_0"])
    assert got == {("q4_0", 1): 0.25, ("q4_0", 16): 4.0, ("q4_K", 1): 0.5, ("q4_K", 16): 8.0,
                   ("q8_0", 1): 0.75, ("q8_0", 16): 12.0}
    assert (peer / "calls").read_text().splitlines() == ["q4_0|q4_K repack=1 threads=2", "q8_0 repack=0 threads=2"]


def test_a_missing_benchmark_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(bench_cpu_peer.PeerError, match=r"test-backend-ops: no such file; wanted the folder where"):
        bench_cpu_peer.peer_layers(tmp_path, 1, ["q4_0"])


def test_the_table_keeps_each_sides_best_round_with_its_load() -> None:
    def cell(r: int, ours: float, peer: float) -> dict:
        return {"round": r, "threads": 2, "tokens": 1, "pair": "int4 g128 sym", "kernel": "k", "ours_ms": ours,
                "ours_load": 1.0 + r, "peer_type": "q4_0", "peer_ms": peer, "peer_load": 5.0 + r}

    doc = {"cells": [cell(0, 2.0, 1.0), cell(1, 1.0, 3.0)], "streaming": [
        {"threads": 2, "pair": "int4 g128 sym", "kernel": "k", "ms": 2.0, "load": 0.5, "bytes_per_call": 2**21,
         "bandwidth_gbs": 2.0, "floor_ms": 1.0}]}
    text = bench_cpu_peer.markdown(doc)
    assert "| 2 | 1 | int4 g128 sym | Q4_0 | 1.00 (2.0) | 1.00 (5.0) | 1.00 |" in text
    assert "| 2 | 1 | int4 g128 sym (k) | Q4_0 |" in bench_cpu_peer.markdown({**doc, "kernel": "other"})
    assert "| 2 | int4 g128 sym | 2.00 (0.5) | 2.0 MiB | 2.0 GB/s | 1.00 | 0.50 |" in text


def test_a_type_two_pairs_share_is_asked_of_ggml_once(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path)
    bench_cpu_peer.peer_layers(peer, 1, [p.peer for p in bench_cpu_peer.chosen_pairs("int4 g128 sym,NVFP4,int8")])
    assert (peer / "calls").read_text().splitlines() == ["q4_0 repack=1 threads=1", "q8_0 repack=0 threads=1"]


def test_pairs_are_chosen_by_the_starts_of_their_labels() -> None:
    assert [p.label for p in bench_cpu_peer.chosen_pairs("int8,MXFP4")] == ["int8 g128", "MXFP4"]
    assert [(p.peer, p.kernel) for p in bench_cpu_peer.chosen_pairs("NVFP4,FP8")] == [
        ("q4_0", None), ("q8_0", None), ("q8_0", None)]
    with pytest.raises(bench_cpu_peer.PeerError, match=r"--pairs 'int8,fp5': no pair label starts with fp5; labels: "
                                                       r"int4 g128 sym, "):
        bench_cpu_peer.chosen_pairs("int8,fp5")
