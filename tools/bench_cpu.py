"""CPU benchmark of the torch reference experts for every shipped scheme's key pair.

Each layer call is timed (median over repeats) and compared with a plain unquantized torch layer
of the same shape (dense weights, per-expert matmuls), so the table shows what the scheme's
numerics (activation quantisation, dequantized-weight reads) cost on top of the GEMMs.

    python tools/bench_cpu.py [--experts 8] [--top-k 2] [--hidden 1024] [--intermediate 512]
                              [--tokens 16] [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from moe_registry_kernels.activations import act_and_mul
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import ReferenceExperts

from moe_registry.experts import ExpertsConfig
from moe_registry.keys import parse_quant_key
from moe_registry.routing import softmax_topk


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_key: str
    activation_key: str


SCHEMES = [
    Scheme("unquantized-bf16", "unquantized", "unquantized"),
    Scheme("awq-w4a16-g128", "uint4 scale:float16:group(128):static zp:group", "unquantized"),
    Scheme("gptq-w4a16-g128", "uint4b8 scale:float16:group(128):static", "unquantized"),
    Scheme("gptq-w8a16-g128", "uint8b128 scale:float16:group(128):static", "unquantized"),
    Scheme("w8a8-int8", "int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic"),
    Scheme("w4a8", "uint4 scale:float16:group(128):static zp:group", "int8 scale:float32:token:dynamic"),
    Scheme("mxfp8", "fp8e4m3 scale:e8m0:block(1x32):static", "fp8e4m3 scale:e8m0:block(1x32):dynamic"),
    Scheme("fp8-block128", "fp8e4m3 scale:float32:block(128x128):static",
           "fp8e4m3 scale:float32:group(128):dynamic"),
]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Row:
    scheme: str
    weight_key: str
    activation_key: str
    median_ms: float
    ratio: float


def median_ms(fns: list[Callable[[], object]], repeats: int, warmup: int = 3) -> list[float]:
    """Median ms per call of each fn, timed round-robin so load from other processes hits all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns, strict=True):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def plain_layer(w13: torch.Tensor, w2: torch.Tensor, activation: str) -> Callable[..., torch.Tensor]:
    """The unquantized baseline: per-expert matmuls on dense weights, weighted index_add."""

    def run(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        x = hidden.to(w13.dtype)
        out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=w13.dtype)
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        tokens = order // topk_ids.shape[1]
        router = topk_weights.reshape(-1)[order].to(w13.dtype)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=w13.shape[0]).tolist()):
            if n:
                tok = tokens[start:start + n]
                y = act_and_mul(x[tok] @ w13[e].T, activation) @ w2[e].T
                out.index_add_(0, tok, y * router[start:start + n, None])
                start += n
        return out.to(hidden.dtype)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="activation dtype")
    ap.add_argument("--baseline-dtype", choices=list(DTYPES), default="float32",
                    help="weight dtype of the plain unquantized layer")
    ap.add_argument("--activation", choices=["silu", "gelu", "swigluoai"], default="silu")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)

    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(dtype)
    routing = softmax_topk(torch.randn(args.tokens, args.experts, generator=gen), args.top_k, True)
    config = ExpertsConfig(args.activation)

    bdt = DTYPES[args.baseline_dtype]
    w13 = torch.randn(args.experts, 2 * args.intermediate, args.hidden, generator=gen).to(bdt)
    w2 = torch.randn(args.experts, args.hidden, args.intermediate, generator=gen).to(bdt)
    base = plain_layer(w13, w2, args.activation)
    calls = [lambda: base(hidden, routing.topk_weights, routing.topk_ids)]
    for s in SCHEMES:
        weights = make_random_expert_weights(
            parse_quant_key(s.weight_key), parse_quant_key(s.activation_key), num_experts=args.experts,
            hidden=args.hidden, intermediate=args.intermediate, dtype=dtype, bias=False, act_order=False,
            seed=1)
        experts = ReferenceExperts(weights, config)
        calls.append(lambda e=experts: e.apply(hidden, routing.topk_weights, routing.topk_ids))
    base_ms, *scheme_ms = median_ms(calls, args.repeats)
    rows = [Row(s.name, s.weight_key, s.activation_key, ms, ms / base_ms)
            for s, ms in zip(SCHEMES, scheme_ms, strict=True)]

    if args.json:
        shape = {k: getattr(args, k) for k in ("experts", "top_k", "hidden", "intermediate", "tokens", "dtype")}
        doc = {"shape": shape, "threads": torch.get_num_threads(), "baseline_ms": base_ms,
               "baseline_dtype": args.baseline_dtype, "rows": [asdict(r) for r in rows]}
        print(json.dumps(doc, indent=2))
        return 0
    print(f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate} M={args.tokens} "
          f"{args.dtype} {args.activation}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"baseline: plain {args.baseline_dtype} per-expert matmuls {base_ms:.3f} ms")
    header = ("scheme", "weight key", "activation key", "ms", "x plain")
    table = [(r.scheme, r.weight_key, r.activation_key, f"{r.median_ms:.3f}", f"{r.ratio:.2f}") for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table, strict=True)]
    for i, line in enumerate([header, *table]):
        print("  ".join(c.rjust(w) if j >= 3 else c.ljust(w) for j, (c, w) in enumerate(zip(line, widths,
                                                                                           strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
