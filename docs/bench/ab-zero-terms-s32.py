"""Session 32: the zero points' terms of a ZERO_SUMS tile (after the loop, one float32-accurate dot
of the rows' group sums and s (z - MID)) as session 31 took them, Triton's tf32x3 (its three TF32
products summed into a second accumulator from zero, then added to the tile), against this
session's three TF32 products accumulated into the tile itself; on today's tables at Mixtral's
M = 8 and 64 (their ZERO_SUMS cells), the new form also under a cap of 168 registers (three
programs an SM), GPTQ int8 / int4 as the yardstick; three alternated rounds, medians, us.

Session 31's kernel is its kernels/moe_gemm.py (commit e9e93be), given as the first argument; its
launch arguments are this session's but for the one-row sums of one-token blocks (not at these M).
Ran at 6b6c18e, from a snapshot's root on the GPU:
python3 docs/bench/ab-zero-terms-s32.py /path/to/moe_gemm_e9e93be.py"""
import importlib.util
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

spec = importlib.util.spec_from_file_location("moe_registry_kernels._moe_gemm_s31", sys.argv[1])
s31 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s31)
kernels = {"s31 tf32x3": s31._fused_moe_kernel, "s32 into the tile": triton_moe._fused_moe_kernel}

schemes = bench.registry_schemes()
dev = torch.device("cuda")
name, sms = torch.cuda.get_device_name(dev), torch.cuda.get_device_properties(dev).multi_processor_count
runs = []
for m in (64, 8):
    for zp, fixed in (("compressed-tensors-w8a16-asym", "gptq-w8a16"), ("awq-w4a16", "gptq-w4a16")):
        shape = bench.SHAPES["mixtral"]
        layer = tune.Layer(shape, schemes[zp], dev, False)
        inputs = layer.inputs(m)
        ref = layer.reference(*inputs)
        today = tune.todays_configs(shape, schemes[zp].keys, m, name, sms)
        if not today[0].get("ZERO_SUMS"):
            continue
        capped = tuple({**c, "maxnreg": 168} for c in today)
        for label, kernel, configs in (("s31 tf32x3", kernels["s31 tf32x3"], today),
                                       ("s32 into the tile", kernels["s32 into the tile"], today),
                                       ("s32 into the tile, cap 168", kernels["s32 into the tile"], capped)):
            triton_moe._fused_moe_kernel = kernel
            runs.append((f"{zp} M={m} {label}", layer, inputs, configs, kernel, m, layer.error(configs, *inputs, ref)))
        fixed_layer = tune.Layer(shape, schemes[fixed], dev, False)
        runs.append((f"{fixed} M={m} today", fixed_layer, fixed_layer.inputs(m), (None, None),
                     kernels["s32 into the tile"], m, 0.0))


def step(layer, inputs, configs, kernel, m):
    def run() -> float:
        triton_moe._fused_moe_kernel = kernel
        return layer.time(configs, m, *inputs) * 1e6
    return run


times = tune.alternated([step(*r[1:6]) for r in runs], 3)
for (label, *_, err), ts in zip(runs, times, strict=True):
    print(f"{label:62s} {statistics.median(ts):7.1f} us  err {err:.2e}  ({' '.join(f'{t:.1f}' for t in ts)})",
          flush=True)
