"""Session 33: zero-point weights' float16 group scales and zero points as two tensors (a 2-byte and
a 1-byte load a column, which each K step waited on) against one int32 word each (one 4-byte load,
streamed ahead by the pipeliner: triton_moe._scale_zero_words); the same kernel and today's tuned
tiles for both, AWQ and W8A16 asym at the three benchmark shapes, M = 1, 8, 64; GPTQ int4/int8 as
the yardstick, and each row's per-byte ratio to it (weight bytes as tools/per_byte.py counts them:
codes, scales and zero points as the checkpoint holds them). Three alternated rounds, medians, us.
Ran on the tree of 108f429 plus the words for every zero-point width (W8A16 asym's rows held words
too; they lost, and TritonExperts now packs 4-bit codes' only, so its "words" rows now time two
tensors): docs/bench/tune-s33-h100.txt, part 1. From a snapshot's root on the GPU:
python3 docs/bench/ab-scale-words-s33.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

M_VALUES = (1, 8, 64)
SHAPES = ("qwen3", "dsv2lite", "mixtral")
SCHEMES = (("awq-w4a16", "gptq-w4a16"), ("compressed-tensors-w8a16-asym", "gptq-w8a16"))


gpu = ab_kernels.this_gpu()
kernel = ab_kernels.todays_kernel()
rows = []
for shape_name in SHAPES:
    shape = bench.SHAPES[shape_name]
    for zp, fixed in SCHEMES:
        two = ab_kernels.two_tensor_layer(shape, gpu.schemes[zp], gpu.device, M_VALUES)
        words = tune.Layer(shape, gpu.schemes[zp], gpu.device, False)
        yardstick = tune.Layer(shape, gpu.schemes[fixed], gpu.device, False)
        for m in M_VALUES:
            inputs = words.inputs(m)
            ref = words.reference(*inputs)
            base = f"{fixed} {shape_name} M={m} today"
            for label, layer in (("two tensors", two), ("words", words)):
                rows.append(ab_kernels.timed_variant(f"{zp} {shape_name} M={m} {label}", layer, inputs, m, kernel,
                                                     base, ref))
            rows.append(ab_kernels.timed_variant(base, yardstick, yardstick.inputs(m), m, kernel))
        print(f"built {shape_name} {zp}", flush=True)
ab_kernels.print_per_byte(rows, 3)
