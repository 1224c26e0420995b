"""vLLM's own MoE kernels beside ours on one GPU: the output folders of `tools/gpu_run.sh peer` distilled into
one small record docs/performance.md's side-by-side tables are made from.

    python tools/peer_record.py RUN_DIR [RUN_DIR ...] --out docs/bench/h200-peer-vllm.json
    python tools/peer_record.py RUN_DIR --onto docs/bench/h200-peer-vllm.json --out docs/bench/h200-peer-vllm.json
    python tools/peer_record.py RUN_DIR --project 8cf9fd4 ...   # the commit whose tree the runs measured

Each run names the project commit its gpu.txt says (the harness reads it from the git data the GPU machine was
given, which can be older than the tree it ran); ``--project`` names the commit for every RUN_DIR given instead.

A RUN_DIR is what one `tools/gpu_run.sh peer triton|marlin "SCHEME_SPEC ..."` call wrote: ours/bench.jsonl (or
ours/bench.json) from tools/bench.py, gpu.txt, and the peer's output in peer.tgz (or unpacked in peer/):
times.jsonl + checks.jsonl + env.json from vLLM's Triton fused_moe_kernel, or marlin.jsonl + marlin_meta.json
from vLLM's CUDA Marlin MoE. A cell is one (peer, shape, scheme, M) both sides timed; a cell in a later RUN_DIR
(or in a RUN_DIR over the record given with --onto) replaces the same cell of an earlier one.

What each cell compares (ratio = peer time / our time; above 1, ours is faster):
  GEMMs: our two expert GEMM kernels (tools/bench.py's gemm_us per layer call: their launches replayed alone in
         a CUDA graph, the median; a run before that method, the profiler's kernel times) against the peer's two
         launches (t_gemms_us: CUDA-graph medians).
  layer: our whole layer call (us) against
         - Marlin: its two launches with vLLM's own CUDA glue and block alignment (t_layer_align_us): fair;
         - vLLM Triton: its two launches with the harness's torch glue (t_layer_us) and torch
           moe_align_block_size (t_align_us), slower than vLLM's own CUDA glue ops: this layer ratio
           overstates our lead, and only the GEMM ratio is a fair comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_lines import read_json_lines  # noqa: E402

# the peer's timing file -> the peer it holds
PEERS = {"marlin.jsonl": "Marlin", "times.jsonl": "vLLM-Triton"}
# the peer -> its argument to tools/gpu_run.sh peer
PEER_ARG = {"Marlin": "marlin", "vLLM-Triton": "triton"}
# the peers whose layer time holds vLLM's own glue, so that the layer ratio is a fair comparison
FAIR_LAYER = {"Marlin"}
# our scheme spec (tools/bench.py) -> the peer's scheme of the same weights and activations
SCHEME_PAIRS = {
    "unquantized": "bf16",
    "quark-w8a8-int8": "int8_w8a8",
    "compressed-tensors-w8a8-fp8-dynamic": "fp8_w8a8",
    "fp8-block128": "fp8_w8a8_block128",
    "gptq-w4a16": "int4_w4a16",
    "awq-w4a16": "int4_w4a16_zp",
}
# what the peer harness runs when SHAPES / MS are not set
DEFAULT_SHAPES = ["qwen3", "dsv2lite", "mixtral"]
DEFAULT_MS = [1, 8, 64, 512, 4096]
# (name, test on M) of the geo-mean buckets
BUCKETS = [("all", lambda m: True), ("decode, M <= 64", lambda m: m <= 64), ("prefill, M >= 512", lambda m: m >= 512)]


class PeerRecordError(Exception):
    """A run folder or record this tool cannot read: one line for the user."""


PEER_FILES = {*PEERS, "checks.jsonl", "env.json", "marlin_meta.json"}


def _peer_dir(run: Path, scratch: Path) -> Path:
    """The folder holding the peer's output files: run/peer/, or else run/peer.tgz's files unpacked into scratch."""
    if (run / "peer").is_dir():
        return run / "peer"
    if not (run / "peer.tgz").is_file():
        raise PeerRecordError(f"{run}: no peer/ or peer.tgz")
    with tarfile.open(run / "peer.tgz") as tar:
        for member in tar.getmembers():
            if member.isfile() and Path(member.name).name in PEER_FILES:
                (scratch / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    return scratch


def _peer_env(peer_dir: Path) -> dict:
    """vLLM's version and the peer's machine: the Triton harness's env.json or the Marlin one's meta file."""
    if (peer_dir / "env.json").is_file():
        return json.loads((peer_dir / "env.json").read_text())
    if (peer_dir / "marlin_meta.json").is_file():
        return json.loads((peer_dir / "marlin_meta.json").read_text()).get("env", {})
    return {}


def _gpu_txt(run: Path) -> dict:
    """gpu.txt's first line (name, clock, memory, driver) and its `project:` line."""
    out = {}
    if (run / "gpu.txt").is_file():
        lines = (run / "gpu.txt").read_text().splitlines()
        if lines:
            out["gpu"] = lines[0].strip()
        out.update(("project", line.split(":", 1)[1].strip()) for line in lines if line.startswith("project:"))
    return out


def read_run(run: Path) -> tuple[dict, list[dict]]:
    """(run header, cells) of one tools/gpu_run.sh peer output folder."""
    from bench import SHAPES
    from bench import read_run as read_bench

    ours_path = next((p for p in (run / "ours" / "bench.jsonl", run / "ours" / "bench.json") if p.is_file()), None)
    if ours_path is None:
        raise PeerRecordError(f"{run}: no ours/bench.jsonl or ours/bench.json")
    try:
        header, rows = read_bench(ours_path)
    except ValueError as e:
        raise PeerRecordError(str(e)) from None
    with tempfile.TemporaryDirectory() as scratch:
        peer_dir = _peer_dir(run, Path(scratch))
        timing = [name for name in PEERS if (peer_dir / name).is_file()]
        if len(timing) != 1:
            raise PeerRecordError(f"{run}: the peer's output holds {' and '.join(timing) or 'no'} timing file "
                                  f"(wanted one of {', '.join(PEERS)})")
        peer = PEERS[timing[0]]
        records = read_json_lines(peer_dir / timing[0])
        if (peer_dir / "checks.jsonl").is_file():
            records += read_json_lines(peer_dir / "checks.jsonl")
        peer_env = _peer_env(peer_dir)
    times, checks = {}, {}
    for r in records:
        key = (r.get("shape"), r.get("scheme"), int(r.get("M", -1)))
        if r.get("kind") == "time" and "t_gemms_us" in r:
            times[key] = r
        elif r.get("kind") == "check":
            checks[key] = r
    cells = []
    for row in rows:
        peer_scheme = SCHEME_PAIRS.get(row["scheme"])
        key = (row["shape"].lower(), peer_scheme, int(row["m"]))
        if peer_scheme is None or key not in times:
            continue
        t = times[key]
        # Marlin times vLLM's glue and alignment together; the Triton harness times them apart
        peer_layer = t["t_layer_align_us"] if "t_layer_align_us" in t else t["t_layer_us"] + t["t_align_us"]
        cell = {"peer": peer, "shape": row["shape"], "scheme": row["scheme"], "peer_scheme": peer_scheme,
                "m": int(row["m"]), "ours_gemm_us": round(row["gemm_us"], 3), "peer_gemm_us": round(t["t_gemms_us"], 3),
                "ours_layer_us": round(row["us"], 3), "peer_layer_us": round(peer_layer, 3),
                "ours_rel_error": float(f"{row['rel_error']:.4g}")}
        # our share of tools/bench.py's roofline (the bytes our layer moves, or its flops), where the row has it
        for ours, field in (("ours_gemm_roofline_pct", "gemm_pct_roofline"),
                            ("ours_layer_roofline_pct", "pct_roofline")):
            if field in row:
                cell[ours] = round(row[field], 1)
        # each GEMM alone on both sides, where both timed them (which of the two holds a cell back); then our
        # GEMMs are the sum of the two, as the peer's t_gemms_us is its t_g1_us + t_g2_us (tools/bench.py times our
        # two in one graph after each alone, on a GPU those bursts left warmer: up to 10% more than the sum on an
        # H200's Mixtral FP8 and bf16 prefill)
        if row.get("gemm1_us") is not None and "t_g1_us" in t:
            cell.update(ours_gemm1_us=round(row["gemm1_us"], 3), ours_gemm2_us=round(row["gemm2_us"], 3),
                        peer_gemm1_us=round(t["t_g1_us"], 3), peer_gemm2_us=round(t["t_g2_us"], 3))
            cell["ours_gemm_us"] = round(row["gemm1_us"] + row["gemm2_us"], 3)
            if "gemm_roofline_us" in row:
                cell["ours_gemm_roofline_pct"] = round(100 * row["gemm_roofline_us"] / cell["ours_gemm_us"], 1)
        if "config_src" in t:  # the Triton peer: vLLM's tuned table for this device and shape, or its default
            cell["peer_config"] = "tuned" if t["config_src"].startswith("tuned") else "default"
        if key in checks:
            cell.update(peer_rel_error=float(f"{checks[key]['rel_err']:.4g}"), peer_check_ok=bool(checks[key]["ok"]))
        cells.append(cell)
    env = header["env"]
    by_name = {shape.name: key for key, shape in SHAPES.items()}
    run_header = {"peer": peer, "device": env["device"], "torch": env["torch"], "triton": env.get("triton"),
                  "vllm": peer_env.get("vllm_version"), "vllm_commit": peer_env.get("vllm_commit"),
                  "shapes": list(dict.fromkeys(by_name.get(c["shape"], c["shape"]) for c in cells)),
                  "schemes": list(dict.fromkeys(c["scheme"] for c in cells)),
                  "ms": sorted({c["m"] for c in cells}), **_gpu_txt(run)}
    return run_header, cells


def distil(runs: list[Path], onto: dict | None = None, project: str | None = None) -> dict:
    """The record of one or more run folders: a header per run and every cell both sides timed, each cell
    naming its run (``run``: its index in ``runs``). ``onto``: an earlier record whose cells the runs' replace
    and whose other cells stay; a run left with no cell goes, and each run's shapes, schemes and Ms are those of
    its cells, so that its command measures what the record holds of it (and no more, where they make a grid).
    ``project``: the commit the runs measured, over their gpu.txt's."""
    from bench import SHAPES

    headers, cells = [], {}
    if onto is not None:
        headers = [dict(h) for h in onto["runs"]]
        for c in onto["cells"]:
            cells[(c["peer"], c["shape"], c["scheme"], c["m"])] = {"run": _run_of(c, headers), **c}
    for run in runs:
        header, run_cells = read_run(run)
        headers.append(header if project is None else {**header, "project": project})
        for c in run_cells:
            cells[(c["peer"], c["shape"], c["scheme"], c["m"])] = {**c, "run": len(headers) - 1}
    if not cells:
        raise PeerRecordError(f"{', '.join(map(str, runs))}: no cell timed by both ours and the peer")
    kept = sorted({c["run"] for c in cells.values()})
    index = {old: new for new, old in enumerate(kept)}
    out_cells = [{**c, "run": index[c["run"]]} for c in cells.values()]
    by_name = {shape.name: key for key, shape in SHAPES.items()}
    out_runs = []
    for old in kept:
        own = [c for c in cells.values() if c["run"] == old]
        shapes = {by_name.get(c["shape"], c["shape"]) for c in own}
        schemes = {c["scheme"] for c in own}
        out_runs.append({**headers[old], "shapes": [s for s in headers[old]["shapes"] if s in shapes],
                         "schemes": [s for s in headers[old]["schemes"] if s in schemes],
                         "ms": sorted({c["m"] for c in own})})
    return {"tool": "tools/peer_record.py", "runs": out_runs, "cells": out_cells}


def _run_of(cell: dict, headers: list[dict]) -> int:
    """The index of the run an earlier record's cell came from: its own ``run``, or (records that do not
    name it) the first run of its peer that measured its M and scheme."""
    if "run" in cell:
        return cell["run"]
    for i, h in enumerate(headers):
        if h["peer"] == cell["peer"] and cell["m"] in h["ms"] and cell["scheme"] in h["schemes"]:
            return i
    raise PeerRecordError(f"a cell of the earlier record ({cell['peer']}, {cell['shape']}, {cell['scheme']}, "
                          f"M = {cell['m']}) belongs to none of its runs")


def command(run: dict) -> str:
    """The tools/gpu_run.sh call that measures one run's cells (the harness's default shapes and Ms left out)."""
    env = []
    if sorted(run["shapes"]) != sorted(DEFAULT_SHAPES):
        env.append(f'SHAPES="{" ".join(run["shapes"])}"')
    if run["ms"] != DEFAULT_MS:
        env.append(f'MS="{" ".join(map(str, run["ms"]))}"')
    return " ".join([*env, "bash tools/gpu_run.sh peer", PEER_ARG[run["peer"]], f'"{" ".join(run["schemes"])}"'])


def machine(doc: dict) -> str:
    """The machine and software of the runs, once per distinct combination."""
    seen = {}
    for r in doc["runs"]:
        text = (f"{r.get('gpu') or r['device']}, torch {r['torch']}, Triton {r['triton']}, vLLM {r['vllm']}"
                + (f" ({r['vllm_commit']})" if r.get("vllm_commit") else ""))
        seen.setdefault(text, []).append(r["peer"])
    if len(seen) == 1:
        return next(iter(seen))
    return "; ".join(f"{text} ({', '.join(peers)})" for text, peers in seen.items())


def gemm_ratio(cell: dict) -> float:
    return cell["peer_gemm_us"] / cell["ours_gemm_us"]


def layer_ratio(cell: dict) -> float:
    return cell["peer_layer_us"] / cell["ours_layer_us"]


def geo_mean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def summary(doc: dict) -> list[dict]:
    """Geo-means per peer x scheme (and every scheme of the peer, where it has several) x bucket of M."""
    out = []
    peers = list(dict.fromkeys(c["peer"] for c in doc["cells"]))
    for peer in peers:
        mine = [c for c in doc["cells"] if c["peer"] == peer]
        schemes = list(dict.fromkeys(c["scheme"] for c in mine))
        for scheme in schemes + (["all schemes"] if len(schemes) > 1 else []):
            for bucket, wanted in BUCKETS:
                sel = [c for c in mine if scheme in ("all schemes", c["scheme"]) and wanted(c["m"])]
                if sel:
                    out.append({"peer": peer, "scheme": scheme, "bucket": bucket, "cells": len(sel),
                                "gemm": geo_mean([gemm_ratio(c) for c in sel]),
                                "layer": geo_mean([layer_ratio(c) for c in sel]),
                                "gemm_below_1": sum(gemm_ratio(c) < 1 for c in sel),
                                "layer_below_1": sum(layer_ratio(c) < 1 for c in sel)})
    return out


def _layer(peer: str, text: str) -> str:
    """A layer figure, in brackets where the peer's layer time is not a fair comparison."""
    return text if peer in FAIR_LAYER else f"({text})"


def _with_pct(us: float, pct: float | None) -> str:
    return f"{us:.1f}" + (f" ({pct:.0f}%)" if pct is not None else "")


def markdown(doc: dict) -> str:
    """The geo-mean table, which ratio is fair for which peer, and the per-cell table."""
    lines = ["| peer | scheme | M | cells | GEMM ratio | layer ratio | GEMM cells < 1 | layer cells < 1 |",
             "|" + " --- |" * 8]
    for s in summary(doc):
        scheme = s["scheme"] if s["scheme"] == "all schemes" else f"`{s['scheme']}`"
        lines.append(f"| {s['peer']} | {scheme} | {s['bucket']} | {s['cells']} | {s['gemm']:.2f} "
                     f"| {_layer(s['peer'], format(s['layer'], '.2f'))} | {s['gemm_below_1']} "
                     f"| {_layer(s['peer'], str(s['layer_below_1']))} |")
    # our share of tools/bench.py's roofline beside our times, where the record has it
    pct = " (% of roofline)" if any("ours_gemm_roofline_pct" in c for c in doc["cells"]) else ""
    lines += ["", "Ratio = peer time / our time (geo-mean over the cells): above 1, ours is faster. The GEMM ratio "
              "compares the two expert GEMM launches on each side (our GEMM1 also applies the gated activation to "
              "its output, which both peers run as a torch launch of its own outside their GEMM time). The layer "
              "ratio is fair for Marlin, whose layer time holds vLLM's own CUDA glue and block alignment; for "
              "vLLM-Triton it is in brackets: the harness runs vLLM's two Triton launches with torch glue and a "
              "torch moe_align_block_size, slower than vLLM's own CUDA ops, so only its GEMM ratio is a fair "
              "comparison. The peer's check is its own output's relative error against its own reference; its tiles "
              "are vLLM's tuned table for this device and shape, or vLLM's default configuration where it has none. "
              "GEMM1 / GEMM2: the ratio of each GEMM timed alone, where both sides timed each (our GEMMs are then "
              "the two alone summed, as the peer's are).", ""]
    if pct:
        lines += ["Our times carry their share of tools/bench.py's roofline (the bytes of the weights and rows the "
                  "layer moves at the GPU's measured copy bandwidth, or its flops at the peak, whichever is "
                  "longer).", ""]
    lines += [f"| peer | shape | scheme | M | ours GEMMs µs{pct} | peer GEMMs µs | GEMM ratio | GEMM1 / GEMM2 "
              f"| ours layer µs{pct} | peer layer µs | layer ratio | ours rel err | peer check | peer tiles |",
              "|" + " --- |" * 14]
    order = {key: {v: i for i, v in enumerate(dict.fromkeys(c[key] for c in doc["cells"]))}
             for key in ("peer", "scheme", "shape")}
    for c in sorted(doc["cells"], key=lambda c: (order["peer"][c["peer"]], order["scheme"][c["scheme"]],
                                                  order["shape"][c["shape"]], c["m"])):
        check = "-" if "peer_rel_error" not in c else (
            f"{c['peer_rel_error']:.1e}" + ("" if c["peer_check_ok"] else " (failed)"))
        lines.append(f"| {c['peer']} | {c['shape']} | `{c['scheme']}` | {c['m']} "
                     f"| {_with_pct(c['ours_gemm_us'], c.get('ours_gemm_roofline_pct'))} "
                     f"| {c['peer_gemm_us']:.1f} | {gemm_ratio(c):.2f} | {_each_gemm(c)} "
                     f"| {_with_pct(c['ours_layer_us'], c.get('ours_layer_roofline_pct'))} "
                     f"| {_layer(c['peer'], format(c['peer_layer_us'], '.1f'))} "
                     f"| {_layer(c['peer'], format(layer_ratio(c), '.2f'))} | {c['ours_rel_error']:.1e} | {check} "
                     f"| {c.get('peer_config', '-')} |")
    return "\n".join(lines) + "\n"


def _each_gemm(cell: dict) -> str:
    """Peer time / our time of GEMM1 and of GEMM2, each timed alone, or "-" where a side did not time each."""
    if "ours_gemm1_us" not in cell:
        return "-"
    return (f"{cell['peer_gemm1_us'] / cell['ours_gemm1_us']:.2f} / "
            f"{cell['peer_gemm2_us'] / cell['ours_gemm2_us']:.2f}")


def dumps(doc: dict) -> str:
    """The record as JSON text, one cell a line."""
    head = json.dumps({k: v for k, v in doc.items() if k != "cells"}, indent=1)[:-2]
    cells = ",\n".join("  " + json.dumps(c) for c in doc["cells"])
    return f'{head},\n "cells": [\n{cells}\n ]\n}}\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, help="write the record here (else print it)")
    parser.add_argument("--onto", type=Path, metavar="RECORD",
                        help="an earlier record: its cells stay where the runs did not time them again")
    parser.add_argument("--project", metavar="COMMIT",
                        help="the project commit the runs measured (else each run's gpu.txt says)")
    args = parser.parse_args(argv)
    try:
        onto = json.loads(args.onto.read_text()) if args.onto else None
        doc = distil(args.runs, onto, args.project)
    except (PeerRecordError, OSError, ValueError, KeyError, tarfile.TarError) as e:
        print(f"peer_record.py: {e}", file=sys.stderr)
        return 2
    text = dumps(doc)
    if args.out is None:
        print(text, end="")
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}: {len(doc['cells'])} cells from {len(doc['runs'])} runs\n")
    print(markdown(doc), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
