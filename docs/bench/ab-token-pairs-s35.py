"""Session 35: W4A8's one-token GEMMs reading each K step of the token as two vectors, its even and
its odd columns, each quantised and repeated down the tile (moe_gemm._token_pairs, commit 756c208),
against the kernel before it (one vector, quantised, then split into the nibble halves through
shared memory); the same tuned tiles, M = 1 on the three benchmark shapes, GPTQ int4 as the
yardstick. Five alternated rounds, medians, us: docs/bench/tune-s35-h100.txt. From a snapshot's
root on the GPU, after git show 756c208~1:kernels/moe_gemm.py > /tmp/moe_gemm-one-vector.py:
python3 docs/bench/ab-token-pairs-s35.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402

gpu = ab_kernels.this_gpu()
today = ab_kernels.todays_kernel()
one_vector = ab_kernels.kernel_from_file("/tmp/moe_gemm-one-vector.py")
rows = []
for shape_name in ("qwen3", "dsv2lite", "mixtral"):
    cell = ab_kernels.one_token_cell(gpu, shape_name, "compressed-tensors-w4a8-int", "gptq-w4a16")
    for label, kernel in (("one vector", one_vector), ("two vectors", today)):
        rows.append(ab_kernels.timed_variant(f"w4a8 {shape_name} M=1 {label}", cell.layer, cell.inputs, 1, kernel,
                                             cell.base, cell.ref))
    rows.append(ab_kernels.timed_variant(cell.base, cell.yardstick, cell.yardstick.inputs(1), 1, today))
    print(f"built {shape_name}", flush=True)
ab_kernels.print_per_byte(rows, 5)
