"""``moe-registry run``: load one MoE layer, run it on hidden states, compare with the float64
dequantised reference, and time it."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_registry.builder import DTYPES, MoELayer, build
from moe_registry.errors import ConfigError
from moe_registry.experts import ExpertsConfig
from moe_registry.report import Report
from moe_registry.routing import Routing, from_given


@dataclass(frozen=True)
class RunResult:
    """What a run measured."""

    tokens: int
    relative_error: float
    tolerance: float
    median_ms: float
    device: str

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


def run_layer(args: argparse.Namespace) -> tuple[Report, RunResult, torch.Tensor]:
    """Build the layer and measure it; returns the oracle's report, the result and the output."""
    from moe_registry_kernels.reference import reference_moe

    layer = build(args.target, layer=args.layer, platform=args.platform, dtype=args.dtype, kernel=args.kernel,
                  prefer=args.prefer, spec_dirs=args.spec_dir, tp=args.tp, ep=args.ep)
    built = layer.built
    runtime = built.report.situation.runtime
    dtype = DTYPES[runtime.dtype]
    device = built.kernel.experts.weights.device
    shape = layer.model.shape
    routing: Routing | None = None
    if args.inputs:
        x, routing = read_inputs(Path(args.inputs), shape.hidden, shape.num_experts)
    else:
        if args.tokens < 1:
            raise ConfigError(f"--tokens: got {args.tokens}; wanted at least 1")
        gen = torch.Generator().manual_seed(args.seed)
        x = torch.randn(args.tokens, shape.hidden, generator=gen)
    x = x.to(device, dtype)
    if routing is None:
        routing = MoELayer(layer).route(x)
    ids, w = routing.topk_ids.to(device), routing.topk_weights.to(device)

    def call() -> torch.Tensor:
        return built.kernel(x, w, ids)

    out = call()
    _sync(device)
    times = []
    for _ in range(max(args.repeat, 1)):
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    config = ExpertsConfig(activation=shape.activation)  # type: ignore[arg-type]
    ref = reference_moe(x.cpu(), w.cpu(), ids.cpu(), built.weights.to("cpu"), config, torch.float64)
    err = float((out.cpu().double() - ref).norm() / ref.norm().clamp_min(1e-30))
    result = RunResult(int(x.shape[0]), err, built.tolerance, statistics.median(times), str(device))
    return built.report, result, out


def run_layer_command(args: argparse.Namespace) -> int:
    report, result, out = run_layer(args)
    if args.save_output:
        save_file({"output": out.detach().cpu().contiguous()}, args.save_output, metadata={"format": "pt"})
    if args.json:
        print(json.dumps({"report": report.to_dict(), "result": {**result.__dict__, "ok": result.ok}}, indent=2))
    else:
        print(report.to_text())
        print()
        rows = [("tokens", str(result.tokens)), ("device", result.device),
                ("rel. error", f"{result.relative_error:.3e} vs float64 reference "
                               f"(tolerance {result.tolerance:.1e}: {'ok' if result.ok else 'TOO LARGE'})"),
                ("time", f"{result.median_ms:.3f} ms per call (median of {max(args.repeat, 1)})")]
        if args.save_output:
            rows.append(("output", args.save_output))
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    return 0 if result.ok else 1
