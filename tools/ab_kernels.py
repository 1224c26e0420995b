"""What the kernel A/B scripts in docs/bench share: another commit's GEMM kernel loaded beside
today's, layers timed under a given kernel and tile configs in alternation (tune.alternated, so
every variant sees the same clocks), their medians printed, alone or per byte of weights against
a yardstick row; a layer holding zero-point weights' scales and zero points as two tensors; and a
seed's tiles on the factored zero-point dot, as tools/tune.py seeds a zero-point scheme."""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import tune
from per_byte import bytes_per_us_ratio


def kernel_from_file(path: str):  # type: ignore[no-untyped-def]
    """``_fused_moe_kernel`` of a moe_gemm.py from another commit, loaded beside today's (its
    relative imports read today's package)."""
    spec = importlib.util.spec_from_file_location("moe_registry_kernels._moe_gemm_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._fused_moe_kernel


def todays_kernel():  # type: ignore[no-untyped-def]
    from moe_registry_kernels import triton_moe

    return triton_moe._fused_moe_kernel


@dataclass(frozen=True)
class Gpu:
    """The registry's bench schemes, and the GPU the tables are read for (its name and SM count)."""

    schemes: dict
    device: object
    name: str
    sms: int


def this_gpu() -> Gpu:
    import bench
    import torch

    dev = torch.device("cuda")
    return Gpu(bench.registry_schemes(), dev, torch.cuda.get_device_name(dev),
               torch.cuda.get_device_properties(dev).multi_processor_count)


def zero_sums_tiles(seed: tuple[dict, dict], kscheme) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """A seed's (GEMM1, GEMM2) tiles without their register caps, on the factored dot (ZERO_SUMS),
    fitted to the scheme."""
    from moe_registry_kernels import tile_config

    return tile_config._fit_pair(*({k: v for k, v in c.items() if k != "maxnreg"} | {"ZERO_SUMS": True}
                                   for c in seed), kscheme)


@dataclass(frozen=True)
class Variant:
    """One timed row: a layer at ``m`` tokens under ``configs`` (None: today's) and ``kernel``."""

    label: str
    layer: tune.Layer
    inputs: tuple
    configs: tuple[dict | None, dict | None]
    kernel: object
    m: int
    error: float  # against the layer's reference (0.0: not checked)

    def step(self) -> Callable[[], float]:
        def run() -> float:
            _use(self.kernel)
            return self.layer.time(self.configs, self.m, *self.inputs) * 1e6
        return run


def variant(label: str, layer: tune.Layer, inputs: tuple, m: int, kernel, configs,  # type: ignore[no-untyped-def]
            ref=None) -> Variant:
    """A row, its output checked against ``ref`` (the layer's reference) under its own kernel."""
    _use(kernel)
    error = layer.error(configs, *inputs, ref) if ref is not None else 0.0
    return Variant(label, layer, inputs, configs, kernel, m, error)


def print_alternated(variants: list[Variant], rounds: int = 3) -> None:
    """Time the rows in alternation ``rounds`` times and print each one's median (µs), error and times."""
    times = tune.alternated([v.step() for v in variants], rounds)
    for v, ts in zip(variants, times, strict=True):
        print(f"{v.label:62s} {statistics.median(ts):7.1f} us  err {v.error:.2e}  "
              f"({' '.join(f'{t:.1f}' for t in ts)})", flush=True)


@dataclass(frozen=True)
class Timed:
    """One row of a per-byte A/B: a step timing it (µs), its weights' bytes (tools/per_byte.py's
    count), the label of the yardstick row it is compared with per byte (None: it is one), and its
    error against the reference (0.0: not checked)."""

    label: str
    step: Callable[[], float]
    weight_bytes: int
    yardstick: str | None = None
    error: float = 0.0


def print_per_byte(rows: list[Timed], rounds: int) -> None:
    """Time the rows in alternation ``rounds`` times and print each one's median (µs), its bytes
    per µs over its yardstick's (below 1: slower per byte), its error and its times."""
    times = tune.alternated([row.step for row in rows], rounds)
    medians = {row.label: statistics.median(ts) for row, ts in zip(rows, times, strict=True)}
    sizes = {row.label: row.weight_bytes for row in rows}
    width = max(len(row.label) for row in rows) + 1
    for row, ts in zip(rows, times, strict=True):
        ratio = ""
        if row.yardstick is not None:
            per_byte = bytes_per_us_ratio(row.weight_bytes, medians[row.label], sizes[row.yardstick],
                                          medians[row.yardstick])
            ratio = f"per byte {per_byte:.3f}"
        print(f"{row.label:{width}s} {medians[row.label]:8.1f} us  {ratio:15s} err {row.error:.2e}  "
              f"({' '.join(f'{t:.1f}' for t in ts)})", flush=True)


def timed_variant(label: str, layer: tune.Layer, inputs: tuple, m: int, kernel,  # type: ignore[no-untyped-def]
                  yardstick: str | None = None, ref=None) -> Timed:
    """A per-byte row of ``layer`` at ``m`` tokens under ``kernel`` and today's tiles (its output
    checked against ``ref`` where given), compared with the row labelled ``yardstick``."""
    v = variant(label, layer, inputs, m, kernel, (None, None), ref)
    return Timed(label, v.step(), layer.weight_bytes, yardstick, v.error)


def timed_setting(label: str, layer: tune.Layer, inputs: tuple, m: int,  # type: ignore[no-untyped-def]
                  use: Callable[[], None], yardstick: str | None = None, ref=None) -> Timed:
    """A per-byte row of ``layer`` at ``m`` tokens on today's kernel and tiles under a setting that
    ``use`` puts in place (a module flag the layer reads when its graph is captured): applied before
    its output is checked against ``ref`` (where given) and before each timing."""
    def run() -> float:
        use()
        return layer.time((None, None), m, *inputs) * 1e6
    use()
    error = layer.error((None, None), *inputs, ref) if ref is not None else 0.0
    return Timed(label, run, layer.weight_bytes, yardstick, error)


def print_cells_per_byte(cells: dict[tuple[str, int], list[str]], rounds: int) -> None:
    """Decode cells ((shape, M) -> schemes) on today's kernel and tiles, each against its yardstick
    (per_byte's GPTQ int4 for 4-bit weights, int8 for 8-bit, timed in the same rounds), in alternation:
    print_per_byte's table."""
    import bench
    import per_byte

    gpu = this_gpu()
    bits = per_byte.weight_bits(gpu.schemes)
    yardsticks = per_byte.baselines_by_width(list(per_byte.DEFAULT_BASELINES), bits)
    kernel = todays_kernel()
    rows = []
    for (shape_name, m), schemes in cells.items():
        shape = bench.SHAPES[shape_name]
        bases = {yardsticks[bits[s]] for s in schemes}
        for name in [*schemes, *sorted(bases)]:
            layer = tune.Layer(shape, gpu.schemes[name], gpu.device, False)
            inputs = layer.inputs(m)
            base = None if name in bases else f"{yardsticks[bits[name]]} {shape_name} M={m}"
            rows.append(timed_variant(f"{name} {shape_name} M={m}", layer, inputs, m, kernel, base,
                                      layer.reference(*inputs)))
        print(f"built {shape_name} M={m}", flush=True)
    print_per_byte(rows, rounds)


@dataclass(frozen=True)
class OneTokenCell:
    """A scheme's layer beside its yardstick's at one token on one shape: the scheme's inputs and
    reference, and the yardstick row's label (what the scheme's rows are read per byte against)."""

    layer: tune.Layer
    yardstick: tune.Layer
    inputs: tuple
    ref: object
    base: str


def one_token_cell(gpu: Gpu, shape_name: str, scheme: str, yardstick: str) -> OneTokenCell:
    import bench

    shape = bench.SHAPES[shape_name]
    layer = tune.Layer(shape, gpu.schemes[scheme], gpu.device, False)
    other = tune.Layer(shape, gpu.schemes[yardstick], gpu.device, False)
    inputs = layer.inputs(1)
    return OneTokenCell(layer, other, inputs, layer.reference(*inputs), f"{yardstick} {shape_name} M=1")


def two_tensor_layer(shape, scheme, device, m_values: tuple[int, ...]) -> tune.Layer:  # type: ignore[no-untyped-def]
    """A layer whose kernels hold zero-point weights' scales and zero points as two tensors, not as
    triton_moe._scale_zero_words' words (every weight copy the ``m_values`` time is built now)."""
    from moe_registry_kernels import triton_moe

    words = triton_moe._scale_zero_words
    triton_moe._scale_zero_words = lambda scale, zero: (scale, zero)
    try:
        layer = tune.Layer(shape, scheme, device, False)
        for m in m_values:
            layer.copies_for(m)
    finally:
        triton_moe._scale_zero_words = words
    return layer


def _use(kernel) -> None:  # type: ignore[no-untyped-def]
    from moe_registry_kernels import triton_moe

    triton_moe._fused_moe_kernel = kernel
