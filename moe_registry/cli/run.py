"""``moe-registry run``: load one MoE layer, run it on hidden states, compare with the float64
dequantised reference, and time it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from moe_registry.core import guards
from moe_registry.core.errors import ConfigError
from moe_registry.layer.build import DTYPES, MoELayer, build
from moe_registry.model.routing import Routing, from_given
from moe_registry.oracle.contract import Report
from moe_registry.oracle.runtime import MoEShape


@dataclass(frozen=True)
class RunResult:
    """What a run measured."""

    tokens: int
    relative_error: float
    tolerance: float
    median_ms: float
    device: str
    min_ms: float = 0.0
    max_ms: float = 0.0
    repeat: int = 1
    threads: int = 1

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance


def read_inputs(path: Path, hidden: int, num_experts: int) -> tuple[torch.Tensor, Routing | None]:
    """hidden_states [M, H] and, optionally, topk_ids/topk_weights from a safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if "hidden_states" not in names:
                raise ConfigError(f"{path}: no tensor named hidden_states (found {', '.join(sorted(names)) or 'none'})")
            guards.check_run_input_names(path, names)
            x = f.get_tensor("hidden_states")
            ids = f.get_tensor("topk_ids") if "topk_ids" in names else None
            w = f.get_tensor("topk_weights") if "topk_weights" in names else None
    except (OSError, RuntimeError, SafetensorError) as err:
        raise ConfigError(f"{path}: cannot read safetensors: {err}") from None
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ConfigError(f"{path}: hidden_states shape {list(x.shape)}; expected [tokens, {hidden}]")
    if (ids is None) != (w is None):
        raise ConfigError(f"{path}: give both topk_ids and topk_weights, or neither")
    if ids is None or w is None:
        return x, None
    try:
        return x, from_given(ids.to(torch.int32), w.to(torch.float32), num_experts)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_threads() -> int:
    """The CPUs this process may run on (a cpuset or taskset counts, unlike torch's default)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_run_flags(args: argparse.Namespace) -> None:
    """Refuse, before loading anything, the flags one process cannot honour and bad values."""
    check_one_process_flags(args)
    check_common_flags(args)


def check_one_process_flags(args: argparse.Namespace) -> None:
    """Outside torchrun, run is one process: no expert or data parallelism, no all2all."""
    for flag, value in (("--ep", args.ep), ("--dp", args.dp)):
        if value is not None and value > 1:
            how = ("that each call moe_registry.build(..., ep={v}, all2all='allgather_reducescatter')"
                   if flag == "--ep" else "that each run their own tokens").format(v=value)
            raise ConfigError(f"{flag} {value}: run is one process and joins no process group; start {value} ranks "
                              f"(e.g. `torchrun --nproc-per-node {value} ...`) {how} "
                              f"(use `moe-registry explain {flag} {value}` to see the kernel choice)")
    if args.all2all not in (None, "none"):
        raise ConfigError(f"--all2all {args.all2all}: an all2all dispatches between expert-parallel ranks; "
                          "run is one process (ep=1), so only 'none' applies")


def check_common_flags(args: argparse.Namespace) -> None:
    """Values every run must have right, one process or many."""
    for flag, value in (("--repeat", args.repeat), ("--tokens", args.tokens), ("--threads", args.threads),
                        ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}: got {value}; wanted at least 1")
    for flag, value, most in (("--tokens", args.tokens, guards.MAX_RUN_TOKENS), ("--repeat", args.repeat, 100_000),
                              ("--threads", args.threads, 4096)):
        if value is not None:  # e.g. --tokens 1000000000 would die allocating
            guards.check_int(value, flag, lo=1, hi=most)
    if args.save_output:
        guards.check_output_path(Path(args.save_output), "--save-output")
    if args.inputs:  # a regular file: a FIFO would block the read
        guards.check_file(Path(args.inputs), "--inputs file")


def run_layer(args: argparse.Namespace) -> tuple[Report, RunResult, torch.Tensor]:
    """Build the layer and measure it; returns the oracle's report, the result and the output.
    Torch uses ``--threads`` CPU threads (default: every CPU this process may use) while it runs."""
    check_run_flags(args)
    threads = args.threads or default_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_layer(args, threads)
    finally:
        torch.set_num_threads(before)


def layer_inputs(args: argparse.Namespace, shape: MoEShape, tokens: int) -> tuple[torch.Tensor, Routing | None]:
    """The hidden states (float32) and the routing, if given: ``--inputs``, checked, or ``tokens`` seeded random
    rows (the same on every rank)."""
    if not args.inputs:
        return torch.randn(tokens, shape.hidden, generator=torch.Generator().manual_seed(args.seed)), None
    x, routing = read_inputs(Path(args.inputs), shape.hidden, shape.num_experts)
    guards.check_run_inputs(Path(args.inputs), x, None if routing is None else routing.topk_ids, shape.top_k)
    return x, routing


def _run_layer(args: argparse.Namespace, threads: int) -> tuple[Report, RunResult, torch.Tensor]:
    from moe_registry_kernels.reference import reference_moe

    layer = build(args.target, layer=args.layer, platform=args.platform, dtype=args.dtype, kernel=args.kernel,
                  prefer=args.prefer, spec_dirs=args.spec_dir, tp=args.tp, ep=args.ep, max_tokens=args.max_tokens,
                  keep_weights=True)
    built = layer.built
    runtime = built.report.situation.runtime
    dtype = DTYPES[runtime.dtype]
    device = built.kernel.experts.weights.device
    shape = layer.model.shape
    x, routing = layer_inputs(args, shape, args.tokens)
    if x.shape[0] > runtime.max_tokens:
        raise ConfigError(f"--max-tokens: {x.shape[0]} tokens to run; the token budget is {runtime.max_tokens}")
    x = x.to(device, dtype)
    if routing is None:
        routing = MoELayer(layer).route(x)
    ids, w = routing.topk_ids.to(device), routing.topk_weights.to(device)

    def call() -> torch.Tensor:
        return built.kernel(x, w, ids)

    out = call()
    _sync(device)
    bad = int((~torch.isfinite(out)).sum())
    if bad:  # weights and inputs were checked finite: the dtype overflowed; write nothing
        source = args.inputs or f"--tokens {args.tokens} (random)"
        raise ConfigError(f"{source}: {bad} of {out.numel()} output values are NaN or infinite in {runtime.dtype} "
                          "(the hidden states overflow it); nothing was written")
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    config = built.kernel.experts.config  # the layer's own (activation, router weight on the input)
    ref = reference_moe(x.cpu(), w.cpu(), ids.cpu(), built.weights.to("cpu"), config, torch.float64)
    err = float((out.cpu().double() - ref).norm() / ref.norm().clamp_min(1e-30))
    result = RunResult(int(x.shape[0]), err, built.tolerance, statistics.median(times), str(device),
                       min(times), max(times), len(times), threads)
    return built.report, result, out


def run_layer_command(args: argparse.Namespace) -> int:
    """``moe-registry run`` in one process: exit 0 within the scheme's tolerance, 1 outside it (under torchrun
    ``cli.run_ep`` runs instead)."""
    report, result, out = run_layer(args)
    if args.save_output:
        guards.write_bytes(Path(args.save_output), save({"output": out.detach().cpu().contiguous()},
                                                        metadata={"format": "pt"}), "--save-output")
    code = 0 if result.ok else 1
    if args.json:
        body = {"report": report.to_dict(args.verbose), "result": {**result.__dict__, "ok": result.ok},
                "exit_code": code}
        if not result.ok:
            body["error"] = (f"relative error {result.relative_error:.3e} is above the scheme's tolerance "
                             f"{result.tolerance:.1e}")
        print(json.dumps(body))
    else:
        print(report.to_text(args.verbose))
        print()
        rows = [("tokens", str(result.tokens)), ("device", f"{result.device} ({result.threads} CPU threads)"),
                ("rel. error", f"{result.relative_error:.3e} vs float64 reference "
                               f"(tolerance {result.tolerance:.1e}: {'ok' if result.ok else 'TOO LARGE'})"),
                ("time", f"{result.median_ms:.3f} ms per call (median of {result.repeat}; "
                         f"min {result.min_ms:.3f}, max {result.max_ms:.3f})")]
        if args.save_output:
            rows.append(("output", args.save_output))
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
        if not result.ok:
            print(f"error: relative error {result.relative_error:.3e} is above the scheme's tolerance "
                  f"{result.tolerance:.1e}", file=sys.stderr)
    return code
