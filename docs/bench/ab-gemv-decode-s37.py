"""Session 37, ran at 631b745 (its triton_moe.GEMV_MAX_TOKENS, raised to 16 here, became
GEMV_PAIRS_PER_EXPERT after this run): the decode GEMV past one token on
blocks of 1, 2 and 4 aligned pairs (GEMV_BLOCK_M) against the tile kernels (DECODE_GEMV off), for
W4A8 and Quark W8A8 int8 beside GPTQ int4 / int8 as per-byte yardsticks, M = 2, 4, 8, 16 on the
three benchmark shapes; five alternated rounds, medians (CUDA graphs):
docs/bench/gemv-s37-h100.txt. From a snapshot's root on the GPU: python3 docs/bench/ab-gemv-decode-s37.py"""
import sys

import torch

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

SCHEMES = (("compressed-tensors-w4a8-int", "gptq-w4a16"), ("quark-w8a8-int8", "gptq-w8a16"))
VARIANTS = {"tiles": (False, 1), "gemv bm1": (True, 1), "gemv bm2": (True, 2), "gemv bm4": (True, 4)}
gpu = ab_kernels.this_gpu()
triton_moe.GEMV_MAX_TOKENS = 16


def row(label: str, layer: tune.Layer, m: int, inputs: tuple, variant: tuple[bool, int], yardstick: str | None,
        ref) -> ab_kernels.Timed:
    def use() -> None:  # read when the layer's graph is captured
        triton_moe.DECODE_GEMV, triton_moe.GEMV_BLOCK_M = variant
    return ab_kernels.timed_setting(label, layer, inputs, m, use, yardstick, ref)


for shape_name in ("qwen3", "dsv2lite", "mixtral"):
    shape = bench.SHAPES[shape_name]
    layers = {name: tune.Layer(shape, gpu.schemes[name], gpu.device, False) for pair in SCHEMES for name in pair}
    for m in (2, 4, 8, 16):
        rows = []
        for name, yardstick in SCHEMES:
            inputs = layers[name].inputs(m)
            ref = layers[name].reference(*inputs)
            for label, variant in VARIANTS.items():
                rows.append(row(f"{name} {shape_name} M={m} {label}", layers[name], m, inputs, variant,
                                f"{yardstick} {shape_name} M={m}", ref))
        for yardstick in dict.fromkeys(pair[1] for pair in SCHEMES):
            inputs = layers[yardstick].inputs(m)
            rows.append(row(f"{yardstick} {shape_name} M={m}", layers[yardstick], m, inputs, (True, 1), None,
                            layers[yardstick].reference(*inputs)))
        ab_kernels.print_per_byte(rows, 5)
    del layers
    torch.cuda.empty_cache()
