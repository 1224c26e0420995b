"""``moe-registry run``: load one MoE layer, run it on hidden states, compare with the float64
dequantised reference, and time it."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from moe_registry.cli.run_checks import check_inputs_header, check_router, check_run_flags, layer_situation
from moe_registry.core import guards
from moe_registry.core.errors import ConfigError
from moe_registry.layer.build import DTYPES, build
from moe_registry.layer.moe_layer import MoELayer
from moe_registry.layer.routing import Routing, correction_bias_note, from_given
from moe_registry.oracle.contract import Report
from moe_registry.oracle.render import TEXT_WIDTH, wrap
from moe_registry.situation.runtime import MoEShape


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
    p25_ms: float = 0.0  # the middle half of the timed calls lies between p25 and p75: the spread
    p75_ms: float = 0.0
    notes: tuple[str, ...] = ()  # what the user should know about this run's inputs (e.g. a degenerate router)

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance


def read_inputs(path: Path, hidden: int, num_experts: int) -> tuple[torch.Tensor, Routing | None]:
    """hidden_states [M, H] and, optionally, topk_ids/topk_weights from a safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            check_inputs_header(path, {n: f.get_slice(n).get_shape() for n in names}, hidden)
            x = f.get_tensor("hidden_states")
            ids = f.get_tensor("topk_ids") if "topk_ids" in names else None
            w = f.get_tensor("topk_weights") if "topk_weights" in names else None
    except (OSError, RuntimeError, SafetensorError) as err:
        raise ConfigError(f"{path}: cannot read safetensors: {err}") from None
    if ids is None or w is None:
        return x, None
    try:
        return x, from_given(ids.to(torch.int32), w.to(torch.float32), num_experts)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None


WARMUP_S, WARMUP_CALLS = 0.2, 3  # first calls pay for allocation, caches, lazy compilation: not timed
TIMED_S, TIMED_CALLS = 1.0, (10, 1000)  # without --repeat: calls for about a second, at least 10, at most 1000


def time_calls(call: Callable[[], object], repeat: int | None) -> list[float]:
    """Milliseconds of each timed call, after a warm-up (``WARMUP_CALLS`` calls and ``WARMUP_S`` seconds).
    ``repeat`` calls when given, else as many as fit in ``TIMED_S`` (within ``TIMED_CALLS``), so a fast layer is
    timed often enough for a stable median and a slow one does not take minutes."""
    start = time.perf_counter()
    for i in itertools.count():
        if i >= WARMUP_CALLS and time.perf_counter() - start >= WARMUP_S:
            break
        call()
    times: list[float] = []
    lo, hi = (repeat, repeat) if repeat is not None else TIMED_CALLS
    while len(times) < hi and (len(times) < lo or sum(times) < TIMED_S * 1e3):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_threads() -> int:
    """The CPUs this process may run on (a cpuset or taskset counts, unlike torch's default)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


def inputs_before_build(args: argparse.Namespace) -> tuple[torch.Tensor, Routing | None]:
    """The hidden states and given routing (``layer_inputs``), after every check that needs no built layer: building
    converts the experts and may compile the kernel (minutes, the first time), so the config and the flags'
    situation, ``--inputs`` against the layer's shape and the token budget, and the layer's router when no routing
    is given are refused before it. Without ``--inputs`` the router was checked with the flags, before torch
    (``run_checks.check_before_torch``): the checkpoint's headers are read again only for an inputs file whose
    header did not say whether it holds the routing."""
    registry, model, situation = layer_situation(args)
    x, routing = layer_inputs(args, model.shape, args.tokens)
    budget = situation.runtime.max_tokens
    if x.shape[0] > budget:
        raise ConfigError(f"--max-tokens: {x.shape[0]} tokens to run; the token budget is {budget}")
    if routing is None and args.inputs:
        check_router(args, registry, model, situation)
    return x, routing


def _run_layer(args: argparse.Namespace, threads: int) -> tuple[Report, RunResult, torch.Tensor]:
    from moe_registry_kernels.reference import reference_moe

    x, routing = inputs_before_build(args)
    layer = build(args.target, layer=args.layer, platform=args.platform, dtype=args.dtype, kernel=args.kernel,
                  prefer=args.prefer, spec_dirs=args.spec_dir, tp=args.tp, ep=args.ep, max_tokens=args.max_tokens,
                  keep_weights=True)
    built = layer.built
    runtime = built.report.situation.runtime
    dtype = DTYPES[runtime.dtype]
    device = built.kernel.experts.weights.device
    x = x.to(device, dtype)
    notes: tuple[str, ...] = ()
    if routing is None:
        routing = MoELayer(layer).route(x)
        bias, name = layer.router_tensors.correction_bias, layer.router_tensors.names.correction_bias
        note = None if bias is None else correction_bias_note(bias, name or "correction bias")
        notes = () if note is None else (note,)
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
    times = time_calls(lambda: (call(), _sync(device)), args.repeat)
    config = built.kernel.experts.config  # the layer's own (activation, router weight on the input)
    ref = reference_moe(x.cpu(), w.cpu(), ids.cpu(), built.weights.to("cpu"), config, torch.float64)
    err = float((out.cpu().double() - ref).norm() / ref.norm().clamp_min(1e-30))
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    result = RunResult(int(x.shape[0]), err, built.tolerance, statistics.median(times), str(device),
                       min(times), max(times), len(times), threads, q1, q3, notes)
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
        if args.verbose:
            print(report.to_text(args.verbose))
            print()
        rows = [("ran", report.summary()), *report.notice_rows(), *(("note", n) for n in result.notes),
                ("tokens", str(result.tokens)), ("device", f"{result.device} ({result.threads} CPU threads)"),
                ("rel. error", f"{result.relative_error:.3e} vs float64 reference "
                               f"(tolerance {result.tolerance:.1e}: {'ok' if result.ok else 'TOO LARGE'})"),
                ("time", f"{result.median_ms:.3f} ms per call (median of {result.repeat} after warm-up; middle "
                         f"half {result.p25_ms:.3f}-{result.p75_ms:.3f}, min {result.min_ms:.3f}, "
                         f"max {result.max_ms:.3f})")]
        if args.save_output:
            rows.append(("output", args.save_output))
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{(k if i == 0 else '').ljust(width)}  {part}" for k, v in rows
                        for i, part in enumerate(wrap(v, TEXT_WIDTH, width + 2))))
        if not result.ok:
            print(f"error: relative error {result.relative_error:.3e} is above the scheme's tolerance "
                  f"{result.tolerance:.1e}", file=sys.stderr)
    return code
