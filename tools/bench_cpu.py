"""CPU benchmark of a CPU experts kernel for every shipped quantized key pair, against a plain float32 layer.

Rows come from the scheme specs: every scheme that lists a ``--kernel`` (default torch-cpu-packed;
several, comma-separated, are timed side by side), bound as tools/bench.py binds them (group 128 and no
act-order where the spec allows it), one row per distinct quantized (weight key, activation key) and
kernel claiming it, with the schemes that share it. The kernels of one key pair and a plain float32
per-expert torch layer of the same shape are timed round-robin in the same run (median of
``--repeats``), so load from other processes hits them alike: ``x_plain`` = kernel ms / plain ms.
``weight_bytes_resident`` is every tensor storage reachable from the built kernel right after building
(``moe_registry.layer.resident``: weights, scales, zero points and anything else it keeps; the fp8
dequantisation tile, made at the first call, is workspace and not counted);
``weight_bytes_packed`` the checkpoint's bytes for the expert weights, scales and zero points. Large layers
are built from ``--distinct`` random experts copied to E (real copies: every expert has its own
memory).

    python tools/bench_cpu.py [--preset small|qwen3-30b-a3b] [--tokens 1,16] [--threads 2]
                              [--kernel torch-cpu-native,torch-cpu-packed]
                              [--repeats 20] [--reference] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from moe_registry_kernels.activations import act_and_mul
from moe_registry_kernels.cpu_packed import packed_checkpoint_bytes
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import ReferenceExperts

from moe_registry.core.keys import QuantKey, parse_quant_key
from moe_registry.core.vocab import ACTIVATION_FNS
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.build import experts_class
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.layer.routing import softmax_topk
from moe_registry.spec.loader import load_registry

PRESETS = {  # experts, top-k, hidden, intermediate
    "small": (8, 2, 1024, 512),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Row:
    scheme: str
    schemes: list[str]
    weight_key: str
    activation_key: str
    kernel: str
    tokens: int
    ms: float
    plain_ms: float
    x_plain: float
    weight_bytes_resident: int
    weight_bytes_packed: int
    resident_over_packed: float
    reference_ms: float | None = None


def median_ms(fns: list[Callable[[], object]], repeats: int, warmup: int = 2) -> list[float]:
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


def _tile(t: torch.Tensor | None, experts: int) -> torch.Tensor | None:
    """[e, ...] -> [experts, ...] by copying (each expert gets its own memory)."""
    if t is None or t.dim() == 0 or t.shape[0] == experts:
        return t
    reps = -(-experts // t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:experts].contiguous()


def random_weights(wkey: QuantKey, akey: QuantKey, experts: int, distinct: int, hidden: int, intermediate: int,
                   dtype: torch.dtype) -> ExpertWeights:
    w = make_random_expert_weights(wkey, akey, num_experts=min(experts, distinct), hidden=hidden,
                                   intermediate=intermediate, dtype=dtype, seed=1)

    def grow(p: ProjectionWeights) -> ProjectionWeights:
        return dataclasses.replace(p, weight=_tile(p.weight, experts), scale=_tile(p.scale, experts),
                                   zero=_tile(p.zero, experts), bias=_tile(p.bias, experts),
                                   scale2=_tile(p.scale2, experts))
    return ExpertWeights(grow(w.w13), grow(w.w2), w.weight_key, w.activation_key)


def key_pairs(kernel: str) -> list[tuple[list[str], QuantKey, QuantKey]]:
    """(schemes, weight key, activation key) for each distinct quantized pair the kernel claims."""
    from bench import registry_schemes, same_keys

    pairs = same_keys(registry_schemes(kernel))
    keys = [(names, parse_quant_key(w), parse_quant_key(a)) for (w, a), names in pairs.items()]
    return [(names, w, a) for names, w, a in keys if w.quantized]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="small",
                    help="small: E=8 top-2 H=1024 I=512; qwen3-30b-a3b: E=128 top-8 H=2048 I=768")
    ap.add_argument("--experts", type=int, help="override the preset's experts")
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--tokens", default="16", help="comma-separated token counts M, e.g. 1,16")
    ap.add_argument("--kernel", default="torch-cpu-packed",
                    help="kernel name, or several comma-separated (timed side by side on the key pairs they share)")
    ap.add_argument("--distinct", type=int, default=16, help="distinct random experts, copied up to E")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="activation dtype")
    ap.add_argument("--activation", choices=ACTIVATION_FNS, default="silu")
    ap.add_argument("--reference", action="store_true", help="also time the torch reference (dense float32)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    e0, k0, h0, i0 = PRESETS[args.preset]
    experts, top_k = args.experts or e0, args.top_k or k0
    hidden_size, inter = args.hidden or h0, args.intermediate or i0
    dtype = DTYPES[args.dtype]
    config = ExpertsConfig(args.activation)
    registry = load_registry()
    kernels = args.kernel.split(",")
    classes = {k: experts_class(registry.kernel(k)) for k in kernels}
    gen = torch.Generator().manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    inputs = {}
    for m in tokens:
        hidden = torch.randn(m, hidden_size, generator=gen).to(dtype)
        inputs[m] = (hidden, softmax_topk(torch.randn(m, experts, generator=gen), top_k, True))
    d = min(experts, args.distinct)
    w13 = _tile(torch.randn(d, 2 * inter, hidden_size, generator=gen) / hidden_size ** 0.5, experts)
    w2 = _tile(torch.randn(d, hidden_size, inter, generator=gen) / inter ** 0.5, experts)
    assert w13 is not None and w2 is not None
    plain = plain_layer(w13, w2, args.activation)
    plain_bytes = w13.nbytes + w2.nbytes

    pairs: dict[tuple[str, str], tuple[list[str], QuantKey, QuantKey, list[str]]] = {}
    for kernel in kernels:  # each distinct key pair once, with the kernels that claim it
        for names, wkey, akey in key_pairs(kernel):
            row = pairs.setdefault((str(wkey), str(akey)), ([], wkey, akey, []))
            row[0].extend(n for n in names if n not in row[0])
            row[3].append(kernel)
    rows: list[Row] = []
    for names, wkey, akey, claiming in pairs.values():
        names.sort()
        weights = random_weights(wkey, akey, experts, args.distinct, hidden_size, inter, dtype)
        packed_bytes = packed_checkpoint_bytes(weights)
        built = {k: classes[k](weights, config) for k in claiming}
        del weights
        gc.collect()
        resident = {k: reachable_tensor_bytes(obj) for k, obj in built.items()}  # every tensor each keeps reachable
        ref = None
        if args.reference:
            ref = ReferenceExperts(random_weights(wkey, akey, experts, args.distinct, hidden_size, inter, dtype),
                                   config)
        for m in tokens:
            hidden, routing = inputs[m]
            fns: list[Callable[[], object]] = [lambda h=hidden, r=routing: plain(h, r.topk_weights, r.topk_ids)]
            fns += [lambda h=hidden, r=routing, k=obj: k.apply(h, r.topk_weights, r.topk_ids) for obj in built.values()]
            if ref is not None:
                fns.append(lambda h=hidden, r=routing, k=ref: k.apply(h, r.topk_weights, r.topk_ids))
            plain_ms, *times = median_ms(fns, args.repeats)
            ref_ms = times[len(built)] if ref is not None else None
            for k, ms in zip(built, times, strict=False):
                rows.append(Row(names[0], names, str(wkey), str(akey), k, m, ms, plain_ms, ms / plain_ms,
                                resident[k], packed_bytes, resident[k] / packed_bytes, ref_ms))
        built = ref = None  # free this row's layers before building the next
        gc.collect()

    shape = {"experts": experts, "top_k": top_k, "hidden": hidden_size, "intermediate": inter, "dtype": args.dtype}
    if args.json:
        doc = {"shape": shape, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
               "plain_weight_bytes": plain_bytes, "rows": [asdict(r) for r in rows]}
        print(json.dumps(doc, indent=2))
        return 0
    print(f"E={experts} top-{top_k} H={hidden_size} I={inter} {args.dtype} {args.activation}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}; "
          f"plain float32 layer {plain_bytes / 2**20:.0f} MiB")
    header = ("scheme (+ same keys)", "kernel", "M", "ms", "plain ms", "x plain", "resident MiB", "packed MiB",
              "res/packed")
    table = [(r.scheme + (f" (+{len(r.schemes) - 1})" if len(r.schemes) > 1 else ""), r.kernel, str(r.tokens),
              f"{r.ms:.3f}",
              f"{r.plain_ms:.3f}", f"{r.x_plain:.2f}", f"{r.weight_bytes_resident / 2**20:.1f}",
              f"{r.weight_bytes_packed / 2**20:.1f}", f"{r.resident_over_packed:.3f}") for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table, strict=True)]
    for i, line in enumerate([header, *table]):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths,
                                                                                           strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
