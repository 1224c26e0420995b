"""Session 38: the decode cells of issue #19's schemes that the session 38 table
(issue19-s38-h100-decode.jsonl, one sample a cell) read below 0.97 per byte, timed again against their
yardsticks (GPTQ int4 for 4-bit weights, GPTQ int8 for 8-bit), in alternation, five rounds, so each ratio
compares rows of one call under the same clocks: docs/bench/scale-codes-s38-h100.txt. From a snapshot's
root on the GPU: python3 docs/bench/ab-decode-cells-s38.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import per_byte  # noqa: E402
import tune  # noqa: E402

CELLS = {("dsv2lite", 1): ["fp8-w8a8-dynamic", "compressed-tensors-w8a8-fp8-dynamic", "modelopt-mxfp8"],
         ("dsv2lite", 8): ["modelopt-nvfp4", "modelopt-fp8"],
         ("mixtral", 8): ["modelopt-fp8"],
         ("qwen3", 8): ["compressed-tensors-w8a16-asym"]}

gpu = ab_kernels.this_gpu()
bits = per_byte.weight_bits(gpu.schemes)
yardsticks = per_byte.baselines_by_width(list(per_byte.DEFAULT_BASELINES), bits)
kernel = ab_kernels.todays_kernel()
rows = []
for (shape_name, m), schemes in CELLS.items():
    shape = bench.SHAPES[shape_name]
    bases = {yardsticks[bits[s]] for s in schemes}
    for name in [*schemes, *sorted(bases)]:
        layer = tune.Layer(shape, gpu.schemes[name], gpu.device, False)
        inputs = layer.inputs(m)
        base = None if name in bases else f"{yardsticks[bits[name]]} {shape_name} M={m}"
        rows.append(ab_kernels.timed_variant(f"{name} {shape_name} M={m}", layer, inputs, m, kernel, base,
                                             layer.reference(*inputs)))
    print(f"built {shape_name} M={m}", flush=True)
ab_kernels.print_per_byte(rows, 5)
