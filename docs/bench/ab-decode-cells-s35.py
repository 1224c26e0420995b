"""Session 35: the decode cells the session 34 table read below 0.95 per byte, timed again against
their yardsticks (GPTQ int4 for 4-bit weights, GPTQ int8 for 8-bit), in alternation, five rounds, so
each ratio compares rows of one call under the same clocks: docs/bench/tune-s35-h100.txt. From a
snapshot's root on the GPU: python3 docs/bench/ab-decode-cells-s35.py"""
import sys

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402

CELLS = {("dsv2lite", 1): ["fp8-block128", "fp8-w8a8-dynamic", "modelopt-mxfp8"],
         ("dsv2lite", 8): ["awq-w4a16", "modelopt-nvfp4"],
         ("qwen3", 1): ["compressed-tensors-w4a8-int"],
         ("qwen3", 8): ["awq-w4a16", "compressed-tensors-w4a8-int"]}

ab_kernels.print_cells_per_byte(CELLS, 5)
