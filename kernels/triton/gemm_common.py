"""What the fused MoE GEMM kernels (:mod:`moe_registry_kernels.triton.gemm`) share: one prologue
(:func:`_program_block`, :func:`_block_rows`, :func:`_k_range`, :func:`_weight_rows`,
:func:`_expert_weight_ptrs`, :func:`_column_zero`), one per-tile loader of group and MX scales
(:func:`_group_scales`), the zero-point, dot and one-token scale helpers, and one epilogue
(:func:`_finish_tile`, also the decode GEMV's).
"""

import triton
import triton.language as tl

from .dequant_ptx import _e4m3_folded_scale, _e8m0, _nibbles_as_int8, _offset_zero
from .fp4_dequant import _folded_e8m0, _scale_code_value, e2m1_fold_factor
from .quant_math import AMAX_FLOOR, FP8_MAX, INT8_MAX, _rows_amax, _span_amax, _to_e4m3, _to_int8, gated_act


@triton.constexpr_function
def _groups_per_tile(block_k: int, group: int) -> int:
    """Weight scale groups one K tile of ``block_k`` columns spans (1 when a group holds the tile,
    or the weights have no groups)."""
    return max(block_k // max(group, 1), 1)


@triton.constexpr_function
def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@triton.constexpr_function
def _exp2(n: int) -> float:
    return 2.0 ** n


# ---------------------------------------------------------------------------------------------
# the prologue both kernels share


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering (Triton matmul tutorial): GROUP_M row blocks share the same weight columns
    while they are hot in L2."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _block_pairs(pid_m, offs_m, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, num_valid, num_experts,
                 BLOCK_M: tl.constexpr, ONE_PAIR_BLOCKS: tl.constexpr):
    """(pairs [BLOCK_M], expert) of row block pid_m; expert -1: the block has no rows (past the
    aligned pairs, or a foreign expert). Aligned: the block's slice of sorted_ids (padding holds
    the sentinel num_valid). ONE_PAIR_BLOCKS: block b holds pair b alone and expert_ids are the
    router's ids (one token: its top-k experts are distinct, so no alignment is needed)."""
    if ONE_PAIR_BLOCKS:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, -1)
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_valid)
    else:
        num_post_padded = tl.load(num_post_padded_ptr)  # a multiple of BLOCK_M
        pairs = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < num_post_padded, other=num_valid)
        expert = tl.where(pid_m * BLOCK_M < num_post_padded, tl.load(expert_ids_ptr + pid_m).to(tl.int64), -1)
    return pairs, expert


@triton.jit
def _program_block(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_num_tokens_ptr, N, K, num_valid,
                   rows_per_expert, num_experts, TOP_K: tl.constexpr, BATCHED: tl.constexpr,
                   ONE_PAIR_BLOCKS: tl.constexpr, WRITE_EMPTY: tl.constexpr, FUSE_ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """What this program computes: (pid_n, offs_m, expert, rows, k_end); ``expert`` -1: nothing to do,
    the kernel returns before :func:`_block_rows` reads ``rows`` (computing the row masks first
    measured 2% slower on Mixtral AWQ at M = 64, H100).

    Program 0 of the grid's first axis is a (row block, column tile) pair in grouped order. Its
    rows: BATCHED, rows e·T .. e·T + expert_num_tokens[e] of A and C (expert e = program_id(1);
    ``rows`` is that count); otherwise the aligned (token, k) pairs of the block (``rows``: the
    pairs; padding holds the sentinel num_valid). Batched with WRITE_EMPTY, empty blocks skip the
    K loop (``k_end`` 0) and still write their zeros."""
    # with FUSE_ACT a tile holds BLOCK_N / 2 gate rows interleaved with their up rows
    num_pid_n = tl.cdiv(N // 2, BLOCK_N // 2) if FUSE_ACT != "none" else tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(rows_per_expert, BLOCK_M), num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_end = K
    if BATCHED:
        expert = tl.program_id(1).to(tl.int64)
        rows = tl.load(expert_num_tokens_ptr + expert)
        empty = pid_m * BLOCK_M >= rows
        if WRITE_EMPTY:
            k_end = tl.where(empty, 0, K)  # an empty block skips the loop and writes zeros
        else:
            expert = tl.where(empty, -1, expert)
    else:
        rows, expert = _block_pairs(pid_m, offs_m, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                                    num_valid, num_experts, BLOCK_M, ONE_PAIR_BLOCKS)
    return pid_n, offs_m, expert, rows, k_end


@triton.jit
def _block_rows(offs_m, expert, rows, num_valid, rows_per_expert, TOP_K: tl.constexpr, BATCHED: tl.constexpr):
    """(a_rows, c_rows, row_mask, store_rows) of the block :func:`_program_block` chose: the A and C
    rows (batched: the expert's slab; otherwise A row pair // TOP_K, C row the pair), the rows that
    hold data, and the rows C takes (batched: every row of the slab, so empty rows get zeros)."""
    if BATCHED:
        row_mask = offs_m < rows
        a_rows = expert * rows_per_expert + offs_m
        c_rows = a_rows
        store_rows = offs_m < rows_per_expert
    else:
        row_mask = rows < num_valid
        a_rows = rows // TOP_K
        c_rows = rows
        store_rows = row_mask
    return a_rows, c_rows, row_mask, store_rows


@triton.jit
def _k_range(K, k_end, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(split, k_lo, k_hi): SPLIT_K: program_id(2) sums its share of K (whole K tiles) into
    partial output number ``split``."""
    split = tl.program_id(2)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    return split, k_lo, tl.minimum(k_end, k_lo + k_per_split)


@triton.jit
def _weight_rows(pid_n, N, FUSE_ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows [BLOCK_N] of column tile pid_n, wrapped at N so loads need no column mask
    (the store masks). FUSE_ACT: tile column 2i is gate row c_i, column 2i + 1 up row N/2 + c_i."""
    if FUSE_ACT != "none":
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        offs_bn = cols % (N // 2) + (tl.arange(0, BLOCK_N) % 2) * (N // 2)
    else:
        offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    return offs_bn


@triton.jit
def _tile_scale_blocks(pid_n, N, W_GROUP_N: tl.constexpr, FUSE_ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block rows of the scales of column tile pid_n's weight rows (_weight_rows), where they lie in one
    weight block: (its even columns', its odd columns'); with FUSE_ACT the gate rows' and the up rows'
    (N / 2 a whole number of blocks), else the same block twice. (Wrapped columns past N are not stored.)"""
    if FUSE_ACT != "none":
        first = (pid_n * (BLOCK_N // 2)) % (N // 2)
        return first // W_GROUP_N, (N // 2 + first) // W_GROUP_N
    else:
        first = (pid_n * BLOCK_N) % N
        return first // W_GROUP_N, first // W_GROUP_N


@triton.jit
def _tile_block_scales(k_scales, block_even, block_odd, stride_sn, FUSE_ACT: tl.constexpr):
    """The scalar block scales of a K step's tile (k_scales: its K block's scales of the expert)."""
    scale_even = tl.load(k_scales + block_even * stride_sn)
    if FUSE_ACT != "none":
        return scale_even, tl.load(k_scales + block_odd * stride_sn)
    return scale_even, scale_even


@triton.jit
def _pair_factors(row_scales, scale_even, scale_odd, BLOCK_N: tl.constexpr, FUSE_ACT: tl.constexpr,
                  SWAPPED: tl.constexpr):
    """What a K step's fp8 dot is multiplied by: each token's group scale times its weight rows' block
    scale, [BLOCK_M, BLOCK_N] (SWAPPED: [BLOCK_N, BLOCK_M]). The weight side takes one scale, or with
    FUSE_ACT one on the even columns and one on the odd ones, a pattern each thread's registers know at
    compile time: one multiply-add a value into the accumulator where a vector of scales takes two."""
    even = (tl.arange(0, BLOCK_N) % 2 == 0)
    if SWAPPED and FUSE_ACT != "none":
        factors = tl.where(even[:, None], (row_scales * scale_even)[None, :], (row_scales * scale_odd)[None, :])
    elif SWAPPED:
        factors = (row_scales * scale_even)[None, :]
    elif FUSE_ACT != "none":
        factors = tl.where(even[None, :], (row_scales * scale_even)[:, None], (row_scales * scale_odd)[:, None])
    else:
        factors = (row_scales * scale_even)[:, None]
    return factors


@triton.jit
def _expert_weight_ptrs(b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_bn, stride_be, stride_bn, stride_se,
                        stride_sn, N_AXIS: tl.constexpr):
    """Pointers to the weight rows ``offs_bn`` of the expert, and to their scales and zero points
    (which share the scales' strides), laid along N_AXIS of a 2-D tile: [1, BN] or [BN, 1]."""
    rows = offs_bn[None, :] if N_AXIS == 1 else offs_bn[:, None]
    w = b_ptr + expert * stride_be + rows * stride_bn
    scale = b_scale_ptr + expert * stride_se + rows * stride_sn
    zero = b_zero_ptr + expert * stride_se + rows * stride_sn
    return w, scale, zero


@triton.jit
def _column_zero(zero_ptrs, dtype, W_ZERO: tl.constexpr, HAS_ZERO: tl.constexpr, W_SCALE: tl.constexpr,
                 NARROW: tl.constexpr):
    """The offset zero code (see dequant_ptx._offset_zero) of each weight row, shaped as
    ``zero_ptrs``: the type's bias, or per-channel zero points."""
    zero = _offset_zero(tl.full(zero_ptrs.shape, W_ZERO, tl.float32), dtype, NARROW)
    if HAS_ZERO and W_SCALE == "channel":
        zero = _offset_zero(tl.load(zero_ptrs).to(tl.float32), dtype, NARROW)
    return zero


@triton.jit
def _repeat_rows(x, ROWS: tl.constexpr):
    """Per-group values [G, BN] -> [ROWS, BN], each repeated over ROWS // G consecutive rows
    (G == 1 is left to broadcasting)."""
    if x.shape[0] == 1:
        out = x
    else:
        parts = tl.broadcast_to(x[:, None, :], (x.shape[0], ROWS // x.shape[0], x.shape[1]))
        out = tl.reshape(parts, (ROWS, x.shape[1]))
    return out


@triton.jit
def _repeat_cols(x, COLS: tl.constexpr):
    """Per-group values [BM, G] -> [BM, COLS], each repeated over COLS // G consecutive columns."""
    if x.shape[1] == 1:
        out = x
    else:
        parts = tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], COLS // x.shape[1]))
        out = tl.reshape(parts, (x.shape[0], COLS))
    return out


@triton.jit
def _group_scales(scale_ptrs, zero_ptrs, zero, k_start, scale_groups, stride_sk, dtype, W_SCALE: tl.constexpr,
                  W_GROUP: tl.constexpr, W_GROUPS: tl.constexpr, HAS_ZERO: tl.constexpr, NARROW: tl.constexpr,
                  K_AXIS: tl.constexpr, K_LEN: tl.constexpr, E2M1_FOLDED: tl.constexpr = False,
                  E2M1_SHIFT: tl.constexpr = 0, E4M3_FOLDED: tl.constexpr = False, ASM: tl.constexpr = False):
    """(scale, tile_zero) of the weight tile at k_start for per-group (16-bit) or MX (e8m0) scales:
    one load per group and weight row, repeated over the tile's K_LEN weight elements along
    K_AXIS (0: a [K_LEN, BN] tile, 1: [BN, K_LEN]). ``tile_zero``: the group's offset zero
    points with HAS_ZERO, else ``zero``. ``scale_groups``: the groups a weight row's scales hold
    (a multiple of 16 where TritonExperts pads them, so the masked load of a row's groups is still
    one vector, which the pipeliner streams ahead of the tile like the codes; past K the pad is
    finite and meets masked-off codes and activations). E2M1_FOLDED, E2M1_SHIFT: an FP4 tile's
    scales carry the codes' unscale over 2^E2M1_SHIFT (fp4_dequant's module note; MX: no shift).
    E4M3_FOLDED: MX fp8 tiles' scales as :func:`_dequant_e4m3` takes them (dequant_ptx._e4m3_folded_scale).
    ASM: NVFP4's scale codes decoded two at a time by PTX (fp4_dequant._scale_code_value)."""
    # a K tile starts at a multiple of W_GROUPS groups
    w_groups = tl.max_contiguous(tl.multiple_of(k_start // W_GROUP + tl.arange(0, W_GROUPS), W_GROUPS), W_GROUPS)
    groups = w_groups[:, None] if K_AXIS == 0 else w_groups[None, :]
    g_mask = groups < scale_groups
    loaded = tl.load(scale_ptrs + groups * stride_sk, mask=g_mask, other=0)
    scale = _scale_of(loaded)
    if W_SCALE == "mx":
        if NARROW and E2M1_FOLDED:  # 2^U times the power of two, from the code's bits
            tl.static_assert(E2M1_SHIFT == 0, "folded MX scales are not shifted")
            scale = _folded_e8m0(scale, dtype)
        elif NARROW:  # e2m1 tiles take the power of two in the 16-bit dtype (fp4_dequant: exact where it matters)
            scale = _e8m0(scale).to(dtype)
        elif E4M3_FOLDED:
            scale = _e4m3_folded_scale(_e8m0(scale), dtype)
        else:
            scale = _e8m0(scale)
    elif scale.dtype == tl.uint8:  # NVFP4's e4m3 group scales, as exponent codes (fp4_dequant.e4m3_scale_codes)
        scale = _scale_code_value(scale, dtype, e2m1_fold_factor(dtype, E2M1_FOLDED, E2M1_SHIFT), ASM)
    else:
        scale = scale.to(dtype)
    scale = _repeat_rows(scale, K_LEN) if K_AXIS == 0 else _repeat_cols(scale, K_LEN)
    tile_zero = zero
    if HAS_ZERO:
        group_zero = _offset_zero(_zero_of(loaded, zero_ptrs, groups * stride_sk, g_mask, 0.0), dtype, NARROW)
        tile_zero = _repeat_rows(group_zero, K_LEN) if K_AXIS == 0 else _repeat_cols(group_zero, K_LEN)
    return scale, tile_zero


@triton.jit
def _weight_scale2(acc, b_scale2_ptr, expert, N, offs_bn, W_SCALE2: tl.constexpr, E2M1_SHIFT: tl.constexpr,
                   N_AXIS: tl.constexpr):
    """The dot's float32 result times the second-level weight scale of each weight row (W_SCALE2)
    and 2^E2M1_SHIFT, the power of two folded FP4 tiles left out (exact). N_AXIS: where the weight
    rows run in ``acc``."""
    if W_SCALE2:
        scale2 = tl.load(b_scale2_ptr + expert * N + offs_bn)
        if E2M1_SHIFT != 0:
            scale2 = scale2 * _exp2(E2M1_SHIFT)
        acc = acc * (scale2[None, :] if N_AXIS == 1 else scale2[:, None])
    elif E2M1_SHIFT != 0:
        acc = acc * _exp2(E2M1_SHIFT)
    return acc


@triton.jit
def _row(x, i: tl.constexpr):
    """Row ``i`` of a [R, C] tile, as [1, C]: a select and a sum over R (within each thread where
    the layout keeps a column's R values together, as for two or four 16-bit group scales)."""
    return tl.sum(tl.where(tl.arange(0, x.shape[0])[:, None] == i, x, 0.0), axis=0)[None, :]


@triton.jit
def _scale_of(loaded):
    """The 16-bit group scales of loaded scale values: themselves, or the float16 low halves of
    scale-and-zero words (int32: TritonExperts' layout for zero-point weights, see
    layout._scale_zero_words), or those halves loaded alone (int16: layout._word_halves_for)."""
    if loaded.dtype == tl.int32:
        loaded = (loaded & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    elif loaded.dtype == tl.int16:
        loaded = loaded.to(tl.float16, bitcast=True)
    return loaded


@triton.jit
def _zero_of(loaded, zero_ptrs, offsets, mask, other):
    """The float32 zero points beside loaded group scales: the high halves of scale-and-zero words
    (no second load; a masked-off word is 0, whose scale 0 cancels its zero), else loaded from
    ``zero_ptrs + offsets``. (No select on the words: Triton then no longer dequantises the codes
    in the dot's operand layout, but converts the whole 16-bit tile through shared memory.)"""
    if loaded.dtype == tl.int32:
        zero = (loaded >> 16).to(tl.float32)
    else:
        zero = tl.load(zero_ptrs + offsets, mask=mask, other=other).to(tl.float32)
    return zero


# weight groups a step of _less_zero_point_terms takes (the K of its dot)
ZERO_TERM_GROUPS = tl.constexpr(16)


@triton.jit
def _less_zero_point_terms(acc, row_sums_ptr, stride_rs, a_one_row, a_rows, row_mask, scale_cols, zero_cols, stride_sk,
                           scale_groups, k_lo, k_hi, K, W_GROUP: tl.constexpr, MID: tl.constexpr,
                           PIECES: tl.constexpr, ONE_ROW: tl.constexpr, HAS_ZERO: tl.constexpr = True,
                           W_ZERO: tl.constexpr = 0):
    """``acc`` less sum_g rowsum_g(A) * s_g * (z_g - MID) over the weight groups whose first column
    lies in [k_lo, k_hi) (a split's share: each group's terms are taken once over the splits), for
    the float32 [BLOCK_M, BLOCK_N] tile of a zero-point GEMM's factored dot of code - MID (see
    FACTORED). ``row_sums_ptr``: A's rows' sums per group, [A rows, groups * PIECES] (row stride
    ``stride_rs``, which also bounds the pieces: a group's sum is that of its PIECES consecutive
    ones); z_g the group's zero point, or W_ZERO for codes of a fixed zero (not HAS_ZERO); ONE_ROW
    (one-pair blocks, whose one row ``a_one_row`` is the only one stored): that row's
    sums, found here from A (a second read of one row, from L2) instead of by a launch before
    the GEMM. The dot keeps float32 accuracy (three TF32 products): with zero points far
    from MID the terms are large beside the result they correct. (H100, Mixtral M = 64: as one
    rank-1 update a group, 1.06-1.15x the time; under a cap of 168 registers, three programs an
    SM instead of two, 1.05-1.19x: tools/bench.py --shapes mixtral --m 64.)"""
    first, groups = tl.cdiv(k_lo, W_GROUP), tl.cdiv(k_hi, W_GROUP)
    # steps start at multiples of ZERO_TERM_GROUPS (a split's first step reads a few of the last
    # one's groups, whose sums it takes as zero) and the scales and zero points are masked by the
    # groups a weight row holds, not the split's: a row's 16 load as vectors where that is a
    # multiple of 16 (Triton marks such integer arguments; TritonExperts pads zero-point weights'
    # scales to one), not as 16 scalar loads a thread each (H100, AWQ on GPTQ int4's tiles at
    # Qwen3's M = 64: 181.1 -> 164.7 us a layer, tools/bench.py --shapes qwen3 --m 64). Not
    # pipelined: a few steps after the main loop, whose registers a pipeline's would add to.
    for g0 in tl.range(first // ZERO_TERM_GROUPS * ZERO_TERM_GROUPS, groups, ZERO_TERM_GROUPS, num_stages=1):
        g = tl.max_contiguous(tl.multiple_of(g0 + tl.arange(0, ZERO_TERM_GROUPS), ZERO_TERM_GROUPS),
                              ZERO_TERM_GROUPS)
        g_mask = (g >= first) & (g < groups)
        if ONE_ROW:  # every row of the tile takes the one row's sums (the others are never stored)
            cols = g[:, None] * W_GROUP + tl.arange(0, W_GROUP)[None, :]
            row = tl.load(a_one_row + cols, mask=g_mask[:, None] & (cols < K), other=0.0).to(tl.float32)
            sums = tl.broadcast_to(tl.sum(row, axis=1)[None, :], (acc.shape[0], ZERO_TERM_GROUPS))
        elif PIECES == 1:
            sums = tl.load(row_sums_ptr + a_rows[:, None] * stride_rs + g[None, :],
                           mask=row_mask[:, None] & g_mask[None, :], other=0.0)
        else:
            p = g0 * PIECES + tl.arange(0, ZERO_TERM_GROUPS * PIECES)
            parts = tl.load(row_sums_ptr + a_rows[:, None] * stride_rs + p[None, :],
                            mask=row_mask[:, None] & (p[None, :] >= first * PIECES) & (p[None, :] < stride_rs)
                            & (p[None, :] < groups * PIECES),
                            other=0.0)
            sums = tl.sum(tl.reshape(parts, (parts.shape[0], ZERO_TERM_GROUPS, PIECES)), axis=2)
        held = g[:, None] < scale_groups
        loaded = tl.load(scale_cols + g[:, None] * stride_sk, mask=held, other=0)
        scale = _scale_of(loaded).to(tl.float32)
        if HAS_ZERO:
            zero = _zero_of(loaded, zero_cols, g[:, None] * stride_sk, held, MID)
            acc = _dot_tf32x3(-sums, scale * (zero - MID), acc)
        else:  # (W_ZERO - MID is a small integer: the product is the scale's, exactly)
            acc = _dot_tf32x3(-sums, scale * (W_ZERO - MID), acc)
    return acc


@triton.jit
def _tf32_halves(x):
    """float32 ``x`` -> (its TF32 part, the exact rest): x with its 10 leading mantissa bits only,
    and x less that (whose own TF32 part, all a TF32 product reads of it, keeps at least 22 of x's
    24 significant bits in all)."""
    high = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return high, x - high


@triton.jit
def _dot_tf32x3(a, b, acc):
    """acc + a @ b in float32 accuracy from three TF32 products (high x high, high x rest, rest x
    high), each accumulated into ``acc`` itself: Triton's tf32x3 sums them into a second
    accumulator from zero, which held a whole extra tile of registers at the epilogue (W8A16 asym
    at Mixtral's M = 64: 239 registers, 209 so; on an H100 645.1 -> 611.3 us a layer,
    tools/bench.py --shapes mixtral --m 64)."""
    a_high, a_rest = _tf32_halves(a)
    b_high, b_rest = _tf32_halves(b)
    acc = tl.dot(a_rest, b_high, acc, input_precision="tf32")
    acc = tl.dot(a_high, b_rest, acc, input_precision="tf32")
    return tl.dot(a_high, b_high, acc, input_precision="tf32")


@triton.jit
def _token_halves(row, BLOCK_M: tl.constexpr):
    """One token's [C] activations -> its even and odd columns, each repeated down a [BLOCK_M, C / 2]
    tile (the nibble half-dots' operands): split once, not once per repeated row."""
    even, odd = tl.split(tl.reshape(row, (row.shape[0] // 2, 2)))
    return (tl.broadcast_to(even[None, :], (BLOCK_M, row.shape[0] // 2)),
            tl.broadcast_to(odd[None, :], (BLOCK_M, row.shape[0] // 2)))


@triton.jit
def _int4_as_int8_tile(packed_codes, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_K // 2, BN] bytes of uint4b8 nibbles (low: even column) -> [BLOCK_K, BN] int8 values
    code - 8 in K order, the operand of an int8 dot (W4A8); ASM: see _nibbles_as_int8."""
    low, high = _nibbles_as_int8(packed_codes, ASM)
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b; float32 operands use exact fp32 products (no TF32)."""
    return tl.dot(a, b, acc, input_precision="ieee") if a.dtype == tl.float32 else tl.dot(a, b, acc)


@triton.jit
def _codes_by_reciprocal(v, scale, reciprocal, DOT: tl.constexpr, HW_FP8_CAST: tl.constexpr):
    """float32 values -> the int8 or e4m3 codes of the dot (DOT) at this scale, as
    quant_math._int8_codes / _fp8_codes round them, in a few instructions a value: the quotient
    RN(v / scale) by Markstein's correction of v * RN(1 / scale) (correctly rounded for these
    quotients, at most ~448; those too small to keep every bit round to the zero code anyway),
    without div.rn's range checks, whose slow path every zero would take; then round half to
    even and saturate (int8), or the GPU's saturating round-to-nearest-even cast (HW_FP8_CAST;
    the sign of a zero code, which it may drop, does not change a dot) or, in the interpreter,
    whose cast rounds differently, quant_math._to_e4m3."""
    q = v * reciprocal
    q = tl.fma(tl.fma(-q, scale, v), reciprocal, q)
    if DOT == "int8":
        codes = _to_int8(q)
    elif HW_FP8_CAST:
        codes = q.to(tl.float8e4nv)
    else:
        codes = _to_e4m3(q)
    return codes


@triton.jit
def _one_token_scale(a_ptr, a_scale_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, stride_am, scale_rows,
                     amax_parts, num_experts, A_QUANT: tl.constexpr, DOT: tl.constexpr, A_SCALE_IN: tl.constexpr,
                     BLOCK_M: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr):
    """The scale of the one token's input this GEMM quantises itself (A_SCALE_IN): a static
    scale's value ("static"), or max(amax, 1e-10) / (448 or 127) as the quantisation kernels find
    it (:func:`_one_token_amax`). One return: Triton 3.6 compiles what follows an early one."""
    if A_SCALE_IN == "static":
        scale = tl.load(a_scale_ptr).to(tl.float32)
    else:
        amax = _one_token_amax(a_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, stride_am, scale_rows, amax_parts,
                               num_experts, A_QUANT, A_SCALE_IN, BLOCK_M, SCALE_ROWS, SCALE_COLS)
        scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), INT8_MAX if DOT == "int8" else FP8_MAX)
    return scale


@triton.jit
def _input_halves(a_row_ptrs, row_mask, first, K_HALF, WIDTH: tl.constexpr):
    """The block's rows' even and odd input columns 2 (first + j) and 2 (first + j) + 1, j < WIDTH,
    from an input stored as its even columns, then its odd ones (K_HALF each): two contiguous
    loads, where an input in column order is split in registers (INPUT_HALVES)."""
    cols = first + tl.arange(0, WIDTH)
    mask = row_mask[:, None] & (cols[None, :] < K_HALF)
    ptrs = a_row_ptrs[:, None] + cols[None, :]
    even = tl.load(ptrs, mask=mask, other=0.0)
    odd = tl.load(ptrs + K_HALF, mask=mask, other=0.0)
    return even, odd


@triton.jit
def _one_token_input(a_ptr, a_scale_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, k_lo, stride_am, scale_rows,
                     amax_parts, num_experts, A_QUANT: tl.constexpr, DOT: tl.constexpr, A_SCALE_IN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                     SCALE_COLS: tl.constexpr):
    """What a GEMM quantising one token's input itself (A_SCALE_IN) starts from: the scale
    (_one_token_scale), its reciprocal, the block's one row (its other rows are never stored) and
    that row's first K slice. The row is read as a vector, quantised (and split, for packed weights)
    as one, then repeated across the tile, instead of each step handling BLOCK_M rows; each step
    loads the next slice a step ahead (the pipeliner would read it in the dot's layout, each thread
    then handling many values). (16-bit rows taken so ran int4 decode slower on an H100: more
    instructions a step, the tile's activation split traded for a pass through shared memory;
    gptq-w4a16 at M = 1 on Mixtral's shape 105 us against 96.)"""
    scale = _one_token_scale(a_ptr, a_scale_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, stride_am, scale_rows,
                             amax_parts, num_experts, A_QUANT, DOT, A_SCALE_IN, BLOCK_M, SCALE_ROWS, SCALE_COLS)
    one_row = a_ptr + tl.max(tl.where(row_mask, a_rows, 0), axis=0).to(tl.int64) * stride_am
    first = tl.load(one_row + k_lo + tl.arange(0, BLOCK_K), mask=k_lo + tl.arange(0, BLOCK_K) < K, other=0.0)
    return scale, tl.math.div_rn(1.0, scale), one_row, first


@triton.jit
def _one_token_amax(a_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, stride_am, scale_rows, amax_parts,
                    num_experts, A_QUANT: tl.constexpr, A_SCALE_IN: tl.constexpr, BLOCK_M: tl.constexpr,
                    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr):
    """The amax from A's ``scale_rows`` rows ("rows": the token's hidden state, per token or per
    tensor alike), or from the row-amax pieces GEMM1's epilogue left ("pieces": per token the
    block's own pair's; fp8_tensor those of every one of the ``scale_rows`` pairs routed to this
    rank's experts, the only rows GEMM1 wrote)."""
    if A_QUANT != "fp8_tensor" and A_SCALE_IN == "pieces":
        amax = tl.max(_rows_amax(amax_ptr, a_rows, row_mask, amax_parts, amax_parts, BLOCK_M, SCALE_COLS), axis=0)
    elif A_SCALE_IN == "rows":
        amax = _span_amax(a_ptr, stride_am, K, 0, scale_rows, pair_ids_ptr, num_experts, False, SCALE_ROWS,
                          SCALE_COLS)
    else:
        amax = _span_amax(amax_ptr, amax_parts, amax_parts, 0, scale_rows, pair_ids_ptr, num_experts, True,
                          SCALE_ROWS, SCALE_COLS)
    return amax


@triton.jit
def _finish_tile(acc, expert, c_rows, row_mask, store_rows, offs_bn, pid_n, split, N, scale_cols, bias_ptr,
                 topk_weights_ptr, c_ptr, stride_cm, stride_cs, W_SCALE: tl.constexpr, ROUTED_WEIGHT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, WRITE_EMPTY: tl.constexpr, FUSE_ACT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, pieces_ptr, num_pieces, PIECES: tl.constexpr,
                 HALVES: tl.constexpr = False):
    """The epilogue on a float32 [BLOCK_M rows, BLOCK_N weight rows] tile: per-channel scale,
    router weight, bias (first split only), the gated activation when fused, and the store; with
    PIECES (fused activation only) also a piece of each stored row over the tile, as stored, into
    pieces_ptr[row, pid_n] (row stride ``num_pieces``): "amax", its max |value|, so the per-token
    quantisation after this GEMM need not find it; "sum", its sum, so a ZERO_SUMS GEMM2 needs no
    launch to sum its input's groups. HALVES (fused activation only): the activated row stored as its
    even columns, then its odd ones (N / 4 each), as a GEMM2 with INPUT_HALVES reads it."""
    if W_SCALE == "channel":
        acc *= tl.load(scale_cols).to(tl.float32)
    if ROUTED_WEIGHT != "none":
        router = tl.load(topk_weights_ptr + c_rows, mask=row_mask, other=0.0).to(tl.float32)
    if ROUTED_WEIGHT == "input":  # W (w·x) + b = w·(W x) + b
        acc *= router[:, None]
    if HAS_BIAS:  # added by the first split only
        bias = tl.load(bias_ptr + expert * N + offs_bn).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    if ROUTED_WEIGHT == "output":  # w·(W x + b)
        acc *= router[:, None]
    if WRITE_EMPTY:
        acc = tl.where(row_mask[:, None], acc, 0.0)
    c_row_ptrs = c_ptr + split * stride_cs + c_rows.to(tl.int64)[:, None] * stride_cm
    if FUSE_ACT != "none":
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        out = gated_act(gate, up, FUSE_ACT)
        offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        stored = out.to(c_ptr.dtype.element_ty)
        if HALVES:  # (N / 2 is even where a GEMM2 reads 4-bit weights' nibble halves)
            even, odd = tl.split(tl.reshape(stored, (BLOCK_M, BLOCK_N // 4, 2)))
            offs_half = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
            in_half = store_rows[:, None] & (offs_half[None, :] < N // 4)
            tl.store(c_row_ptrs + offs_half[None, :], even, mask=in_half)
            tl.store(c_row_ptrs + N // 4 + offs_half[None, :], odd, mask=in_half)
        else:
            tl.store(c_row_ptrs + offs_out[None, :], stored, mask=store_rows[:, None] & (offs_out[None, :] < N // 2))
        if PIECES != "none":
            kept = tl.where(offs_out[None, :] < N // 2, stored.to(tl.float32), 0.0)
            piece = tl.max(tl.abs(kept), axis=1) if PIECES == "amax" else tl.sum(kept, axis=1)
            tl.store(pieces_ptr + c_rows.to(tl.int64) * num_pieces + pid_n, piece, mask=store_rows)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(c_row_ptrs + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=store_rows[:, None] & (offs_n[None, :] < N))
