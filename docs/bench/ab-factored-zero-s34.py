"""Session 34: zero-point weights on the factored decode dot with each weight's own zero point
(FACTORED_TILE_ZERO, commit b60327e, reverted by ae2d9a5: the tile's dot runs on code - zero,
exact in 16 bits, and the group's scale multiplies its result; no paired multiply a weight pair),
against today's kernel (code - zero times the scale per weight); the same tuned tiles for both,
AWQ and W8A16 asym at the three benchmark shapes, M = 1, 8, 64; GPTQ int4/int8 as the yardstick, and each row's per-byte
ratio to it (weight bytes as tools/per_byte.py counts them). Three alternated rounds, medians, us:
docs/bench/tune-s34-h100.txt, part 1 (run at b60327e, whose "b14ab1c" rows are today's kernel).
From a snapshot's root on the GPU, after
git show b60327e:kernels/moe_gemm.py > /tmp/moe_gemm-factored-zero.py:
python3 docs/bench/ab-factored-zero-s34.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

M_VALUES = (1, 8, 64)
SHAPES = ("qwen3", "dsv2lite", "mixtral")
SCHEMES = (("awq-w4a16", "gptq-w4a16"), ("compressed-tensors-w8a16-asym", "gptq-w8a16"))

gpu = ab_kernels.this_gpu()
today = ab_kernels.todays_kernel()
factored = ab_kernels.kernel_from_file("/tmp/moe_gemm-factored-zero.py")
rows = []
for shape_name in SHAPES:
    shape = bench.SHAPES[shape_name]
    for zp, fixed in SCHEMES:
        layer = tune.Layer(shape, gpu.schemes[zp], gpu.device, False)
        yardstick = tune.Layer(shape, gpu.schemes[fixed], gpu.device, False)
        for m in M_VALUES:
            inputs = layer.inputs(m)
            ref = layer.reference(*inputs)
            base = f"{fixed} {shape_name} M={m}"
            for label, kernel in (("today", today), ("factored zero", factored)):
                rows.append(ab_kernels.timed_variant(f"{zp} {shape_name} M={m} {label}", layer, inputs, m, kernel,
                                                     base, ref))
            rows.append(ab_kernels.timed_variant(base, yardstick, yardstick.inputs(m), m, today))
        print(f"built {shape_name} {zp}", flush=True)
ab_kernels.print_per_byte(rows, 3)
