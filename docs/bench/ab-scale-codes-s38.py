"""Session 38: NVFP4 layers whose e4m3 group scales reach the GEMM as exponent codes (one integer
multiply-add a scale, fp4_dequant.e4m3_scale_codes) against the same layers on the kernel before it
(the e4m3 bytes through the GPU's fp8 conversion, a float32 detour and a pack), beside GPTQ int4 as
the per-byte yardstick, at the decode M on the three benchmark shapes: five alternated rounds,
medians (CUDA graphs): docs/bench/scale-codes-s38-h100.txt. From a snapshot's root on the GPU, the
earlier commit's kernel modules given:
    git show 11aa88a:kernels/moe_gemm.py > /tmp/moe_gemm-bytes.py
    git show 11aa88a:kernels/fp4_dequant.py > /tmp/fp4_dequant-bytes.py
    python3 docs/bench/ab-scale-codes-s38.py /tmp/moe_gemm-bytes.py /tmp/fp4_dequant-bytes.py [prefill]
(prefill: M = 512 and 4096 on the three shapes, three rounds)"""
import importlib.util
import sys
from unittest import mock

import torch

sys.path.insert(0, "tools")
import ab_kernels  # noqa: E402
import bench  # noqa: E402
import tune  # noqa: E402
from moe_registry_kernels import fp4_dequant, triton_moe  # noqa: E402

PREFILL = sys.argv[3:] == ["prefill"]
CELLS = ({"dsv2lite": (512, 4096), "qwen3": (512, 4096), "mixtral": (512, 4096)} if PREFILL
         else {"dsv2lite": (1, 8, 64), "qwen3": (1, 8), "mixtral": (1, 8)})


def bytes_kernel(moe_gemm_path: str, fp4_dequant_path: str):  # type: ignore[no-untyped-def]
    """The earlier _fused_moe_kernel, its e4m3 scale decoder (gone from today's fp4_dequant) put back
    for its import, launched with the GPU's fp8 conversion as the earlier launcher passed it."""
    spec = importlib.util.spec_from_file_location("moe_registry_kernels._fp4_dequant_bytes", fp4_dequant_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    fp4_dequant._e4m3_scale = old._e4m3_scale
    kernel = ab_kernels.kernel_from_file(moe_gemm_path)

    class WithConversion:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: kernel[grid](*args, E4M3_CVT=True, **kwargs)

    return WithConversion()


def bytes_layer(shape, scheme, ms) -> tune.Layer:  # type: ignore[no-untyped-def]
    """A layer whose experts hold the e4m3 scale bytes as they are (the earlier kernel's input)."""
    def as_bytes(packed, scale):  # type: ignore[no-untyped-def]
        return packed, scale.view(torch.uint8)

    with mock.patch.object(triton_moe, "e4m3_scale_codes", as_bytes):
        layer = tune.Layer(shape, scheme, gpu.device, False)
        for m in ms:
            layer.copies_for(m)
    return layer


gpu = ab_kernels.this_gpu()
today = ab_kernels.todays_kernel()
before = bytes_kernel(sys.argv[1], sys.argv[2])
for shape_name, ms in CELLS.items():
    shape = bench.SHAPES[shape_name]
    codes = tune.Layer(shape, gpu.schemes["modelopt-nvfp4"], gpu.device, False)
    scale_bytes = bytes_layer(shape, gpu.schemes["modelopt-nvfp4"], ms)
    gptq = tune.Layer(shape, gpu.schemes["gptq-w4a16"], gpu.device, False)
    rows = []
    for m in ms:
        inputs = codes.inputs(m)
        ref = codes.reference(*inputs)
        base = f"gptq-w4a16 {shape_name} M={m}"
        rows.append(ab_kernels.timed_variant(f"modelopt-nvfp4 {shape_name} M={m} scale codes", codes, inputs, m,
                                             today, base, ref))
        rows.append(ab_kernels.timed_variant(f"modelopt-nvfp4 {shape_name} M={m} scale bytes", scale_bytes, inputs,
                                             m, before, base, ref))
        rows.append(ab_kernels.timed_variant(base, gptq, inputs, m, today, None, gptq.reference(*inputs)))
    print(f"built {shape_name}", flush=True)
    ab_kernels.print_per_byte(rows, 3 if PREFILL else 5)
