"""Time `moe-registry explain` end to end (a fresh process each run, as a user runs it) against a
bare Python start measured in the same run, and check that the spec/oracle/explain path imports
neither torch nor triton. Runs as an installed package runs: bytecode cached (``PYTHONDONTWRITEBYTECODE``
is dropped from the children's environment; pip writes .pyc files at install) and the spec cache warm,
after one untimed run that fills both; ``--cold`` times the first run after clearing the spec cache.
The target: the explain median at most 0.12 s over the bare
start's median; also reported: the pydantic import alone (the floor of any path that uses it).

    python tools/bench_explain.py [config.json ...] [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import sys; from moe_registry.cli.main import main; rc = main(sys.argv[1:]); "
         "bad = [m for m in ('torch', 'triton') if m in sys.modules]; "
         "sys.exit(3 if bad else rc)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=[str(ROOT / "examples/mixtral-8x7b-awq/config.json")])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--platform", default="cuda:9.0")
    parser.add_argument("--cold", action="store_true", help="also time explain with an empty spec cache "
                        "(validation with pydantic and YAML: the first run after a spec file changes)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["MOE_REGISTRY_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="moe-registry-bench-")

    def median_of(argv: list[str]) -> float:
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, env=env)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    bare = median_of([sys.executable, "-c", "pass"])
    pydantic = median_of([sys.executable, "-c", "from pydantic import BaseModel"]) - bare
    print(f"bare python start {bare:.3f} s; importing pydantic.BaseModel adds {pydantic:.3f} s")
    print(f"{'config':<60} {'median s':>9} {'max s':>7} {'over bare':>10}")
    worst = 0.0
    for cfg in args.configs:
        argv = [sys.executable, "-c", PROBE, "explain", cfg, "--platform", args.platform]
        subprocess.run(argv, capture_output=True, env=env)  # untimed: writes bytecode and the spec cache
        if args.cold:
            cold = []
            for _ in range(args.runs):
                for f in Path(cache).glob("registry-*.json"):
                    f.unlink()
                t0 = time.perf_counter()
                subprocess.run(argv, capture_output=True, env=env)
                cold.append(time.perf_counter() - t0)
            print(f"{'(cold spec cache) ' + cfg[-42:]:<60} {statistics.median(cold):>9.3f} {max(cold):>7.3f} "
                  f"{statistics.median(cold) - bare:>10.3f}")
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            times.append(time.perf_counter() - t0)
            if proc.returncode == 3:
                print(f"{cfg}: explain imported torch or triton", file=sys.stderr)
                return 1
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
        med = statistics.median(times)
        worst = max(worst, med)
        print(f"{cfg[-60:]:<60} {med:>9.3f} {max(times):>7.3f} {med - bare:>10.3f}")
    over = worst - bare
    print(f"worst median {worst:.3f} s, {over:.3f} s over a bare start (target <= 0.12 s: "
          f"{'met' if over <= 0.12 else 'missed'}); torch and triton not imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
