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

from .triton_ops import AMAX_FLOOR, FP8_MAX, _fp8_codes

__all__ = ["FP8_DYNAMIC_MODES", "quant_fp8_dynamic"]

FP8_DYNAMIC_MODES = ("fp8_token", "fp8_tensor")
BLOCK = 1024  # columns per step of a row
# fp8_tensor: a tensor this small (decode) is read twice by one program, in one launch, ONE_PROGRAM_TILE
# elements at a time (at most 2 tiles a pass: each is a dependent load, ~1 us of latency); larger ones take
# row programs with an atomic amax (3 launches)
ONE_PROGRAM_ELEMENTS = 1 << 14
ONE_PROGRAM_TILE = 1 << 13


@triton.jit
def _row_amax(x_ptr, row, D, stride_x, factor, BLOCK: tl.constexpr):
    """max |x[row] * factor| over the row's D columns (float32)."""
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for d in range(0, D, BLOCK):
        cols = d + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0).to(tl.float32) * factor
        amax = tl.maximum(amax, tl.abs(v))
    return tl.max(amax, axis=0)


@triton.jit
def _row_codes(x_ptr, out_ptr, row, D, stride_x, stride_out, factor, scale, BLOCK: tl.constexpr):
    for d in range(0, D, BLOCK):
        cols = d + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0).to(tl.float32) * factor
        tl.store(out_ptr + row * stride_out + cols, _fp8_codes(v, scale), mask=cols < D)


@triton.jit
def _row_factor(row_scale_ptr, row, HAS_ROW_SCALE: tl.constexpr):
    factor = 1.0
    if HAS_ROW_SCALE:
        factor = tl.load(row_scale_ptr + row).to(tl.float32)
    return factor


@triton.jit
def _fp8_token_kernel(x_ptr, out_ptr, scale_ptr, row_scale_ptr, D, stride_x, stride_out,
                      HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0): its amax (times the row factor), its float32 scale, then its codes."""
    row = tl.program_id(0).to(tl.int64)
    factor = _row_factor(row_scale_ptr, row, HAS_ROW_SCALE)
    scale = tl.math.div_rn(tl.maximum(_row_amax(x_ptr, row, D, stride_x, factor, BLOCK), AMAX_FLOOR), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    _row_codes(x_ptr, out_ptr, row, D, stride_x, stride_out, factor, scale, BLOCK)


@triton.jit
def _fp8_tensor_one_program_kernel(x_ptr, out_ptr, scale_ptr, row_scale_ptr, rows_ptr, T, D, stride_x, stride_out,
                                   HAS_ROW_SCALE: tl.constexpr, HAS_ROWS: tl.constexpr, ROWS: tl.constexpr,
                                   BLOCK: tl.constexpr):
    """A small tensor (decode) in one launch: the amax of the rows that hold data, the scale, every
    row's codes, a [ROWS, BLOCK] tile at a time (one load in flight per tile, not per row)."""
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for r in range(0, T, ROWS):
        rows = r + tl.arange(0, ROWS)
        factor = tl.load(row_scale_ptr + rows, mask=rows < T, other=0.0).to(tl.float32) if HAS_ROW_SCALE else 1.0
        take = rows < T
        if HAS_ROWS:
            take = take & (tl.load(rows_ptr + rows, mask=rows < T, other=0) != 0)
        for d in range(0, D, BLOCK):
            cols = d + tl.arange(0, BLOCK)
            mask = take[:, None] & (cols < D)[None, :]
            v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32) * factor[:, None] if HAS_ROW_SCALE else v.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(amax, axis=1), axis=0), AMAX_FLOOR), FP8_MAX)
    tl.store(scale_ptr, scale)
    for r in range(0, T, ROWS):
        rows = r + tl.arange(0, ROWS)
        factor = tl.load(row_scale_ptr + rows, mask=rows < T, other=0.0).to(tl.float32) if HAS_ROW_SCALE else 1.0
        for d in range(0, D, BLOCK):
            cols = d + tl.arange(0, BLOCK)
            mask = (rows < T)[:, None] & (cols < D)[None, :]
            v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
            v = v.to(tl.float32) * factor[:, None] if HAS_ROW_SCALE else v.to(tl.float32)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], _fp8_codes(v, scale),
                     mask=mask)


@triton.jit
def _fp8_tensor_amax_kernel(x_ptr, amax_ptr, row_scale_ptr, rows_ptr, D, stride_x, HAS_ROW_SCALE: tl.constexpr,
                            HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0) folds its amax into amax_ptr[0] (zeroed; amaxes are >= 0, so the atomic float
    maximum orders them as their bits do)."""
    row = tl.program_id(0).to(tl.int64)
    valid = True
    if HAS_ROWS:
        valid = tl.load(rows_ptr + row) != 0
    if valid:
        tl.atomic_max(amax_ptr, _row_amax(x_ptr, row, D, stride_x, _row_factor(row_scale_ptr, row, HAS_ROW_SCALE),
                                          BLOCK))


@triton.jit
def _fp8_tensor_codes_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, row_scale_ptr, D, stride_x, stride_out,
                             HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0)'s codes at the tensor's scale (program 0 also stores the scale)."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.math.div_rn(tl.maximum(tl.load(amax_ptr), AMAX_FLOOR), FP8_MAX)
    if row == 0:
        tl.store(scale_ptr, scale)
    _row_codes(x_ptr, out_ptr, row, D, stride_x, stride_out, _row_factor(row_scale_ptr, row, HAS_ROW_SCALE), scale,
               BLOCK)


def _quant_fp8_tensor(x: torch.Tensor, row_scale: torch.Tensor | None, rows: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_tensor: max(amax over the rows that hold data, 1e-10) / 448, then every row's codes. A tensor of
    at most ONE_PROGRAM_ELEMENTS (decode) takes one launch; a larger one an atomic amax over row programs
    and a codes launch (plus the amax's zeroing). quant_ref's amax of x * factor bit for bit."""
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    block = min(BLOCK, max(triton.next_power_of_2(d), 16))
    row_scale_arg = row_scale if row_scale is not None else scale
    rows_arg = rows if rows is not None else scale
    flags = {"HAS_ROW_SCALE": row_scale is not None, "BLOCK": block}
    if t * d <= ONE_PROGRAM_ELEMENTS:
        tile_rows = max(1, min(triton.next_power_of_2(t), ONE_PROGRAM_TILE // block))
        _fp8_tensor_one_program_kernel[(1,)](x, out, scale, row_scale_arg, rows_arg, t, d, x.stride(0), out.stride(0),
                                             HAS_ROWS=rows is not None, ROWS=tile_rows, num_warps=8, **flags)
        return out, scale
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    _fp8_tensor_amax_kernel[(t,)](x, amax, row_scale_arg, rows_arg, d, x.stride(0), HAS_ROWS=rows is not None,
                                  num_warps=4, **flags)
    _fp8_tensor_codes_kernel[(t,)](x, out, amax, scale, row_scale_arg, d, x.stride(0), out.stride(0), num_warps=4,
                                   **flags)
    return out, scale


def quant_fp8_dynamic(x: torch.Tensor, quant: str, *, row_scale: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
        return _quant_fp8_tensor(x, row_scale, rows)
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        block = min(BLOCK, max(triton.next_power_of_2(d), 16))
        _fp8_token_kernel[(t,)](x, out, scale, row_scale if row_scale is not None else scale, d, x.stride(0),
                                out.stride(0), HAS_ROW_SCALE=row_scale is not None, BLOCK=block, num_warps=4)
    return out, scale
