"""Session 34: one-token GEMMs that quantise their own input (A_SCALE_IN) find the input's scale
before the pipeliner issues their first weight copies; moe_gemm._prefetch_to_l2 (4bc4b73) asked L2
for those lines first. The kernel with it ("today") against the kernel without it, for W4A8 (int4 weights) and
Quark W8A8 int8 at M = 1 on the three benchmark shapes, the same tuned tiles; GPTQ int4/int8 as
the yardstick, with each row's per-byte ratio to it. For W4A8, two ablations (wrong numbers, timing
only) that show what the scale's search and the in-loop quantisation cost: the amax taken as a
constant, and the token's values used as codes unrounded. Five alternated rounds, medians, us:
docs/bench/tune-s34-h100.txt, part 2. Ran from a snapshot of 4bc4b73 (the prefetch, reverted by
7db11de), after writing the variants with BASE the kernel without it:
git show 1771c87:kernels/moe_gemm.py > BASE
python3 docs/bench/ab-one-token-prefetch-s34.py --write-variants BASE
python3 docs/bench/ab-one-token-prefetch-s34.py"""
import sys
from pathlib import Path

sys.path.insert(0, "tools")

VARIANTS = Path("/tmp/ab-one-token")
AMAX_CALL = "amax = _one_token_amax(a_ptr, amax_ptr,"
QUANT_CALL = "a_row = _codes_by_reciprocal(a_next.to(tl.float32), a_scale_in, a_reciprocal, DOT, HW_FP8_CAST)"


def write_variants(base: str) -> None:
    """The kernel without the prefetch (``base``), and today's with each ablation."""
    VARIANTS.mkdir(exist_ok=True)
    (VARIANTS / "without.py").write_text(Path(base).read_text())
    today = Path("kernels/moe_gemm.py").read_text()
    start = today.index(AMAX_CALL)
    end = today.index("\n", today.index("\n", start) + 1)  # the call spans two lines
    assert today.count(AMAX_CALL) == 1 and today.count(QUANT_CALL) == 1
    (VARIANTS / "const-amax.py").write_text(today[:start] + "amax = 2.0" + today[end:])
    (VARIANTS / "no-rounding.py").write_text(today.replace(QUANT_CALL, "a_row = a_next.to(tl.float32)"))


if len(sys.argv) == 3 and sys.argv[1] == "--write-variants":
    write_variants(sys.argv[2])
    sys.exit(0)

import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402

SHAPES = ("qwen3", "dsv2lite", "mixtral")
SCHEMES = (("compressed-tensors-w4a8-int", "gptq-w4a16"), ("quark-w8a8-int8", "gptq-w8a16"))

gpu = ab_kernels.this_gpu()
today = ab_kernels.todays_kernel()
kernels = {name: ab_kernels.kernel_from_file(str(VARIANTS / f"{name}.py"))
           for name in ("without", "const-amax", "no-rounding")}
rows = []
for shape_name in SHAPES:
    shape = bench.SHAPES[shape_name]
    for quantised, fixed in SCHEMES:
        layer = tune.Layer(shape, gpu.schemes[quantised], gpu.device, False)
        yardstick = tune.Layer(shape, gpu.schemes[fixed], gpu.device, False)
        inputs = layer.inputs(1)
        ref = layer.reference(*inputs)
        base = f"{fixed} {shape_name} M=1"
        labels = ["without", "today"] + (["const-amax", "no-rounding"] if "w4a8" in quantised else [])
        for label in labels:
            kernel = today if label == "today" else kernels[label]
            rows.append(ab_kernels.timed_variant(f"{quantised} {shape_name} M=1 {label}", layer, inputs, 1, kernel,
                                                 base, ref))
        rows.append(ab_kernels.timed_variant(base, yardstick, yardstick.inputs(1), 1, today))
        print(f"built {shape_name} {quantised}", flush=True)
ab_kernels.print_per_byte(rows, 5)
