"""Time how long ``moe-registry`` takes to refuse bad input (a fresh process each run, as a user runs it) against a
bare Python start measured in the same run: bad flag values, missing files, a checkpoint without a router, bad
``--inputs``. The target: each error within 1 s of the bare start's median. Each case must exit 2 with one line
on stderr; the cache dir is new and empty, and the kernels compiled during the bench are counted (an error that
compiles a kernel first is the slow path this guards against). One untimed run per case first writes the bytecode
and the spec cache, as an installed package has them.

    python tools/bench_errors.py [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 1.0
EXAMPLE = "deepseek-fp8-block"  # its CPU kernel (torch-cpu-native) is compiled on first use


def _inputs(d: Path) -> dict[str, Path]:
    """The bad checkpoint and inputs files the cases read, written under ``d``."""
    import torch
    from make_examples import make_example
    from safetensors.torch import load_file, save_file

    model = Path(make_example(EXAMPLE, d / "examples"))
    no_router = d / "no-router"
    shutil.copytree(model, no_router)
    tensors = load_file(str(no_router / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if not n.endswith("mlp.gate.weight")},
              str(no_router / "model.safetensors"), metadata={"format": "pt"})
    hidden = int(json.loads((model / "config.json").read_text())["hidden_size"])
    wrong = d / "wrong-hidden.safetensors"
    save_file({"hidden_states": torch.randn(3, hidden - 1)}, str(wrong))
    misspelt = d / "misspelt.safetensors"
    save_file({"hidden_states": torch.randn(3, hidden), "topk_idz": torch.zeros(3, 4, dtype=torch.int32),
               "topk_weights": torch.full((3, 4), 0.25)}, str(misspelt))
    return {"model": model, "no_router": no_router, "wrong": wrong, "misspelt": misspelt}


def cases(f: dict[str, Path], d: Path) -> list[tuple[str, list[str]]]:
    """(what is wrong, the command's arguments)."""
    m = str(f["model"])
    return [
        ("--tokens 0", ["run", m, "--tokens", "0"]),
        ("--repeat 0", ["run", m, "--repeat", "0"]),
        ("--tp 0", ["run", m, "--tp", "0"]),
        ("--ep 2 in one process", ["run", m, "--ep", "2"]),
        ("--all2all in one process", ["run", m, "--all2all", "pplx"]),
        ("model dir missing", ["run", str(d / "no-such-model")]),
        ("--inputs file missing", ["run", m, "--inputs", str(d / "no-such.safetensors")]),
        ("--save-output dir missing", ["run", m, "--save-output", str(d / "no/dir/out.safetensors")]),
        ("--layer not a MoE layer", ["run", m, "--layer", "99"]),
        ("--kernel misspelt", ["run", m, "--kernel", "torch-refrence"]),
        ("checkpoint without a router", ["run", str(f["no_router"]), "--platform", "cpu"]),
        ("--inputs hidden size wrong", ["run", m, "--platform", "cpu", "--inputs", str(f["wrong"])]),
        ("--inputs tensor name misspelt", ["run", m, "--platform", "cpu", "--inputs", str(f["misspelt"])]),
        ("explain --max-tokens -7", ["explain", m, "--max-tokens", "-7"]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case (the median is reported)")
    parser.add_argument("--json", action="store_true", help="the table as JSON on stdout")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tools"))
    d = Path(tempfile.mkdtemp(prefix="moe-registry-bench-errors-"))
    cache = d / "cache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["MOE_REGISTRY_CACHE_DIR"] = str(cache)
    script = Path(sys.executable).parent / "moe-registry"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "moe_registry"]

    def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
        times, proc = [], None
        for _ in range(args.runs):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
            times.append(time.perf_counter() - t0)
        assert proc is not None
        return statistics.median(times), proc

    try:
        files = _inputs(d)
        bare, _ = timed([sys.executable, "-c", "pass"])
        rows, bad = [], []
        for what, case in cases(files, d):
            subprocess.run([*command, *case], capture_output=True, env=env, timeout=600)  # untimed: bytecode, cache
            median, proc = timed([*command, *case])
            message = proc.stderr.strip()
            if proc.returncode != 2 or message.count("\n") or not message.startswith("error: "):
                bad.append(f"{what}: exit {proc.returncode}, stderr {proc.stderr[-300:]!r}")
            rows.append({"case": what, "median_s": round(median, 3), "over_bare_s": round(median - bare, 3),
                         "within_target": median - bare <= TARGET_S, "error": message})
        built = sorted(p.name for p in (cache / "extensions").glob("*.so")) if (cache / "extensions").is_dir() else []
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if args.json:
        print(json.dumps({"bare_python_s": round(bare, 3), "runs": args.runs, "target_over_bare_s": TARGET_S,
                          "kernels_compiled": built, "rows": rows}))
    else:
        print(f"bare `python -c pass`: {bare:.3f} s (median of {args.runs}); target: each error within "
              f"{TARGET_S:g} s over it; kernels compiled during the bench: {len(built)}")
        print(f"| {'input error':<30} | median s | over bare s | <= {TARGET_S:g} s | error (start) |")
        print(f"| {'-' * 30} | -------: | ----------: | :----: | --- |")
        for r in rows:
            print(f"| {r['case']:<30} | {r['median_s']:8.3f} | {r['over_bare_s']:11.3f} | "
                  f"{'yes' if r['within_target'] else 'NO':^6} | {r['error'][:70]} |")
    for line in bad:
        print(f"not a one-line input error: {line}", file=sys.stderr)
    return 1 if bad or built else 0


if __name__ == "__main__":
    sys.exit(main())
