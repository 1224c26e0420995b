"""Session 32: a ZERO_SUMS tile's zero-point terms with their first step's operands (the rows'
group sums, the groups' scales and zero points) loaded after the main loop, where nothing hides
their latency (the kernel of commit d7d8be9, given as the first argument), against loaded before
it; AWQ on GPTQ int4's tuned tiles with ZERO_SUMS (as tools/tune.py seeds them, without the seed's
register caps) at Qwen3's and DeepSeek-V2-Lite's decode shapes, today's AWQ tables and GPTQ int4
as the yardsticks; three alternated rounds, medians, us.
Ran at 07dfc41 (which loaded them ahead; reverted after this run: no faster, see
docs/bench/tune-s32-h100.txt), from a snapshot's root on the GPU:
python3 docs/bench/ab-zero-terms-ahead-s32.py /path/to/moe_gemm_d7d8be9.py"""
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
for shape_name, m in (("qwen3", 8), ("qwen3", 64), ("dsv2lite", 8)):
    shape = bench.SHAPES[shape_name]
    layer = tune.Layer(shape, schemes["awq-w4a16"], dev, False)
    kscheme = triton_moe.scheme_from_keys(*schemes["awq-w4a16"].keys)
    inputs = layer.inputs(m)
    ref = layer.reference(*inputs)
    seed = tune.todays_configs(shape, schemes["gptq-w4a16"].keys, m, name, sms)
    tile = tile_config._fit_pair(*({k: v for k, v in c.items() if k != "maxnreg"} | {"ZERO_SUMS": True} for c in seed),
                                 kscheme)
    today = tune.todays_configs(shape, schemes["awq-w4a16"].keys, m, name, sms)
    variants = (("today", after, today), ("gptq tile, terms' loads after the loop", before._fused_moe_kernel, tile),
                ("gptq tile, first loads ahead of the loop", after, tile))
    for label, kernel, configs in variants:
        triton_moe._fused_moe_kernel = kernel
        runs.append((f"awq {shape_name} M={m} {label}", layer, inputs, configs, kernel, m,
                     layer.error(configs, *inputs, ref)))
    print(f"awq {shape_name} M={m}: tile {tile}", flush=True)
    gptq = tune.Layer(shape, schemes["gptq-w4a16"], dev, False)
    runs.append((f"gptq-w4a16 {shape_name} M={m} today", gptq, gptq.inputs(m), (None, None), after, m, 0.0))


def step(layer, inputs, configs, kernel, m):
    def run() -> float:
        triton_moe._fused_moe_kernel = kernel
        return layer.time(configs, m, *inputs) * 1e6
    return run


times = tune.alternated([step(*r[1:6]) for r in runs], 3)
for (label, *_, err), ts in zip(runs, times, strict=True):
    print(f"{label:62s} {statistics.median(ts):7.1f} us  err {err:.2e}  ({' '.join(f'{t:.1f}' for t in ts)})",
          flush=True)
