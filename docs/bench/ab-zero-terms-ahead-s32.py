"""Session 32: a ZERO_SUMS tile's zero-point terms with their first step's operands (the rows'
group sums, the groups' scales and zero points) loaded after the main loop, where nothing hides
their latency (the kernel of commit d7d8be9, given as the first argument), against loaded before
it; AWQ on GPTQ int4's tuned tiles with ZERO_SUMS (as tools/tune.py seeds them, without the seed's
register caps) at Qwen3's and DeepSeek-V2-Lite's decode shapes, today's AWQ tables and GPTQ int4
as the yardsticks; three alternated rounds, medians, us.
Ran at 07dfc41 (which loaded them ahead, reverted after this run: no faster, see
docs/bench/tune-s32-h100.txt; the script's shared parts have since moved to tools/ab_kernels.py),
from a snapshot's root on the GPU:
python3 docs/bench/ab-zero-terms-ahead-s32.py /path/to/moe_gemm_d7d8be9.py"""
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
for shape_name, m in (("qwen3", 8), ("qwen3", 64), ("dsv2lite", 8)):
    shape = bench.SHAPES[shape_name]
    layer = tune.Layer(shape, schemes["awq-w4a16"], dev, False)
    inputs = layer.inputs(m)
    ref = layer.reference(*inputs)
    tile = ab_kernels.zero_sums_tiles(tune.todays_configs(shape, schemes["gptq-w4a16"].keys, m, name, sms),
                                      triton_moe.scheme_from_keys(*schemes["awq-w4a16"].keys))
    today = tune.todays_configs(shape, schemes["awq-w4a16"].keys, m, name, sms)
    for label, kernel, configs in (("today", after, today), ("gptq tile, terms' loads after the loop", before, tile),
                                   ("gptq tile, first loads ahead of the loop", after, tile)):
        rows.append(ab_kernels.variant(f"awq {shape_name} M={m} {label}", layer, inputs, m, kernel, configs, ref))
    print(f"awq {shape_name} M={m}: tile {tile}", flush=True)
    gptq = tune.Layer(shape, schemes["gptq-w4a16"], dev, False)
    rows.append(ab_kernels.variant(f"gptq-w4a16 {shape_name} M={m} today", gptq, gptq.inputs(m), m, after,
                                   (None, None)))
ab_kernels.print_alternated(rows)
