"""Two tools/bench.py runs, cell by cell: the cells whose whole-layer time moved by more than a
threshold from the first run to the second, each with its GEMMs' move and its weight width's
baseline's move at the same shape and M, so a change in one scheme reads apart from a faster or
slower machine. (Session 34 found AWQ's M = 4096 regression this way: its GEMMs 1.21x on
DeepSeek-V2-Lite's shape while GPTQ int4's stayed at 1.00x.)

    python tools/bench_diff.py docs/bench/issue19-s27-h100.jsonl docs/bench/issue19-s34-h100.jsonl
    python tools/bench_diff.py OLD NEW --threshold 0.1 --m 512 4096 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from per_byte import (  # noqa: E402
    DEFAULT_BASELINES,
    PerByteError,
    baselines_by_width,
    by_cell,
    load_rows,
    weight_bits,
)


@dataclass(frozen=True)
class Moved:
    """One cell measured in both runs: its times and their ratios (second run over first)."""

    shape: str
    scheme: str
    m: int
    old_us: float
    new_us: float
    ratio: float
    gemm_ratio: float | None  # the GEMMs alone, where both runs timed them
    baseline: str | None  # the scheme of its weight width the runs are checked against
    baseline_ratio: float | None


def moved(old: list[dict], new: list[dict], bits: dict[str, int], baselines: list[str],
          threshold: float) -> list[Moved]:
    """The cells of both runs whose layer time moved by more than ``threshold`` (0.05: 5%) either way."""
    before, after = by_cell(old), by_cell(new)
    common = sorted(before.keys() & after.keys())
    if not common:
        raise PerByteError("the two runs share no cell (shape, scheme and M)")
    by_width = baselines_by_width(baselines, bits)

    def ratio(key: tuple, field: str) -> float | None:
        if key not in before or key not in after or not before[key].get(field) or not after[key].get(field):
            return None
        return after[key][field] / before[key][field]

    cells = []
    for key in common:
        shape, scheme, m = key
        layer = ratio(key, "us")
        if layer is None or abs(layer - 1) <= threshold:
            continue
        base = by_width.get(bits.get(scheme, 0))
        base_ratio = ratio((shape, base, m), "us") if base is not None and base != scheme else None
        cells.append(Moved(shape, scheme, m, before[key]["us"], after[key]["us"], layer, ratio(key, "gemm_us"),
                           base if base_ratio is not None else None, base_ratio))
    return cells


def report(cells: list[Moved], threshold: float) -> str:
    """One aligned line a cell, slowest first."""
    if not cells:
        return f"no cell moved by more than {threshold:.0%}"
    lines = [f"{'shape':<18}{'scheme':<36}{'M':>5}{'first us':>11}{'second us':>11}{'layer':>8}{'GEMMs':>8}"
             f"  baseline"]
    for c in sorted(cells, key=lambda c: -c.ratio):
        gemm = f"{c.gemm_ratio:.2f}x" if c.gemm_ratio is not None else "-"
        base = f"{c.baseline} {c.baseline_ratio:.2f}x" if c.baseline is not None else "-"
        lines.append(f"{c.shape:<18}{c.scheme:<36}{c.m:>5}{c.old_us:>11.1f}{c.new_us:>11.1f}{c.ratio:>7.2f}x"
                     f"{gemm:>8}  {base}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a tools/bench.py --out directory, bench.jsonl or bench.json")
    parser.add_argument("second", type=Path, help="the run to compare with the first (same forms)")
    parser.add_argument("--threshold", type=float, default=0.05, metavar="FRACTION",
                        help="list the cells whose layer time moved by more than this (default: %(default)s)")
    parser.add_argument("--m", nargs="*", type=int, default=None, help="only these token counts")
    parser.add_argument("--baselines", nargs="+", default=list(DEFAULT_BASELINES), metavar="SCHEME",
                        help="one scheme per weight width, shown beside each cell (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="the cells as JSON")
    args = parser.parse_args(argv)
    if args.threshold < 0:
        parser.error(f"--threshold: a fraction of at least 0, got {args.threshold}")
    from bench import registry_schemes

    try:
        old, new = load_rows(args.first), load_rows(args.second)
        if args.m:
            old, new = ([r for r in rows if int(r["m"]) in args.m] for rows in (old, new))
        cells = moved(old, new, weight_bits(registry_schemes()), args.baselines, args.threshold)
    except PerByteError as e:
        print(f"bench_diff.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(c) for c in cells], indent=1) if args.json else report(cells, args.threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
