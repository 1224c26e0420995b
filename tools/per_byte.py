"""Per byte of weights: each quantised scheme's whole-layer bytes moved per µs in one tools/bench.py
run, over those of the baseline scheme of its weight width in the same run, cell by cell (the
measure that no weight format may run slower per byte than the int4 / int8 paths at decode). Below 1
is slower per byte than the baseline.

    python tools/per_byte.py docs/bench/h100-layer.jsonl
    python tools/per_byte.py docs/bench/h100-layer.jsonl --markdown   # the table docs/performance.md shows
    python tools/per_byte.py out/ --baselines gptq-w4a16 gptq-w8a16 --below 0.95
    python tools/per_byte.py out/bench.json --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_BASELINES = ("gptq-w4a16", "gptq-w8a16")


@dataclass(frozen=True)
class Cell:
    shape: str
    scheme: str
    m: int
    baseline: str
    ratio: float  # (bytes / µs) / (the baseline's bytes / µs)
    us: float
    baseline_us: float


class PerByteError(Exception):
    """A run or a baseline this tool cannot compare: one line for the user."""


def load_rows(path: Path) -> list[dict]:
    """The rows of a tools/bench.py run: its --out directory, its bench.jsonl or its bench.json."""
    from bench import read_progress, read_run

    try:
        if path.is_dir():
            header, rows = read_progress(path)
            if header is None and not rows:
                raise PerByteError(f"{path}: no bench.jsonl or bench.json in it")
            return rows
        if not path.is_file():
            raise PerByteError(f"{path}: no such file or directory")
        return read_run(path)[1]
    except ValueError as e:
        raise PerByteError(str(e)) from None


def weight_bits(schemes: dict) -> dict[str, int]:
    """Each quantised scheme spec's weight width in bits, by name (16-bit weights left out)."""
    from moe_registry.core.keys import parse_quant_key

    bits = {}
    for name, scheme in schemes.items():
        key = parse_quant_key(scheme.weight)
        if key.quantized:
            bits[name] = key.dtype.bits
    return bits


def baselines_by_width(baselines: list[str], bits: dict[str, int]) -> dict[int, str]:
    """Weight width in bits -> the first of ``baselines`` of that width (each a quantised scheme spec)."""
    by_width: dict[int, str] = {}
    for name in baselines:
        if name not in bits:
            raise PerByteError(f"baseline {name!r}: not a quantised scheme spec the benchmark runs")
        by_width.setdefault(bits[name], name)
    return by_width


def by_cell(rows: list[dict]) -> dict[tuple[str, str, int], dict]:
    """A run's rows by cell: (shape, scheme, M)."""
    return {(r["shape"], r["scheme"], int(r["m"])): r for r in rows}


def bytes_per_us_ratio(moved: float, us: float, base_moved: float, base_us: float) -> float:
    """Bytes per µs over the baseline's (below 1: slower per byte)."""
    return (moved / us) / (base_moved / base_us)


def per_byte(rows: list[dict], bits: dict[str, int], baselines: list[str]) -> list[Cell]:
    """Every quantised scheme's cells against the baseline of its width measured at the same shape and M."""
    by_width = baselines_by_width(baselines, bits)
    measured = by_cell(rows)
    in_run = {scheme for _, scheme, _ in measured}
    widths = {bits[scheme] for scheme in in_run if scheme in bits}
    missing = sorted(name for width, name in by_width.items() if width in widths and name not in in_run)
    if missing:
        raise PerByteError(f"baseline {missing[0]!r} is not in this run; measure it in the same run")
    cells = []
    for (shape, scheme, m), row in sorted(measured.items()):
        base_name = by_width.get(bits.get(scheme, 0))
        if base_name is None or base_name == scheme or (shape, base_name, m) not in measured:
            continue
        base = measured[(shape, base_name, m)]
        ratio = bytes_per_us_ratio(row["bytes_moved"], row["us"], base["bytes_moved"], base["us"])
        cells.append(Cell(shape, scheme, m, base_name, ratio, row["us"], base["us"]))
    return cells


def table(cells: list[Cell]) -> str:
    """Schemes down, shapes across, each entry the ratios at the run's M values (M1/M8/...)."""
    shapes = list(dict.fromkeys(c.shape for c in cells))
    ms = sorted({c.m for c in cells})
    ratio = {(c.scheme, c.shape, c.m): c.ratio for c in cells}
    schemes = sorted({c.scheme for c in cells})
    width = max([len(s) for s in schemes] + [6]) + 2
    heads = [f"{s} M{'/'.join(map(str, ms))}" for s in shapes]
    cols = [max(len(h), 5 * len(ms)) + 2 for h in heads]
    lines = ["scheme".ljust(width) + "".join(h.rjust(w) for h, w in zip(heads, cols, strict=True))]
    for scheme in schemes:
        entries = ["/".join(f"{ratio[(scheme, shape, m)]:.2f}" if (scheme, shape, m) in ratio else "-" for m in ms)
                   for shape in shapes]
        lines.append(scheme.ljust(width) + "".join(e.rjust(w) for e, w in zip(entries, cols, strict=True)))
    return "\n".join(lines)


def markdown(cells: list[Cell]) -> str:
    """The same ratios in Markdown, one table per shape: schemes down, M across."""
    ms = sorted({c.m for c in cells})
    ratio = {(c.scheme, c.shape, c.m): c.ratio for c in cells}
    baseline = {c.scheme: c.baseline for c in cells}
    head = ["scheme", "against"] + [f"M = {m}" for m in ms]
    out = []
    for shape in dict.fromkeys(c.shape for c in cells):
        out += [f"**{shape}**", "", "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
        for scheme in sorted({c.scheme for c in cells if c.shape == shape}):
            entries = [f"{ratio[(scheme, shape, m)]:.2f}" if (scheme, shape, m) in ratio else "-" for m in ms]
            out.append("| " + " | ".join([f"`{scheme}`", f"`{baseline[scheme]}`", *entries]) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a tools/bench.py --out directory, bench.jsonl or bench.json")
    parser.add_argument("--baselines", nargs="+", default=list(DEFAULT_BASELINES), metavar="SCHEME",
                        help="one scheme per weight width, compared against (default: %(default)s)")
    parser.add_argument("--below", type=float, default=None, metavar="RATIO",
                        help="also list the cells below this ratio, with their times")
    parser.add_argument("--json", action="store_true", help="the cells as JSON")
    parser.add_argument("--markdown", action="store_true", help="the table in Markdown (docs/performance.md)")
    args = parser.parse_args(argv)
    from bench import registry_schemes

    try:
        cells = per_byte(load_rows(args.run), weight_bits(registry_schemes()), args.baselines)
    except PerByteError as e:
        print(f"per_byte.py: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(c) for c in cells], indent=1))
        return 0
    print(markdown(cells) if args.markdown else table(cells))
    if args.below is not None:
        low = [c for c in cells if c.ratio < args.below]
        print(f"\n{len(low)} cells below {args.below}:")
        for c in low:
            print(f"  {c.scheme:<36}{c.shape:<18}M={c.m:<5}{c.ratio:.3f}  {c.us:.1f} us against {c.baseline} "
                  f"{c.baseline_us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
