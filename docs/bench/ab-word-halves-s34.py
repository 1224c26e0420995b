"""Session 34: AWQ's scale-and-zero words read by the large non-swapped prefill tiles as their two
16-bit halves (triton_moe._word_halves_for: a load into registers, as two tensors were) against the
words themselves (a 4-byte load the pipeliner streams through shared memory), today's kernel and
tiles, at M = 512 and 4096 on Qwen3-30B-A3B's and DeepSeek-V2-Lite's shapes (Mixtral's prefill
tiles are swapped, or of 64 rows, and read the words either way); GPTQ int4 as the yardstick.
Three alternated rounds, medians, us: docs/bench/tune-s34-h100.txt, part 7. From a snapshot's root
on the GPU: python3 docs/bench/ab-word-halves-s34.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import triton_moe  # noqa: E402

HALVES_FROM = triton_moe.WORD_HALVES_MIN_ROWS
NEVER = 1 << 30


def timed(layer: tune.Layer, m: int, inputs: tuple, least_rows: int):  # type: ignore[no-untyped-def]
    def run() -> float:
        triton_moe.WORD_HALVES_MIN_ROWS = least_rows  # read when the layer's graph is captured
        return layer.time((None, None), m, *inputs) * 1e6
    return run


gpu = ab_kernels.this_gpu()
rows = []
for shape_name in ("qwen3", "dsv2lite"):
    shape = bench.SHAPES[shape_name]
    awq = tune.Layer(shape, gpu.schemes["awq-w4a16"], gpu.device, False)
    gptq = tune.Layer(shape, gpu.schemes["gptq-w4a16"], gpu.device, False)
    for m in (512, 4096):
        inputs = awq.inputs(m)
        ref = awq.reference(*inputs)
        base = f"gptq-w4a16 {shape_name} M={m}"
        for label, least_rows in (("words", NEVER), ("halves", HALVES_FROM)):
            triton_moe.WORD_HALVES_MIN_ROWS = least_rows
            rows.append(ab_kernels.Timed(f"awq-w4a16 {shape_name} M={m} {label}", timed(awq, m, inputs, least_rows),
                                         awq.weight_bytes, base, awq.error((None, None), *inputs, ref)))
        rows.append(ab_kernels.Timed(base, timed(gptq, m, gptq.inputs(m), HALVES_FROM), gptq.weight_bytes))
    print(f"built {shape_name}", flush=True)
ab_kernels.print_per_byte(rows, 3)
triton_moe.WORD_HALVES_MIN_ROWS = HALVES_FROM
