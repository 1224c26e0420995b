"""Session 32: the zero points' terms of a ZERO_SUMS tile (after the loop, one float32-accurate dot
of the rows' group sums and s (z - MID)) as session 31 took them, Triton's tf32x3 (its three TF32
products summed into a second accumulator from zero, then added to the tile), against this
session's three TF32 products accumulated into the tile itself; on today's tables at Mixtral's
M = 8 and 64 (their ZERO_SUMS cells), the new form also under a cap of 168 registers (three
programs an SM), GPTQ int8 / int4 as the yardstick; three alternated rounds, medians, us.

Session 31's kernel is its kernels/moe_gemm.py (commit e9e93be), given as the first argument; its
launch arguments are this session's but for the one-row sums of one-token blocks (not at these M).
Ran at 6b6c18e (its shared parts since moved to tools/ab_kernels.py), from a snapshot's root on the GPU:
python3 docs/bench/ab-zero-terms-s32.py /path/to/moe_gemm_e9e93be.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

s31, s32 = ab_kernels.kernel_from_file(sys.argv[1]), ab_kernels.todays_kernel()
gpu = ab_kernels.this_gpu()
schemes, dev, name, sms = gpu.schemes, gpu.device, gpu.name, gpu.sms
shape = bench.SHAPES["mixtral"]
rows = []
for m in (64, 8):
    for zp, fixed in (("compressed-tensors-w8a16-asym", "gptq-w8a16"), ("awq-w4a16", "gptq-w4a16")):
        layer = tune.Layer(shape, schemes[zp], dev, False)
        inputs = layer.inputs(m)
        ref = layer.reference(*inputs)
        today = tune.todays_configs(shape, schemes[zp].keys, m, name, sms)
        if not today[0].get("ZERO_SUMS"):
            continue
        capped = tuple({**c, "maxnreg": 168} for c in today)
        for label, kernel, configs in (("s31 tf32x3", s31, today), ("s32 into the tile", s32, today),
                                       ("s32 into the tile, cap 168", s32, capped)):
            rows.append(ab_kernels.variant(f"{zp} M={m} {label}", layer, inputs, m, kernel, configs, ref))
        yardstick = tune.Layer(shape, schemes[fixed], dev, False)
        rows.append(ab_kernels.variant(f"{fixed} M={m} today", yardstick, yardstick.inputs(m), m, s32, (None, None)))
ab_kernels.print_alternated(rows)
