"""tools/perf_tables.py: docs/performance.md's tables are the records' numbers, regenerated, never typed."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"


@pytest.fixture
def perf_tables(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    for name in ("perf_tables", "per_byte", "bench"):
        sys.modules.pop(name, None)
    import perf_tables

    return perf_tables


def test_the_performance_page_holds_the_tables_its_records_make(perf_tables):
    assert perf_tables.main(["--check", str(DOC)]) == 0


def test_every_record_in_docs_bench_is_named_by_the_manifest(perf_tables):
    """docs/bench holds the current records only: each is read by a table."""
    manifest = perf_tables.read_manifest()
    named = {manifest["gpu_layer"]["record"], manifest["cpu_layer"]["record"]}
    named |= {e["record"] for e in manifest["gpu_tuned"]}
    named |= {manifest[key]["record"] for key in (*perf_tables.WHOLE_MODEL_BLOCKS, "cpu_peer") if key in manifest}
    present = {p.name for p in (ROOT / "docs" / "bench").iterdir()} - {"records.json"}
    assert present == named


def _copy_records(tmp_path: Path) -> Path:
    bench = tmp_path / "bench"
    shutil.copytree(ROOT / "docs" / "bench", bench)
    return bench / "records.json"


def test_a_changed_record_makes_the_page_out_of_date_and_write_brings_it_back(perf_tables, tmp_path, capsys):
    manifest = _copy_records(tmp_path)
    record = manifest.parent / json.loads(manifest.read_text())["gpu_layer"]["record"]
    lines = record.read_text().splitlines()
    row = json.loads(lines[1])
    row["row"]["us"] = 12345.6
    lines[1] = json.dumps(row)
    record.write_text("\n".join(lines) + "\n")
    doc = tmp_path / "performance.md"
    shutil.copy(DOC, doc)
    assert perf_tables.main(["--check", str(doc), "--manifest", str(manifest)]) == 1
    assert "generated tables out of date" in capsys.readouterr().err
    assert perf_tables.main(["--write", str(doc), "--manifest", str(manifest)]) == 0
    assert "12345.6" in doc.read_text()
    assert perf_tables.main(["--check", str(doc), "--manifest", str(manifest)]) == 0


def test_a_block_the_tool_does_not_make_or_a_missing_record_is_one_line(perf_tables, tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- generated: peers -->\n<!-- /generated -->\n")
    assert perf_tables.main(["--check", str(doc)]) == 2
    assert capsys.readouterr().err.strip() == (
        "perf_tables.py: generated block 'peers': not one this tool makes (known: gpu-layer, per-byte, tuned, "
        "cpu-layer, cpu-peer, gpu-whole-model, gpu-whole-model-modes, cpu-whole-model, cpu-whole-model-tiny)")
    manifest = _copy_records(tmp_path)
    (manifest.parent / "h100-layer.jsonl").unlink()
    assert perf_tables.main(["--manifest", str(manifest)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perf_tables.py: ") and err.endswith("h100-layer.jsonl: no such record (named in "
                                                               "records.json)")


def test_the_command_shown_is_the_one_that_measures_the_records_cells(perf_tables):
    rows = [{"shape": "Mixtral-8x7B", "scheme": s, "m": m} for s in ("awq-w4a16", "gptq-w4a16") for m in (512, 4096)]
    assert perf_tables.bench_command(rows) == (
        "bash tools/gpu_run.sh bench --shapes mixtral --schemes awq-w4a16 gptq-w4a16 --m 512 4096")
    import bench

    every = [{"shape": bench.SHAPES[k].name, "scheme": s, "m": m} for k in bench.DEFAULT_SHAPES
             for s in bench.default_schemes(bench.registry_schemes()) for m in (1, 8, 64, 512, 4096)]
    assert perf_tables.bench_command(every) == "bash tools/gpu_run.sh bench"


def test_per_byte_markdown_is_one_table_per_shape(perf_tables, tmp_path, capsys):
    import per_byte

    lines = [json.dumps({"env": {}, "ceilings": {}})]
    for scheme, us in (("gptq-w4a16", 10.0), ("mxfp4", 8.0)):
        lines.append(json.dumps({"row": {"shape": "S", "scheme": scheme, "m": 1, "us": us, "bytes_moved": 1.0}}))
    (tmp_path / "run.jsonl").write_text("\n".join(lines) + "\n")
    assert per_byte.main([str(tmp_path / "run.jsonl"), "--markdown"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "**S**", "", "| scheme | against | M = 1 |", "| --- | --- | --- |", "| `mxfp4` | `gptq-w4a16` | 1.25 |"]
