"""Session 38: the decode cells of issue #19's schemes that the session 38 table
(issue19-s38-h100-decode.jsonl, one sample a cell) read below 0.97 per byte, timed again against their
yardsticks (GPTQ int4 for 4-bit weights, GPTQ int8 for 8-bit), in alternation, five rounds, so each ratio
compares rows of one call under the same clocks: docs/bench/scale-codes-s38-h100.txt. From a snapshot's
root on the GPU: python3 docs/bench/ab-decode-cells-s38.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402

CELLS = {("dsv2lite", 1): ["fp8-w8a8-dynamic", "compressed-tensors-w8a8-fp8-dynamic", "modelopt-mxfp8"],
         ("dsv2lite", 8): ["modelopt-nvfp4", "modelopt-fp8"],
         ("mixtral", 8): ["modelopt-fp8"],
         ("qwen3", 8): ["compressed-tensors-w8a16-asym"]}

ab_kernels.print_cells_per_byte(CELLS, 5)
