"""Session 32: a ZERO_SUMS tile's epilogue reading a row's 16 groups of scales and zero points as
16 scalar loads a thread each (the kernel of commit 63cdb60, given as the first argument), against as
vectors (steps aligned to 16 groups, masked by the groups a weight row holds, which TritonExperts
pads to a multiple of 16 for zero-point weights: both kernels read padded tensors here); AWQ on
GPTQ int4's tuned tiles with ZERO_SUMS (as tools/tune.py seeds them, without the seed's register
caps) at Qwen3's and DeepSeek-V2-Lite's decode shapes, and today's ZERO_SUMS tables at Mixtral's
M = 64 (AWQ, W8A16 asym); today's tables and GPTQ as the yardsticks; three alternated rounds,
medians, us. Ran at b877502 (its shared parts since moved to tools/ab_kernels.py), from a snapshot's root on the GPU:
python3 docs/bench/ab-zero-terms-vector-s32.py /path/to/moe_gemm_63cdb60.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

before, after = ab_kernels.kernel_from_file(sys.argv[1]), ab_kernels.todays_kernel()
gpu = ab_kernels.this_gpu()
schemes, dev, name, sms = gpu.schemes, gpu.device, gpu.name, gpu.sms
rows = []
for zp, fixed, shape_name, m in (("awq-w4a16", "gptq-w4a16", "qwen3", 8), ("awq-w4a16", "gptq-w4a16", "qwen3", 64),
                                  ("awq-w4a16", "gptq-w4a16", "dsv2lite", 8),
                                  ("awq-w4a16", "gptq-w4a16", "dsv2lite", 64),
                                  ("compressed-tensors-w8a16-asym", "gptq-w8a16", "qwen3", 64),
                                  ("awq-w4a16", "gptq-w4a16", "mixtral", 64),
                                  ("compressed-tensors-w8a16-asym", "gptq-w8a16", "mixtral", 64)):
    shape = bench.SHAPES[shape_name]
    layer = tune.Layer(shape, schemes[zp], dev, False)
    inputs = layer.inputs(m)
    ref = layer.reference(*inputs)
    today = tune.todays_configs(shape, schemes[zp].keys, m, name, sms)
    tile = today if today[0].get("ZERO_SUMS") else ab_kernels.zero_sums_tiles(
        tune.todays_configs(shape, schemes[fixed].keys, m, name, sms), triton_moe.scheme_from_keys(*schemes[zp].keys))
    variants = (("scalar loads", before, tile), ("vector loads", after, tile))
    if not today[0].get("ZERO_SUMS"):
        variants = (("today", after, today), *variants)
    for label, kernel, configs in variants:
        rows.append(ab_kernels.variant(f"{zp} {shape_name} M={m} {label}", layer, inputs, m, kernel, configs, ref))
    print(f"{zp} {shape_name} M={m}: ZERO_SUMS tile {tile}", flush=True)
    yardstick = tune.Layer(shape, schemes[fixed], dev, False)
    rows.append(ab_kernels.variant(f"{fixed} {shape_name} M={m} today", yardstick, yardstick.inputs(m), m, after,
                                   (None, None)))
ab_kernels.print_alternated(rows)
