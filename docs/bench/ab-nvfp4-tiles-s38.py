"""Session 38: NVFP4 at DeepSeek-V2-Lite's M = 8 on its tuned tiles (chosen before the scale codes,
tune-s35-h100.txt) against a few larger ones the scale codes' fewer registers may now favour, beside
GPTQ int4, five alternated rounds: docs/bench/scale-codes-s38-h100.txt. From a snapshot's root on the
GPU: python3 docs/bench/ab-nvfp4-tiles-s38.py"""
import json
import sys
from pathlib import Path

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

TABLE = Path("kernels/configs") / ("NVIDIA_H100_80GB_HBM3__e2m1_scale_fp8e4m3_group_16_static_scale2_float32_tensor"
                                   "_static__unquantized.json")
entries = json.loads(TABLE.read_text())
TODAY = (entries["E64_top6_N2816_K2048"]["8"], entries["E64_top6_N2048_K1408"]["8"])
VARIANTS = {
    "gemm1 BN 128": ({**TODAY[0], "BLOCK_N": 128, "maxnreg": None}, TODAY[1]),
    "gemm1 BK 256": ({**TODAY[0], "BLOCK_K": 256, "num_stages": 3, "maxnreg": None}, TODAY[1]),
    "gemm2 BN 128": (TODAY[0], {**TODAY[1], "BLOCK_N": 128}),
    "gemm2 BK 256": (TODAY[0], {**TODAY[1], "BLOCK_K": 256}),
    "both BN 128": ({**TODAY[0], "BLOCK_N": 128, "maxnreg": None}, {**TODAY[1], "BLOCK_N": 128}),
}
gpu = ab_kernels.this_gpu()
shape, kernel = bench.SHAPES["dsv2lite"], ab_kernels.todays_kernel()
nvfp4 = tune.Layer(shape, gpu.schemes["modelopt-nvfp4"], gpu.device, False)
gptq = tune.Layer(shape, gpu.schemes["gptq-w4a16"], gpu.device, False)
inputs = nvfp4.inputs(8)
ref = nvfp4.reference(*inputs)
rows = [ab_kernels.variant("modelopt-nvfp4 dsv2lite M=8 today's tiles", nvfp4, inputs, 8, kernel, (None, None), ref)]
rows += [ab_kernels.variant(f"modelopt-nvfp4 dsv2lite M=8 {label}", nvfp4, inputs, 8, kernel, configs, ref)
         for label, configs in VARIANTS.items()]
rows.append(ab_kernels.variant("gptq-w4a16 dsv2lite M=8", gptq, inputs, 8, kernel, (None, None),
                               gptq.reference(*inputs)))
ab_kernels.print_alternated(rows, 5)
