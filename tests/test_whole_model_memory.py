"""tools/load_memory.py: the peak memory of a load against what the loaded model keeps. Its accounting is held to
the checkpoint's own bytes, and its exit status to its limit (the figures themselves are the machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("transformers")

from make_transformers_whole import make_whole_model  # noqa: E402  (tools/, on sys.path from conftest)

TOOL = Path(__file__).resolve().parents[1] / "tools" / "load_memory.py"


def _run(path: Path, limit: float) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, str(TOOL), str(path), "--json", "--limit", str(limit)],
                          capture_output=True, text=True, timeout=600)
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_load_memory_counts_the_checkpoints_experts_and_keeps_to_its_limit(tmp_path: Path) -> None:
    path = make_whole_model("qwen3_moe", tmp_path / "m", layers=2)
    stored = load_file(str(path / "model.safetensors"))
    expert_bytes = sum(t.numel() * t.element_size() for k, t in stored.items() if ".mlp.experts." in k)
    rc, r = _run(path, 1000.0)
    assert rc == 0 and r["within_limit"]
    assert r["experts_checkpoint_bytes"] == expert_bytes
    assert r["experts_resident_bytes"] >= expert_bytes  # the kernel holds every expert (bf16 as stored, or wider)
    assert r["peak_over_packed"] == pytest.approx(r["peak_bytes"] / (expert_bytes + r["kept_other_bytes"]))
    assert 0 < r["load_s"] < 60  # the measured load's own wall time, not the child process's
    rc, r = _run(path, 1e-6)
    assert rc == 1 and not r["within_limit"]
