"""Session 37: one token's int8-activation layers with both GEMMs as decode_gemv's dp4a GEMV
(triton_moe.DECODE_GEMV) against the tile kernels (the flag off), beside GPTQ int4 / int8 as the
per-byte yardsticks, at M = 1 on the three benchmark shapes: five alternated rounds, medians (CUDA
graphs), then each layer's GEMM and other kernel time (profiler, plain launches, 20 calls):
docs/bench/gemv-s37-h100.txt. From a snapshot's root on the GPU: python3 docs/bench/ab-gemv-s37.py"""
import sys

import torch

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

# (scheme, its yardstick)
SCHEMES = (("compressed-tensors-w4a8-int", "gptq-w4a16"), ("compressed-tensors-w8a8-int8", "gptq-w8a16"),
           ("quark-w8a8-int8", "gptq-w8a16"), ("quark-w8a8-int8-tensor", "gptq-w8a16"))
gpu = ab_kernels.this_gpu()


def row(label: str, layer: tune.Layer, inputs: tuple, gemv: bool, yardstick: str | None, ref) -> ab_kernels.Timed:
    def use() -> None:  # read when the layer's graph is captured
        triton_moe.DECODE_GEMV = gemv
    return ab_kernels.timed_setting(label, layer, inputs, 1, use, yardstick, ref)


def kernel_split(layer: tune.Layer, inputs: tuple, gemv: bool) -> str:
    triton_moe.DECODE_GEMV = gemv
    kernels = layer.copies_for(1)
    gemm, glue = bench.kernel_times(bench._calls(kernels, *inputs), len(kernels), gpu.device, repeats=20)
    return f"GEMMs {gemm * 1e6:6.1f} us   other kernels {glue * 1e6:5.1f} us"


for shape_name in ("qwen3", "dsv2lite", "mixtral"):
    shape = bench.SHAPES[shape_name]
    rows, layers = [], {}
    for name in dict.fromkeys(name for pair in SCHEMES for name in pair):
        layers[name] = tune.Layer(shape, gpu.schemes[name], gpu.device, False)
    for name, yardstick in SCHEMES:
        layer = layers[name]
        inputs = layer.inputs(1)
        ref = layer.reference(*inputs)
        base = f"{yardstick} {shape_name} M=1"
        rows.append(row(f"{name} {shape_name} M=1 gemv", layer, inputs, True, base, ref))
        rows.append(row(f"{name} {shape_name} M=1 tiles", layer, inputs, False, base, ref))
    for yardstick in dict.fromkeys(pair[1] for pair in SCHEMES):
        layer = layers[yardstick]
        inputs = layer.inputs(1)
        rows.append(row(f"{yardstick} {shape_name} M=1", layer, inputs, True, None, layer.reference(*inputs)))
    print(f"built {shape_name}", flush=True)
    ab_kernels.print_per_byte(rows, 5)
    for name, gemv in (("compressed-tensors-w4a8-int", True), ("compressed-tensors-w4a8-int", False),
                       ("gptq-w4a16", True), ("quark-w8a8-int8", True), ("quark-w8a8-int8", False),
                       ("gptq-w8a16", True)):
        label = f"{name} {'gemv' if gemv else 'tiles'}" if "gptq" not in name else name
        print(f"# {shape_name:9s} {label:40s} {kernel_split(layers[name], layers[name].inputs(1), gemv)}", flush=True)
    triton_moe.DECODE_GEMV = True
    del rows, layers
    torch.cuda.empty_cache()
