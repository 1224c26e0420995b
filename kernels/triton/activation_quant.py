"""Activation quantisation (and the gated activation fused with it): :func:`act_quant` on tiles of
rows (one row at decode), and the torch custom ops built on it (``torch.ops.moe_registry.<name>``,
each with a fake implementation, so torch.compile traces through it and CUDA graphs capture it;
no output is sized from a device value).
"""

import torch
import triton
import triton.language as tl

from .chain import grid_dependency, pdl_launch
from .quant_math import _as_stored, _fp8_codes, _group_scale, _int8_codes, _int8_token_scale, gated_act

MX_GROUP = 32  # MXFP8 block size
# act_quant: columns per program (rows are cut into chunks that run side by side), and the widest
# int8_token row read once (its amax and its codes from the same registers; wider rows are read twice)
ROW_CHUNK = 2048
ROW_BLOCK_MAX = 16384
# act_quant at prefill (this many rows or more): values per program, at most this many rows,
# values per thread (see _act_quant_tile_shape), and the narrowest chunk a row is cut into
# (see _act_quant_launch)
ROW_TILE_MIN_ROWS = 1024
ROW_TILE_ELEMS = 4096
ROW_TILE_MAX_ROWS = 16
ROW_TILE_PER_THREAD = 16
ROW_TILE_MIN_CHUNK = 64
# amax pieces of an int8_token row read per step (a GEMM epilogue leaves one per column tile)
PIECES_STEP = 128

# act_quant modes: how the rows are quantised after the (optional) activation.
QUANT_MODES = ("none", "int8_token", "int8_static", "fp8_static", "fp8_group", "mxfp8")
# int8 codes as act_quant stores them: int8 (None), or their values in a 16-bit float type (exact),
# for GEMM tiles that take them as 16-bit operands (gemm's W4A8_FLOAT)
INT8_CODE_DTYPES = (None, torch.int8, torch.float16, torch.bfloat16)


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, scale_ptr, static_scale_ptr, row_scale_ptr, counts_ptr, pieces_ptr,
                      D, stride_x, stride_out, stride_scale, capacity, num_pieces, num_rows,
                      ACTIVATION: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                      HAS_ROW_SCALE: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
                      ONE_READ: tl.constexpr, PIECES: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
                      pair_experts_ptr=None, num_experts=0, NIBBLE_HALVES: tl.constexpr = False,
                      PAIR_ROWS: tl.constexpr = False):
    """Program (r, c): rows [r * ROWS, (r + 1) * ROWS), columns [c * BLOCK, (c + 1) * BLOCK) (the
    whole row for int8_token, whose scale needs it, unless its amax comes in pieces)."""
    grid_dependency(PDL)
    col_lo = tl.program_id(1) * BLOCK
    col_hi = D if QUANT == "int8_token" and PIECES == 0 else tl.minimum(D, col_lo + BLOCK)
    _act_quant_tile(tl.program_id(0).to(tl.int64) * ROWS, x_ptr, out_ptr, scale_ptr, static_scale_ptr,
                    row_scale_ptr, counts_ptr, pieces_ptr, D, stride_x, stride_out, stride_scale, capacity,
                    num_pieces, num_rows, col_lo, col_hi, ACTIVATION, QUANT, GROUP, HAS_ROW_SCALE, HAS_COUNTS, BLOCK,
                    ONE_READ, PIECES, ROWS, pair_experts_ptr, num_experts, NIBBLE_HALVES, PAIR_ROWS)


@triton.jit
def _store_int8_codes(out_ptr, rows, row_ok, stride_out, col_lo, codes, D, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      NIBBLE_HALVES: tl.constexpr):
    """Store a [ROWS, BLOCK] tile of int8 codes (columns from ``col_lo``, even) in place, or
    (NIBBLE_HALVES) its even columns in the row's first half and its odd ones in the second: split
    in registers, two contiguous stores (each code scattered to its place took a byte store apiece)."""
    codes = _as_stored(codes, out_ptr)
    row_base = out_ptr + rows[:, None] * stride_out
    if NIBBLE_HALVES:
        even, odd = tl.split(tl.reshape(codes, (ROWS, BLOCK // 2, 2)))
        half = col_lo // 2 + tl.arange(0, BLOCK // 2)
        mask = row_ok[:, None] & (half[None, :] < D // 2)
        tl.store(row_base + half[None, :], even, mask=mask)
        tl.store(row_base + D // 2 + half[None, :], odd, mask=mask)
    else:
        cols = col_lo + tl.arange(0, BLOCK)
        tl.store(row_base + cols[None, :], codes, mask=row_ok[:, None] & (cols[None, :] < D))


@triton.jit
def _tile_values(x_ptr, rows, row_ok, cols, D, stride_x, row_factor, ACTIVATION: tl.constexpr):
    """float32 values of a [rows, cols] tile (masked off: 0): act(gate) * up or x, times each
    row's factor."""
    mask = row_ok[:, None] & (cols[None, :] < D)
    x_tile = x_ptr + rows[:, None] * stride_x + cols[None, :]
    if ACTIVATION == "none":
        v = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
    else:
        v = gated_act(tl.load(x_tile, mask=mask, other=0.0), tl.load(x_tile + D, mask=mask, other=0.0), ACTIVATION)
    return v * row_factor[:, None]


@triton.jit
def _act_quant_tile(row_lo, x_ptr, out_ptr, scale_ptr, static_scale_ptr, row_scale_ptr, counts_ptr, pieces_ptr,
                    D, stride_x, stride_out, stride_scale, capacity, num_pieces, num_rows, col_lo, col_hi,
                    ACTIVATION: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                    HAS_ROW_SCALE: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
                    ONE_READ: tl.constexpr, PIECES: tl.constexpr, ROWS: tl.constexpr, pair_experts_ptr=None,
                    num_experts=0, NIBBLE_HALVES: tl.constexpr = False, PAIR_ROWS: tl.constexpr = False):
    """Rows [row_lo, row_lo + ROWS) (those below num_rows; with counts, the batched format, rows
    past their expert's count are skipped; PAIR_ROWS, rows that are (token, expert) pairs, the rows
    of pairs whose expert in pair_experts_ptr lies outside [0, num_experts) are skipped: another
    rank's, never written), columns [col_lo, col_hi), BLOCK at a time: optional gated activation
    ([2D] -> [D]), optional row factor (router weight on the input), then store as the activation
    dtype or quantise (see QUANT_MODES). NIBBLE_HALVES (int8 codes): each row's even columns are
    stored first, then its odd ones, as the low and high nibbles of int4 weight words take them
    (decode_gemv).

    int8_token needs each row's amax first: with PIECES > 0 the largest of its num_pieces pieces
    (read PIECES at a time; any column range can then be quantised alone, and the chunk at
    column 0 stores the scale); otherwise the kernel passes the whole row, read once when
    ONE_READ (BLOCK >= D: its values stay in registers between the amax and the codes), else an
    amax pass, then the codes. Decode runs one row per program (ROWS 1); prefill a few rows of
    chunks that tile them (see _act_quant_launch), so no lanes sit masked off."""
    rows = row_lo + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    if HAS_COUNTS:
        row_ok &= rows % capacity < tl.load(counts_ptr + rows // capacity, mask=row_ok, other=0)
    if PAIR_ROWS:
        expert = tl.load(pair_experts_ptr + rows, mask=row_ok, other=-1)
        row_ok &= (expert >= 0) & (expert < num_experts)
    row_factor = tl.full([ROWS], 1.0, tl.float32)
    if HAS_ROW_SCALE:
        row_factor = tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if QUANT == "int8_token":  # each row's amax: from its pieces, one read, or a first pass
        if PIECES > 0:
            parts = tl.arange(0, PIECES)
            amax = tl.zeros([ROWS, PIECES], dtype=tl.float32)
            for first in range(0, num_pieces, PIECES):
                amax = tl.maximum(amax, tl.load(pieces_ptr + rows[:, None] * num_pieces + first + parts[None, :],
                                                mask=row_ok[:, None] & (first + parts[None, :] < num_pieces),
                                                other=0.0))
        elif ONE_READ:
            v = _tile_values(x_ptr, rows, row_ok, tl.arange(0, BLOCK), D, stride_x, row_factor, ACTIVATION)
            amax = tl.abs(v)
        else:
            amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for d in range(0, D, BLOCK):
                v = _tile_values(x_ptr, rows, row_ok, d + tl.arange(0, BLOCK), D, stride_x, row_factor, ACTIVATION)
                amax = tl.maximum(amax, tl.abs(v))
        row_scale = _int8_token_scale(tl.max(amax, axis=1))
        if col_lo == 0:  # with pieces, the row's first chunk stores it
            tl.store(scale_ptr + rows * stride_scale, row_scale, mask=row_ok)
        scale = row_scale[:, None]
        if ONE_READ and PIECES == 0:  # the values are still in registers: the codes now
            _store_int8_codes(out_ptr, rows, row_ok, stride_out, 0, _int8_codes(v, scale), D, ROWS, BLOCK,
                              NIBBLE_HALVES)
            col_hi = 0  # done: the loop below runs no step
    elif QUANT == "int8_static" or QUANT == "fp8_static":
        scale = tl.load(static_scale_ptr).to(tl.float32)

    for d in range(col_lo, col_hi, BLOCK):
        cols = d + tl.arange(0, BLOCK)
        v = _tile_values(x_ptr, rows, row_ok, cols, D, stride_x, row_factor, ACTIVATION)
        out_tile = out_ptr + rows[:, None] * stride_out + cols[None, :]
        mask = row_ok[:, None] & (cols[None, :] < D)
        if QUANT == "none":
            tl.store(out_tile, v.to(out_ptr.dtype.element_ty), mask=mask)
        elif QUANT == "int8_token" or QUANT == "int8_static":
            _store_int8_codes(out_ptr, rows, row_ok, stride_out, d, _int8_codes(v, scale), D, ROWS, BLOCK,
                              NIBBLE_HALVES)
        elif QUANT == "fp8_static":
            tl.store(out_tile, _fp8_codes(v, scale), mask=mask)
        else:  # a scale per GROUP columns: fp8_group (float32 amax / 448) or mxfp8 (e8m0)
            v = tl.reshape(v, (ROWS, BLOCK // GROUP, GROUP))
            group_scale, stored = _group_scale(tl.max(tl.abs(v), axis=2), QUANT)
            tl.store(out_tile, tl.reshape(_fp8_codes(v, group_scale[:, :, None]), (ROWS, BLOCK)), mask=mask)
            groups = d // GROUP + tl.arange(0, BLOCK // GROUP)
            tl.store(scale_ptr + rows[:, None] * stride_scale + groups[None, :], stored,
                     mask=row_ok[:, None] & (groups[None, :] < tl.cdiv(D, GROUP)))


def act_quant(x: torch.Tensor, activation: str, quant: str, *, static_scale: torch.Tensor | None = None,
              row_scale: torch.Tensor | None = None, group: int = 128,
              out_dtype: torch.dtype | None = None, expert_num_tokens: torch.Tensor | None = None,
              capacity: int = 1, amax_pieces: torch.Tensor | None = None,
              pdl: bool = False, nibble_halves: bool = False, pair_experts: torch.Tensor | None = None,
              num_experts: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of x [T, D_in] -> (values [T, D], scale or None): ``activation`` "none" or one of
    core.vocab.ACTIVATION_FNS (then D = D_in / 2), ``quant`` one of QUANT_MODES. Scales: int8_token float32
    [T, 1]; static modes return ``static_scale``; fp8_group float32 [T, ceil(D/group)]; mxfp8 uint8
    [T, ceil(D/32)]. ``out_dtype``: quant "none": the values' dtype (default x's); int8 modes: the
    codes' (INT8_CODE_DTYPES; a 16-bit float holds each code's value exactly). ``row_scale`` [T]
    multiplies each row before quantising. With
    ``expert_num_tokens`` [E] (batched rows, T = E·capacity) rows past a count are left unwritten.
    ``amax_pieces`` [T, P] (int8_token, no activation or row factor): each row's amax is the
    largest of its P pieces (a GEMM epilogue left them), so rows are cut into chunks like the
    group modes. ``pdl``: launch as part of a programmatic-dependent-launch chain.
    ``nibble_halves`` (int8 modes, even D): each row's codes of even columns first, then of odd
    ones (the decode GEMV's int4 words). ``pair_experts`` [T]: the rows are (token, expert) pairs,
    these their experts; a pair's row whose expert lies outside [0, ``num_experts``) (another
    rank's: GEMM1 never wrote it) is neither read nor written, nor is its scale. Plain
    implementation behind the custom ops (no dispatcher hop inside the fused layer)."""
    if nibble_halves and not (quant.startswith("int8") and x.shape[1] % 2 == 0 and activation == "none"):
        raise ValueError(f"codes in nibble halves are int8 codes of rows of even width, no activation; got {quant} "
                         f"rows of {x.shape[1]}, activation {activation}")
    if pair_experts is not None and pair_experts.shape != (x.shape[0],):
        raise ValueError(f"pair_experts holds one expert per row: [{x.shape[0]}], got {list(pair_experts.shape)}")
    out, scale, args, meta = _act_quant_launch(x, activation, quant, static_scale, row_scale, group, out_dtype,
                                               expert_num_tokens, capacity, amax_pieces)
    if nibble_halves:
        meta["NIBBLE_HALVES"] = True
    if pair_experts is not None:
        meta |= {"PAIR_ROWS": True, "pair_experts_ptr": pair_experts, "num_experts": num_experts}
    if x.shape[0]:
        whole_rows = quant == "int8_token" and amax_pieces is None
        chunks = 1 if whole_rows else triton.cdiv(out.shape[1], meta["BLOCK"])
        rows, warps = _act_quant_tile_shape(x.shape[0], out.shape[1], meta)
        _act_quant_kernel[(triton.cdiv(x.shape[0], rows), chunks)](
            *args, x.shape[0], **meta, ROWS=rows, PDL=pdl, num_warps=warps, **pdl_launch(pdl))
    return out, scale


def _act_quant_tile_shape(num_rows: int, width: int, meta: dict) -> tuple[int, int]:
    """(rows per program, warps) of one act_quant launch of rows ``width`` values wide. Decode: a
    row per program, 16 warps from 2048-column blocks up (on an H100 they beat 8 by 0.1-0.7 us).
    Prefill (ROW_TILE_MIN_ROWS rows or more): blocks of several rows,
    ROW_TILE_ELEMS values and ROW_TILE_PER_THREAD per thread (measured on an H100 against 2k and
    8k values, 8 per thread), except int8_token rows wider than that, read twice: one a program
    (14336 columns: 145 us against 195 for two)."""
    block = meta["BLOCK"]
    one_row = 1, 4 if block <= 512 else 8 if block <= 1024 else 16
    if num_rows < ROW_TILE_MIN_ROWS:
        return one_row
    if meta["QUANT"] == "int8_token" and not meta["ONE_READ"] and not meta["PIECES"] and width > ROW_TILE_ELEMS:
        return one_row
    rows = max(1, min(ROW_TILE_MAX_ROWS, ROW_TILE_ELEMS // block))
    if rows == 1:
        return one_row
    return rows, max(1, min(8, rows * block // (32 * ROW_TILE_PER_THREAD)))


def prefill_row_chunks(width: int) -> int:
    """The chunks act_quant cuts a row ``width`` values wide into at prefill (1: one block).
    A width that is no power of two is tiled by chunks of its largest power-of-two factor, so
    no lanes sit masked off (on an H100, 1408 columns went 2x faster); int8_token rows without
    amax pieces are then read twice (an amax pass, then the codes)."""
    low = width & -width
    if low == width or low < ROW_TILE_MIN_CHUNK:
        return 1
    return width // min(low, ROW_CHUNK)


def _act_quant_launch(x, activation, quant, static_scale, row_scale, group, out_dtype, expert_num_tokens,
                      capacity, amax_pieces):
    """Outputs, kernel arguments and constexprs of one act_quant launch (shared with the launch
    that fuses it with alignment)."""
    if amax_pieces is not None and (quant != "int8_token" or activation != "none" or row_scale is not None
                                    or amax_pieces.shape[0] != x.shape[0] or not amax_pieces.is_contiguous()):
        raise ValueError("amax pieces are a contiguous [rows, P] amax of the rows as given (int8_token, no "
                         "activation or row factor)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, d_in = x.shape
    d = d_in if activation == "none" else d_in // 2
    dev = x.device
    if quant == "mxfp8":
        group = MX_GROUP
    scale: torch.Tensor | None = None
    if quant == "none":
        out = torch.empty(t, d, dtype=out_dtype or x.dtype, device=dev)
    elif quant.startswith("int8"):
        if out_dtype not in INT8_CODE_DTYPES:
            raise ValueError(f"int8 codes are stored as one of {INT8_CODE_DTYPES}, got {out_dtype}")
        out = torch.empty(t, d, dtype=out_dtype or torch.int8, device=dev)
        scale = torch.empty(t, 1, dtype=torch.float32, device=dev) if quant == "int8_token" else static_scale
    else:
        out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=dev)
        if quant == "fp8_static":
            scale = static_scale
        else:
            sdt = torch.uint8 if quant == "mxfp8" else torch.float32
            scale = torch.empty(t, triton.cdiv(d, group), dtype=sdt, device=dev)
    widest = ROW_BLOCK_MAX if quant == "int8_token" and amax_pieces is None else ROW_CHUNK
    block = max(min(triton.next_power_of_2(d), widest), group if quant in ("fp8_group", "mxfp8") else 16)
    if t >= ROW_TILE_MIN_ROWS and prefill_row_chunks(d) > 1:
        block = max(d // prefill_row_chunks(d), group if quant in ("fp8_group", "mxfp8") else 16)
    dummy = out
    scale_arg = scale if scale is not None else dummy
    args = (x, out, scale_arg, static_scale if static_scale is not None else dummy,
            row_scale if row_scale is not None else dummy,
            expert_num_tokens if expert_num_tokens is not None else dummy,
            amax_pieces if amax_pieces is not None else dummy,
            d, x.stride(0), out.stride(0), scale_arg.stride(0) if scale_arg.dim() == 2 else 0, capacity,
            amax_pieces.shape[1] if amax_pieces is not None else 0)
    pieces = min(triton.next_power_of_2(amax_pieces.shape[1]), PIECES_STEP) if amax_pieces is not None else 0
    meta = {"ACTIVATION": activation, "QUANT": quant, "GROUP": group, "HAS_ROW_SCALE": row_scale is not None,
            "HAS_COUNTS": expert_num_tokens is not None, "BLOCK": block, "ONE_READ": block >= d, "PIECES": pieces}
    return out, scale, args, meta


@torch.library.custom_op("moe_registry::act_and_mul", mutates_args=())
def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2I] -> [T, I] in x's dtype: act(gate) * up, gate = first half, up = second half;
    activation is silu, gelu (erf) or swigluoai. Computed in float32."""
    return act_quant(x, activation, "none")[0]


@act_and_mul.register_fake
def _(x, activation):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("moe_registry::act_and_mul_quant", mutates_args=())
def act_and_mul_quant(x: torch.Tensor, activation: str, quant: str,
                      static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """act_and_mul fused with activation quantisation (``quant`` in QUANT_MODES except "none"),
    quantising the float32 activation directly (no rounding to 16 bits in between)."""
    q, s = act_quant(x, activation, quant, static_scale=static_scale)
    return q, s.clone() if s is static_scale else s


@act_and_mul_quant.register_fake
def _(x, activation, quant, static_scale=None):
    return _fake_quant(x.shape[0], x.shape[1] // 2, quant, x, static_scale)


def _fake_quant(t, d, quant, like, static_scale):
    qdt = torch.int8 if quant.startswith("int8") else torch.float8_e4m3fn
    if quant == "int8_token":
        s = like.new_empty(t, 1, dtype=torch.float32)
    elif quant in ("int8_static", "fp8_static"):
        s = static_scale.new_empty(static_scale.shape)
    elif quant == "mxfp8":
        s = like.new_empty(t, triton.cdiv(d, MX_GROUP), dtype=torch.uint8)
    else:
        s = like.new_empty(t, triton.cdiv(d, 128), dtype=torch.float32)
    return like.new_empty(t, d, dtype=qdt), s


@torch.library.custom_op("moe_registry::quant_int8_per_token", mutates_args=())
def quant_int8_per_token(x: torch.Tensor,
                         static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> int8 codes and float32 scales [T, 1] (amax / 127 per row), or with a static
    per-tensor ``static_scale`` [1], codes against it (returned scale: a copy of it)."""
    q, s = act_quant(x, "none", "int8_token" if static_scale is None else "int8_static",
                     static_scale=static_scale)
    return q, s.clone() if s is static_scale else s


@quant_int8_per_token.register_fake
def _(x, static_scale=None):
    return _fake_quant(x.shape[0], x.shape[1], "int8_token" if static_scale is None else "int8_static",
                       x, static_scale)


@torch.library.custom_op("moe_registry::quant_fp8_per_group", mutates_args=())
def quant_fp8_per_group(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> float8_e4m3fn codes and float32 scales [T, ceil(K/group)] (amax / 448 per group;
    group_size a power of two)."""
    return act_quant(x, "none", "fp8_group", group=group_size)


@quant_fp8_per_group.register_fake
def _(x, group_size=128):
    t, k = x.shape
    return x.new_empty(t, k, dtype=torch.float8_e4m3fn), x.new_empty(t, triton.cdiv(k, group_size),
                                                                       dtype=torch.float32)


@torch.library.custom_op("moe_registry::quant_mxfp8", mutates_args=())
def quant_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> MXFP8: float8_e4m3fn codes and raw e8m0 exponents uint8 [T, ceil(K/32)]."""
    return act_quant(x, "none", "mxfp8")


@quant_mxfp8.register_fake
def _(x):
    return _fake_quant(x.shape[0], x.shape[1], "mxfp8", x, None)
