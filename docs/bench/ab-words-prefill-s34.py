"""Session 34: session 33's A/B of zero-point 4-bit weights' scales and zero points as two tensors
against one int32 word a group (triton_moe._scale_zero_words), at prefill: AWQ at M = 512 and 4096
on the three benchmark shapes, today's kernel and tiles for both, GPTQ int4 as the yardstick
(issue19-s34-h100 read AWQ's GEMMs at M = 4096 21% slower on DeepSeek-V2-Lite's shape and 14% on
Qwen3's than session 27's run). Three alternated rounds, medians, us: docs/bench/tune-s34-h100.txt,
part 6. From a snapshot's root on the GPU: python3 docs/bench/ab-words-prefill-s34.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

M_VALUES = (512, 4096)

gpu = ab_kernels.this_gpu()
kernel = ab_kernels.todays_kernel()
rows = []
for shape_name in ("qwen3", "dsv2lite", "mixtral"):
    shape = bench.SHAPES[shape_name]
    two = ab_kernels.two_tensor_layer(shape, gpu.schemes["awq-w4a16"], gpu.device, M_VALUES)
    words = tune.Layer(shape, gpu.schemes["awq-w4a16"], gpu.device, False)
    yardstick = tune.Layer(shape, gpu.schemes["gptq-w4a16"], gpu.device, False)
    for m in M_VALUES:
        inputs = words.inputs(m)
        ref = words.reference(*inputs)
        base = f"gptq-w4a16 {shape_name} M={m} today"
        for label, layer in (("two tensors", two), ("words", words)):
            rows.append(ab_kernels.timed_variant(f"awq-w4a16 {shape_name} M={m} {label}", layer, inputs, m, kernel,
                                                 base, ref))
        rows.append(ab_kernels.timed_variant(base, yardstick, yardstick.inputs(m), m, kernel))
    print(f"built {shape_name} awq-w4a16", flush=True)
ab_kernels.print_per_byte(rows, 3)
