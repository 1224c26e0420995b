"""The tables of docs/performance.md, made from the benchmark records named in docs/bench/records.json.

Each generated block of the document sits between ``<!-- generated: NAME -->`` and
``<!-- /generated -->``; the text around the blocks is written by hand. A block names the record it
reads, the command that made it (derived from the record's cells), the machine (from the record's
environment) and the date and commit the manifest gives.

    python tools/perf_tables.py                              # print every block
    python tools/perf_tables.py --write docs/performance.md  # rewrite the blocks in place
    python tools/perf_tables.py --check docs/performance.md  # exit 1 if a block is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "docs" / "bench" / "records.json"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)


class TablesError(Exception):
    """A manifest, record or document this tool cannot read: one line for the user."""


def read_manifest(path: Path = MANIFEST) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TablesError(f"{path}: {e}") from None


def gpu_run(entry: dict, base: Path) -> tuple[dict, list[dict]]:
    """(header, rows) of one tools/bench.py record the manifest names."""
    from bench import read_run

    path = base / entry["record"]
    if not path.is_file():
        raise TablesError(f"{path}: no such record (named in {MANIFEST.name})")
    header, rows = read_run(path)
    if header is None or not rows:
        raise TablesError(f"{path}: no tools/bench.py header or rows in it")
    return header, rows


def bench_command(rows: list[dict]) -> str:
    """The tools/gpu_run.sh command that measures exactly these cells (defaults left out)."""
    from bench import DEFAULT_SHAPES, SHAPES, default_schemes, registry_schemes

    by_name = {shape.name: key for key, shape in SHAPES.items()}
    shapes = list(dict.fromkeys(by_name.get(r["shape"], r["shape"]) for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    ms = sorted({int(r["m"]) for r in rows})
    parts = ["bash tools/gpu_run.sh bench"]
    if sorted(shapes) != sorted(DEFAULT_SHAPES):
        parts.append("--shapes " + " ".join(shapes))
    if sorted(schemes) != sorted(default_schemes(registry_schemes())):
        parts.append("--schemes " + " ".join(schemes))
    if ms != [1, 8, 64, 512, 4096]:
        parts.append("--m " + " ".join(map(str, ms)))
    return " ".join(parts)


def provenance(command: str, machine: str, entry: dict) -> str:
    return (f"Command: `{command}`. Machine: {machine}. Date: {entry['date']}, code at commit "
            f"`{entry['commit']}`. Record: `docs/bench/{entry['record']}`.")


def gpu_machine(header: dict) -> str:
    env = header["env"]
    return f"{env['device']}, torch {env['torch']}, Triton {env.get('triton', '?')}"


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def gpu_layer_block(entry: dict, base: Path) -> str:
    """Per shape: µs per layer call and its % of the roofline, schemes down, M across."""
    header, rows = gpu_run(entry, base)
    out = [provenance(bench_command(rows), gpu_machine(header), entry), ""]
    ms = sorted({int(r["m"]) for r in rows})
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells = {(r["scheme"], int(r["m"])): r for r in rows if r["shape"] == shape}
        schemes = sorted({s for s, _ in cells})
        table = [[f"`{s}`"] + [f"{cells[(s, m)]['us']:.1f} ({cells[(s, m)]['pct_roofline']:.0f}%)"
                               if (s, m) in cells else "-" for m in ms] for s in schemes]
        out += [f"**{shape}**: µs per layer call (% of roofline)", "",
                md_table(["scheme"] + [f"M = {m}" for m in ms], table), ""]
    return "\n".join(out).rstrip() + "\n"


def per_byte_cells(rows: list[dict]) -> list:
    import per_byte
    from bench import registry_schemes

    return per_byte.per_byte(rows, per_byte.weight_bits(registry_schemes()), list(per_byte.DEFAULT_BASELINES))


def per_byte_block(entry: dict, base: Path) -> str:
    """The whole table's quantised schemes per byte of weights against GPTQ int4 / int8."""
    import per_byte

    header, rows = gpu_run(entry, base)
    command = f"python tools/per_byte.py docs/bench/{entry['record']} --markdown"
    return (provenance(command, gpu_machine(header) + " (the whole-layer table's run)", entry) + "\n\n"
            + per_byte.markdown(per_byte_cells(rows)) + "\n")


def tuned_block(entries: list[dict], base: Path) -> str:
    """Cells measured again after their tile tables were tuned, each beside its baseline in the
    same run; a cell in a later record replaces the same cell of an earlier one."""
    latest: dict[tuple[str, str, int], tuple] = {}
    notes = []
    for entry in entries:
        header, rows = gpu_run(entry, base)
        notes.append(f"- {provenance(bench_command(rows), gpu_machine(header), entry)}")
        for c in per_byte_cells(rows):
            latest[(c.shape, c.scheme, c.m)] = (c, entry["record"])
    table = [[f"`{c.scheme}`", c.shape, str(c.m), f"{c.us:.1f}", f"`{c.baseline}` {c.baseline_us:.1f}",
              f"{c.ratio:.2f}", f"`{record}`"] for (c, record) in (latest[k] for k in sorted(latest))]
    return (md_table(["scheme", "shape", "M", "µs", "baseline µs", "per byte", "record"], table) + "\n\n"
            + "\n".join(notes) + "\n")


def json_record(entry: dict, base: Path) -> dict:
    """The JSON record a manifest entry names."""
    path = base / entry["record"]
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TablesError(f"{path}: {e}") from None


def cpu_block(entry: dict, base: Path) -> str:
    doc = json_record(entry, base)
    shape = doc["shape"]
    kernels = ",".join(dict.fromkeys(r["kernel"] for r in doc["rows"]))
    tokens = ",".join(str(m) for m in sorted({r["tokens"] for r in doc["rows"]}))
    command = (f"python tools/bench_cpu.py --preset {entry['preset']} --tokens {tokens} --threads {doc['threads']} "
               f"--kernel {kernels} --repeats {entry['repeats']} --json")
    machine = f"{doc['machine']}, torch {doc['torch']}" + (f" ({entry['note']})" if entry.get("note") else "")
    table = [[f"`{r['scheme']}`" + (f" (+{len(r['schemes']) - 1})" if len(r["schemes"]) > 1 else ""),
              f"`{r['kernel']}`", str(r["tokens"]), f"{r['ms']:.3f}", f"{r['x_plain']:.2f}",
              f"{r['resident_over_packed']:.2f}"] for r in doc["rows"]]
    return (provenance(command, machine, entry) + "\n\n"
            + f"E = {shape['experts']}, top-{shape['top_k']}, hidden {shape['hidden']}, intermediate "
              f"{shape['intermediate']}, {shape['dtype']} activations; `x plain` is the kernel's time over a plain "
              "float32 torch layer's in the same run, `resident/packed` the bytes it holds over the checkpoint's.\n\n"
            + md_table(["scheme (+ same keys)", "kernel", "M", "ms", "x plain", "resident/packed"], table) + "\n")


def cpu_peer_block(entry: dict, base: Path) -> str:
    """A tools/bench_cpu_peer.py record: our CPU layer beside ggml's MUL_MAT_ID, and the streaming case."""
    import bench_cpu_peer

    doc = json_record(entry, base)
    command = (f"python tools/bench_cpu_peer.py PEER --threads {','.join(map(str, doc['threads']))} --tokens "
               f"{','.join(map(str, doc['tokens']))} --rounds {doc['rounds']} --repeats {doc['repeats']} --kernel "
               f"{doc['kernel']} --out docs/bench/{entry['record']}")
    machine = f"{doc['machine']}, torch {doc['torch']}" + (f" ({entry['note']})" if entry.get("note") else "")
    shape = doc["shape"]
    return (provenance(command, machine, entry) + f" PEER: {entry['peer']}.\n\n"
            + f"E = {shape['experts']}, top-{shape['top_k']}, hidden {shape['hidden']}, intermediate "
              f"{shape['intermediate']}, {shape['dtype']} activations; best of {doc['rounds']} rounds on each side, "
              "the 1-minute load average read before it in brackets; `llama.cpp / ours` above 1: ours is faster. "
              "Below: M = 1, each call routed to 8 experts no recent call touched, so every call reads its "
              "weights from memory; the floor is those bytes at the memory bandwidth measured in the same run.\n\n"
            + bench_cpu_peer.markdown(doc))


def gpu_peer_block(entry: dict, base: Path) -> str:
    """A tools/peer_record.py record: vLLM's own MoE kernels beside ours on one GPU, one run per peer."""
    import peer_record

    doc = json_record(entry, base)
    commands = "; ".join(f"`{peer_record.command(run)}` ({run['peer']})" for run in doc["runs"])
    machine = peer_record.machine(doc) + (f" ({entry['note']})" if entry.get("note") else "")
    return (f"Commands: {commands}, each one GPU call timing the peer, then tools/bench.py, on the same GPU; "
            f"then `python tools/peer_record.py RUN_DIR ... [--onto docs/bench/{entry['record']}] --out "
            f"docs/bench/{entry['record']}`. Machine: {machine}. "
            f"Date: {entry['date']}, code at commit `{entry['commit']}`. Record: `docs/bench/{entry['record']}`.\n\n"
            + peer_record.markdown(doc))


def untuned_block(entry: dict, base: Path) -> str:
    """A tools/bench_untuned.py record: the tiles the kernel picks on shapes nobody tuned, beside tuned ones."""
    import bench_untuned

    path = base / entry["record"]
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise TablesError(f"{path}: {e}") from None
    if not rows:
        raise TablesError(f"{path}: no tools/bench_untuned.py rows in it")

    def listed(key: str) -> str:
        return " ".join(str(v) for v in dict.fromkeys(r[key] for r in rows))

    command = (f"python tools/bench_untuned.py --shapes {listed('shape')} --schemes {listed('scheme')} --m "
               f"{' '.join(map(str, sorted({r['m'] for r in rows})))} --tuned TUNED_DIR")
    return (provenance(command, entry["machine"], entry) + f" TUNED_DIR: `{entry['tuned']}`.\n\n"
            + "Each cell times the layer (both GEMMs) under each tile choice in alternation: the hand-written "
              "`defaults`; the tiles tuned for the nearest tuned shape of the same scheme (rows an expert sees, "
              "then K and N) on this GPU's tables, split-K redone; and, where tools/tune.py tuned this very shape, "
              "its entry. `runs` names the choice whose tiles this code picks there (a shape nobody tuned takes "
              "the nearest tuned shape's from half a row an expert up, the defaults below), with its speed as a "
              "share of the fastest choice measured at the cell. Every choice's output was within the scheme's "
              "tolerance of the float32 reference first.\n\n"
            + bench_untuned.markdown(rows) + "\n")


# manifest key -> generated block of a tools/bench_model.py record
WHOLE_MODEL_BLOCKS = {"gpu_whole": "gpu-whole-model", "gpu_whole_deep": "gpu-whole-model-deep",
                      "gpu_whole_profile": "gpu-whole-model-profile", "gpu_whole_modes": "gpu-whole-model-modes",
                      "gpu_whole_prefill": "gpu-whole-model-prefill", "cpu_whole": "cpu-whole-model",
                      "cpu_whole_tiny": "cpu-whole-model-tiny"}


def whole_model_block(entry: dict, base: Path) -> str:
    """A tools/bench_model.py record: the registry's whole model beside transformers' own, per format."""
    import bench_model

    path = base / entry["record"]
    if not path.is_file():
        raise TablesError(f"{path}: no such record (named in {MANIFEST.name})")
    header, lines = bench_model.read_record(path)
    if not header or not lines:
        raise TablesError(f"{path}: no tools/bench_model.py header or lines in it")
    env = header["env"]
    formats = list(dict.fromkeys(line["format"] for line in lines))
    machine = (f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, Triton {env['triton']}, "
               f"compressed-tensors {'installed' if env['compressed_tensors'] else 'not installed'}"
               + (f", {env['threads']} threads" if env.get("threads") else "")
               + "".join(f", Hub kernel {name} from {source}" for name, source in env.get("hub_kernels", {}).items())
               + (f" ({entry['note']})" if entry.get("note") else ""))
    return (provenance(bench_model.command(header["settings"], formats), machine, entry) + "\n\n"
            + bench_model.markdown(path))


def blocks(manifest: dict, base: Path) -> dict[str, str]:
    """Every generated block's body, by name (a whole-model block once the manifest names its record)."""
    out = {
        "gpu-layer": gpu_layer_block(manifest["gpu_layer"], base),
        "per-byte": per_byte_block(manifest["gpu_layer"], base),
        "tuned": tuned_block(manifest["gpu_tuned"], base),
        "cpu-layer": cpu_block(manifest["cpu_layer"], base),
    }
    if "cpu_peer" in manifest:
        out["cpu-peer"] = cpu_peer_block(manifest["cpu_peer"], base)
    if "gpu_peer" in manifest:
        out["gpu-peer"] = gpu_peer_block(manifest["gpu_peer"], base)
    if "gpu_untuned" in manifest:
        out["gpu-untuned-shapes"] = untuned_block(manifest["gpu_untuned"], base)
    for key, name in WHOLE_MODEL_BLOCKS.items():
        if key in manifest:
            out[name] = whole_model_block(manifest[key], base)
    return out


def render(document: str, bodies: dict[str, str]) -> str:
    """The document with each generated block's body replaced; a block the tool does not make is an error."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in bodies:
            raise TablesError(f"generated block {name!r}: not one this tool makes (known: {', '.join(bodies)})")
        return match.group(1) + bodies[name] + match.group(4)

    return BLOCK.sub(body, document)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="DOC", help="rewrite DOC's generated blocks in place")
    group.add_argument("--check", type=Path, metavar="DOC", help="exit 1 if DOC's generated blocks are out of date")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    args = parser.parse_args(argv)
    try:
        bodies = blocks(read_manifest(args.manifest), args.manifest.parent)
        if args.write is None and args.check is None:
            for name, text in bodies.items():
                print(f"<!-- generated: {name} -->\n{text}<!-- /generated -->\n")
            return 0
        doc_path = args.write or args.check
        document = doc_path.read_text()
        new = render(document, bodies)
    except (TablesError, OSError, ValueError) as e:
        print(f"perf_tables.py: {e}", file=sys.stderr)
        return 2
    if args.check is not None:
        if new != document:
            print(f"{doc_path}: generated tables out of date; run python tools/perf_tables.py --write {doc_path}",
                  file=sys.stderr)
            return 1
        return 0
    doc_path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
