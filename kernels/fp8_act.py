"""Dynamic fp8 activation quantisation with one scale per token or per tensor, for the fp8_outer dot
(:mod:`moe_registry_kernels.scheme`): ``fp8_token`` (compressed-tensors FP8_DYNAMIC) and
``fp8_tensor`` (``quant_method: fp8`` with ``activation_scheme: dynamic``: vLLM's fp8 MoE quantises
each GEMM input with one amax over all of its rows). Static per-tensor fp8 (``fp8_static``) is
:func:`moe_registry_kernels.triton_ops.act_quant`'s.

Numerics are :mod:`moe_registry_kernels.quant_ref`'s bit for bit: scale = max(amax, 1e-10) / 448
(a true division), codes rounded as ``triton_ops._fp8_codes`` rounds them.
"""

import torch
import triton
import triton.language as tl

from . import triton_ops
from .triton_ops import AMAX_FLOOR, FP8_MAX, _fp8_codes

__all__ = ["FP8_DYNAMIC_MODES", "quant_fp8_dynamic"]

FP8_DYNAMIC_MODES = ("fp8_token", "fp8_tensor")
BLOCK = 1024  # columns per step of a row


@triton.jit
def _fp8_token_kernel(x_ptr, out_ptr, scale_ptr, row_scale_ptr, D, stride_x, stride_out,
                      HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0): its amax (times the row factor), its float32 scale, then its codes."""
    row = tl.program_id(0).to(tl.int64)
    factor = 1.0
    if HAS_ROW_SCALE:
        factor = tl.load(row_scale_ptr + row).to(tl.float32)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for d in range(0, D, BLOCK):
        cols = d + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0).to(tl.float32) * factor
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for d in range(0, D, BLOCK):
        cols = d + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0).to(tl.float32) * factor
        tl.store(out_ptr + row * stride_out + cols, _fp8_codes(v, scale), mask=cols < D)


def _tensor_scale(x: torch.Tensor, row_scale: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor:
    """float32 [1]: max(amax over the rows that hold data, 1e-10) / 448. Row extremes first (no
    copy of x: a prefill intermediate is hundreds of MB in float32); a row factor scales its row's
    amax exactly as it would scale each value (rounding is monotonic), so this is quant_ref's
    amax of x * factor bit for bit."""
    if x.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        low, high = torch.aminmax(x, dim=1)
        amax_rows = torch.maximum(high.float(), -low.float())
        if row_scale is not None:
            amax_rows = amax_rows * row_scale.float().abs()
        if rows is not None:
            amax_rows = torch.where(rows, amax_rows, 0.0)
        amax = amax_rows.max()
    return (amax.clamp(min=float(AMAX_FLOOR.value)) / float(FP8_MAX.value)).reshape(1)


def quant_fp8_dynamic(x: torch.Tensor, quant: str, *, row_scale: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (float8_e4m3fn codes [T, D], float32 scales: [T, 1] for fp8_token, [1] for
    fp8_tensor). ``row_scale`` [T] multiplies each row first (router weight on the input);
    ``rows`` [T] bool: the rows that hold data (fp8_tensor's amax skips the others, e.g. pairs
    routed to another rank's expert, whose rows were never written)."""
    if quant not in FP8_DYNAMIC_MODES:
        raise ValueError(f"quant {quant!r}; wanted one of {', '.join(FP8_DYNAMIC_MODES)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, d = x.shape
    if quant == "fp8_tensor":
        scale = _tensor_scale(x, row_scale, rows)
        out, _ = triton_ops.act_quant(x, "none", "fp8_static", static_scale=scale, row_scale=row_scale, pdl=pdl)
        return out, scale
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        block = min(BLOCK, max(triton.next_power_of_2(d), 16))
        _fp8_token_kernel[(t,)](x, out, scale, row_scale if row_scale is not None else scale, d, x.stride(0),
                                out.stride(0), HAS_ROW_SCALE=row_scale is not None, BLOCK=block, num_warps=4)
    return out, scale
