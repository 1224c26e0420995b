"""Session 35: one token's fp8 block-128 layer whose GEMMs quantise their own input a 128-column
group at a time (each K step finds its group's scale: triton_moe.GROUP_QUANTS_IN_GEMM) against the
same layer with its two quantisation launches, at M = 1 on the three benchmark shapes (Mixtral's
experts are past SCALE_IN_GEMM_MAX_BYTES: there also with the budget lifted); GPTQ int8 as the
yardstick. Also W4A8 at Qwen3 M = 1 under GPTQ int4's tiles with one dot per group. Three
alternated rounds, medians, us: docs/bench/tune-s35-h100.txt. From a snapshot's root on the GPU:
python3 docs/bench/ab-group-in-gemm-s35.py, on the tree of experiment commit c8f1466 (reverted by
the commit after it: triton_moe.GROUP_QUANTS_IN_GEMM is gone)."""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

BUDGET = triton_moe.SCALE_IN_GEMM_MAX_BYTES
UNBOUNDED = 1 << 62


def timed(layer: tune.Layer, m: int, inputs: tuple, in_gemm: bool, budget: int, configs=(None, None)):  # type: ignore[no-untyped-def]
    def run() -> float:
        triton_moe.SCALE_IN_GEMM, triton_moe.SCALE_IN_GEMM_MAX_BYTES = in_gemm, budget  # read at capture
        return layer.time(configs, m, *inputs) * 1e6
    return run


def error(layer: tune.Layer, inputs: tuple, ref, in_gemm: bool, budget: int, configs=(None, None)) -> float:  # type: ignore[no-untyped-def]
    triton_moe.SCALE_IN_GEMM, triton_moe.SCALE_IN_GEMM_MAX_BYTES = in_gemm, budget
    return layer.error(configs, *inputs, ref)


gpu = ab_kernels.this_gpu()
rows = []
for shape_name in ("qwen3", "dsv2lite", "mixtral"):
    cell = ab_kernels.one_token_cell(gpu, shape_name, "fp8-block128", "gptq-w8a16")
    fp8, gptq, inputs, ref, base = cell.layer, cell.yardstick, cell.inputs, cell.ref, cell.base
    variants = [("launch", False, BUDGET), ("in-gemm", True, BUDGET)]
    if shape_name == "mixtral":
        variants.append(("in-gemm unbounded", True, UNBOUNDED))
    for label, in_gemm, budget in variants:
        rows.append(ab_kernels.Timed(f"fp8-block128 {shape_name} M=1 {label}", timed(fp8, 1, inputs, in_gemm, budget),
                                     fp8.weight_bytes, base, error(fp8, inputs, ref, in_gemm, budget)))
    rows.append(ab_kernels.Timed(base, timed(gptq, 1, gptq.inputs(1), True, BUDGET), gptq.weight_bytes))
    print(f"built {shape_name}", flush=True)
shape = bench.SHAPES["qwen3"]
w4a8 = tune.Layer(shape, gpu.schemes["compressed-tensors-w4a8-int"], gpu.device, False)
gptq4 = tune.Layer(shape, gpu.schemes["gptq-w4a16"], gpu.device, False)
inputs = w4a8.inputs(1)
ref = w4a8.reference(*inputs)
gptq_tiles = ({"BLOCK_K": 256, "BLOCK_M": 16, "BLOCK_N": 32, "GROUP_DOTS": True, "GROUP_M": 1, "num_stages": 3,
               "num_warps": 4},
              {"BLOCK_K": 128, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP_DOTS": True, "GROUP_M": 1, "num_stages": 4,
               "num_warps": 4})
base = "gptq-w4a16 qwen3 M=1"
for label, configs in (("today's tiles", (None, None)), ("gptq's tiles, a dot a group", gptq_tiles)):
    rows.append(ab_kernels.Timed(f"w4a8 qwen3 M=1 {label}", timed(w4a8, 1, inputs, True, BUDGET, configs),
                                 w4a8.weight_bytes, base, error(w4a8, inputs, ref, True, BUDGET, configs)))
rows.append(ab_kernels.Timed(base, timed(gptq4, 1, gptq4.inputs(1), True, BUDGET), gptq4.weight_bytes))
ab_kernels.print_per_byte(rows, 3)
triton_moe.SCALE_IN_GEMM, triton_moe.SCALE_IN_GEMM_MAX_BYTES = True, BUDGET
