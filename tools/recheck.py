"""Time again the cells of one tools/bench.py run that read below a per-byte ratio, each in
alternation with its baseline at the same shape and M (tools/per_byte.py's comparison: the baseline
of its weight width). A table's cell is one sample. On an H100 a decode cell can read a few points
low in one run and level in the next: session 35's fp8-block128 on DeepSeek-V2-Lite at M = 1 read
0.91 in one table and 0.975 timed again. Each ratio keeps the run's bytes moved and takes the
medians of ``--rounds`` alternated timings at today's kernel and tile tables.

    python tools/recheck.py docs/bench/issue19-s35-h100-decode.jsonl --below 0.95
    python tools/recheck.py out/ --below 0.95 --m 1 8 --rounds 5 --json
    python tools/recheck.py out/ --dry-run     # a bench --dry-run's tiny cells, on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from per_byte import (  # noqa: E402
    DEFAULT_BASELINES,
    Cell,
    PerByteError,
    by_cell,
    bytes_per_us_ratio,
    load_rows,
    per_byte,
    weight_bits,
)


@dataclass(frozen=True)
class Rechecked:
    """A cell timed again beside its baseline: the run's ratio, and the ratio now (medians)."""

    shape: str
    scheme: str
    m: int
    baseline: str
    run_ratio: float
    ratio: float
    us: float
    baseline_us: float
    rel_error: float  # the cell's output against the reference, today's kernel


def slow_cells(rows: list[dict], bits: dict[str, int], baselines: list[str], below: float,
               ms: list[int] | None) -> list[Cell]:
    """The run's cells below ``below`` per byte (at the token counts ``ms``, where given)."""
    return [c for c in per_byte(rows, bits, baselines) if c.ratio < below and (not ms or c.m in ms)]


def shapes_by_name(dry: bool) -> dict:
    """The benchmark's shapes by the name its rows carry."""
    import bench

    return {s.name: s for s in (bench.DRY_SHAPES if dry else bench.SHAPES).values()}


def recheck(cells: list[Cell], rows: list[dict], rounds: int, dry: bool) -> list[Rechecked]:
    """Each (shape, M)'s slow cells and their baselines built as tools/tune.py layers, timed in
    alternation ``rounds`` times (one (shape, M) at a time, so only its layers hold memory)."""
    import torch
    import tune
    from bench import registry_schemes

    schemes, shapes = registry_schemes(), shapes_by_name(dry)
    measured = by_cell(rows)
    device = torch.device("cpu" if dry else "cuda")
    unknown = sorted({c.shape for c in cells} - set(shapes))
    if unknown:
        raise PerByteError(f"shape {unknown[0]!r} is not one this benchmark builds{' on a dry run' if dry else ''} "
                           f"(known: {', '.join(sorted(shapes))})")
    out = []
    for shape_name, m in dict.fromkeys((c.shape, c.m) for c in cells):
        group = [c for c in cells if (c.shape, c.m) == (shape_name, m)]
        names = list(dict.fromkeys([*(c.scheme for c in group), *(c.baseline for c in group)]))
        print(f"timing {shape_name} M={m}: {', '.join(names)}", file=sys.stderr, flush=True)
        layers = {name: tune.Layer(shapes[shape_name], schemes[name], device, dry) for name in names}
        inputs = {name: layer.inputs(m) for name, layer in layers.items()}
        errors = {c.scheme: layers[c.scheme].error((None, None), *inputs[c.scheme],
                                                   layers[c.scheme].reference(*inputs[c.scheme]))
                  for c in group}
        steps = [_step(layers[name], m, inputs[name]) for name in names]
        medians = {name: statistics.median(ts) for name, ts in zip(names, tune.alternated(steps, rounds),
                                                                    strict=True)}
        for c in group:
            ratio = bytes_per_us_ratio(measured[(shape_name, c.scheme, m)]["bytes_moved"], medians[c.scheme],
                                       measured[(shape_name, c.baseline, m)]["bytes_moved"], medians[c.baseline])
            out.append(Rechecked(shape_name, c.scheme, m, c.baseline, c.ratio, ratio, medians[c.scheme],
                                 medians[c.baseline], errors[c.scheme]))
            # each cell as its group finishes: a run cut off keeps what it timed
            print(f"  {c.scheme} {ratio:.3f} (run {c.ratio:.3f})", file=sys.stderr, flush=True)
    return out


def _step(layer, m: int, inputs: tuple):  # type: ignore[no-untyped-def]
    return lambda: layer.time((None, None), m, *inputs) * 1e6


def report(cells: list[Rechecked], below: float, rounds: int) -> str:
    """The cells as an aligned table, and how many are still below ``below``."""
    if not cells:
        return f"no cell below {below}"
    heads = ["shape", "scheme", "M", "run", "now", "us", "baseline", "us", "rel err"]
    table = [[c.shape, c.scheme, str(c.m), f"{c.run_ratio:.3f}", f"{c.ratio:.3f}", f"{c.us:.1f}", c.baseline,
              f"{c.baseline_us:.1f}", f"{c.rel_error:.2e}"] for c in cells]
    widths = [max(len(r[i]) for r in [heads, *table]) for i in range(len(heads))]
    names = {0, 1, 6}  # left-aligned columns

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(widths[i]) if i in names else v.rjust(widths[i]) for i, v in enumerate(values))

    lines = [line(r) for r in [heads, *table]]
    still = sum(c.ratio < below for c in cells)
    return "\n".join([*lines, f"\n{still} of {len(cells)} still below {below} (medians of {rounds} rounds)"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a tools/bench.py --out directory, bench.jsonl or bench.json")
    parser.add_argument("--below", type=float, default=0.95, metavar="RATIO",
                        help="time again the cells below this per-byte ratio (default: %(default)s)")
    parser.add_argument("--m", nargs="*", type=int, default=None, help="only these token counts")
    parser.add_argument("--rounds", type=int, default=5, help="alternated timings a cell (default: %(default)s)")
    parser.add_argument("--baselines", nargs="+", default=list(DEFAULT_BASELINES), metavar="SCHEME",
                        help="one scheme per weight width, compared against (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="the cells as JSON")
    parser.add_argument("--dry-run", action="store_true", help="a dry bench run's tiny cells, on the CPU")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    from bench import registry_schemes

    try:
        if not args.dry_run and not torch.cuda.is_available():
            raise PerByteError("no GPU here: the cells are timed on one (--dry-run: a dry run's cells, on the CPU)")
        rows = load_rows(args.run)
        cells = slow_cells(rows, weight_bits(registry_schemes()), args.baselines, args.below, args.m)
        rechecked = recheck(cells, rows, args.rounds, args.dry_run)
    except PerByteError as e:
        print(f"recheck.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(c) for c in rechecked], indent=1) if args.json
          else report(rechecked, args.below, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
