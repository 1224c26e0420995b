"""Session 34: where W4A8's one-token layer spends its time against GPTQ int4's, per kernel kind
(GEMMs against the rest, tools/bench.kernel_times: profiler device time, plain launches), and the
layer's time (CUDA graph): today (both GEMMs quantise the token themselves), the quantisation
kernels feeding GEMMs that read codes (SCALE_IN_GEMM off), and today's kernel with the in-loop
rounding taken out (wrong numbers, timing only: /tmp/ab-one-token/no-rounding.py as
ab-one-token-prefetch-s34.py --write-variants writes it). Qwen3 and DeepSeek-V2-Lite, M = 1:
docs/bench/tune-s34-h100.txt, part 3. From a snapshot's root on the GPU (ran at 1771c87's kernels):
python3 docs/bench/ab-one-token-prefetch-s34.py --write-variants BASE (any BASE), then
python3 docs/bench/profile-one-token-s34.py"""
import statistics
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

gpu = ab_kernels.this_gpu()
today = ab_kernels.todays_kernel()
no_rounding = ab_kernels.kernel_from_file("/tmp/ab-one-token/no-rounding.py")
for shape_name in ("qwen3", "dsv2lite"):
    shape = bench.SHAPES[shape_name]
    w4a8 = tune.Layer(shape, gpu.schemes["compressed-tensors-w4a8-int"], gpu.device, False)
    gptq = tune.Layer(shape, gpu.schemes["gptq-w4a16"], gpu.device, False)
    for label, layer, kernel, in_gemm in (("W4A8 today", w4a8, today, True),
                                          ("W4A8 quantisation kernels", w4a8, today, False),
                                          ("W4A8 no rounding", w4a8, no_rounding, True),
                                          ("GPTQ int4", gptq, today, True)):
        triton_moe.SCALE_IN_GEMM = in_gemm
        ab_kernels._use(kernel)
        x, tw, ti = layer.inputs(1)
        kernels = layer.copies_for(1)
        gemm, glue = bench.kernel_times(bench._calls(kernels, x, tw, ti), len(kernels), gpu.device, repeats=20)
        layer_us = statistics.median(layer.time((None, None), 1, x, tw, ti) * 1e6 for _ in range(5))
        print(f"{shape_name:9s} {label:28s} layer {layer_us:6.1f} us   GEMMs {gemm * 1e6:6.1f}   "
              f"other kernels {glue * 1e6:5.1f}", flush=True)
    triton_moe.SCALE_IN_GEMM = True
