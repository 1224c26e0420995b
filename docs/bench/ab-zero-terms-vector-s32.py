"""Session 32: a ZERO_SUMS tile's epilogue reading a row's 16 groups of scales and zero points as
16 scalar loads a thread each (the kernel of commit 63cdb60, given as the first argument), against as
vectors (steps aligned to 16 groups, masked by the groups a weight row holds, which TritonExperts
pads to a multiple of 16 for zero-point weights: both kernels read padded tensors here); AWQ on
GPTQ int4's tuned tiles with ZERO_SUMS (as tools/tune.py seeds them, without the seed's register
caps) at Qwen3's and DeepSeek-V2-Lite's decode shapes, and today's ZERO_SUMS tables at Mixtral's
M = 64 (AWQ, W8A16 asym); today's tables and GPTQ as the yardsticks; three alternated rounds,
medians, us. Ran at b877502, from a snapshot's root on the GPU:
python3 docs/bench/ab-zero-terms-vector-s32.py /path/to/moe_gemm_63cdb60.py"""
import importlib.util
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import tile_config, triton_moe  # noqa: E402

spec = importlib.util.spec_from_file_location("moe_registry_kernels._moe_gemm_before", sys.argv[1])
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
after = triton_moe._fused_moe_kernel

schemes = bench.registry_schemes()
dev = torch.device("cuda")
name, sms = torch.cuda.get_device_name(dev), torch.cuda.get_device_properties(dev).multi_processor_count
runs = []
for zp, fixed, shape_name, m in (("awq-w4a16", "gptq-w4a16", "qwen3", 8), ("awq-w4a16", "gptq-w4a16", "qwen3", 64),
                                  ("awq-w4a16", "gptq-w4a16", "dsv2lite", 8),
                                  ("awq-w4a16", "gptq-w4a16", "dsv2lite", 64),
                                  ("compressed-tensors-w8a16-asym", "gptq-w8a16", "qwen3", 64),
                                  ("awq-w4a16", "gptq-w4a16", "mixtral", 64),
                                  ("compressed-tensors-w8a16-asym", "gptq-w8a16", "mixtral", 64)):
    shape = bench.SHAPES[shape_name]
    layer = tune.Layer(shape, schemes[zp], dev, False)
    kscheme = triton_moe.scheme_from_keys(*schemes[zp].keys)
    inputs = layer.inputs(m)
    ref = layer.reference(*inputs)
    today = tune.todays_configs(shape, schemes[zp].keys, m, name, sms)
    seed = tune.todays_configs(shape, schemes[fixed].keys, m, name, sms)
    tile = today if today[0].get("ZERO_SUMS") else tile_config._fit_pair(
        *({k: v for k, v in c.items() if k != "maxnreg"} | {"ZERO_SUMS": True} for c in seed), kscheme)
    variants = (("scalar loads", before._fused_moe_kernel, tile), ("vector loads", after, tile))
    if not today[0].get("ZERO_SUMS"):
        variants = (("today", after, today), *variants)
    for label, kernel, configs in variants:
        triton_moe._fused_moe_kernel = kernel
        runs.append((f"{zp} {shape_name} M={m} {label}", layer, inputs, configs, kernel, m,
                     layer.error(configs, *inputs, ref)))
    print(f"{zp} {shape_name} M={m}: ZERO_SUMS tile {tile}", flush=True)
    yardstick = tune.Layer(shape, schemes[fixed], dev, False)
    runs.append((f"{fixed} {shape_name} M={m} today", yardstick, yardstick.inputs(m), (None, None), after, m, 0.0))


def step(layer, inputs, configs, kernel, m):
    def run() -> float:
        triton_moe._fused_moe_kernel = kernel
        return layer.time(configs, m, *inputs) * 1e6
    return run


times = tune.alternated([step(*r[1:6]) for r in runs], 3)
for (label, *_, err), ts in zip(runs, times, strict=True):
    print(f"{label:62s} {statistics.median(ts):7.1f} us  err {err:.2e}  ({' '.join(f'{t:.1f}' for t in ts)})",
          flush=True)
