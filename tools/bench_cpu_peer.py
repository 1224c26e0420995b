"""Our CPU MoE layer beside llama.cpp's, side by side on this machine: ggml's own MUL_MAT_ID benchmark (its
test-backend-ops, built outside the repository; PEER is the folder holding that binary) and our kernel at a
Qwen3-30B-A3B layer's shapes (128 experts, top-8, hidden 2048, intermediate 768), run in alternation (ours, then
ggml, per thread count, per round) so both meet the same load, with the load average read before each figure.

Pairs by bits per weight: int4 group-128 symmetric (GPTQ) against Q4_0, int4 with zero points (AWQ) against Q4_K,
int8 group-128 against Q8_0, MXFP4 against ggml's MXFP4, NVFP4 (which ggml lacks) against Q4_0; ggml's weights in
its repacked CPU layout where it has one (what llama.cpp's loader does), ours as our converter repacks them. One
layer = ggml's gate/up op twice plus its down op; ours is the whole layer (both GEMMs, the activation, the weighted
sum). Each cell keeps the best of the rounds on each side. ggml times each op on its own, so at M = 1 one op's
experts (13 MiB at 8 bits) stay in an L3 of 32 MiB between its runs, where our layer's call (both GEMMs, 37 MiB at 8
bits) streams from memory: the streaming table is where both meet the memory's floor.

Also the streaming case: M = 1 with each call routed to 8 experts the previous calls did not touch (all 128 in
turn: far more than the L3 holds), so every call reads its weights from memory, beside the floor that this
machine's memory bandwidth (a float32 sum over 1 GiB, same threads) puts under it.

    python tools/bench_cpu_peer.py PEER [--threads 1,2] [--tokens 1,16] [--rounds 3] [--kernel torch-cpu-dot8]
                                        [--pairs int8,MXFP4] [--out docs/bench/cpu-peer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))

import torch
from bench_cpu import median_ms, random_weights

from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.build import experts_class
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.layer.routing import softmax_topk
from moe_registry.spec.loader import load_registry

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
class Pair(NamedTuple):
    """One row of the table: our weight key (with the activation key the scheme runs, on ``kernel``: None for
    --kernel) beside a ggml type."""

    label: str
    weight: str
    peer: str
    kernel: str | None = None
    activation: str = "unquantized"


PAIRS = (
    Pair("int4 g128 sym", "uint4b8 scale:float16:group(128):static", "q4_0"),
    Pair("int4 g128 + zero points", "uint4 scale:float16:group(128):static zp:group", "q4_K"),
    Pair("int8 g128", "uint8b128 scale:float16:group(128):static", "q8_0"),
    Pair("MXFP4", "e2m1 scale:e8m0:block(1x32):static", "mxfp4"),
    # ggml has no NVFP4 or FP8 type: Q4_0 and Q8_0 are the nearest by bytes per weight (0.5625 and 1.0625 against
    # NVFP4's 0.5625 and FP8's 1.0); FP8 with the e4m3 activations its schemes declare
    Pair("NVFP4", "e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static", "q4_0"),
    Pair("FP8 block 128", "fp8e4m3 scale:float32:block(128x128):static", "q8_0",
         activation="fp8e4m3 scale:float32:group(128):dynamic"),
    Pair("FP8 channel", "fp8e4m3 scale:float32:channel:static", "q8_0",
         activation="fp8e4m3 scale:float32:token:dynamic"),
)
REPACKED = ("q4_0", "q4_K")  # ggml types timed in its CPU_REPACK layout; Q8_0 in its plain one (its repacked
# setup in the benchmark crashes on AVX-512 machines)
# ggml's cases at our shapes (the cpu-peer patch adds them): gate/up [768 x 2048] and down [2048 x 768]
PEER_CASES = "n_mats=128,n_used=8,b=(1,m=768|0,m=2048),n=(1|16),k=(2048|768),"
PEER_LINE = re.compile(r"MUL_MAT_ID\(type_a=(?P<type>\w+),.*?b=(?P<b>\d),m=(?P<m>\d+),n=(?P<n>\d+),k=(?P<k>\d+)"
                       r".*?\):\s+\d+ runs -\s+(?P<us>[\d.]+) us/run")
STREAM_CALLS = EXPERTS // TOP_K  # calls that touch every expert once


class PeerError(RuntimeError):
    """ggml's benchmark could not be run or read: one line for the user."""


@dataclass(frozen=True)
class Cell:
    round: int
    threads: int
    tokens: int
    pair: str
    kernel: str
    ours_ms: float
    ours_load: float
    peer_type: str
    peer_ms: float
    peer_load: float


@dataclass(frozen=True)
class Stream:
    threads: int
    pair: str
    kernel: str
    ms: float
    load: float
    bytes_per_call: int
    bandwidth_gbs: float
    floor_ms: float


def load1() -> float:
    return os.getloadavg()[0]


def peer_layers(peer: Path, threads: int, types: list[str]) -> dict[tuple[str, int], float]:
    """ggml's ms per layer (2 x gate/up + down) by (type, tokens): one run of its benchmark for the repacked
    types, one for the others."""
    out = {}
    for repack in (True, False):
        chosen = sorted({t for t in types if (t in REPACKED) == repack})
        if chosen:
            out.update(_peer_run(peer, threads, chosen, repack))
    return out


def _peer_run(peer: Path, threads: int, types: list[str], repack: bool) -> dict[tuple[str, int], float]:
    binary = peer / "test-backend-ops"
    if not binary.is_file():
        raise PeerError(f"{binary}: no such file; wanted the folder where the cpu-peer build script put "
                        "test-backend-ops (build.sh DIR)")
    env = {**os.environ, "TBO_FAST_INIT": "1", "TBO_THREADS": str(threads), **({"TBO_REPACK": "1"} if repack else {})}
    cases = f"type_a=({'|'.join(types)}),type_b=f32,{PEER_CASES}"
    cmd = [str(binary), "perf", "-b", "CPU", "-o", "MUL_MAT_ID", "-p", cases]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise PeerError(f"{binary} exited {done.returncode}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    ops: dict[tuple[str, int, str], float] = {}
    for match in PEER_LINE.finditer(done.stdout):
        proj = "gate_up" if match["b"] == "1" else "down"
        ops[(match["type"], int(match["n"]), proj)] = float(match["us"]) / 1e3
    out = {}
    for t in types:
        for m in (1, 16):
            if (t, m, "gate_up") in ops and (t, m, "down") in ops:
                out[(t, m)] = 2 * ops[(t, m, "gate_up")] + ops[(t, m, "down")]
    if not out:
        raise PeerError(f"{binary}: no MUL_MAT_ID line at our shapes in its output (is it built with the cpu-peer "
                        "patch?)")
    return out


def bandwidth_gbs(threads: int) -> float:
    """Read bandwidth: a float32 sum over 1 GiB (far beyond any cache), best of 5."""
    torch.set_num_threads(threads)
    buf = torch.ones(1 << 28)
    best = min(_timed(lambda: buf.sum()) for _ in range(5))
    return buf.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", type=Path, help="the folder holding ggml's test-backend-ops (the cpu-peer build's DIR)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="our calls per cell and round (median)")
    ap.add_argument("--kernel", default="torch-cpu-dot8")
    ap.add_argument("--distinct", type=int, default=16, help="distinct random experts, copied up to 128")
    ap.add_argument("--pairs", help="comma-separated starts of the pair labels to run (default: all): "
                    + ", ".join(p.label for p in PAIRS))
    ap.add_argument("--out", type=Path, help="write the record (JSON) here")
    args = ap.parse_args(argv)
    pairs = chosen_pairs(args.pairs)
    threads = [int(t) for t in args.threads.split(",")]
    tokens = [int(m) for m in args.tokens.split(",")]
    registry = load_registry()
    config = ExpertsConfig("silu")
    gen = torch.Generator().manual_seed(0)
    inputs = {m: (torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16),
                  softmax_topk(torch.randn(m, EXPERTS, generator=gen), TOP_K, True)) for m in tokens}
    layers = {}
    kernel_of = {p.label: p.kernel or args.kernel for p in pairs}
    for label, key, _, _, act in pairs:
        cls = experts_class(registry.kernel(kernel_of[label]))
        weights = random_weights(parse_quant_key(key), parse_quant_key(act), EXPERTS, args.distinct, HIDDEN, INTER,
                                 torch.bfloat16)
        layers[label] = cls(weights, config)
        del weights
    print(f"built {len(layers)} layers on {', '.join(sorted(set(kernel_of.values())))}; load {load1():.2f}",
          file=sys.stderr, flush=True)

    cells: list[Cell] = []
    for r in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            ours = {}
            for label in kernel_of:
                for m in tokens:
                    hidden, routing = inputs[m]
                    load = load1()
                    (ms,) = median_ms([lambda h=hidden, rt=routing, k=layers[label]: k.apply(h, rt.topk_weights,
                                                                                            rt.topk_ids)],
                                      args.repeats)
                    ours[(label, m)] = (ms, load)
            load = load1()
            peer = peer_layers(args.peer, t, [p.peer for p in pairs])
            for label, _, ptype, _, _ in pairs:
                for m in tokens:
                    ms, oload = ours[(label, m)]
                    cell = Cell(r, t, m, label, kernel_of[label], ms, oload, ptype, peer.get((ptype, m), float("nan")),
                                load)
                    cells.append(cell)
                    print(f"round {r} threads {t} M={m} {label}: ours {ms:.3f} ms (load {oload:.2f}), "
                          f"{ptype} {cell.peer_ms:.3f} ms (load {load:.2f})", file=sys.stderr, flush=True)

    streams: list[Stream] = []
    for t in threads:
        torch.set_num_threads(t)
        bw = bandwidth_gbs(t)
        for label in kernel_of:
            layer = layers[label]
            hidden = inputs[tokens[0]][0][:1]
            weights = torch.full((1, TOP_K), 1.0 / TOP_K)
            calls = [torch.arange(i * TOP_K, (i + 1) * TOP_K).view(1, TOP_K) for i in range(STREAM_CALLS)]
            per_call = reachable_tensor_bytes(layer) * TOP_K // EXPERTS
            load = load1()
            for ids in calls:  # warm: the code, not the weights (every call's experts are out of cache again)
                layer.apply(hidden, weights, ids)
            times = [_timed(lambda k=layer, h=hidden, w=weights, ids=ids: k.apply(h, w, ids))
                     for _ in range(2) for ids in calls]
            times.sort()
            ms = times[len(times) // 2] * 1e3
            streams.append(Stream(t, label, kernel_of[label], ms, load, per_call, bw, per_call / bw / 1e6))
            print(f"streaming threads {t} {label}: {ms:.3f} ms per call, floor {per_call / bw / 1e6:.3f} ms "
                  f"({per_call / 2**20:.1f} MiB at {bw:.1f} GB/s; load {load:.2f})", file=sys.stderr, flush=True)

    doc = {"shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "intermediate": INTER,
                     "dtype": "bfloat16"},
           "kernel": args.kernel, "threads": threads, "tokens": tokens, "rounds": args.rounds,
           "repeats": args.repeats, "torch": torch.__version__,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           "cells": [asdict(c) for c in cells], "streaming": [asdict(s) for s in streams]}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(markdown(doc))
    return 0


def chosen_pairs(spec: str | None) -> tuple[Pair, ...]:
    """The pairs whose labels start with one of the comma-separated ``spec`` words (all for None)."""
    if spec is None:
        return PAIRS
    words = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in words if not any(p.label.startswith(w) for p in PAIRS)]
    if unknown or not words:
        raise PeerError(f"--pairs {spec!r}: no pair label starts with {', '.join(unknown) or 'nothing'}; labels: "
                        + ", ".join(p.label for p in PAIRS))
    return tuple(p for p in PAIRS if any(p.label.startswith(w) for w in words))


def best_cells(doc: dict) -> list[dict]:
    """Per (threads, tokens, pair): the best round on each side, with the load read before it."""
    best: dict[tuple, dict] = {}
    for c in doc["cells"]:
        key = (c["threads"], c["tokens"], c["pair"])
        b = best.setdefault(key, dict(c))
        if c["ours_ms"] < b["ours_ms"]:
            b["ours_ms"], b["ours_load"] = c["ours_ms"], c["ours_load"]
        if c["peer_ms"] < b["peer_ms"]:
            b["peer_ms"], b["peer_load"] = c["peer_ms"], c["peer_load"]
    order = {p.label: i for i, p in enumerate(PAIRS)}
    return sorted(best.values(), key=lambda c: (-c["threads"], c["tokens"], order.get(c["pair"], 99)))


def _ours(doc: dict, row: dict) -> str:
    """A row's pair, with its kernel where that is not the run's --kernel."""
    return row["pair"] if row["kernel"] == doc.get("kernel", row["kernel"]) else f"{row['pair']} ({row['kernel']})"


def markdown(doc: dict) -> str:
    """The ratio table (llama.cpp ms / ours: above 1, ours is faster) and the streaming table."""
    head = "| threads | M | ours | llama.cpp | ours ms (load) | llama.cpp ms (load) | llama.cpp / ours |"
    lines = [head, "|" + " --- |" * 7]
    for c in best_cells(doc):
        lines.append(f"| {c['threads']} | {c['tokens']} | {_ours(doc, c)} | {c['peer_type'].upper()} "
                     f"| {c['ours_ms']:.2f} ({c['ours_load']:.1f}) | {c['peer_ms']:.2f} ({c['peer_load']:.1f}) "
                     f"| {c['peer_ms'] / c['ours_ms']:.2f} |")
    lines += ["", "| threads | ours | ms per call (load) | weights per call | memory bandwidth | floor ms | "
              "floor / ours |", "|" + " --- |" * 7]
    for s in doc["streaming"]:
        lines.append(f"| {s['threads']} | {_ours(doc, s)} | {s['ms']:.2f} ({s['load']:.1f}) | "
                     f"{s['bytes_per_call'] / 2**20:.1f} MiB | {s['bandwidth_gbs']:.1f} GB/s | {s['floor_ms']:.2f} | "
                     f"{s['floor_ms'] / s['ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except PeerError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
