"""Whole-layer MoE benchmark against the roofline (run on a GPU; `--dry-run` checks the tool on CPU).

For each model shape × scheme × token count: build random quantized experts in the kernel
layout, check the chosen kernel's output against the reference, then time CUDA-graph replays of
back-to-back layer calls (at least GRAPH_CALLS of them per graph, as in a model's forward pass,
so the graph's own launch is not charged to one layer) rotating over enough weight copies that
the experts a call touches are never still in L2 from the previous one. Ceilings (copy
bandwidth, bf16 / int8 / fp8 matrix rates) are measured in the same run. Roofline time =
max(minimum bytes / copy bandwidth, FLOPs / peak of the matrix unit the scheme uses), minimum
bytes = weights + scales + zero points of the experts the routing hits + activations in and out
+ routing; FLOPs = 6·M·top-k·hidden·intermediate. The two GEMMs are also reported alone (on a GPU
their launches replayed alone in short CUDA-graph bursts before the layer is timed, from an idle
GPU as the side-by-side harness times a peer's: see gpu_cell_seconds; elsewhere their kernel
times from the profiler; against a roofline of the weights, the hidden rows in and the top-k rows
out), and the rest of the layer's kernels as glue (the profiler's kernel times, its CUPTI torn down
after each profile, so it does not slow the cells timed after it).

The schemes are the scheme specs that list the Triton kernel (KERNEL), their keys bound with
group 128 where the spec allows it; a spec added (MOE_REGISTRY_SPEC_PATH for user specs) is
benchmarked with no edit here. By default one scheme per distinct key pair runs (the others
run the same kernel on the same weights; --help lists them); a row fails when its error is past the scheme's
conformance tolerance.

    python tools/bench.py                       # all shapes, one scheme per key pair, all M
    python tools/bench.py --shapes qwen3 --m 1 8 64 --schemes unquantized awq-w4a16
    python tools/bench.py --dry-run             # tiny shapes on CPU: checks the tool runs
    python tools/bench.py --resume ...          # measure only the cells not yet in --out

Writes bench.json and roofline.png to --out (default: current dir), and bench.jsonl as it goes:
one line per cell (shape x scheme x M) as soon as it is measured, so a run cut off keeps every
finished cell and ``--resume`` goes on from there (with the ceilings measured the first time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from json_lines import read_json_lines

from moe_registry.core.keys import QuantKey, parse_quant_key
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import ExpertsConfig


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int


SHAPES = {
    "mixtral": Shape("Mixtral-8x7B", 8, 2, 4096, 14336),
    "qwen3": Shape("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "dsv2lite": Shape("DeepSeek-V2-Lite", 64, 6, 2048, 1408),
    "gptoss20b": Shape("gpt-oss-20b", 32, 4, 2880, 2880),  # MXFP4's own model: K not a multiple of 128
    # shapes no tile table was tuned for: what the kernels' defaults give on models beside the three
    "dsv3": Shape("DeepSeek-V3", 256, 8, 7168, 2048),
    "gptoss120b": Shape("gpt-oss-120b", 128, 4, 2880, 2880),
    "glm45air": Shape("GLM-4.5-Air", 128, 8, 4096, 1408),
    "qwen3-235b": Shape("Qwen3-235B-A22B", 128, 8, 4096, 1536),
}
# what a run without --shapes measures (the tables in docs/bench); the others are asked for by name
DEFAULT_SHAPES = ["mixtral", "qwen3", "dsv2lite"]
DRY_SHAPES = {"tiny": Shape("tiny", 8, 2, 128, 128)}

# the kernel whose schemes are benchmarked (on CPU, --dry-run runs the same schemes on the reference)
KERNEL = "triton-fused-moe"
# binding values benchmarked where a scheme's spec allows them (group 128: what checkpoints ship)
PREFERRED_BINDINGS = {"group": 128, "act_order": False}


@dataclass(frozen=True)
class Scheme:
    """A scheme spec as the tools run it: bound keys, the matrix unit whose peak bounds it, and
    its conformance tolerance per dtype."""

    name: str
    weight: str  # canonical key text (what the kernel's config files are named by)
    activation: str
    unit: str  # "bf16", "int8" or "fp8"
    tolerance: dict[str, float]
    bindings: dict[str, object]

    @property
    def keys(self) -> tuple[str, str]:
        return self.weight, self.activation

    def tolerance_for(self, dtype: str) -> float:
        return self.tolerance.get(dtype, max(self.tolerance.values()))


def benchmarked_experts(dry: bool) -> type:
    """The Experts class the tools time: KERNEL's implementation, or on a dry run (CPU) the reference's."""
    from moe_registry.layer.build import experts_class
    from moe_registry.spec.loader import load_registry

    return experts_class(load_registry().kernel("torch-reference" if dry else KERNEL))


def matrix_unit(akey: QuantKey) -> str:
    """The matrix unit a layer's dots run on: int8 or fp8 activations use theirs; 16-bit ones and
    MX-scaled (e8m0) fp8, which Triton on Hopper dots in bf16, the bf16 unit."""
    if not akey.quantized:
        return "bf16"
    if akey.dtype.name == "int8":
        return "int8"
    if akey.dtype.name.startswith("fp8") and akey.scale is not None and akey.scale.dtype.name != "e8m0":
        return "fp8"
    return "bf16"


def pick_bindings(spec, preferred: dict[str, object] = PREFERRED_BINDINGS) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The spec's binding sample closest to ``preferred`` (most preferred values; the first sample
    on a tie)."""
    from moe_registry.spec.loader import binding_samples

    samples = binding_samples(spec)
    return max(samples, key=lambda s: sum(k in preferred and s[k] == preferred[k] for k in s))


def registry_schemes(kernel: str = KERNEL, registry=None,  # type: ignore[no-untyped-def]
                     platform: str | None = None) -> dict[str, Scheme]:
    """Every scheme spec that lists ``kernel`` and whose bound keys the kernel claims, by name; with
    ``platform`` (e.g. cuda:8.0), the activations the kernel is handed there (fp8 before sm_89: 16-bit)."""
    from moe_registry import load_registry
    from moe_registry.oracle.handed import handed_activation
    from moe_registry.oracle.predicates import check_keys, matching_pattern
    from moe_registry.situation.runtime import parse_platform
    from moe_registry.spec.loader import fill_template

    registry = registry or load_registry()
    kspec = registry.kernel(kernel)
    out = {}
    for name, loaded in sorted(registry.schemes.items()):
        spec = loaded.spec
        if kernel not in spec.kernels:
            continue
        bindings = pick_bindings(spec)
        wkey = parse_quant_key(fill_template(spec.weight, bindings))
        akey = parse_quant_key(fill_template(spec.run_activation, bindings))
        on = parse_platform(platform) if platform else None
        if all(c.passed for c in check_keys(kspec, wkey, akey, on)):
            if on is not None:
                akey = handed_activation(akey, matching_pattern(kspec, wkey, akey, on))
            out[name] = Scheme(name, str(wkey), str(akey), matrix_unit(akey), dict(spec.tolerance), bindings)
    return out


def same_keys(schemes: dict[str, Scheme]) -> dict[tuple[str, str], list[str]]:
    """Scheme names by (weight key, activation key), in name order."""
    out: dict[tuple[str, str], list[str]] = {}
    for name, s in sorted(schemes.items()):
        out.setdefault(s.keys, []).append(name)
    return out


def default_schemes(schemes: dict[str, Scheme]) -> list[str]:
    """One scheme per distinct key pair (the shortest name, then the first): the others run the
    same kernel on the same weights."""
    return sorted(min(names, key=lambda n: (len(n), n)) for names in same_keys(schemes).values())


def check_names(given: list[str], known: list[str], what: str = "scheme") -> str | None:
    """A one-line error for the names not in ``known`` (with a guess where one is close), or None."""
    import difflib

    unknown = [g for g in given if g not in known]
    if not unknown:
        return None
    guesses = []
    for g in unknown:
        close = difflib.get_close_matches(g, known, n=1, cutoff=0.5) or [k for k in known if k.startswith(g)][:1]
        guesses += [f"{g!r} (did you mean {close[0]!r}?)" if close else repr(g)]
    return f"unknown {what} {', '.join(guesses)}; known: {', '.join(known)}"


L2_BYTES = 50 * 1024 * 1024
# layer calls per timed graph, at least: launching a graph costs a few µs of its own (H100: 3-5 µs
# of a 30 µs one-call replay), which a model's forward pass pays once for all of its layers
GRAPH_CALLS = 8
# the GEMMs alone are timed as the side-by-side harness times a peer's launches (its time_graph): a graph of
# back-to-back steps holding about this much work (at most BURST_STEPS steps), replayed BURST_REPLAYS times,
# each replay timed alone with a host sync between, the median (see burst_seconds)
BURST_SECONDS = 3e-3
BURST_STEPS = 400
BURST_REPLAYS = 15
# the idle pause before a cell's GEMM bursts, as the peer harness pauses after its sustained runs: the cell before
# ends in the layer's 0.3 s of back-to-back replays, which hold an H200 running FP8 or bf16 prefill at its power
# limit; GEMM1 bursts of Mixtral's per-channel FP8 at M = 4096 timed 0, 0.25, 0.5, 1 and 2 s after those replays
# read 1773.8, 1594.4, 1525.3, 1539.5 and 1528.8 us (and vLLM's own 1818.8 us at once against 1560.1-1588.0 us
# after a second's pause)
COOL_SECONDS = 1.0


@dataclass(frozen=True)
class Row:
    shape: str
    scheme: str
    m: int
    us: float
    roofline_us: float
    bytes_moved: float
    flops: float
    rel_error: float
    gemm_us: float  # the two GEMM kernels alone, per layer call (GPU: gemm_graph_seconds; else the profiler)
    gemm_roofline_us: float
    glue_us: float  # every other kernel of the layer: alignment, quantisation, reduction
    # each GEMM alone (GPU: gemm_graph_seconds, where each call made the two launches), to set beside the peer's
    gemm1_us: float | None = None
    gemm2_us: float | None = None

    @property
    def pct(self) -> float:
        return 100.0 * self.roofline_us / self.us if self.us > 0 else 0.0

    @property
    def gemm_pct(self) -> float:
        return 100.0 * self.gemm_roofline_us / self.gemm_us if self.gemm_us > 0 else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.us * 1e-6) / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / (self.us * 1e-6) / 1e12


def _median_time(fn, min_seconds: float, device: torch.device, warmup_seconds: float = 0.0) -> float:
    """Median seconds per call over at least ``min_seconds`` (events on GPU), after untimed calls
    for ``warmup_seconds`` (a GPU left idle, e.g. while Triton compiled, clocks down at first)."""
    fn()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 5:
        times.append(time_call(fn, device))
    return statistics.median(times)


def time_call(fn, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Seconds one call of ``fn`` takes: between CUDA events on a GPU, by the host clock on a CPU."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_ceilings(device: torch.device, dry: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and matrix-unit rates, measured here."""
    n = 1 << (20 if dry else 30)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), 0.1 if dry else 0.5, device)
    out = {"copy_bytes_per_s": 2 * src.numel() * 4 / t}
    size = 256 if dry else 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if not dry else torch.float32)
    b = torch.randn(size, size, device=device, dtype=a.dtype)
    out["bf16_flops"] = 2 * size**3 / _median_time(lambda: a @ b, 0.1 if dry else 0.5, device)
    if device.type == "cuda":
        ai = torch.randint(-128, 127, (size, size), device=device, dtype=torch.int8)
        bi = torch.randint(-128, 127, (size, size), device=device, dtype=torch.int8).t()  # column-major B
        out["int8_ops"] = 2 * size**3 / _median_time(lambda: torch._int_mm(ai, bi), 0.5, device)
        af = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
        bf = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out["fp8_flops"] = 2 * size**3 / _median_time(
            lambda: torch._scaled_mm(af, bf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 0.5, device)
    else:
        out["int8_ops"] = out["fp8_flops"] = out["bf16_flops"]
    return out


def _tensor_bytes(p: ProjectionWeights, experts_hit: float, num_experts: int) -> float:
    per_expert = sum(t.numel() * t.element_size() for t in (p.weight, p.scale, p.zero, p.bias) if t is not None)
    return per_expert * experts_hit / num_experts


def expected_experts_hit(m: int, top_k: int, experts: int) -> float:
    """Distinct experts a batch of m tokens routes to, for uniform random routing."""
    return experts * (1 - (1 - top_k / experts) ** m)


def make_weights(shape: Shape, wkey: QuantKey, akey: QuantKey, dtype: torch.dtype, device: torch.device,
                 seed: int) -> ExpertWeights:
    """Random experts quantized on the device (real codes and scales, never zeros)."""
    from moe_registry_kernels.quant_ref import quantize_weight_to_layout, static_input_scale

    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.randn(e, 2 * i, h, generator=gen, device=device) / math.sqrt(h)
    p13 = quantize_weight_to_layout(w13, wkey, dtype=dtype)
    del w13
    w2 = torch.randn(e, h, i, generator=gen, device=device) / math.sqrt(i)
    p2 = quantize_weight_to_layout(w2, wkey, dtype=dtype)
    del w2
    s = static_input_scale(akey, 6.0)
    if s is not None:
        from dataclasses import replace

        p13, p2 = replace(p13, input_scale=s.to(device)), replace(p2, input_scale=s.to(device))
    return ExpertWeights(p13, p2, wkey, akey)


ROUTING_SEED = 1


def cell_inputs(shape: Shape, m: int, dtype: torch.dtype, device: torch.device, seed: int = ROUTING_SEED,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states ~ N(0, 1) in ``dtype``, top-k router weights, their int32 expert ids) for
    ``m`` tokens: softmax over random logits, so every expert is about as likely. Drawn from a
    generator of the cell's own, so a (shape, M) gets the same tokens and routing whatever ran
    before it: a resumed bench run, the tuner and the profiler see what one whole run would (from
    one generator in turn, a resumed run's cells read other experts than an uncut run's)."""
    return draw_inputs(shape, m, dtype, torch.Generator(device=device).manual_seed(seed))


def draw_inputs(shape: Shape, m: int, dtype: torch.dtype, gen: torch.Generator,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cell_inputs' draw from a generator that is passed in (and advanced)."""
    x = torch.randn(m, shape.hidden, device=gen.device, generator=gen).to(dtype)
    logits = torch.randn(m, shape.experts, device=gen.device, generator=gen)
    tw, ti = torch.topk(torch.softmax(logits, -1), shape.top_k, -1)
    return x, tw, ti.to(torch.int32)


def reference_output(base, config: ExpertsConfig, x: torch.Tensor, tw: torch.Tensor,
                     ti: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """The float32 reference's output, summed over the experts ``ti`` routes to, ``chunk`` experts at a time
    (each pair routed elsewhere weighs nothing in that chunk): dequantised in float32 at once, DeepSeek-V3's
    256 experts would take 45 GB beside the kernel's copies."""
    from moe_registry_kernels.reference import ReferenceExperts

    hit = torch.unique(ti).long()
    out = None
    for part in hit.split(chunk):
        local = torch.searchsorted(part, ti.long()).clamp(max=len(part) - 1)
        here = part[local] == ti.long()
        got = ReferenceExperts(base.subset(part), config).apply(
            x.float(), torch.where(here, tw, torch.zeros_like(tw)), torch.where(here, local, 0).to(ti.dtype)).float()
        out = got if out is None else out + got
    assert out is not None
    return out


def bench_one(shape: Shape, scheme: Scheme, ms: list[int], ceilings: dict[str, float], device: torch.device,
              kernel_cls, dry: bool, check_m: int | None = None) -> Iterator[Row]:
    """One row per M, each yielded as soon as it is measured (the correctness check on
    ``check_m`` tokens, default min(max(ms), 64), comes first); each cell draws its own inputs
    (cell_inputs), so a resumed cell reads what an uncut run's would."""
    wkey, akey = parse_quant_key(scheme.weight), parse_quant_key(scheme.activation)
    dtype = torch.float16 if dry else torch.bfloat16
    config = ExpertsConfig()
    base = make_weights(shape, wkey, akey, dtype, device, seed=0)
    peak = {"bf16": ceilings["bf16_flops"], "int8": ceilings["int8_ops"], "fp8": ceilings["fp8_flops"]}[scheme.unit]
    # correctness first, on the real shape
    check_m = check_m or min(max(ms), 64)
    x, tw, ti = cell_inputs(shape, check_m, dtype, device)
    kernel = kernel_cls(base, config)
    out = kernel.apply(x, tw, ti)
    ref = reference_output(base, config, x, tw, ti)
    rel = float((out.float() - ref).norm() / ref.norm())
    del ref
    pool = [kernel]
    for m in ms:
        x, tw, ti = cell_inputs(shape, m, dtype, device)
        hit = float(torch.unique(ti).numel())  # the experts this routing really reads
        wbytes = _tensor_bytes(base.w13, hit, shape.experts) + _tensor_bytes(base.w2, hit, shape.experts)
        act_bytes = 2 * m * shape.hidden * x.element_size() + m * shape.top_k * 8
        bytes_moved = wbytes + act_bytes
        flops = 6.0 * m * shape.top_k * shape.hidden * shape.intermediate
        roof = max(bytes_moved / ceilings["copy_bytes_per_s"], flops / peak)
        copies = 1 if dry else weight_copies(wbytes, wbytes * shape.experts / max(hit, 1))
        while len(pool) < copies:  # weight copies are made once per scheme and reused across M
            pool.append(kernel_cls(make_weights(shape, wkey, akey, dtype, device, seed=len(pool)), config))
        kernels = pool[:copies]

        step = _calls(kernels, x, tw, ti)

        each: tuple[float | None, float | None] = (None, None)
        if device.type == "cuda":
            t, (gemm_s, *each) = gpu_cell_seconds(kernels, x, tw, ti, device)
            _, glue_s = kernel_times(step, len(kernels), device)
        else:
            t = _median_time(step, 0.05, device) / len(kernels)
            gemm_s, glue_s = kernel_times(step, len(kernels), device)
        # the GEMMs alone move the weights, the hidden rows in and the top-k rows out (the
        # activation's round trip belongs to the layer); same FLOPs
        gemm_bytes = wbytes + m * shape.hidden * x.element_size() * (1 + shape.top_k)
        gemm_roof = max(gemm_bytes / ceilings["copy_bytes_per_s"], flops / peak)
        yield Row(shape.name, scheme.name, m, t * 1e6, roof * 1e6, bytes_moved, flops, rel,
                  gemm_s * 1e6, gemm_roof * 1e6, glue_s * 1e6, *(None if s is None else s * 1e6 for s in each))


# what the GEMM kernels are called in a CPU profile: the reference's matmuls (on a GPU, gemm_kernels asks the
# Triton package)
CPU_GEMM_KERNELS = ("aten::mm",)


def gemm_kernels(device_type: str) -> tuple[str, ...]:
    """The names a profile gives the layer's GEMMs on this device: the Triton GEMM kernels' on a GPU."""
    if device_type != "cuda":
        return CPU_GEMM_KERNELS
    from moe_registry_kernels.triton.api import GEMM_KERNEL_NAMES

    return GEMM_KERNEL_NAMES


def kernel_times(step, calls_per_step: int, device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """Seconds per layer call spent in GEMM kernels and in all other kernels (device time from the
    profiler, eager steps, plain launches: a kernel chained by programmatic dependent launch
    starts early and waits, so its duration would count the previous kernel's time too)."""
    from moe_registry_kernels.triton.api import plain_launches
    from torch.profiler import ProfilerActivity, profile

    # CUPTI torn down when the profile ends: left attached (Kineto's default), it slowed every layer
    # timed after a run's first profile, so only the run's first cell was timed without it (H100,
    # Qwen3 M = 1: whichever of AWQ and GPTQ int4 ran second took 20.9 us against 18.1-18.2; torn
    # down, 18.2-18.6 in both orders; tests/test_bench_tools.py checks it is torn down)
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with plain_launches():
        step()
        with profile(activities=[activity]) as prof:
            for _ in range(repeats):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
    gemm = glue = 0.0
    for event in prof.key_averages():
        if device.type == "cuda":
            us = getattr(event, "self_device_time_total", 0.0)
        else:
            us = event.self_cpu_time_total if event.key in CPU_GEMM_KERNELS else 0.0
        if any(name in event.key for name in gemm_kernels(device.type)):
            gemm += us
        else:
            glue += us
    per_call = 1e-6 / (repeats * calls_per_step)
    return gemm * per_call, glue * per_call


def record_gemm_launches(step) -> list[tuple]:  # type: ignore[no-untyped-def]
    """The GEMM launches one call of ``step`` makes (plain launches: no programmatic dependent launch), each as
    (kernel, grid, args, kwargs): the arguments hold the very buffers the step used, so the launches can run again."""
    from moe_registry_kernels.triton.api import plain_launches, recorded_gemm_launches

    launches: list[tuple] = []
    with plain_launches(), recorded_gemm_launches(launches):
        step()
    return launches


def replay(launches: list[tuple]):  # type: ignore[no-untyped-def]
    """A step that runs the recorded launches again, in order."""

    def run() -> None:
        for kernel, grid, args, kwargs in launches:
            kernel[grid](*args, **kwargs)

    return run


def burst_seconds(run, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Seconds one ``run`` takes, timed as the side-by-side harness times a peer's launches: ``run`` replayed in a
    CUDA graph of back-to-back runs that holds about BURST_SECONDS of work, the graph replayed BURST_REPLAYS times,
    each replay timed alone, the median. Short bursts with host syncs between run near the GPU's boost clock, as
    the peer's do; 0.3 s of back-to-back replays (_median_time, the layer's own timing) hold an H200 running FP8
    prefill at its power limit (690 W, the SM clock down from 1980 to 1000-1500 MHz within a second, nvidia-smi
    every 100 ms)."""
    run()
    one = max(time_call(run, device), 1e-9)
    reps = max(1, min(BURST_STEPS, math.ceil(BURST_SECONDS / one)))
    graph = capture_graph(lambda: [run() for _ in range(reps)])
    graph.replay()
    times = [time_call(graph.replay, device) for _ in range(BURST_REPLAYS)]
    del graph
    return statistics.median(times) / reps


def gpu_cell_seconds(kernels: list, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor,
                     device: torch.device) -> tuple[float, tuple[float, float | None, float | None]]:
    """(seconds per layer call, gemm_graph_seconds) of one cell on a GPU, the layers of ``kernels`` (weight
    copies) called in turn. The GEMMs alone come first, as the side-by-side harness times a peer's two launches
    before its layer: the layer's 0.3 s of back-to-back replays hold a GPU running a power-bound cell at its
    power limit, and bursts timed right after them read that lowered clock (see COOL_SECONDS)."""
    gemms = gemm_graph_seconds(_calls(kernels, x, tw, ti), len(kernels), device)
    rounds = math.ceil(GRAPH_CALLS / len(kernels))  # the copies in turn, round after round
    graph = capture_graph(_calls(kernels * rounds, x, tw, ti))
    layer = _median_time(graph.replay, 0.3, device) / (len(kernels) * rounds)
    del graph
    return layer, gemms


def gemm_graph_seconds(step, calls_per_step: int,  # type: ignore[no-untyped-def]
                       device: torch.device) -> tuple[float, float | None, float | None]:
    """Seconds per layer call in the GEMM kernels alone, timed as a peer's two launches are timed beside ours
    (burst_seconds), after COOL_SECONDS idle: the GEMM launches of one step, recorded with their arguments
    (record_gemm_launches), GEMM1's and GEMM2's launches each alone (None where a call made other than two: see
    launches_by_gemm), then all of them together: (together, GEMM1, GEMM2). A profile of a few eager steps
    (kernel_times) gave GEMM times that followed the GPU's clock from call to call (up to 7% apart on an H200
    where the layer's graph-timed median moved by under 1%)."""
    launches = record_gemm_launches(step)
    time.sleep(COOL_SECONDS)
    # each GEMM alone first, GEMM1 then GEMM2 as the peer harness times its two: a burst heats the GPU for the
    # next (Mixtral's per-channel FP8 GEMM1 at M = 4096 on an H200: 1530 us a second after the layer's replays,
    # 1807 us after the two GEMMs' own burst had run first)
    each = [burst_seconds(replay(part), device) / calls_per_step for part in launches_by_gemm(launches, calls_per_step)]
    both = burst_seconds(replay(launches), device) / calls_per_step
    return both, *(each or (None, None))


def launches_by_gemm(launches: list[tuple], calls: int) -> tuple[list[tuple], ...]:
    """The GEMM launches ``calls`` layer calls made, as (GEMM1's, GEMM2's): each call launches GEMM1, then GEMM2.
    () where the count says a call made other than those two."""
    if len(launches) != 2 * calls:
        return ()
    return launches[0::2], launches[1::2]


def weight_copies(bytes_hit: float, bytes_all: float) -> int:
    """Weight copies to rotate so the experts one call reads (``bytes_hit``) are out of L2 by the
    time the same copy comes round again, capped at 20 GB of copies in all."""
    copies = max(1, math.ceil(2 * L2_BYTES / max(bytes_hit, 1)))
    return min(copies, max(1, int(20e9 // max(bytes_all, 1))))


def capture_graph(step) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    """``step`` captured in a CUDA graph (run once on a side stream first, as capture wants)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _calls(kernels: list, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor):  # type: ignore[no-untyped-def]
    """One step: every weight copy's layer called once, back to back."""

    def step() -> None:
        for k in kernels:
            k.apply(x, tw, ti)

    return step


def print_table(rows: list[Row]) -> None:
    print(f"{'shape':<18}{'scheme':<26}{'M':>6}{'us':>9}{'roof us':>9}{'GB/s':>7}{'TFLOP/s':>9}"
          f"{'% roof':>8}{'gemm us':>9}{'% gemm':>8}{'glue us':>9}{'rel err':>10}")
    for r in rows:
        print(f"{r.shape:<18}{r.scheme:<26}{r.m:>6}{r.us:>9.1f}{r.roofline_us:>9.1f}{r.gbps:>7.0f}"
              f"{r.tflops:>9.1f}{r.pct:>7.0f}%{r.gemm_us:>9.1f}{r.gemm_pct:>7.0f}%{r.glue_us:>9.1f}"
              f"{r.rel_error:>10.2e}")


def plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({r.shape for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for scheme in dict.fromkeys(r.scheme for r in rows):
            pts = sorted((r.m, r.pct) for r in rows if r.shape == shape and r.scheme == scheme)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scheme)
        ax.axhline(100, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("% of roofline (whole layer)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def row_record(r: Row) -> dict:
    """A row as bench.json holds it: the measured fields and the figures derived from them."""
    return {**asdict(r), "pct_roofline": r.pct, "gemm_pct_roofline": r.gemm_pct, "gbps": r.gbps, "tflops": r.tflops}


def row_from_record(record: dict) -> Row:
    """A bench.json row as a Row (records from before the per-GEMM times lack them)."""
    return Row(**{f: record[f] for f in Row.__dataclass_fields__ if f in record})


def read_progress(out: Path) -> tuple[dict | None, list[dict]]:
    """The run header ({"env", "ceilings"}) and the rows recorded in ``out``: bench.jsonl (one
    line per measured cell, written as it is measured), else a finished bench.json (see read_run)."""
    progress, final = out / PROGRESS, out / RESULT
    if progress.is_file():
        return read_run(progress)
    if final.is_file():
        return read_run(final)
    return None, []


def read_run(path: Path) -> tuple[dict | None, list[dict]]:
    """The run header and rows of one file: a bench.jsonl, whose last line a kill may have cut off
    (ignored), or a bench.json. Anything else: ValueError naming the file (and line)."""
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text())
            return {"env": doc["env"], "ceilings": doc["ceilings"]}, doc["rows"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a tools/bench.py result ({e})") from None
    header, rows = None, []
    for record in read_json_lines(path):
        if "row" in record:
            rows.append(record["row"])
        elif "ceilings" in record:
            header = header or record
    return header, rows


def cell(record: dict) -> tuple[str, str, int]:
    return record["shape"], record["scheme"], int(record["m"])


def environment(device: torch.device, dry: bool) -> dict:
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "dry_run": dry}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


# what nvidia-smi reports of the GPU after each cell (--format=csv,noheader,nounits): its SM clock, power and heat
GPU_STATE_FIELDS = {"clocks.sm": "sm_mhz", "power.draw": "power_w", "temperature.gpu": "temp_c"}


def gpu_state(device: torch.device) -> dict | None:
    """The GPU's SM clock (MHz), power draw (W) and temperature (C) as nvidia-smi reads them right after a cell's
    timing, kept beside the cell in bench.jsonl: where a cell ran slower than in another call on the same tiles,
    this says whether the GPU itself ran slower (its clock held down by power or heat). None off CUDA or without
    nvidia-smi."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None in ids:  # a torch that does not say where the GPU sits
        return None
    bus = "{:08X}:{:02X}:{:02X}.0".format(*ids)  # as nvidia-smi -i takes it (CUDA_VISIBLE_DEVICES renumbers)
    try:
        out = subprocess.run(["nvidia-smi", "-i", bus, f"--query-gpu={','.join(GPU_STATE_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_state(out)


def parse_gpu_state(line: str) -> dict | None:
    """nvidia-smi's CSV line for GPU_STATE_FIELDS as numbers (None where it did not give one number each)."""
    values = [v.strip() for v in line.strip().split(",")]
    try:
        return dict(zip(GPU_STATE_FIELDS.values(), map(float, values), strict=True))
    except ValueError:
        return None


RESULT, PROGRESS = "bench.json", "bench.jsonl"


def main(argv: list[str] | None = None) -> int:
    # --platform is read first: it decides the keys each scheme runs (and so the --schemes help)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--platform", default=None)
    platform = first.parse_known_args(argv)[0].platform
    schemes = registry_schemes(platform=platform)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default=None,
                        help="run each scheme as the kernel spec runs it on this platform, e.g. cuda:8.0 (fp8 "
                             "checkpoints weight-only); default: the bound keys")
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--schemes", nargs="*", default=None, metavar="SCHEME",
                        help=f"scheme spec names (those listing {KERNEL}; MOE_REGISTRY_SPEC_PATH adds "
                             "user specs); default: one per distinct key pair: "
                             + ", ".join(default_schemes(schemes)) + "; all: " + ", ".join(schemes))
    parser.add_argument("--m", nargs="*", type=int, default=None,
                        help="token counts (default 1 8 64 512 4096; --dry-run: 1 8)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--resume", action="store_true",
                        help=f"keep the cells already in --out ({PROGRESS}, else {RESULT}) and measure the rest")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (reference kernel)")
    args = parser.parse_args(argv)
    names = default_schemes(schemes) if args.schemes is None else list(dict.fromkeys(args.schemes))
    bad_names = check_names(names, list(schemes))
    if bad_names:
        print(f"bench.py: {bad_names}", file=sys.stderr)
        return 2
    dry = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry:
        print("no GPU: running the dry run", file=sys.stderr)
    device = torch.device("cpu" if dry else "cuda")
    kernel_cls = benchmarked_experts(dry)
    if dry:
        shapes, ms = list(DRY_SHAPES.values()), args.m or [1, 8]
    else:
        shapes, ms = [SHAPES[s] for s in args.shapes], args.m or [1, 8, 64, 512, 4096]
    env = environment(device, dry)
    if platform:
        env["platform"] = platform  # the keys each scheme ran with: as the kernel spec runs them there
    try:
        header, recorded = read_progress(args.out) if args.resume else (None, [])
    except ValueError as e:
        print(f"bench.py: {e}", file=sys.stderr)
        return 2
    if header is not None and (header["env"]["device"], header["env"].get("dry_run")) != (env["device"], dry):
        print(f"{args.out / PROGRESS} was measured on {header['env']['device']} (dry run: "
              f"{header['env'].get('dry_run')}), this is {env['device']} (dry run: {dry}): run without --resume "
              "or with another --out", file=sys.stderr)
        return 2
    # a resumed run keeps the ceilings its rows' rooflines were computed with
    ceilings = header["ceilings"] if header is not None else measure_ceilings(device, dry)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = args.out / PROGRESS
    with progress.open("w") as f:  # the rows kept, then each new one as it is measured
        f.write(json.dumps({"env": header["env"] if header else env, "ceilings": ceilings}) + "\n")
        for record in recorded:
            f.write(json.dumps({"row": record}) + "\n")
    rows = {cell(r): row_from_record(r) for r in recorded}
    skipped = 0
    for shape in shapes:
        for name in names:
            todo = [m for m in ms if (shape.name, name, m) not in rows]
            skipped += len(ms) - len(todo)
            if not todo:
                continue
            for row in bench_one(shape, schemes[name], todo, ceilings, device, kernel_cls, dry,
                                 check_m=min(max(ms), 64)):
                rows[cell(asdict(row))] = row
                with progress.open("a") as f:
                    f.write(json.dumps({"row": row_record(row), "at": time.time(), "gpu": gpu_state(device)}) + "\n")
            torch.cuda.empty_cache() if device.type == "cuda" else None
    result = {"env": header["env"] if header else env, "ceilings": ceilings,
              "rows": [row_record(r) for r in rows.values()]}
    tmp = args.out / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out / RESULT)
    plotted = plot(list(rows.values()), args.out / "roofline.png")
    print(f"device {env['device']}; copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s, int8 {ceilings['int8_ops'] / 1e12:.0f} TOP/s, "
          f"fp8 {ceilings['fp8_flops'] / 1e12:.0f} TFLOP/s" + (f"; {skipped} cells kept" if skipped else ""))
    print_table(list(rows.values()))
    print(f"wrote {args.out / RESULT}" + (f" and {args.out / 'roofline.png'}" if plotted else ""))
    dtype = "float16" if dry else "bfloat16"
    bad = [r for r in rows.values()
           if not r.rel_error <= (schemes[r.scheme].tolerance_for(dtype) if r.scheme in schemes else 0.1)]
    for r in bad:
        print(f"{r.shape} {r.scheme} M={r.m}: relative error {r.rel_error:.2e} past the scheme's tolerance",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
