"""Wall time of ``moe-registry explain`` on a compressed-tensors config whose ``ignore`` list holds N module
names, as llm-compressor writes it for a model with many layers (every ignored Linear by name, plus a few
``re:`` patterns). Matching must stay near-linear in N.

    python tools/bench_ignore_scale.py 10000 100000
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from moe_registry.cli.main import main

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "compressed_tensors" / "qwen3-w4a16"


def ignore_list(n: int) -> list[str]:
    """``n`` entries: attention and router names of many layers, a few patterns, lm_head."""
    names = ["lm_head", "re:.*shared_expert_gate$", "re:.*mlp\\.gate$"]
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate")
    layer = 0
    while len(names) < n:
        names += [f"model.layers.{layer}.{p}" for p in parts]
        layer += 1
    return names[:n]


def explain_seconds(n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "m"
        shutil.copytree(FIXTURE, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["ignore"] = ignore_list(n)
        (d / "config.json").write_text(json.dumps(cfg))
        start = time.perf_counter()
        code = main(["explain", str(d / "config.json"), "--platform", "cpu", "--json"])
        seconds = time.perf_counter() - start
        if code != 0:
            raise SystemExit(f"explain exited {code}")
        return seconds


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="+", type=int, help="ignore list lengths")
    args = parser.parse_args()
    rows = [(n, explain_seconds(n)) for n in args.sizes]
    print()
    for n, s in rows:
        print(f"ignore entries {n:>8}: explain {s:.2f} s")


if __name__ == "__main__":
    run()
