"""Session 30: 8-bit weights with per-group zero points on the factored dot (triton_moe.FACTORED_ZEROS:
the zero taken off each row's result by the row's input sums) against the per-weight zero, three
alternated rounds, medians; today's configs, and at Mixtral M = 64 GPTQ int8's non-swapped tile
(today: the swapped kernel). Run in a snapshot of f33521d (FACTORED_ZEROS was reverted after it) on
the GPU: python3 ab-asym-s30.py."""
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

schemes = bench.registry_schemes()
dev = torch.device("cuda")
GPTQ8 = {"BLOCK_K": 128, "BLOCK_M": 32, "BLOCK_N": 128, "GROUP_M": 1, "SPLIT_K": 1, "SWAP_AB": False,
         "num_stages": 3, "num_warps": 4}
runs = []
for shape in ("qwen3", "dsv2lite", "mixtral"):
    for sch in ("compressed-tensors-w8a16-asym", "gptq-w8a16"):
        layer = tune.Layer(bench.SHAPES[shape], schemes[sch], dev, False)
        for m in (1, 8, 64):
            inputs = layer.inputs(m)
            ref = layer.reference(*inputs)
            variants = [("today", (None, None), False)]
            if sch.endswith("asym"):
                variants.append(("today+factored_zeros", (None, None), True))
                if shape == "mixtral" and m == 64:
                    variants += [("gptq8_tile", (GPTQ8, GPTQ8), False),
                                 ("gptq8_tile+factored_zeros", (GPTQ8, GPTQ8), True)]
            for name, configs, factored in variants:
                triton_moe.FACTORED_ZEROS = factored
                err = layer.error(configs, *inputs, ref)
                runs.append((f"{sch} {shape} M={m} {name}", layer, m, inputs, configs, factored, err))


def step(layer, m, inputs, configs, factored):
    def run() -> float:
        triton_moe.FACTORED_ZEROS = factored
        return layer.time(configs, m, *inputs) * 1e6
    return run


times = tune.alternated([step(*r[1:6]) for r in runs], 3)
for (label, *_, err), ts in zip(runs, times, strict=True):
    print(f"{label:62s} {statistics.median(ts):7.1f} us  err {err:.2e}  ({' '.join(f'{t:.1f}' for t in ts)})")
