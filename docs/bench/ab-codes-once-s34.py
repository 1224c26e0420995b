"""Session 34: one-token GEMMs that quantise their own input (A_SCALE_IN), each program quantising
its share of the token's row once before its loop into a row of its own that the loop reads as a
quantised A (141765a's triton_moe.SCALE_IN_GEMM_CODES_ONCE, moe_gemm.CODES_ONCE), against quantising the
row's slice once a K step in the loop (the flag off: the quantised slice, repeated down the tile,
went through shared memory every step). One kernel, the same tuned tiles; every scheme whose
GEMMs quantise one token's input, at M = 1 on the three benchmark shapes; GPTQ int4/int8 as the
yardstick, with each row's per-byte ratio to it. Five alternated rounds, medians, us:
docs/bench/tune-s34-h100.txt, part 4. Ran from a snapshot of 141765a (CODES_ONCE, reverted by
81cfaef): python3 docs/bench/ab-codes-once-s34.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

SHAPES = ("qwen3", "dsv2lite", "mixtral")
SCHEMES = (("compressed-tensors-w4a8-int", "gptq-w4a16"), ("quark-w8a8-int8", "gptq-w8a16"),
           ("quark-w8a8-int8-tensor", "gptq-w8a16"), ("compressed-tensors-w8a8-fp8-dynamic", "gptq-w8a16"),
           ("fp8-w8a8-dynamic", "gptq-w8a16"), ("fp8-w8a8-static", "gptq-w8a16"))


def timed(layer: tune.Layer, inputs: tuple, once: bool):  # type: ignore[no-untyped-def]
    def run() -> float:
        triton_moe.SCALE_IN_GEMM_CODES_ONCE = once  # read when the layer's graph is captured
        return layer.time((None, None), 1, *inputs) * 1e6
    return run


def error(layer: tune.Layer, inputs: tuple, ref, once: bool) -> float:  # type: ignore[no-untyped-def]
    triton_moe.SCALE_IN_GEMM_CODES_ONCE = once
    return layer.error((None, None), *inputs, ref)


gpu = ab_kernels.this_gpu()
rows = []
yardsticks = set()
for shape_name in SHAPES:
    shape = bench.SHAPES[shape_name]
    for quantised, fixed in SCHEMES:
        layer = tune.Layer(shape, gpu.schemes[quantised], gpu.device, False)
        inputs = layer.inputs(1)
        ref = layer.reference(*inputs)
        base = f"{fixed} {shape_name} M=1"
        for label, once in (("in the loop", False), ("once", True)):
            rows.append(ab_kernels.Timed(f"{quantised} {shape_name} M=1 {label}", timed(layer, inputs, once),
                                         layer.weight_bytes, base, error(layer, inputs, ref, once)))
        if base not in yardsticks:
            yardsticks.add(base)
            yardstick = tune.Layer(shape, gpu.schemes[fixed], gpu.device, False)
            rows.append(ab_kernels.Timed(base, timed(yardstick, yardstick.inputs(1), True), yardstick.weight_bytes))
        print(f"built {shape_name} {quantised}", flush=True)
ab_kernels.print_per_byte(rows, 5)
triton_moe.SCALE_IN_GEMM_CODES_ONCE = True
