"""tools/perf_tables.py: docs/performance.md's tables are the records' numbers, regenerated, never typed."""

from __future__ import annotations

import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"


@pytest.fixture
def perf_tables(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    # every tool module that holds tools/bench.py goes with it: a tune module kept would time with the bench module
    # dropped here, where a later test patches the new one's timer (tools/bench_untuned.py imports tune)
    for name in ("perf_tables", "per_byte", "bench", "peer_record", "tune", "bench_untuned"):
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
    keyed = (*perf_tables.WHOLE_MODEL_BLOCKS, "cpu_peer", "gpu_peer", "gpu_untuned")
    named |= {manifest[key]["record"] for key in keyed if key in manifest}
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
        "cpu-layer, cpu-peer, gpu-peer, gpu-untuned-shapes, gpu-whole-model, gpu-whole-model-deep, "
        "gpu-whole-model-profile, gpu-whole-model-modes, gpu-whole-model-prefill, cpu-whole-model, "
        "cpu-whole-model-tiny)")
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


def test_the_vllm_record_gives_the_ratios_the_peer_harness_printed(perf_tables):
    """Cells and geo-means of the committed side-by-side record, against the harness's own ratios.md of the same
    runs (peer time / our time: GEMMs, then layer); where our run timed each GEMM alone, our GEMMs are the sum of
    the two (the harness's ratios.md set the peer's sum against our two timed in one graph)."""
    import peer_record

    doc = perf_tables.json_record(perf_tables.read_manifest()["gpu_peer"], ROOT / "docs" / "bench")
    cells = {(c["peer"], c["shape"], c["scheme"], c["m"]): c for c in doc["cells"]}
    expected = {# 24.7 / (12.3 + 6.7); the harness printed 1.27 against the two in one graph (19.4)
                ("Marlin", "DeepSeek-V2-Lite", "gptq-w4a16", 1): ("1.30", "1.80"),
                # 199.6 / (157.2 + 105.0); the harness printed 0.76 against the two in one graph (261.8)
                ("Marlin", "Mixtral-8x7B", "awq-w4a16", 8): ("0.76", "0.81"),
                ("Marlin", "Mixtral-8x7B", "awq-w4a16", 512): ("1.05", "1.08"),
                # 668.5 / (241.4 + 174.8) and 748.2 / (427.8 + 237.6); the harness printed 1.58 and 1.11 (422.0
                # and 672.3 in one graph, timed after each alone)
                ("vLLM-Triton", "Qwen3-30B-A3B", "compressed-tensors-w8a8-fp8-dynamic", 4096): ("1.61", "2.50"),
                ("vLLM-Triton", "Mixtral-8x7B", "fp8-block128", 512): ("1.12", "1.60"),
                # 2435.2 / (1526.4 + 830.0); the harness printed 0.94 (2595.0 in one graph)
                ("vLLM-Triton", "Mixtral-8x7B", "compressed-tensors-w8a8-fp8-dynamic", 4096): ("1.03", "1.73"),
                ("vLLM-Triton", "Mixtral-8x7B", "compressed-tensors-w8a8-fp8-dynamic", 64): ("1.00", "1.33"),
                # 15.4 / (11.9 + 6.3); the harness printed 0.82 against the two in one graph (18.7)
                ("vLLM-Triton", "Qwen3-30B-A3B", "compressed-tensors-w8a8-fp8-dynamic", 1): ("0.85", "2.89"),
                ("vLLM-Triton", "Mixtral-8x7B", "fp8-block128", 64): ("1.05", "1.39"),
                ("Marlin", "Qwen3-30B-A3B", "gptq-w4a16", 64): ("1.01", "1.12"),
                # 699.0 / (411.6 + 292.2); the harness printed 1.00 against the two in one graph (697.5)
                ("vLLM-Triton", "Qwen3-30B-A3B", "unquantized", 4096): ("0.99", "1.36")}
    for key, (gemm, layer) in expected.items():
        assert (f"{peer_record.gemm_ratio(cells[key]):.2f}", f"{peer_record.layer_ratio(cells[key]):.2f}") == (
            gemm, layer), key
    rows = {(s["peer"], s["scheme"], s["bucket"]): s for s in peer_record.summary(doc)}
    got = {key: (f"{rows[key]['gemm']:.2f}", f"{rows[key]['layer']:.2f}", rows[key]["gemm_below_1"],
                 rows[key]["layer_below_1"], rows[key]["cells"]) for key in rows}
    # (the harness printed 0.92 and 1.14 for AWQ's decode, 1.04 for block-128's, against our two timed in one graph;
    # 1.16 for per-channel FP8's prefill, two cells below 1)
    assert got[("Marlin", "all schemes", "decode, M <= 64")] == ("0.96", "1.16", 13, 7, 18)
    assert got[("Marlin", "awq-w4a16", "decode, M <= 64")] == ("0.92", "1.14", 7, 4, 9)
    assert got[("vLLM-Triton", "compressed-tensors-w8a8-fp8-dynamic", "prefill, M >= 512")] == ("1.20", "2.01", 1, 0, 6)
    assert got[("vLLM-Triton", "fp8-block128", "decode, M <= 64")] == ("1.05", "1.89", 4, 0, 9)
    block = perf_tables.blocks(perf_tables.read_manifest(), ROOT / "docs" / "bench")["gpu-peer"]
    assert ("| Marlin | DeepSeek-V2-Lite | `gptq-w4a16` | 1 | 19.0 (34%) | 24.7 | 1.30 | 1.15 / 1.58 | 23.1 (28%) "
            "| 41.6 | 1.80 |") in block
    # the Triton harness's layer is not vLLM's own glue: its layer figures are bracketed; each GEMM's ratio beside
    # the two's (668.5 = 368.7 + 299.8 against 241.4 + 174.8)
    assert ("| vLLM-Triton | Qwen3-30B-A3B | `compressed-tensors-w8a8-fp8-dynamic` | 4096 | 416.2 (61%) | 668.5 | "
            "1.61 | 1.53 / 1.72 | 565.3 (45%) | (1414.8) | (2.50) |") in block
    # each run's command measures the cells the record keeps of it (later runs replaced earlier runs' cells)
    assert block.startswith('Commands: `MS="512" bash tools/gpu_run.sh peer marlin "gptq-w4a16 awq-w4a16"` (Marlin); '
                            '`MS="512 4096" bash tools/gpu_run.sh peer triton "compressed-tensors-w8a8-fp8-dynamic '
                            'fp8-block128 quark-w8a8-int8 unquantized"` (vLLM-Triton); `MS="1 8 64" bash '
                            'tools/gpu_run.sh peer marlin "gptq-w4a16 awq-w4a16"` (Marlin); `MS="1 8 64" bash '
                            'tools/gpu_run.sh peer triton "compressed-tensors-w8a8-fp8-dynamic fp8-block128"` '
                            '(vLLM-Triton), each one GPU call')


def _peer_run(path: Path, files: dict[str, list[dict] | dict], rows: list[dict]) -> Path:
    """A tools/gpu_run.sh peer output folder: the peer's files in peer.tgz, ours in ours/bench.jsonl."""
    (path / "ours").mkdir(parents=True)
    header = {"env": {"device": "GPU X", "torch": "2.0", "triton": "3.0"}, "ceilings": {}}
    (path / "ours" / "bench.jsonl").write_text(
        "\n".join(json.dumps(x) for x in [header, *({"row": r} for r in rows)]) + "\n")
    (path / "gpu.txt").write_text("GPU X, 1000 MHz\ntorch 2.0\nproject: abc1234\n")
    with tarfile.open(path / "peer.tgz", "w:gz") as tar:
        for name, content in files.items():
            text = (json.dumps(content) if isinstance(content, dict)
                    else "\n".join(json.dumps(x) for x in content) + "\n").encode()
            info = tarfile.TarInfo(f"peer/{name}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    return path


def _ours(scheme: str, m: int, gemm: float, us: float) -> dict:
    return {"shape": "Qwen3-30B-A3B", "scheme": scheme, "m": m, "gemm_us": gemm, "us": us, "rel_error": 0.01}


def test_peer_record_pairs_each_peers_times_with_ours(perf_tables, tmp_path):
    import peer_record

    time = {"kind": "time", "shape": "qwen3-30b-a3b", "scheme": "fp8_w8a8", "M": 8, "t_gemms_us": 30.0,
            "t_layer_us": 50.0, "t_align_us": 10.0, "config_src": "tuned:E=128"}
    triton = _peer_run(tmp_path / "triton", {
        "times.jsonl": [time, {**time, "M": 64, "config_src": "default"}],
        "checks.jsonl": [{"kind": "check", "shape": "qwen3-30b-a3b", "scheme": "fp8_w8a8", "M": 8, "rel_err": 0.02,
                          "ok": False}],
        "env.json": {"vllm_version": "0.33.0", "vllm_commit": "gabc"}},
        # M = 512 has no peer time, unquantized no peer scheme in this run: neither is a cell
        [_ours("compressed-tensors-w8a8-fp8-dynamic", 8, 20.0, 40.0),
         _ours("compressed-tensors-w8a8-fp8-dynamic", 64, 60.0, 80.0),
         _ours("compressed-tensors-w8a8-fp8-dynamic", 512, 1.0, 1.0), _ours("unquantized", 8, 1.0, 1.0)])
    marlin = _peer_run(tmp_path / "marlin", {
        "marlin.jsonl": [{"kind": "time", "shape": "qwen3-30b-a3b", "scheme": "int4_w4a16_zp", "M": 1,
                          "t_gemms_us": 9.0, "t_g1_us": 6.0, "t_g2_us": 3.0, "t_layer_us": 11.0, "t_align_us": 2.0,
                          "t_layer_align_us": 14.0}],
        "marlin_meta.json": {"env": {"vllm_version": "0.33.0"}}},
        [{**_ours("awq-w4a16", 1, 10.0, 12.0), "gemm_pct_roofline": 47.25, "gemm_roofline_us": 4.725,
          "pct_roofline": 49.6, "gemm1_us": 7.0, "gemm2_us": 3.5}])
    doc = peer_record.distil([triton, marlin])
    cells = {(c["peer"], c["scheme"], c["m"]): c for c in doc["cells"]}
    assert sorted(cells) == [("Marlin", "awq-w4a16", 1), ("vLLM-Triton", "compressed-tensors-w8a8-fp8-dynamic", 8),
                             ("vLLM-Triton", "compressed-tensors-w8a8-fp8-dynamic", 64)]
    t8 = cells[("vLLM-Triton", "compressed-tensors-w8a8-fp8-dynamic", 8)]
    # the Triton harness times its glue and its alignment apart: the layer is both
    assert (peer_record.gemm_ratio(t8), peer_record.layer_ratio(t8)) == (1.5, 1.5)
    assert (t8["peer_rel_error"], t8["peer_check_ok"], t8["peer_config"]) == (0.02, False, "tuned")
    assert cells[("vLLM-Triton", "compressed-tensors-w8a8-fp8-dynamic", 64)]["peer_config"] == "default"
    marlin_cell = cells[("Marlin", "awq-w4a16", 1)]
    # each GEMM alone where both sides timed it (our rows from before the per-GEMM times, and the Triton times
    # above, have none); then our GEMMs are their sum, as the peer's are its two (not the 10 us our two took in
    # one graph), and our share of the roofline is of that sum
    assert [marlin_cell[k] for k in ("ours_gemm1_us", "ours_gemm2_us", "peer_gemm1_us", "peer_gemm2_us")] == [
        7.0, 3.5, 6.0, 3.0]
    assert (marlin_cell["ours_gemm_us"], marlin_cell["ours_gemm_roofline_pct"]) == (10.5, 45.0)
    assert (peer_record.gemm_ratio(marlin_cell), peer_record.layer_ratio(marlin_cell)) == (9.0 / 10.5, 14.0 / 12.0)
    assert "ours_gemm1_us" not in t8
    assert [peer_record.command(r) for r in doc["runs"]] == [
        'SHAPES="qwen3" MS="8 64" bash tools/gpu_run.sh peer triton "compressed-tensors-w8a8-fp8-dynamic"',
        'SHAPES="qwen3" MS="1" bash tools/gpu_run.sh peer marlin "awq-w4a16"']
    assert peer_record.machine(doc) == "GPU X, 1000 MHz, torch 2.0, Triton 3.0, vLLM 0.33.0 (gabc) (vLLM-Triton); " \
        "GPU X, 1000 MHz, torch 2.0, Triton 3.0, vLLM 0.33.0 (Marlin)"
    assert json.loads(peer_record.dumps(doc)) == doc
    text = peer_record.markdown(doc)
    # (no GEMM1 / GEMM2 ratios where the peer did not time each GEMM)
    assert ("| vLLM-Triton | Qwen3-30B-A3B | `compressed-tensors-w8a8-fp8-dynamic` | 8 | 20.0 | 30.0 | 1.50 | - "
            "| 40.0 | (60.0) | (1.50) | 1.0e-02 | 2.0e-02 (failed) | tuned |") in text
    # Marlin times vLLM's glue with its alignment (t_layer_align_us), and its layer figures are fair: no brackets
    # our share of the roofline beside our times, where tools/bench.py's row has it
    assert (marlin_cell["ours_gemm_roofline_pct"], marlin_cell["ours_layer_roofline_pct"]) == (45.0, 49.6)
    assert "ours_gemm_roofline_pct" not in t8
    assert ("| Marlin | Qwen3-30B-A3B | `awq-w4a16` | 1 | 10.5 (45%) | 9.0 | 0.86 | 0.86 / 0.86 | 12.0 (50%) | 14.0 "
            "| 1.17 | 1.0e-02 | - | - |") in text
    assert ("| M | ours GEMMs µs (% of roofline) | peer GEMMs µs | GEMM ratio | GEMM1 / GEMM2 "
            "| ours layer µs (% of roofline) |") in text


def _marlin_run(path: Path, times: dict[int, float]) -> Path:
    """A Marlin peer run of AWQ on Qwen3's shape: the peer's GEMM time per M, ours 10 us at every M."""
    return _peer_run(path, {
        "marlin.jsonl": [{"kind": "time", "shape": "qwen3-30b-a3b", "scheme": "int4_w4a16_zp", "M": m, "t_gemms_us": t,
                          "t_layer_us": t, "t_align_us": 0.0, "t_layer_align_us": t} for m, t in times.items()],
        "marlin_meta.json": {"env": {"vllm_version": "0.33.0"}}},
        [_ours("awq-w4a16", m, 10.0, 10.0) for m in times])


def test_a_run_in_a_record_names_only_the_shapes_and_schemes_of_the_cells_kept_of_it(perf_tables, tmp_path):
    """A later run that times again one shape of an earlier run's two and one scheme of its two leaves the earlier
    run's command naming the shape and scheme it still holds cells of, so that running it again measures no more
    than those."""
    import peer_record

    def run(path, shapes, schemes):
        names = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B"}
        peer_schemes = {"compressed-tensors-w8a8-fp8-dynamic": "fp8_w8a8", "fp8-block128": "fp8_w8a8_block128"}
        times = [{"kind": "time", "shape": shape, "scheme": peer_schemes[scheme], "M": 8, "t_gemms_us": 10.0,
                  "t_layer_us": 20.0, "t_align_us": 1.0} for shape in shapes for scheme in schemes]
        rows = [{**_ours(scheme, 8, 10.0, 20.0), "shape": names[shape]} for shape in shapes for scheme in schemes]
        return _peer_run(path, {"times.jsonl": times, "env.json": {}}, rows)

    both = ["compressed-tensors-w8a8-fp8-dynamic", "fp8-block128"]
    first = peer_record.distil([run(tmp_path / "first", ["qwen3-30b-a3b", "mixtral-8x7b"], both)])
    assert peer_record.command(first["runs"][0]) == (
        'SHAPES="qwen3 mixtral" MS="8" bash tools/gpu_run.sh peer triton '
        '"compressed-tensors-w8a8-fp8-dynamic fp8-block128"')
    # Mixtral's cells of both schemes and Qwen3's block-128 one timed again
    doc = peer_record.distil([run(tmp_path / "mixtral", ["mixtral-8x7b"], both),
                              run(tmp_path / "qwen3", ["qwen3-30b-a3b"], ["fp8-block128"])], first)
    assert [peer_record.command(r) for r in doc["runs"]] == [
        'SHAPES="qwen3" MS="8" bash tools/gpu_run.sh peer triton "compressed-tensors-w8a8-fp8-dynamic"',
        'SHAPES="mixtral" MS="8" bash tools/gpu_run.sh peer triton "compressed-tensors-w8a8-fp8-dynamic fp8-block128"',
        'SHAPES="qwen3" MS="8" bash tools/gpu_run.sh peer triton "fp8-block128"']


def test_peer_record_onto_an_earlier_one_keeps_the_cells_a_run_did_not_time_again(perf_tables, tmp_path, capsys):
    """A run over part of a record replaces its cells; the record's other cells stay, each naming its run; a run
    left with no cell goes, and each run's command measures the cells kept of it."""
    import peer_record

    first = peer_record.distil([_marlin_run(tmp_path / "first", {1: 8.0, 8: 9.0, 512: 11.0})])
    # a record made before cells named their run: each is the first run of its peer that measured its M
    unnamed = {**first, "cells": [{k: v for k, v in c.items() if k != "run"} for c in first["cells"]]}
    again = _marlin_run(tmp_path / "again", {1: 12.0, 8: 13.0})
    for onto in (first, unnamed):
        doc = peer_record.distil([again], onto)
        by_m = {c["m"]: c for c in doc["cells"]}
        assert {m: (c["peer_gemm_us"], c["run"]) for m, c in by_m.items()} == {1: (12.0, 1), 8: (13.0, 1),
                                                                                512: (11.0, 0)}
        assert [peer_record.command(r) for r in doc["runs"]] == [
            'SHAPES="qwen3" MS="512" bash tools/gpu_run.sh peer marlin "awq-w4a16"',
            'SHAPES="qwen3" MS="1 8" bash tools/gpu_run.sh peer marlin "awq-w4a16"']
    # every cell of the earlier record timed again: its run goes
    doc = peer_record.distil([_marlin_run(tmp_path / "all", {1: 7.0, 8: 7.0, 512: 7.0})], first)
    assert len(doc["runs"]) == 1 and {c["run"] for c in doc["cells"]} == {0}
    # from the command line, onto the record file
    record = tmp_path / "record.json"
    record.write_text(peer_record.dumps(first))
    assert peer_record.main([str(again), "--onto", str(record), "--out", str(record)]) == 0
    assert "3 cells from 2 runs" in capsys.readouterr().out
    # a cell of the earlier record that none of its runs measured: one line naming it
    stray = {**unnamed, "cells": [{**unnamed["cells"][0], "m": 64}]}
    record.write_text(peer_record.dumps(stray))
    assert peer_record.main([str(again), "--onto", str(record)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("peer_record.py: a cell of the earlier record (Marlin, Qwen3-30B-A3B, awq-w4a16, M = 64) belongs "
                   "to none of its runs")


def test_peer_record_names_the_commit_the_runs_measured(perf_tables, tmp_path, capsys):
    """Each run names the commit its gpu.txt says, or the one --project gives for every run of the call (the earlier
    record's runs keep theirs)."""
    import peer_record

    first = peer_record.distil([_marlin_run(tmp_path / "first", {512: 11.0})])
    assert [r["project"] for r in first["runs"]] == ["abc1234"]
    record = tmp_path / "record.json"
    record.write_text(peer_record.dumps(first))
    again = _marlin_run(tmp_path / "again", {1: 12.0})
    assert peer_record.main([str(again), "--onto", str(record), "--project", "def5678", "--out", str(record)]) == 0
    assert [r["project"] for r in json.loads(record.read_text())["runs"]] == ["abc1234", "def5678"]


def test_peer_record_without_a_shared_cell_is_one_line(perf_tables, tmp_path, capsys):
    import peer_record

    run = _peer_run(tmp_path / "run", {"times.jsonl": [{"kind": "time", "shape": "qwen3-30b-a3b", "scheme": "bf16",
                                                         "M": 1, "t_gemms_us": 1.0, "t_layer_us": 1.0,
                                                         "t_align_us": 0.0}]},
                    [_ours("awq-w4a16", 1, 1.0, 1.0)])
    assert peer_record.main([str(run), "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == f"peer_record.py: {run}: no cell timed by both ours and the peer\n"
    (run / "peer.tgz").unlink()
    assert peer_record.main([str(run)]) == 2
    assert capsys.readouterr().err == f"peer_record.py: {run}: no peer/ or peer.tgz\n"
