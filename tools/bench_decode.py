"""Decode timings on a CUDA GPU: µs per layer for every Triton scheme at a Qwen-MoE-like shape
(64 experts, hidden 2048, intermediate 1408, top-6), the weight bandwidth that implies, the glue
ops alone, and the two alignment paths (one launch vs chunked) for 128 experts, to place
ALIGN_ONE_LAUNCH_MAX. A report, not a pass/fail check: tests/test_triton_gpu.py holds the checks.
For the whole-layer roofline see tools/bench.py.

Each time is the mean of CUDA-graph replays (no launch overhead); a layer is replayed over 4
weight copies so L2 (50 MB on an H100) cannot hold them; H100 copy bandwidth is ~3.0 TB/s.

    python tools/bench_decode.py                      # M = 1 and 64, every scheme
    python tools/bench_decode.py --m 1 --schemes awq-g128 fp8-block
    python tools/bench_decode.py --m 1 2 4 8 --schemes w8a8-int8-token --compare-gemv --no-align
    bash tools/gpu_run.sh decode [args]               # on the GPU machine
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable

import torch

from moe_registry.core.keys import parse_quant_key
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import ExpertsConfig

DEVICE = "cuda"
UNQ = "unquantized"
# name -> (weight key, activation key)
SCHEMES = {
    "16bit": (UNQ, UNQ),
    "awq-g128": ("uint4 scale:float16:group(128):static zp:group", UNQ),
    "awq-g32": ("uint4 scale:float16:group(32):static zp:group", UNQ),
    "gptq4-g128": ("uint4b8 scale:float16:group(128):static", UNQ),
    "gptq4-channel": ("uint4b8 scale:float16:channel:static", UNQ),
    "gptq8-g128": ("uint8b128 scale:float16:group(128):static", UNQ),
    "int8-w8a16-channel": ("int8 scale:float16:channel:static", UNQ),
    "w8a8-int8-token": ("int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic"),
    "w8a8-int8-static": ("int8 scale:float32:tensor:static", "int8 scale:float32:tensor:static"),
    "mxfp8-w8a16": ("fp8e4m3 scale:e8m0:block(1x32):static", UNQ),
    "mxfp8": ("fp8e4m3 scale:e8m0:block(1x32):static", "fp8e4m3 scale:e8m0:block(1x32):dynamic"),
    "fp8-block": ("fp8e4m3 scale:float32:block(128x128):static", "fp8e4m3 scale:float32:group(128):dynamic"),
    "mxfp4": ("e2m1 scale:e8m0:block(1x32):static", UNQ),
    "nvfp4": ("e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static", UNQ),
}

E, H, INTER, TOP_K = 64, 2048, 1408, 6


def _projection(scheme: str, experts: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator
                ) -> ProjectionWeights:
    """Random weights [experts, n, k] of std 1/sqrt(k) quantised on the GPU (the CPU takes minutes at these
    sizes); a static activation key's scale covers |x| <= 6."""
    from moe_registry_kernels import quant_ref

    wkey, akey = (parse_quant_key(key) for key in SCHEMES[scheme])
    weight = torch.randn(experts, n, k, generator=gen, device=DEVICE) / math.sqrt(k)
    p = quant_ref.quantize_weight_to_layout(weight, wkey, dtype=dtype)
    if akey.quantized and not akey.scale.dynamic:
        scale = torch.tensor([6.0 / (127.0 if akey.dtype.name == "int8" else 448.0)], device=DEVICE)
        p = dataclasses.replace(p, input_scale=scale)
    return p


def _weights(scheme: str, dtype: torch.dtype, seed: int) -> ExpertWeights:
    """Random experts at the benchmark's layer shape (_projection)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    p13, p2 = _projection(scheme, E, 2 * INTER, H, dtype, gen), _projection(scheme, E, H, INTER, dtype, gen)
    return ExpertWeights(p13, p2, *(parse_quant_key(key) for key in SCHEMES[scheme]))


def _expert_bytes(weights: ExpertWeights) -> float:
    """Bytes of one expert's tensors (both projections)."""
    total = 0
    for p in (weights.w13, weights.w2):
        for t in (p.weight, p.scale, p.zero, p.bias):
            if t is not None:
                total += t.numel() * t.element_size()
    return total / weights.num_experts


def graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Mean µs of fn() replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def align_rows() -> list[str]:
    from moe_registry_kernels.triton import api

    rows = []
    for pairs in (64, 512, 1024, 2048, 4096):
        ids = torch.rand(pairs // 8, 128, device=DEVICE).topk(8, dim=-1).indices.to(torch.int32)
        one = graph_time_us(lambda ids=ids: api.align(ids, 128, 64, one_launch_max=1 << 20))
        chunked = graph_time_us(lambda ids=ids: api.align(ids, 128, 64, one_launch_max=0))
        rows.append(f"align {pairs:>5} pairs  one launch {one:6.1f} us   chunked {chunked:6.1f} us")
    return rows


def decode_rows(m: int, schemes: list[str], compare_gemv: bool = False) -> list[str]:
    from moe_registry_kernels.triton import api, launch

    dtype = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(m, H, generator=gen, device=DEVICE).to(dtype)
    topk_weights, topk_ids = torch.softmax(torch.randn(m, E, generator=gen, device=DEVICE), -1).topk(TOP_K, dim=-1)
    inputs = (hidden, topk_weights, topk_ids.to(torch.int32))
    touched = torch.unique(inputs[2]).numel()
    rows = []
    for scheme in schemes:
        copies = [api.TritonExperts(_weights(scheme, dtype, seed=s), ExpertsConfig()) for s in range(4)]
        us = graph_time_us(lambda copies=copies: [c.apply(*inputs) for c in copies]) / len(copies)
        gbs = touched * _expert_bytes(copies[0].weights) / (us * 1e-6) / 1e9
        line = f"{scheme:>18} M={m:<4} {us:8.1f} us  {gbs:7.0f} GB/s  ({touched} experts)"
        if compare_gemv:  # the same layer with the decode GEMV off: the tile kernels alone
            launch.DECODE_GEMV = False
            try:
                tiles = graph_time_us(lambda copies=copies: [c.apply(*inputs) for c in copies]) / len(copies)
            finally:
                launch.DECODE_GEMV = True
            line += f"  tiles alone {tiles:8.1f} us ({tiles / us:.2f}x)"
        rows.append(line)
        del copies
        torch.cuda.empty_cache()
    cache1 = torch.randn(m * TOP_K, 2 * INTER, device=DEVICE, dtype=dtype)
    glue = {
        "align": lambda: api.align(inputs[2], E, 16),
        "align+quant int8": lambda: api.align_quant(inputs[2], E, 16, inputs[0], "int8_token"),
        "act_and_mul": lambda: api.act_quant(cache1, "silu", "none"),
        "act_and_mul+int8": lambda: api.act_quant(cache1, "silu", "int8_token"),
        "quant hidden mxfp8": lambda: api.act_quant(inputs[0], "none", "mxfp8"),
        "moe_sum": lambda: api.sum_topk(cache1[:, :H].reshape(m, TOP_K, H)),
    }
    rows += [f"{name:>18} M={m:<4} {graph_time_us(fn):8.1f} us" for name, fn in glue.items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", nargs="*", type=int, default=[1, 64], help="token counts (default: 1 64)")
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES), metavar="SCHEME",
                        help=f"schemes to time (default: all): {', '.join(SCHEMES)}")
    parser.add_argument("--no-align", dest="align", action="store_false", help="leave out the alignment paths")
    parser.add_argument("--compare-gemv", action="store_true",
                        help="also time each layer with the decode GEMV off (the tile kernels alone)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode.py: needs a CUDA GPU (CUDA graphs time the kernels)", file=sys.stderr)
        return 2
    if args.align:
        print("\n".join(align_rows()))
    for m in args.m:
        print("\n".join(decode_rows(m, args.schemes, args.compare_gemv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
