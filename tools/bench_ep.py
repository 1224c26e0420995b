"""Expert-parallel benchmark: one MoE layer on one GPU (EP = 1) and split over the GPUs of one host
(EP = world), each GPU holding its own batch of M tokens, as data-parallel attention hands them over. Run it
under torchrun, one process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tools/bench_ep.py --out DIR
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tools/bench_ep.py --tokens 1 64 --schemes unquantized
    torchrun --nproc-per-node 2 tools/bench_ep.py --dry-run      # CPU, gloo, tiny shape: checks the tool

For each scheme x M (tokens per GPU) it reports:

- ``ep1_us``: the whole layer on one GPU holding every expert (rank 0 alone; the others wait);
- ``ep_us``: the expert-parallel layer (all-gather dispatch, local experts, reduce-scatter combine), the
  slowest rank's time; tokens/s per GPU = M / time for both;
- ``dispatch_us``, ``experts_us``, ``combine_us``: the three parts alone, each in its own CUDA graph, with the
  bus bandwidth the two collectives reach (nccl-tests' busbw: (world-1)/world of the bytes all ranks receive /
  time) against the link's, measured here by a 256 MiB all-gather;
- ``a2a_dispatch_eager_us``: what the alternative dispatch costs: ``all_to_all_single`` of each token to the
  ranks that own its experts, once per rank, after the per-rank counts are exchanged and copied to the host
  (the device sync that keeps it out of a CUDA graph), against ``agrs_dispatch_eager_us``, our all-gather also
  called eagerly (``dispatch_us`` is ours in a graph, where the other cannot go);
- ``relative_error``: each rank's partial sums against the reference experts on the same gathered rows.

Timings are CUDA-graph replays of GRAPH_CALLS back-to-back calls rotating over weight copies (tools/bench.py's
method), the median over the timing window, the maximum over ranks. Rank 0 appends one JSON line per cell to
``bench_ep.jsonl`` as it goes, writes ``bench_ep.json`` and prints the table at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    DRY_SHAPES,
    GRAPH_CALLS,
    L2_BYTES,
    SHAPES,
    _median_time,
    benchmarked_experts,
    capture_graph,
    make_weights,
    registry_schemes,
    time_call,
)

from moe_registry.core.keys import parse_quant_key  # noqa: E402
from moe_registry.formats.weights import ExpertWeights  # noqa: E402
from moe_registry.layer.all2all import ALL_GATHER, AllGatherReduceScatter, ExpertPlacement  # noqa: E402
from moe_registry.layer.experts import ExpertsConfig  # noqa: E402
from moe_registry.layer.modular import FusedMoEKernel, LocalPrepareFinalize  # noqa: E402

LINK_PROBE_BYTES = 256 << 20


@dataclass(frozen=True)
class Cell:
    """One scheme x M: times in microseconds per layer call, bandwidths in GB/s."""

    scheme: str
    m: int
    world: int
    ep1_us: float
    ep_us: float
    dispatch_us: float
    experts_us: float
    combine_us: float
    dispatch_busbw_gbps: float
    combine_busbw_gbps: float
    agrs_dispatch_eager_us: float
    a2a_dispatch_eager_us: float
    relative_error: float

    @property
    def ep1_tokens_per_s(self) -> float:
        return self.m / self.ep1_us * 1e6

    @property
    def ep_tokens_per_s_per_gpu(self) -> float:
        return self.m / self.ep_us * 1e6


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's value (ranks wait on each other in a collective anyway)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def collective_median(fn, seconds: float, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per call of ``fn``, which holds collectives: every rank must call it equally often, so the
    count (what fills ``seconds`` on the slowest rank, 5 to 2000) is agreed first; the slowest rank's median."""
    fn()
    one = time_call(fn, device)
    n = torch.tensor([max(5, min(2000, int(seconds / max(one, 1e-6))))], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return _slowest(statistics.median(time_call(fn, device) for _ in range(int(n))), device)


def _timed(step, device: torch.device, calls: int, seconds: float,  # type: ignore[no-untyped-def]
           alone: bool = False) -> float:
    """Seconds per call of ``step`` (which makes ``calls`` calls): a CUDA graph replay on a GPU, else eager; the
    slowest rank's, unless this rank runs ``alone`` (no collectives)."""
    run = step
    if device.type == "cuda":
        graph = capture_graph(step)
        run = graph.replay
    if alone:
        return _median_time(run, seconds, device, warmup_seconds=0.05) / calls
    return collective_median(run, seconds, device) / calls


def link_busbw(device: torch.device, world: int, n: int) -> float:
    """Bus bandwidth of an all-gather of ``n`` bytes per rank (nccl-tests' busbw), bytes/s: the link's practical
    rate when ``n`` is large."""
    mine = torch.empty(n, dtype=torch.uint8, device=device)
    out = torch.empty(world * n, dtype=torch.uint8, device=device)
    t = _timed(lambda: ALL_GATHER(out, mine), device, 1, 1.0)
    return (world - 1) / world * out.numel() / t


def _routing(m: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, device: torch.device,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(m, experts, device=device, generator=gen)
    tw, ti = torch.topk(torch.softmax(logits, -1), top_k, -1)
    return x, tw, ti.to(torch.int32)


def a2a_dispatch(x: torch.Tensor, ti: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """The all_to_all_single dispatch: each token once to every rank owning one of its experts. The split
    sizes must be host integers, so the counts are exchanged and copied to the host first."""
    world = placement.world_size
    owner = (ti.long() % world) if placement.round_robin else ti.long() // placement.local_count
    needs = torch.zeros(x.shape[0], world, dtype=torch.bool, device=x.device)
    needs.scatter_(1, owner, True)
    token = needs.t().nonzero(as_tuple=True)[1]  # grouped by destination rank
    send_counts = needs.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    counts = torch.stack([send_counts, recv_counts]).cpu().tolist()  # the device sync
    received = x.new_empty(sum(counts[1]), x.shape[1])
    dist.all_to_all_single(received, x[token], output_split_sizes=counts[1], input_split_sizes=counts[0])
    return received


@dataclass(frozen=True)
class Setup:
    """What every cell of a run shares."""

    rank: int
    world: int
    device: torch.device
    seconds: float
    dry: bool


def bench_scheme(name: str, args: argparse.Namespace, setup: Setup, link: float, out: Path | None) -> list[Cell]:
    """Every M of one scheme: weight copies made once (the whole layer on rank 0 for EP = 1, each rank's share)."""
    scheme = registry_schemes()[name]
    shape = DRY_SHAPES["tiny"] if setup.dry else SHAPES[args.shape]
    wkey, akey = parse_quant_key(scheme.weight), parse_quant_key(scheme.activation)
    dtype = torch.float32 if setup.dry else torch.bfloat16
    mine = ExpertPlacement(shape.experts, setup.world, setup.rank).local_experts()
    probe = make_weights(shape, wkey, akey, dtype, setup.device, seed=0)
    per_expert = sum(t.numel() * t.element_size() for p in (probe.w13, probe.w2)
                     for t in (p.weight, p.scale, p.zero) if t is not None) / shape.experts
    del probe
    copies: list[tuple[ExpertWeights | None, ExpertWeights]] = []
    cells = []
    for m in args.tokens:
        hit = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** (m * setup.world))
        want = 1 if setup.dry else max(1, min(math.ceil(2 * L2_BYTES / max(hit * per_expert / setup.world, 1)),
                                              int(args.weight_gb * 1e9 // (shape.experts * per_expert))))
        while len(copies) < want:
            whole = make_weights(shape, wkey, akey, dtype, setup.device, seed=len(copies))
            copies.append((whole if setup.rank == 0 else None, whole.subset(mine)))
            del whole
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
        x, tw, ti = _routing(m, shape.experts, shape.top_k, shape.hidden, dtype, setup.device,
                             seed=1000 * setup.rank + m)
        cell = bench_cell(name, m, shape.experts, copies, (x, tw, ti), setup)
        cells.append(cell)
        if setup.rank == 0 and out is not None:
            with open(out / "bench_ep.jsonl", "a") as f:
                f.write(json.dumps({**asdict(cell), "link_busbw_gbps": link / 1e9}) + "\n")
            print(f"{name} M={m}: ep1 {cell.ep1_us:.1f} us, ep{setup.world} {cell.ep_us:.1f} us", flush=True)
    return cells


def bench_cell(name: str, m: int, num_experts: int, copies: list[tuple[ExpertWeights | None, ExpertWeights]],
               inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], setup: Setup) -> Cell:
    """One scheme x M: EP = 1 on rank 0, then the expert-parallel layer and its three parts on every rank."""
    from moe_registry_kernels.reference import ReferenceExperts

    x, tw, ti = inputs
    device, config, cls = setup.device, ExpertsConfig(), benchmarked_experts(setup.dry)
    ep1 = 0.0
    if setup.rank == 0:
        whole_layers = [FusedMoEKernel(LocalPrepareFinalize(), cls(w, config), validate=False) for w, _ in copies]
        rounds = math.ceil(GRAPH_CALLS / len(whole_layers))
        ep1 = _timed(lambda: [layer(x, tw, ti) for layer in whole_layers * rounds], device,
                     len(whole_layers) * rounds, setup.seconds, alone=True)
    dist.barrier()
    placement = ExpertPlacement(num_experts, setup.world, setup.rank)
    dispatcher = AllGatherReduceScatter(placement, m, agreement=f"{name}|{m}")
    experts = [cls(part, config) for _, part in copies]
    layers = [FusedMoEKernel(dispatcher, e, validate=False) for e in experts]  # its checks read ids on the host
    rounds = math.ceil(GRAPH_CALLS / len(layers))
    calls = len(layers) * rounds
    layers[0](x, tw, ti)  # first call outside the graphs (NCCL's communicator, Triton's compile)
    ep = _timed(lambda: [layer(x, tw, ti) for layer in layers * rounds], device, calls, setup.seconds)
    prepared = dispatcher.prepare(x, tw, ti)
    partial = experts[0].apply(prepared.hidden, prepared.topk_weights, prepared.topk_ids)
    dispatch = _timed(lambda: [dispatcher.prepare(x, tw, ti) for _ in range(calls)], device, calls, setup.seconds)
    combine = _timed(lambda: [dispatcher.finalize(partial, prepared) for _ in range(calls)], device, calls,
                     setup.seconds)
    experts_t = _timed(lambda: [e.apply(prepared.hidden, prepared.topk_weights, prepared.topk_ids)
                                for e in experts * rounds], device, calls, setup.seconds)
    agrs_eager = collective_median(lambda: dispatcher.prepare(x, tw, ti), setup.seconds, device)
    a2a_eager = collective_median(lambda: a2a_dispatch(x, ti, placement), setup.seconds, device)
    # numerics: this rank's partial sums against the reference experts on the same gathered rows
    ref = ReferenceExperts(copies[0][1], config).apply(prepared.hidden.float(), prepared.topk_weights,
                                                       prepared.topk_ids).float()
    err = _slowest(float((partial.float() - ref).norm() / ref.norm().clamp_min(1e-30)), device)
    world = setup.world
    gathered = world * dispatcher.counters.gathered_bytes // max(dispatcher.counters.calls, 1)  # all ranks receive
    scattered = partial.numel() * partial.element_size()
    return Cell(name, m, world, ep1 * 1e6, ep * 1e6, dispatch * 1e6, experts_t * 1e6, combine * 1e6,
                (world - 1) / world * gathered / dispatch / 1e9, (world - 1) / world * scattered / combine / 1e9,
                agrs_eager * 1e6, a2a_eager * 1e6, err)


def print_table(cells: list[Cell], link: float, probe_bytes: int) -> None:
    print(f"link: all-gather busbw {link / 1e9:.1f} GB/s ({probe_bytes >> 20} MiB per rank)")
    head = (f"{'scheme':<16}{'M/GPU':>6}{'EP1 us':>9}{'EPn us':>9}{'tok/s/GPU EP1':>15}{'EPn':>11}"
            f"{'disp us':>9}{'exp us':>9}{'comb us':>9}{'disp GB/s':>10}{'comb GB/s':>10}{'a2a us':>9}{'agrs us':>9}")
    print(head)
    for c in cells:
        print(f"{c.scheme[:15]:<16}{c.m:>6}{c.ep1_us:>9.1f}{c.ep_us:>9.1f}{c.ep1_tokens_per_s:>15.3g}"
              f"{c.ep_tokens_per_s_per_gpu:>11.3g}{c.dispatch_us:>9.1f}{c.experts_us:>9.1f}{c.combine_us:>9.1f}"
              f"{c.dispatch_busbw_gbps:>10.1f}{c.combine_busbw_gbps:>10.1f}{c.a2a_dispatch_eager_us:>9.1f}"
              f"{c.agrs_dispatch_eager_us:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3", choices=sorted(SHAPES), help="layer shape (default qwen3: "
                   "Qwen3-30B-A3B, 128 experts, top-8, hidden 2048, intermediate 768)")
    p.add_argument("--schemes", nargs="+", default=["unquantized", "fp8-block128"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096], help="tokens per GPU, M "
                   "(not --m: torchrun would take that for its own --max-restarts)")
    p.add_argument("--seconds", type=float, default=0.3, help="timing window per measurement")
    p.add_argument("--weight-gb", type=float, default=8.0, help="cap on the weight copies rotated out of L2")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, a tiny shape: checks the tool runs")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("start it with torchrun --nproc-per-node N (one process per GPU)")
    known = registry_schemes()
    unknown = [s for s in args.schemes if s not in known]
    if unknown:
        p.error(f"unknown scheme(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    on_gpu = torch.cuda.is_available() and not args.dry_run
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if args.out is not None and rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_ep.jsonl").write_text("")
        probe = (1 << 20) if not on_gpu else LINK_PROBE_BYTES
        link = link_busbw(device, world, probe)
        setup = Setup(rank, world, device, args.seconds, dry=not on_gpu)  # no GPU: the dry run
        cells = [c for name in args.schemes for c in bench_scheme(name, args, setup, link, args.out)]
        if rank == 0:
            if args.out is not None:
                env = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "world": world,
                       "torch": torch.__version__, "shape": args.shape, "link_busbw_gbps": link / 1e9,
                       "link_probe_bytes": probe}
                (args.out / "bench_ep.json").write_text(json.dumps(
                    {"environment": env, "cells": [{**asdict(c), "ep1_tokens_per_s": c.ep1_tokens_per_s,
                                                    "ep_tokens_per_s_per_gpu": c.ep_tokens_per_s_per_gpu}
                                                   for c in cells]}, indent=1))
            print_table(cells, link, probe)
            dtype = "float32" if not on_gpu else "bfloat16"
            wrong = [c for c in cells if c.relative_error > known[c.scheme].tolerance_for(dtype)]
            for c in wrong:
                print(f"{c.scheme} M={c.m}: relative error {c.relative_error:.2e} is above the scheme's tolerance "
                      f"{known[c.scheme].tolerance_for(dtype):.0e}", file=sys.stderr)
            if wrong:
                return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
