"""Session 30: one token, which GEMMs quantise their own input (triton_moe's SCALE_IN_GEMM budgets:
both, GEMM1 only, GEMM2 only, neither), timed in alternation (five rounds, medians), beside the
weight-only baseline of the same width. Run in a snapshot on the GPU: python3 ab-in-gemm-s30.py."""
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

schemes = bench.registry_schemes()
dev = torch.device("cuda")
BIG, NONE = 1 << 62, -1
choices = {"both": (BIG, BIG), "gemm1_only": (BIG, NONE), "gemm2_only": (NONE, BIG), "neither": (NONE, NONE)}
cells = [("compressed-tensors-w4a8-int", "qwen3", True), ("gptq-w4a16", "qwen3", False),
         ("compressed-tensors-w4a8-int", "dsv2lite", True), ("gptq-w4a16", "dsv2lite", False),
         ("quark-w8a8-int8", "qwen3", True), ("gptq-w8a16", "qwen3", False)]
runs = []
for sch, shape, quantised in cells:
    layer = tune.Layer(bench.SHAPES[shape], schemes[sch], dev, False)
    inputs = layer.inputs(1)
    act = triton_moe.scheme_from_keys(*schemes[sch].keys).act_quant
    for name, budgets in (choices.items() if quantised else [("-", (BIG, BIG))]):
        runs.append((f"{sch} {shape} {name}", layer, inputs, act, budgets))


def step(layer, inputs, act, budgets):
    def run() -> float:
        triton_moe.SCALE_IN_GEMM_MAX_BYTES, triton_moe.SCALE_IN_GEMM2_MAX_BYTES = budgets[0], {act: budgets[1]}
        return layer.time((None, None), 1, *inputs) * 1e6
    return run


times = tune.alternated([step(*r[1:5]) for r in runs], 5)
for (label, *_), ts in zip(runs, times, strict=True):
    print(f"{label:48s} M=1 median {statistics.median(ts):6.1f} us  ({' '.join(f'{t:.1f}' for t in ts)})")
