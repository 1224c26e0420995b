"""Time `moe-registry explain` end to end (a fresh process each run, as a user runs it) against a
bare Python start measured in the same run, and check that the spec/oracle/explain path imports
neither torch nor triton. Issue #23's target: the explain median at most 0.12 s over the bare
start's median; also reported: the pydantic import alone (the floor of any path that uses it).

    python tools/bench_explain.py [config.json ...] [--runs 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
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
    args = parser.parse_args()

    def median_of(argv: list[str]) -> float:
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    bare = median_of([sys.executable, "-c", "pass"])
    pydantic = median_of([sys.executable, "-c", "from pydantic import BaseModel"]) - bare
    print(f"bare python start {bare:.3f} s; importing pydantic.BaseModel adds {pydantic:.3f} s")
    print(f"{'config':<60} {'median s':>9} {'max s':>7} {'over bare':>10}")
    worst = 0.0
    for cfg in args.configs:
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", PROBE, "explain", cfg, "--platform", args.platform],
                                  capture_output=True, text=True)
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
