"""The kernels' tiles on MoE shapes nobody tuned, beside tuned ones.

For each shape x scheme x token count the layer is timed as tools/tune.py times it (CUDA graphs, weight copies
rotated out of L2), under up to three tile choices in alternation, so that all see the same clocks:

- ``defaults``: the hand-written heuristics alone (``tile_config.default_config``), what a device without any
  tuned table runs;
- ``nearest``: the tiles tuned for the nearest tuned shape of the same scheme on this device's tables
  (``nearest_shape_config``), which the kernel takes for a shape its tables lack where an expert sees enough rows
  (``TRANSFER_ROWS``);
- ``tuned``: the entry a tools/tune.py run tuned for this very shape (``--tuned DIR``: that run's ``--out``).

Each choice's output is checked against the float32 reference within the scheme's tolerance first. Rows go to
``--out``/untuned.jsonl as each cell is measured (a run cut off keeps them), then a table to stdout; its
``runs`` column names the choice whose tiles this code picks at the cell, and that choice's speed as a share of
the fastest one measured there.

    python tools/tune.py --shapes qwen3-235b --schemes gptq-w4a16 --m 8 64 --out /tmp/tuned
    python tools/bench_untuned.py --shapes dsv3 qwen3-235b --schemes gptq-w4a16 --m 1 8 64 --tuned /tmp/tuned
    python tools/bench_untuned.py --dry-run          # tiny shapes through the interpreter
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402

CHOICES = ("defaults", "nearest", "tuned")
ROUNDS = 3


def tuned_pair(tuned_dir: Path | None, shape: bench.Shape, scheme: bench.Scheme, m: int,
               device_name: str) -> tuple[dict, dict] | None:
    """The (GEMM1, GEMM2) entry a tune.py run wrote for exactly this shape and token count, if any."""
    from moe_registry_kernels.triton.api import config_file, shape_key

    if tuned_dir is None:
        return None
    path = tuned_dir / config_file(scheme.weight, scheme.activation, device_name).name
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    h, i = shape.hidden, shape.intermediate
    pair = [table.get(shape_key(shape.experts, shape.top_k, n, k), {}).get(str(m)) for n, k in ((2 * i, h), (h, i))]
    return None if None in pair else (pair[0], pair[1])


def cell_configs(shape: bench.Shape, scheme: bench.Scheme, m: int, device_name: str, sms: int,
                 tuned_dir: Path | None) -> dict[str, tuple[dict, dict]]:
    """The tile choices at one cell, by name (CHOICES; ``nearest`` only where the device's tables have an entry in
    reach for both GEMMs, ``tuned`` only where the tuned run has this cell), fitted as the layer fits them."""
    from moe_registry_kernels.triton.api import default_config, fit_pair, nearest_shape_config, variant_from_keys

    variant = variant_from_keys(*scheme.keys)
    gemms = [(2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]
    defaults = tuple(default_config(m, shape.top_k, shape.experts, n, k, scheme.weight, sms, scheme.activation)
                     for n, k in gemms)
    nearest = tuple(nearest_shape_config(m, shape.top_k, shape.experts, n, k, *scheme.keys, device_name, sms)
                    for n, k in gemms)
    tuned = tuned_pair(tuned_dir, shape, scheme, m, device_name)
    out: dict[str, tuple[dict, dict]] = {}
    for name, pair in zip(CHOICES, (defaults, None if None in nearest else nearest, tuned), strict=True):
        if pair is not None:
            out[name] = fit_pair(*pair, variant)
    return out


def measure_cell(layer: tune.Layer, m: int, configs: dict[str, tuple[dict, dict]], tolerance: float) -> dict:
    """Each choice's relative error, then its median time (the distinct choices alternated ROUNDS times; choices
    that fit to the same tiles are timed once, and share that time)."""
    x, tw, ti = layer.inputs(m)
    ref = layer.reference(x, tw, ti)
    distinct = [json.dumps(p, sort_keys=True) for p in configs.values()]
    distinct = list(dict.fromkeys(distinct))
    errors = {name: layer.error(pair, x, tw, ti, ref) for name, pair in configs.items()}
    bad = {name: e for name, e in errors.items() if not e <= tolerance}
    if bad:
        raise SystemExit(f"bench_untuned.py: {layer.shape.name} {layer.scheme.name} M={m}: relative error past the "
                         f"scheme's tolerance {tolerance:.0e}: {bad}")
    times = tune.alternated([lambda key=key: layer.time(tuple(json.loads(key)), m, x, tw, ti) for key in distinct],
                            ROUNDS)
    median = {key: statistics.median(t) * 1e6 for key, t in zip(distinct, times, strict=True)}
    return {"us": {name: median[json.dumps(pair, sort_keys=True)] for name, pair in configs.items()},
            "rel_err": errors, "configs": {name: list(pair) for name, pair in configs.items()}}


def share(row: dict, name: str) -> float | None:
    """``name``'s speed as a share of the fastest choice measured at its cell (1.0: it is the fastest)."""
    us = row["us"]
    return min(us.values()) / us[name] if name in us else None


def main(argv: list[str] | None = None) -> int:
    schemes = bench.registry_schemes()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["dsv3", "gptoss120b", "glm45air", "qwen3-235b"],
                        choices=list(bench.SHAPES))
    parser.add_argument("--schemes", nargs="*", default=["gptq-w4a16", "fp8-block128", "unquantized"],
                        metavar="SCHEME")
    parser.add_argument("--m", nargs="*", type=int, default=None, help="token counts (default 1 8 64 512 4096)")
    parser.add_argument("--tuned", type=Path, default=None, help="a tools/tune.py run's --out directory")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = parser.parse_args(argv)
    bad = bench.check_names(args.schemes, list(schemes))
    if bad:
        print(f"bench_untuned.py: {bad}", file=sys.stderr)
        return 2
    if args.tuned is not None and not args.tuned.is_dir():
        print(f"bench_untuned.py: --tuned {args.tuned}: no such directory (wanted a tools/tune.py run's --out)",
              file=sys.stderr)
        return 2
    dry = args.dry_run or not torch.cuda.is_available()
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from moe_registry_kernels.triton import api

    device = torch.device("cpu" if dry else "cuda")
    device_name = "dry-run" if dry else torch.cuda.get_device_name()
    sms = api.num_sms(device)
    shapes = bench.DRY_SHAPES if dry else {k: bench.SHAPES[k] for k in args.shapes}
    ms = args.m or ([1, 8] if dry else [1, 8, 64, 512, 4096])
    dtype = "float16" if dry else "bfloat16"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.out / "untuned.jsonl").open("a") as log:
        for shape_name, shape in shapes.items():
            for name in args.schemes:
                scheme = schemes[name]
                cells = {m: cell_configs(shape, scheme, m, device_name, sms, args.tuned) for m in ms}
                tune.precompile(shape_name, scheme, [p for c in cells.values() for p in c.values()], dry, args.workers)
                layer = tune.Layer(shape, scheme, device, dry)
                tolerance = tune.tolerance_for_keys(schemes, scheme.keys, dtype)
                for m, configs in cells.items():
                    row = {"shape": shape_name, "scheme": name, "m": m, "device": device_name, "sms": sms,
                           **measure_cell(layer, m, configs, tolerance)}
                    rows.append(row)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    print(markdown_row(row), flush=True)
                del layer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print()
    print(markdown(rows))
    return 0


HEADER = ("| shape | scheme | M | rows an expert | defaults µs | nearest tuned shape's µs | tuned µs | runs | "
          "its share of the fastest |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


@functools.cache
def _schemes() -> dict[str, bench.Scheme]:
    """The registry's schemes, read once for a table's rows."""
    return bench.registry_schemes()


def runs_now(row: dict) -> str | None:
    """Which measured choice holds the tiles this code picks at the row's cell (None: none of them)."""
    from moe_registry_kernels.triton.api import fit_pair, variant_from_keys

    shape = bench.SHAPES.get(row["shape"]) or bench.DRY_SHAPES[row["shape"]]
    schemes = _schemes()
    quiet = logging.getLogger("moe_registry")  # not a word on the untuned shapes: the table is about them
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        scheme = schemes[row["scheme"]]
        picked = fit_pair(*tune.todays_configs(shape, scheme.keys, row["m"], row["device"], row["sms"]),
                          variant_from_keys(*scheme.keys))
    finally:
        quiet.setLevel(level)
    now = json.dumps(list(picked), sort_keys=True)
    return next((name for name in CHOICES if json.dumps(row["configs"].get(name), sort_keys=True) == now), None)


def markdown_row(row: dict) -> str:
    """One cell as a table row."""
    us = row["us"]
    shape = bench.SHAPES.get(row["shape"]) or bench.DRY_SHAPES[row["shape"]]
    runs = runs_now(row)

    def t(name: str) -> str:
        return f"{us[name]:.1f}" if name in us else "-"

    share_now = share(row, runs) if runs else None
    said = {"nearest": "nearest tuned shape's", None: "other tiles"}.get(runs, runs)
    return (f"| {shape.name} | `{row['scheme']}` | {row['m']} | {row['m'] * shape.top_k / shape.experts:.3g} | "
            f"{t('defaults')} | {t('nearest')} | {t('tuned')} | {said} | "
            f"{'-' if share_now is None else f'{share_now:.2f}'} |")


def markdown(rows: list[dict]) -> str:
    """The cells as a table (docs/performance.md's untuned-shapes block)."""
    return "\n".join([HEADER, *(markdown_row(r) for r in rows)])


if __name__ == "__main__":
    sys.exit(main())
