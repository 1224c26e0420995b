"""Session 36: decode tiles with fewer warps. tools/tune.py tries only 4-warp tiles (8 for the widest)
at decode; offline (tools/kernel_sass.py, sm_90) a 2-warp program of today's W4A8 tile at Qwen3's
M = 1 runs 0.107 warp instructions a weight against 0.136 (the token's row, split and repeated for
the dot, is handled once a warp, over twice the columns). Today's tiles against the same tiles on 2
and 1 warps (both GEMMs, without today's register caps), and on 2 warps with 32 columns, for
the decode cells below 0.95 per byte and their yardsticks, in alternation, three rounds:
docs/bench/tune-s36-h100.txt. From a snapshot's root on the GPU: python3 docs/bench/ab-warps-s36.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

CELLS = {("qwen3", 1): ["compressed-tensors-w4a8-int", "gptq-w4a16"],
         ("qwen3", 8): ["compressed-tensors-w4a8-int", "gptq-w4a16"],
         ("dsv2lite", 8): ["modelopt-nvfp4", "awq-w4a16", "gptq-w4a16"],
         ("mixtral", 1): ["compressed-tensors-w4a8-int", "gptq-w4a16"]}
CHANGES = {"2 warps": {"num_warps": 2}, "1 warp": {"num_warps": 1},
           "2 warps, 32 columns": {"num_warps": 2, "BLOCK_N": 32}}

gpu = ab_kernels.this_gpu()
kernel = ab_kernels.todays_kernel()
for (shape_name, m), schemes in CELLS.items():
    shape = bench.SHAPES[shape_name]
    rows = []
    for name in schemes:
        layer = tune.Layer(shape, gpu.schemes[name], gpu.device, False)
        inputs = layer.inputs(m)
        ref = layer.reference(*inputs)
        today = tune.todays_configs(shape, (layer.wkey, layer.akey), m, gpu.name, gpu.sms)
        rows.append(ab_kernels.variant(f"{name} {shape_name} M={m} today", layer, inputs, m, kernel, today, ref))
        for label, change in CHANGES.items():
            configs = tuple({k: v for k, v in c.items() if k != "maxnreg"} | change for c in today)
            try:
                rows.append(ab_kernels.variant(f"{name} {shape_name} M={m} {label}", layer, inputs, m, kernel,
                                               configs, ref))
            except Exception as exc:  # noqa: BLE001 (a tile that does not build is reported, not timed)
                print(f"{name} {shape_name} M={m} {label}: {str(exc).splitlines()[0][:150]}", flush=True)
        print(f"built {name} {shape_name} M={m}: {today}", flush=True)
    ab_kernels.print_alternated(rows, 3)
