"""Session 31: zero-point weights (W8A16 asym, AWQ) on the factored decode dot with the layer's
per-group input sums (ZERO_SUMS), at M = 64, three alternated rounds, medians, us: the zero points'
terms as one float32-accurate dot after the loop (three TF32 products) or as one rank-1 update a
group, under a cap of 168 registers (three programs an SM) and, on Mixtral, uncapped; today's tables,
and GPTQ int8 / int4 (no zero points) as the yardstick. Qwen3 and DeepSeek-V2-Lite take GPTQ's
M = 64 tiles with ZERO_SUMS. Ran at 9085d7a, whose triton_moe.ZERO_TERMS_DOT switched the two forms
(the rank-1 form went after it), from a snapshot's root on the GPU: python3 docs/bench/ab-zero-sums-s31.py."""
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

schemes = bench.registry_schemes()
dev = torch.device("cuda")
name, sms = torch.cuda.get_device_name(dev), torch.cuda.get_device_properties(dev).multi_processor_count
M = 64
runs = []
for shape in ("mixtral", "qwen3", "dsv2lite"):
    for zp, fixed in (("compressed-tensors-w8a16-asym", "gptq-w8a16"), ("awq-w4a16", "gptq-w4a16")):
        base = tune.todays_configs(bench.SHAPES[shape], schemes[fixed].keys, M, name, sms)
        layer = tune.Layer(bench.SHAPES[shape], schemes[zp], dev, False)
        inputs = layer.inputs(M)
        ref = layer.reference(*inputs)
        today = tune.todays_configs(bench.SHAPES[shape], schemes[zp].keys, M, name, sms)
        tile = today if today[0].get("ZERO_SUMS") else tuple(
            {**{k: v for k, v in c.items() if k != "GROUP_DOTS"}, "ZERO_SUMS": True, "BLOCK_K": min(c["BLOCK_K"], 128)}
            for c in base)
        variants = [("today", today, True)]
        for as_dot in (True, False):
            for cap in (None, 168) if shape == "mixtral" else (168,):
                configs = tuple({**c, "maxnreg": cap} if cap else c for c in tile)
                variants.append((f"zero_sums {'dot' if as_dot else 'rank1'} cap {cap}", configs, as_dot))
        for label, configs, as_dot in variants:
            triton_moe.ZERO_TERMS_DOT = as_dot
            err = layer.error(configs, *inputs, ref)
            runs.append((f"{zp} {shape} {label}", layer, inputs, configs, as_dot, err))
        fixed_layer = tune.Layer(bench.SHAPES[shape], schemes[fixed], dev, False)
        fixed_inputs = fixed_layer.inputs(M)
        runs.append((f"{fixed} {shape} today", fixed_layer, fixed_inputs, (None, None), True, 0.0))


def step(layer, inputs, configs, as_dot):
    def run() -> float:
        triton_moe.ZERO_TERMS_DOT = as_dot
        return layer.time(configs, M, *inputs) * 1e6
    return run


times = tune.alternated([step(*r[1:5]) for r in runs], 3)
for (label, *_, err), ts in zip(runs, times, strict=True):
    print(f"{label:62s} {statistics.median(ts):7.1f} us  err {err:.2e}  ({' '.join(f'{t:.1f}' for t in ts)})",
          flush=True)
