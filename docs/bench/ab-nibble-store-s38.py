"""Session 38: W4A8 at M = 1 on the decode GEMV, its input's int8 codes in nibble halves stored by
triton_ops.act_quant as two contiguous runs (today) against each code scattered to its place (the
act_quant kernel of 1050189, loaded beside today's), beside GPTQ int4 as the per-byte yardstick, on
the three benchmark shapes: five alternated rounds, medians (CUDA graphs):
docs/bench/scale-codes-s38-h100.txt. From a snapshot's root on the GPU:
    git show 1050189:kernels/triton_ops.py > /tmp/triton_ops-scattered.py
    python3 docs/bench/ab-nibble-store-s38.py /tmp/triton_ops-scattered.py"""
import importlib.util
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
from moe_registry_kernels import triton_ops  # noqa: E402

spec = importlib.util.spec_from_file_location("moe_registry_kernels._triton_ops_scattered", sys.argv[1])
scattered_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scattered_module)
KERNELS = {"split": triton_ops._act_quant_kernel, "scattered": scattered_module._act_quant_kernel}
gpu = ab_kernels.this_gpu()


def using(store: str):  # type: ignore[no-untyped-def]
    def use() -> None:
        triton_ops._act_quant_kernel = KERNELS[store]
    return use


for shape_name in ("qwen3", "dsv2lite", "mixtral"):
    cell = ab_kernels.one_token_cell(gpu, shape_name, "compressed-tensors-w4a8-int", "gptq-w4a16")
    rows = [ab_kernels.timed_setting(f"compressed-tensors-w4a8-int {shape_name} M=1 {store}", cell.layer, cell.inputs,
                                     1, using(store), cell.base, cell.ref) for store in KERNELS]
    rows.append(ab_kernels.timed_setting(cell.base, cell.yardstick, cell.inputs, 1, using("split"), None,
                                         cell.yardstick.reference(*cell.inputs)))
    print(f"built {shape_name}", flush=True)
    ab_kernels.print_per_byte(rows, 5)
