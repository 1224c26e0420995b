"""Dynamic fp8 activation quantisation with one scale per token or per tensor, for the fp8_outer dot
(:mod:`moe_registry_kernels.variant`): ``fp8_token`` (compressed-tensors FP8_DYNAMIC) and
``fp8_tensor`` (``quant_method: fp8`` with ``activation_scheme: dynamic``: vLLM's fp8 MoE quantises
each GEMM input with one amax over all of its rows). Static per-tensor fp8 (``fp8_static``) is
:func:`moe_registry_kernels.triton.activation_quant.act_quant`'s.

Numerics are :mod:`moe_registry_kernels.quant_ref`'s bit for bit: scale = max(amax, 1e-10) / 448
(a true division), codes rounded as ``quant_math._fp8_codes`` rounds them. Every kernel takes part
in the layer's programmatic-dependent-launch chain (PDL). At decode :func:`align_quant_fp8` runs
the alignment and the quantisation in one launch, :func:`quant_fp8_from_pieces` quantises the
intermediate from GEMM1's row-amax pieces, and one token's GEMMs quantise their own input
(gemm's A_SCALE_IN).
"""

import torch
import triton
import triton.language as tl

from . import align as alignment
from .align import _align_part, _flat_ids, _one_launch_alignment, align
from .chain import grid_dependency, pdl_launch
from .quant_math import AMAX_FLOOR, FP8_MAX, _fp8_codes, _holds_data, _span_amax

__all__ = ["FP8_DYNAMIC_MODES", "quant_fp8_dynamic", "quant_fp8_from_pieces", "align_quant_fp8"]

FP8_DYNAMIC_MODES = ("fp8_token", "fp8_tensor")
BLOCK = 1024  # columns per step of a row
# fp8_tensor: a tensor this small (decode) is read twice by one program, in one launch, ONE_PROGRAM_TILE
# elements at a time (at most 2 tiles a pass: each is a dependent load, ~1 us of latency); larger ones take
# row programs for the amax, then for the codes (2 launches; 3 past ROW_AMAX_MAX_ROWS)
ONE_PROGRAM_ELEMENTS = 1 << 14
ONE_PROGRAM_TILE = 1 << 13
# row programs over at most this many rows store each row's amax, and each codes program reduces
# them all (at most 8 KiB from L2 a program): no zeroed atomic amax, so no zeroing launch between
# the chain's kernels; past it (prefill, where one launch more is noise) an atomic amax, zeroed first
ROW_AMAX_MAX_ROWS = 2048
PIECES_TILE = 1 << 13  # row-amax pieces a program reads a step (quant_fp8_from_pieces)


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
def _fp8_token_row(row, x_ptr, out_ptr, scale_ptr, row_scale_ptr, D, stride_x, stride_out,
                   HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One row: its amax (times the row factor), its float32 scale, then its codes."""
    factor = _row_factor(row_scale_ptr, row, HAS_ROW_SCALE)
    scale = tl.math.div_rn(tl.maximum(_row_amax(x_ptr, row, D, stride_x, factor, BLOCK), AMAX_FLOOR), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    _row_codes(x_ptr, out_ptr, row, D, stride_x, stride_out, factor, scale, BLOCK)


@triton.jit
def _fp8_token_kernel(x_ptr, out_ptr, scale_ptr, row_scale_ptr, D, stride_x, stride_out,
                      HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0)."""
    grid_dependency(PDL)
    _fp8_token_row(tl.program_id(0).to(tl.int64), x_ptr, out_ptr, scale_ptr, row_scale_ptr, D, stride_x,
                   stride_out, HAS_ROW_SCALE, BLOCK)


@triton.jit
def _fp8_tensor_one_program_kernel(x_ptr, out_ptr, scale_ptr, row_scale_ptr, pair_ids_ptr, num_experts, T, D,
                                   stride_x, stride_out, HAS_ROW_SCALE: tl.constexpr, HAS_ROWS: tl.constexpr,
                                   ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A small tensor (decode) in one launch (:func:`_fp8_tensor_whole`)."""
    grid_dependency(PDL)
    _fp8_tensor_whole(x_ptr, out_ptr, scale_ptr, row_scale_ptr, pair_ids_ptr, num_experts, T, D, stride_x,
                      stride_out, HAS_ROW_SCALE, HAS_ROWS, ROWS, BLOCK)


@triton.jit
def _fp8_tensor_whole(x_ptr, out_ptr, scale_ptr, row_scale_ptr, pair_ids_ptr, num_experts, T, D, stride_x,
                      stride_out, HAS_ROW_SCALE: tl.constexpr, HAS_ROWS: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """A small tensor by one program: the amax of the rows that hold data, the scale, every
    row's codes, a [ROWS, BLOCK] tile at a time (one load in flight per tile, not per row)."""
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for r in range(0, T, ROWS):
        rows = r + tl.arange(0, ROWS)
        factor = tl.load(row_scale_ptr + rows, mask=rows < T, other=0.0).to(tl.float32) if HAS_ROW_SCALE else 1.0
        take = rows < T
        if HAS_ROWS:
            take = take & _holds_data(pair_ids_ptr, rows, num_experts, rows < T)
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
def _fp8_tensor_amax_kernel(x_ptr, amax_ptr, row_scale_ptr, pair_ids_ptr, num_experts, D, stride_x,
                            HAS_ROW_SCALE: tl.constexpr, HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0)'s amax: PER_ROW, stored at amax_ptr[row] (0 for a row that holds no
    data); else folded into amax_ptr[0] (zeroed; amaxes are >= 0, so the atomic float maximum
    orders them as their bits do)."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    columns = D  # a row that holds no data reads none
    if HAS_ROWS:
        columns = tl.where(_holds_data(pair_ids_ptr, row, num_experts, True), D, 0)
    amax = _row_amax(x_ptr, row, columns, stride_x, _row_factor(row_scale_ptr, row, HAS_ROW_SCALE), BLOCK)
    if PER_ROW:
        tl.store(amax_ptr + row, amax)
    elif columns > 0:
        tl.atomic_max(amax_ptr, amax)


@triton.jit
def _fp8_tensor_codes_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, row_scale_ptr, T, D, stride_x, stride_out,
                             HAS_ROW_SCALE: tl.constexpr, AMAX_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
    """Row program_id(0)'s codes at the tensor's scale (program 0 also stores the scale): the
    amax is the largest of the T row amaxes (AMAX_ROWS, a power of two >= T) or amax_ptr[0] (0)."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    if AMAX_ROWS > 0:
        rows = tl.arange(0, AMAX_ROWS)
        amax = tl.max(tl.load(amax_ptr + rows, mask=rows < T, other=0.0), axis=0)
    else:
        amax = tl.load(amax_ptr)
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    if row == 0:
        tl.store(scale_ptr, scale)
    _row_codes(x_ptr, out_ptr, row, D, stride_x, stride_out, _row_factor(row_scale_ptr, row, HAS_ROW_SCALE), scale,
               BLOCK)


def _tensor_meta(t: int, d: int) -> dict:
    """The one-program tile of a small tensor: BLOCK columns, ROWS rows (at most ONE_PROGRAM_TILE values)."""
    block = min(BLOCK, max(triton.next_power_of_2(d), 16))
    return {"BLOCK": block, "ROWS": max(1, min(triton.next_power_of_2(t), ONE_PROGRAM_TILE // block))}


def _quant_fp8_tensor(x: torch.Tensor, row_scale: torch.Tensor | None, pair_ids: torch.Tensor | None,
                      num_experts: int, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_tensor: max(amax over the rows that hold data, 1e-10) / 448, then every row's codes. A tensor of
    at most ONE_PROGRAM_ELEMENTS (decode) takes one launch; a larger one row programs for the amax and
    a codes launch (past ROW_AMAX_MAX_ROWS rows an atomic amax, plus its zeroing). quant_ref's amax of
    x * factor bit for bit."""
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    row_scale_arg = row_scale if row_scale is not None else scale
    ids_arg = pair_ids if pair_ids is not None else scale
    flags = {"HAS_ROW_SCALE": row_scale is not None, "PDL": pdl, **pdl_launch(pdl)}
    if t * d <= ONE_PROGRAM_ELEMENTS:
        _fp8_tensor_one_program_kernel[(1,)](x, out, scale, row_scale_arg, ids_arg, num_experts, t, d, x.stride(0),
                                             out.stride(0), HAS_ROWS=pair_ids is not None, num_warps=8,
                                             **_tensor_meta(t, d), **flags)
        return out, scale
    block = _tensor_meta(t, d)["BLOCK"]
    per_row = t <= ROW_AMAX_MAX_ROWS
    amax = torch.empty(t, dtype=torch.float32, device=x.device) if per_row else torch.zeros(
        1, dtype=torch.float32, device=x.device)
    _fp8_tensor_amax_kernel[(t,)](x, amax, row_scale_arg, ids_arg, num_experts, d, x.stride(0),
                                  HAS_ROWS=pair_ids is not None, PER_ROW=per_row, BLOCK=block, num_warps=4, **flags)
    _fp8_tensor_codes_kernel[(t,)](x, out, amax, scale, row_scale_arg, t, d, x.stride(0), out.stride(0),
                                   AMAX_ROWS=triton.next_power_of_2(t) if per_row else 0, BLOCK=block, num_warps=4,
                                   **flags)
    return out, scale


def quant_fp8_dynamic(x: torch.Tensor, quant: str, *, row_scale: torch.Tensor | None = None,
                      pair_ids: torch.Tensor | None = None, num_experts: int = 0, pdl: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (float8_e4m3fn codes [T, D], float32 scales: [T, 1] for fp8_token, [1] for
    fp8_tensor). ``row_scale`` [T] multiplies each row first (router weight on the input);
    ``pair_ids`` [T] with ``num_experts``: fp8_tensor's amax takes only the rows whose pair routes
    to one of this rank's experts, ids in [0, num_experts) (the others, routed to another rank,
    were never written); ``pdl``: launch as part of a programmatic-dependent-launch chain."""
    _check_mode(quant)
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, d = x.shape
    if quant == "fp8_tensor":
        return _quant_fp8_tensor(x, row_scale, pair_ids, num_experts, pdl)
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        _fp8_token_kernel[(t,)](x, out, scale, row_scale if row_scale is not None else scale, d, x.stride(0),
                                out.stride(0), HAS_ROW_SCALE=row_scale is not None,
                                BLOCK=_tensor_meta(1, d)["BLOCK"], PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out, scale


def _check_mode(quant: str) -> None:
    if quant not in FP8_DYNAMIC_MODES:
        raise ValueError(f"quant {quant!r}; wanted one of {', '.join(FP8_DYNAMIC_MODES)}")


# ---------------------------------------------------------------------------------------------
# decode: the intermediate's amax from GEMM1's pieces


@triton.jit
def _fp8_codes_from_pieces_kernel(x_ptr, out_ptr, scale_ptr, pieces_ptr, ids_ptr, T, D, P, num_experts, stride_x,
                                  stride_out, QUANT: tl.constexpr, BLOCK: tl.constexpr, PIECE_ROWS: tl.constexpr,
                                  PIECE_COLS: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0)'s codes at the scale GEMM1's row-amax pieces [T, P] give: fp8_token its
    own row's; fp8_tensor every row's whose pair went to one of this rank's experts (ids_ptr: the
    pairs' experts; the other rows were never written). Program 0 stores the tensor's scale."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    if QUANT == "fp8_token":
        amax = _span_amax(pieces_ptr, P, P, row, row + 1, ids_ptr, num_experts, False, PIECE_ROWS, PIECE_COLS)
    else:
        amax = _span_amax(pieces_ptr, P, P, 0, T, ids_ptr, num_experts, True, PIECE_ROWS, PIECE_COLS)
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    if QUANT == "fp8_token" or row == 0:
        tl.store(scale_ptr + (row if QUANT == "fp8_token" else 0), scale)
    _row_codes(x_ptr, out_ptr, row, D, stride_x, stride_out, 1.0, scale, BLOCK)


def quant_fp8_from_pieces(x: torch.Tensor, quant: str, pieces: torch.Tensor, pair_ids: torch.Tensor,
                          num_experts: int, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_fp8_dynamic` of GEMM1's output x [T, D] in one launch, its amax taken from the
    row-amax pieces [T, P] GEMM1's epilogue left (the largest |value| of each row per column
    tile, as stored) instead of a pass over x: per token, each row's own; per tensor, those of
    the rows whose pair ``pair_ids`` [T] routes to one of this rank's ``num_experts``."""
    _check_mode(quant)
    t, d = x.shape
    if (pieces.shape[0] != t or pair_ids.numel() != t or not pieces.is_contiguous() or not pair_ids.is_contiguous()
            or x.stride(-1) != 1):
        raise ValueError(f"pieces {tuple(pieces.shape)} and pair ids {tuple(pair_ids.shape)} for x {tuple(x.shape)}; "
                         f"wanted contiguous [{t}, P] pieces and {t} contiguous pair ids")
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t if quant == "fp8_token" else 1, dtype=torch.float32, device=x.device)
    if t:
        cols = min(triton.next_power_of_2(pieces.shape[1]), 1024)
        rows = 1 if quant == "fp8_token" else max(1, min(triton.next_power_of_2(t), PIECES_TILE // cols))
        _fp8_codes_from_pieces_kernel[(t,)](x, out, scale, pieces, pair_ids, t, d, pieces.shape[1], num_experts,
                                            x.stride(0), out.stride(0), QUANT=quant, BLOCK=_tensor_meta(1, d)["BLOCK"],
                                            PIECE_ROWS=rows, PIECE_COLS=cols, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out, scale.view(-1, 1) if quant == "fp8_token" else scale


# ---------------------------------------------------------------------------------------------
# decode: alignment and quantisation in one launch


@triton.jit
def _align_quant_fp8_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                            num_blocks, parts, x_ptr, out_ptr, scale_ptr, row_scale_ptr, T, D, stride_x, stride_out,
                            QUANT: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BINS: tl.constexpr,
                            CHUNK: tl.constexpr, EXPERT_TILE: tl.constexpr, FILL: tl.constexpr,
                            TILE_B: tl.constexpr, PDL: tl.constexpr):
    """Programs 0 .. parts - 1 align the pairs (triton_ops' one-launch alignment); the others
    quantise: fp8_token program parts + r row r, fp8_tensor program parts the whole tensor."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < parts:
        _align_part(pid, parts, ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                    num_blocks, BLOCK_M, PAIRS, BINS, CHUNK, EXPERT_TILE, FILL, TILE_B)
    elif QUANT == "fp8_token":
        _fp8_token_row((pid - parts).to(tl.int64), x_ptr, out_ptr, scale_ptr, row_scale_ptr, D, stride_x,
                       stride_out, HAS_ROW_SCALE, BLOCK)
    else:
        _fp8_tensor_whole(x_ptr, out_ptr, scale_ptr, row_scale_ptr, scale_ptr, 0, T, D, stride_x, stride_out,
                          HAS_ROW_SCALE, False, ROWS, BLOCK)


def align_quant_fp8(topk_ids: torch.Tensor, num_experts: int, block_m: int, x: torch.Tensor, quant: str, *,
                    row_scale: torch.Tensor | None = None, pdl: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """align.align and :func:`quant_fp8_dynamic` of the layer's input together: (sorted_token_ids,
    expert_ids, num_tokens_post_padded, codes, scale). Decode (few pairs; fp8_tensor: a tensor one
    program quantises) takes one launch; otherwise they are their own launches."""
    _check_mode(quant)
    ids = _flat_ids(topk_ids)
    numel = ids.numel()
    t, d = x.shape
    # (the switch read where it is set: alignment.ALIGN_ONE_LAUNCH_MAX picks every alignment's path)
    if numel > alignment.ALIGN_ONE_LAUNCH_MAX or quant == "fp8_tensor" and t * d > ONE_PROGRAM_ELEMENTS:
        return (*align(ids, num_experts, block_m, pdl=pdl), *quant_fp8_dynamic(x, quant, row_scale=row_scale, pdl=pdl))
    if x.stride(-1) != 1:
        x = x.contiguous()
    one = _one_launch_alignment(ids, num_experts, block_m)
    out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t if quant == "fp8_token" else 1, dtype=torch.float32, device=x.device)
    quant_programs = t if quant == "fp8_token" else 1
    _align_quant_fp8_kernel[(one.parts + quant_programs,)](
        *one.args, one.parts, x, out, scale, row_scale if row_scale is not None else scale, t, d, x.stride(0),
        out.stride(0), QUANT=quant, HAS_ROW_SCALE=row_scale is not None, **_tensor_meta(t, d), **one.meta, PDL=pdl,
        num_warps=8, **pdl_launch(pdl))
    return *one.outputs, out, scale.view(-1, 1) if quant == "fp8_token" else scale
