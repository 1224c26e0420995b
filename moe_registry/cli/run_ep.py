"""``moe-registry run`` across the ranks torchrun starts: each rank builds its share of the
layer's experts (reading only their tensors), takes its contiguous share of the tokens (data parallel; a rank
may get none), and the all2all backend moves tokens between the ranks. Every rank knows every token (the
inputs are read, or drawn from the seed, identically on each), so after the timed calls one all-gather of the
outputs and one all-reduce of each rank's float64 reference part (its experts' share of every token) let
every rank compute the same error and exit code; rank 0 alone writes the output and prints the report.
These collectives run after the layer's forwards, never inside one."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from moe_registry.cli.run import _sync, default_threads, layer_inputs
from moe_registry.cli.run_checks import TORCHRUN_VARS, check_common_flags
from moe_registry.core import guards
from moe_registry.core.errors import ConfigError, MoERegistryError, SelectionError
from moe_registry.layer.all2all import (
    ALL_GATHER,
    BACKENDS,
    DEFAULT_BACKEND,
    AllGatherReduceScatter,
    collective,
)
from moe_registry.layer.build import DTYPES, build
from moe_registry.layer.moe_layer import MoELayer
from moe_registry.oracle.contract import Report

EP_REPEAT = 5  # timed calls per rank without --repeat


@dataclass(frozen=True)
class TorchrunEnv:
    """Where torchrun put this process."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's place when torchrun started it (RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR set), else None."""
    if not all(os.environ.get(v) for v in TORCHRUN_VARS):
        return None
    try:
        return TorchrunEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    except ValueError:
        raise ConfigError(f"torchrun environment: RANK={os.environ['RANK']!r}, WORLD_SIZE="
                          f"{os.environ['WORLD_SIZE']!r}, LOCAL_RANK={os.environ['LOCAL_RANK']!r}; "
                          "wanted integers") from None


@dataclass(frozen=True)
class RankResult:
    """What one rank did: its experts and tokens, the (token, expert) pairs its experts computed, what its
    dispatcher sent per forward and its time per call."""

    rank: int
    experts: int
    tokens: int
    pairs: int
    bytes_sent: int
    bytes_gathered: int
    bytes_scattered: int
    median_ms: float
    min_ms: float
    max_ms: float


@dataclass(frozen=True)
class EPRunResult:
    """The whole run: error against float64 over every token, the slowest rank's median call time."""

    tokens: int
    relative_error: float
    tolerance: float
    median_ms: float
    device: str
    world_size: int
    all2all: str
    max_tokens: int
    repeat: int
    threads: int
    ranks: tuple[RankResult, ...]

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance


def check_ep_flags(args: argparse.Namespace, env: TorchrunEnv) -> str:
    """Refuse, before joining the group, what the ranks cannot run; returns the all2all backend."""
    world = env.world_size
    if args.ep is None:
        raise ConfigError(f"torchrun started {world} ranks: pass --ep {world} (the ranks split the layer's experts)")
    if args.ep != world:
        raise ConfigError(f"--ep {args.ep}: torchrun started {world} ranks (WORLD_SIZE); wanted --ep {world}")
    if args.dp not in (None, 1):
        raise ConfigError(f"--dp {args.dp}: under torchrun the {world} ranks already split the tokens "
                          "(data parallel beside --ep); wanted no --dp")
    backend = args.all2all or DEFAULT_BACKEND
    if backend not in BACKENDS:
        raise ConfigError(f"--all2all {backend}: {world} ranks must move tokens between them; wanted one of "
                          f"{', '.join(sorted(BACKENDS))}")
    check_common_flags(args)
    return backend


def count_tokens(args: argparse.Namespace) -> int:
    """How many tokens the run has (the inputs file's header, or --tokens), known before building, since the
    per-rank token budget follows from it."""
    if not args.inputs:
        return int(args.tokens)
    try:
        with safe_open(str(args.inputs), framework="pt") as f:
            if "hidden_states" not in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                raise ConfigError(f"{args.inputs}: no tensor named hidden_states")
            shape = f.get_slice("hidden_states").get_shape()
    except (OSError, RuntimeError, SafetensorError) as err:
        raise ConfigError(f"{args.inputs}: cannot read safetensors: {err}") from None
    if len(shape) != 2 or shape[0] < 1:
        raise ConfigError(f"{args.inputs}: hidden_states shape {list(shape)}; expected [tokens, hidden]")
    return int(shape[0])


def run_ep_command(args: argparse.Namespace, env: TorchrunEnv) -> int:
    """One rank's part of ``run`` under torchrun. Ranks other than 0 print nothing, errors included (each
    rank meets the same error; rank 0 says it); the exit code is the same on every rank."""
    try:
        return _run_ep_command(args, env)
    except (SelectionError, MoERegistryError) as err:
        if env.rank == 0:
            raise
        return 1 if isinstance(err, SelectionError) else 2


def _run_ep_command(args: argparse.Namespace, env: TorchrunEnv) -> int:
    backend = check_ep_flags(args, env)
    tokens = count_tokens(args)
    share = math.ceil(tokens / env.world_size)
    budget = args.max_tokens or share
    if budget < share:
        raise ConfigError(f"--max-tokens: {share} tokens per rank ({tokens} over {env.world_size} ranks); the token "
                          f"budget is {budget}")
    on_gpu = args.platform != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if on_gpu else None
    if on_gpu:
        torch.cuda.set_device(device)
    threads = args.threads or default_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo")  # CUDA tensors over NCCL, CPU over gloo
    try:
        report, result, out = _run_ep(args, env, backend, tokens, share, budget, device, threads)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)
    code = 0 if result.ok else 1
    if env.rank == 0:
        if args.save_output:
            guards.write_bytes(Path(args.save_output), save({"output": out.detach().cpu().contiguous()},
                                                            metadata={"format": "pt"}), "--save-output")
        _print(args, report, result, code)
    return code


def _run_ep(args: argparse.Namespace, env: TorchrunEnv, backend: str, tokens: int, share: int, budget: int,
            device: torch.device | None, threads: int) -> tuple[Report, EPRunResult, torch.Tensor]:
    from moe_registry_kernels.reference import reference_moe

    layer = build(args.target, layer=args.layer, platform=args.platform, dtype=args.dtype, kernel=args.kernel,
                  prefer=args.prefer, spec_dirs=args.spec_dir, tp=args.tp, ep=env.world_size, max_tokens=budget,
                  all2all=backend, device=device, expert_placement=args.expert_placement, keep_weights=True)
    built = layer.built
    runtime = built.report.situation.runtime
    dev = built.kernel.experts.weights.device
    shape = layer.model.shape
    x, routing = layer_inputs(args, shape, tokens)
    x = x.to(dev, DTYPES[runtime.dtype])
    if routing is None:
        routing = MoELayer(layer).route(x)  # every rank routes every token alike; each runs its share
    ids, w = routing.topk_ids.to(dev), routing.topk_weights.to(dev)
    lo, hi = min(env.rank * share, tokens), min((env.rank + 1) * share, tokens)
    mine = (x[lo:hi], w[lo:hi], ids[lo:hi])
    out = built.kernel(*mine)
    _sync(dev)
    times = []
    for _ in range(args.repeat or EP_REPEAT):  # a fixed count: every rank joins the same collectives
        t0 = time.perf_counter()
        built.kernel(*mine)
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    dispatcher = built.kernel.prepare_finalize
    assert isinstance(dispatcher, AllGatherReduceScatter)
    counters = dispatcher.counters
    placement = dispatcher.placement
    local_ids = placement.local_ids().to(dev)[ids.long()]  # this rank's experts' pairs; others FOREIGN (-1)
    pairs = int((local_ids >= 0).sum())
    # After the forwards: every rank gets the whole output and the float64 reference (sum of the ranks' parts)
    padded = out.new_zeros(share, out.shape[1])
    padded[:hi - lo] = out
    whole = padded.new_empty(env.world_size * share, out.shape[1])
    collective("all_gather (outputs)", env.rank, env.world_size, lambda: ALL_GATHER(whole, padded))
    whole = whole[:tokens]
    config = built.kernel.experts.config
    ref = reference_moe(x.cpu(), w.cpu(), local_ids.cpu(), built.weights.to("cpu"), config, torch.float64).to(dev)
    collective("all_reduce (reference)", env.rank, env.world_size, lambda: dist.all_reduce(ref))
    err = float((whole.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    if not bool(torch.isfinite(whole).all()):
        source = args.inputs or f"--tokens {tokens} (random)"
        raise ConfigError(f"{source}: output values are NaN or infinite in {runtime.dtype} (the hidden states "
                          "overflow it); nothing was written")
    calls = max(counters.calls, 1)
    mine_stats = torch.tensor([placement.local_count, hi - lo, pairs, counters.sent_bytes // calls,
                               counters.gathered_bytes // calls, counters.scattered_bytes // calls,
                               statistics.median(times), min(times), max(times)], dtype=torch.float64, device=dev)
    stats = mine_stats.new_empty(env.world_size * mine_stats.numel())
    collective("all_gather (rank results)", env.rank, env.world_size, lambda: ALL_GATHER(stats, mine_stats))
    rows = stats.view(env.world_size, -1).cpu().tolist()
    ranks = tuple(RankResult(r, int(s[0]), int(s[1]), int(s[2]), int(s[3]), int(s[4]), int(s[5]), s[6], s[7], s[8])
                  for r, s in enumerate(rows))
    result = EPRunResult(tokens, err, built.tolerance, max(r.median_ms for r in ranks), str(dev), env.world_size,
                         backend, budget, len(times), threads, ranks)
    return built.report, result, whole


def _print(args: argparse.Namespace, report: Report, result: EPRunResult, code: int) -> None:
    if args.json:
        body = {"report": report.to_dict(args.verbose),
                "result": {**asdict(result), "ranks": [asdict(r) for r in result.ranks], "ok": result.ok},
                "exit_code": code}
        if not result.ok:
            body["error"] = (f"relative error {result.relative_error:.3e} is above the scheme's tolerance "
                             f"{result.tolerance:.1e}")
        print(json.dumps(body))
        return
    print(report.to_text(args.verbose))
    print()
    rows = [("tokens", f"{result.tokens} over {result.world_size} ranks (at most {result.max_tokens} each)"),
            ("device", f"{result.device} x {result.world_size} ({result.threads} CPU threads each), "
                       f"all2all {result.all2all}"),
            ("rel. error", f"{result.relative_error:.3e} vs float64 reference "
                           f"(tolerance {result.tolerance:.1e}: {'ok' if result.ok else 'TOO LARGE'})"),
            ("time", f"{result.median_ms:.3f} ms per call (the slowest rank's median of {result.repeat})")]
    if args.save_output:
        rows.append(("output", args.save_output))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    print()
    table = [("rank", "experts", "tokens", "pairs", "bytes sent/call", "median ms")]
    table += [(str(r.rank), str(r.experts), str(r.tokens), str(r.pairs), str(r.bytes_sent), f"{r.median_ms:.3f}")
              for r in result.ranks]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    print("\n".join("  ".join(c.rjust(widths[i]) for i, c in enumerate(row)) for row in table))
    if not result.ok:
        print(f"error: relative error {result.relative_error:.3e} is above the scheme's tolerance "
              f"{result.tolerance:.1e}", file=sys.stderr)
