"""Time `moe-registry explain` end to end (a fresh process each run, as a user runs it) and check
that the spec/oracle/explain path imports neither torch nor triton.

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
    print(f"{'config':<60} {'median s':>9} {'max s':>7}")
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
        print(f"{cfg[-60:]:<60} {med:>9.3f} {max(times):>7.3f}")
    print(f"worst median {worst:.3f} s (target < 0.3 s); torch and triton not imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
