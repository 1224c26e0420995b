"""The fused MoE GEMM kernels: C[rows of one expert block] = A[rows] @ dequant(B[expert])^T with
the layer's epilogue (scales, bias, router weight, gated activation, row amax pieces).

- :func:`_fused_moe_kernel`: every variant, standard (aligned (token, k) pairs) and batched
  (per-expert slabs) formats; int8, fp8 or float dots.
- :func:`_fused_moe_swap_kernel`: the operands swapped for weights dequantised in registers
  (16-bit activations, standard format), so the dequantised tile is the dot's register operand.

Both are specialised on the weight type, scale kind and activation quantisation of
:class:`moe_registry_kernels.triton.variant.KernelVariant`; what follows from those (packing, the
zero code, the dot kind, weight groups per K tile) is derived in the kernel, and what the launcher
guarantees (:func:`moe_registry_kernels.triton.tile_config._fit_config`) is checked with
``tl.static_assert``. Weight tiles become dot operands through
:mod:`moe_registry_kernels.triton.dequant_ptx` and :mod:`moe_registry_kernels.triton.fp4_dequant`.
The launchers are in :mod:`moe_registry_kernels.triton.launch`.
"""

import triton
import triton.language as tl

from .chain import grid_release, grid_wait
from .dequant_ptx import (
    BF16_NIBBLE_OFFSET,
    _dequant_byte,
    _dequant_byte_pairs,
    _dequant_e4m3,
    _dequant_nibbles,
    _e8m0,
    _offset_zero,
    _raw_nibbles,
)
from .fp4_dequant import _dequant_e2m1
from .gemm_common import (
    _block_rows,
    _codes_by_reciprocal,
    _column_zero,
    _dot,
    _expert_weight_ptrs,
    _finish_tile,
    _group_scales,
    _groups_per_tile,
    _input_halves,
    _int4_as_int8_tile,
    _is_pow2,
    _k_range,
    _less_zero_point_terms,
    _one_token_input,
    _pair_factors,
    _program_block,
    _repeat_cols,
    _row,
    _scale_of,
    _tile_block_scales,
    _tile_scale_blocks,
    _token_halves,
    _weight_rows,
    _weight_scale2,
)
from .variant import dot_kind, float_w4a8, packed, zero_code


# token counts vary per call: not specialising on them keeps one compiled kernel for every M
@triton.jit(do_not_specialize=["num_valid", "rows_per_expert"])
def _fused_moe_kernel(
        # tensors
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zero_ptr, perm_ptr, bias_ptr, c_ptr,
        topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_num_tokens_ptr,
        amax_ptr, pair_ids_ptr,
        # sizes: C is [rows, N] = A [rows, K] @ B[e]^T; K_PACKED = K / 2 (its own argument so
        # Triton sees its divisibility and vectorises the byte loads); rows_per_expert is the
        # padded length of sorted_ids (standard) or the per-expert capacity T (batched);
        # amax_parts: columns of the row-amax pieces [rows, amax_parts] (see AMAX_OUT, A_SCALE_IN);
        # scale_rows: the rows A_SCALE_IN's per-tensor amax spans
        N, K, K_PACKED, num_valid, rows_per_expert, num_experts, amax_parts, scale_rows,
        # strides (last dimensions are contiguous; zero points share the scales' strides);
        # stride_cs steps between split-K partial outputs
        stride_am, stride_as_m, stride_as_k, stride_be, stride_bn, stride_se, stride_sn, stride_sk,
        stride_cm, stride_cs,
        # what the weights and activations are (see KernelVariant); COMPUTE is the 16-bit (or float32)
        # activation dtype the float dot runs in; W_GROUP: 0 without groups
        W_TYPE: tl.constexpr, HAS_ZERO: tl.constexpr, W_SCALE: tl.constexpr, W_GROUP: tl.constexpr,
        W_GROUP_N: tl.constexpr, A_QUANT: tl.constexpr, A_GROUP: tl.constexpr, COMPUTE: tl.constexpr,
        ASM_DEQUANT: tl.constexpr,
        # layer options; FUSE_ACT: C = act(gate) * up of this GEMM's [gate | up] outputs (N / 2
        # columns); SPLIT_K: program_id(2) sums its share of K into partial output number pid 2;
        # AMAX_OUT (with FUSE_ACT): also each stored row's max |C| over this tile, into
        # amax_ptr[row, pid_n]
        ACT_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTED_WEIGHT: tl.constexpr,
        TOP_K: tl.constexpr, BATCHED: tl.constexpr, ONE_PAIR_BLOCKS: tl.constexpr, WRITE_EMPTY: tl.constexpr,
        FUSE_ACT: tl.constexpr, SPLIT_K: tl.constexpr, AMAX_OUT: tl.constexpr,
        # A_SCALE_IN (one token's activations quantised per token or per tensor, ONE_PAIR_BLOCKS):
        # A holds the 16-bit input and the kernel quantises it, its scale the static one in
        # a_scale_ptr ("static") or found first from A's rows ("rows") or from GEMM1's row-amax
        # pieces in amax_ptr ("pieces"; pair_ids_ptr: the pairs' experts, [scale_rows]), so the
        # layer launches no quantisation kernel; "none": A holds codes, a_scale_ptr their scales.
        # SCALE_ROWS x SCALE_COLS: the tile that search reads a step; HW_FP8_CAST: see
        # _codes_by_reciprocal
        A_SCALE_IN: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HW_FP8_CAST: tl.constexpr,
        # tiles
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PDL: tl.constexpr,
        # W_SCALE2: a second-level weight scale per (expert, weight row), float32 [E, N] (NVFP4's global
        # scale), multiplied into the dot's result before the epilogue; E2M1_FOLDED, E2M1_SHIFT: FP4
        # tiles whose scales carry their unscale, holding 2^-E2M1_SHIFT times the weights, which the
        # result takes back (fp4_dequant's module note); E4M3_FOLDED: MX fp8 weights by the PTX of
        # dequant_ptx._e4m3_asm, their scales folded
        b_scale2_ptr, W_SCALE2: tl.constexpr, E2M1_FOLDED: tl.constexpr, E2M1_SHIFT: tl.constexpr,
        E4M3_FOLDED: tl.constexpr,
        # the groups each weight row's group (or MX) scales hold: ceil(K / W_GROUP), or more where padded
        scale_groups,
        # GROUP_DOTS: a tile spanning several weight groups takes one dot per group (see GROUPED)
        GROUP_DOTS: tl.constexpr = False,
        # ZERO_SUMS: zero-point weights on the factored dot, each A row's sum over each weight group
        # in row_sums_ptr [A rows, groups * SUM_PIECES] (row stride stride_rs; a group's sum in
        # SUM_PIECES consecutive pieces, as a GEMM1 with SUMS_OUT leaves them), or with
        # ONE_PAIR_BLOCKS found by the kernel from the block's one row (no row_sums_ptr), see FACTORED;
        # SUMS_OUT (with FUSE_ACT): also each stored row's sum over this tile, into amax_ptr[row, pid_n]
        row_sums_ptr=None, stride_rs=0, ZERO_SUMS: tl.constexpr = False, SUM_PIECES: tl.constexpr = 1,
        SUMS_OUT: tl.constexpr = False,
        # INPUT_HALVES: A stored as its even columns, then its odd ones (K / 2 each), as a GEMM1 with
        # HALVES_OUT (fused activation) stores its output: 4-bit tiles' nibble half-dots take each as
        # a load of its own instead of splitting the tile in registers (see tile_config.input_halves_fit)
        INPUT_HALVES: tl.constexpr = False, HALVES_OUT: tl.constexpr = False,
        # TILE_BLOCK_SCALE (fp8 dot on 128x128-block weights): the tile's weight rows lie in one block
        # (with FUSE_ACT its gate rows in one, its up rows in one), see _tile_scale_blocks
        TILE_BLOCK_SCALE: tl.constexpr = False):
    """C[rows of one expert block] = A[rows] @ dequant(B[expert])^T, with the epilogue of the
    layer: scales, + bias, × router weight (before bias on the input side, after on the output),
    and the gated activation when fused."""
    PACKED: tl.constexpr = packed(W_TYPE)  # two 4-bit codes per byte: low nibble column 2i, high 2i + 1
    W_ZERO: tl.constexpr = zero_code(W_TYPE)
    DOT: tl.constexpr = dot_kind(A_QUANT)
    W_GROUPS: tl.constexpr = _groups_per_tile(BLOCK_K, W_GROUP)  # scale groups per K tile
    W_ROWS: tl.constexpr = BLOCK_K // 2 if PACKED else BLOCK_K  # K rows of one weight tile
    NARROW: tl.constexpr = PACKED  # 4-bit codes: the offset trick works in 16 bits
    # what _fit_config and variant_from_keys guarantee
    tl.static_assert(_is_pow2(BLOCK_K) and _is_pow2(BLOCK_N) and BLOCK_N >= 32)
    tl.static_assert(not (BATCHED and ONE_PAIR_BLOCKS))
    tl.static_assert(FUSE_ACT == "none" or SPLIT_K == 1, "the activation needs whole sums")
    tl.static_assert(not (AMAX_OUT or SUMS_OUT) or FUSE_ACT != "none" and not (AMAX_OUT and SUMS_OUT),
                     "amax or sum pieces come from the fused activation")
    tl.static_assert(not PACKED or BLOCK_K >= 32, "each nibble half-dot needs K >= 16")
    tl.static_assert(not E4M3_FOLDED or ASM_DEQUANT and W_TYPE == "fp8e4m3" and W_SCALE == "mx",
                     "folded e4m3 scales are for MX fp8 weights through the PTX")
    tl.static_assert(W_SCALE != "group" and W_SCALE != "mx" and W_SCALE != "block"
                     or _is_pow2(W_GROUP) and (W_GROUP % BLOCK_K == 0 or BLOCK_K % W_GROUP == 0),
                     "a K tile holds whole weight groups or lies in one")
    tl.static_assert(W_SCALE != "block" or W_GROUP % BLOCK_K == 0, "a K tile lies in one weight block")
    tl.static_assert(DOT != "int8" or W_TYPE == "int8" and W_SCALE == "channel"
                     or W_TYPE == "uint4b8" and (W_SCALE == "channel" or W_SCALE == "group" and (
                         W_GROUP % BLOCK_K == 0 or GROUP_DOTS and float_w4a8(A_QUANT, W_TYPE, BLOCK_M))),
                     "int8 dots take int8 per-channel weights, or int4 (W4A8) with a K tile in one group "
                     "or (16-bit-dot tiles) one dot per group")
    tl.static_assert(DOT != "fp8" or W_TYPE == "fp8e4m3" and W_SCALE == "block" and A_GROUP % BLOCK_K == 0,
                     "a K tile lies in one activation group and one weight block")
    tl.static_assert(A_QUANT != "mxfp8" or BLOCK_K % A_GROUP == 0, "a K tile holds whole MX groups")
    tl.static_assert(DOT != "fp8_outer" or W_TYPE == "fp8e4m3" and W_SCALE == "channel",
                     "per-token/tensor fp8 activations take fp8 weights with per-channel/tensor scales")
    STATIC_INPUT: tl.constexpr = A_QUANT == "int8_static" or A_QUANT == "fp8_static"
    tl.static_assert(not INPUT_HALVES or PACKED and DOT == "float" and A_QUANT == "none" and not ACT_ORDER
                     and not ZERO_SUMS, "inputs in halves are for 4-bit weights' 16-bit half-dots")
    tl.static_assert(not HALVES_OUT or FUSE_ACT != "none", "halves are stored by the fused activation")
    tl.static_assert(A_SCALE_IN == "none" or (DOT == "int8" or DOT == "fp8_outer") and ONE_PAIR_BLOCKS
                     and not ACT_ORDER and (A_SCALE_IN == "static") == STATIC_INPUT,
                     "the GEMM quantises one token's input, per token or per tensor, in column order")
    grid_wait(PDL)
    pid_n, offs_m, expert, rows, k_end = _program_block(
        sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_num_tokens_ptr, N, K, num_valid,
        rows_per_expert, num_experts, TOP_K, BATCHED, ONE_PAIR_BLOCKS, WRITE_EMPTY, FUSE_ACT, BLOCK_M, BLOCK_N,
        GROUP_M)
    if expert < 0:
        return
    a_rows, c_rows, row_mask, store_rows = _block_rows(offs_m, expert, rows, num_valid, rows_per_expert, TOP_K,
                                                       BATCHED)
    split, k_lo, k_hi = _k_range(K, k_end, SPLIT_K, BLOCK_K)
    offs_bn = _weight_rows(pid_n, N, FUSE_ACT, BLOCK_N)
    if TILE_BLOCK_SCALE:
        block_even, block_odd = _tile_scale_blocks(pid_n, N, W_GROUP_N, FUSE_ACT, BLOCK_N)
    a_row_ptrs = a_ptr + a_rows.to(tl.int64) * stride_am
    b_cols, scale_cols, zero_cols = _expert_weight_ptrs(b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_bn, stride_be,
                                                        stride_bn, stride_se, stride_sn, 1)  # [1, BN]
    dtype = COMPUTE
    # the code of 0 (the type's bias, or per-column zero points) + the offset of _offset_codes
    zero = _column_zero(zero_cols, dtype, W_ZERO, HAS_ZERO, W_SCALE, NARROW)
    if A_SCALE_IN != "none":  # the block's one row, quantised a step at a time
        a_scale_in, a_reciprocal, a_one_row, a_next = _one_token_input(
            a_ptr, a_scale_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, k_lo, stride_am, scale_rows, amax_parts,
            num_experts, A_QUANT, DOT, A_SCALE_IN, BLOCK_M, BLOCK_K, SCALE_ROWS, SCALE_COLS)

    # decode tiles with per-group scales and no zero points, whose K tiles each lie in one group:
    # the tile's dot runs on code - zero (exact in 16 bits) and its result takes the group's scale,
    # so no weight is multiplied by a scale and each column's scale is loaded once per tile, not
    # once per weight. (Measured on an H100: faster at M <= 64 for GPTQ int4 and int8. With zero
    # points it was no faster (zeros subtracted per weight) or slower (corrected with the input's
    # row sums); on 64+ row tiles it breaks the wgmma chain every step.)
    PER_WEIGHT_SCALE: tl.constexpr = W_SCALE == "group" or W_SCALE == "mx" or W_SCALE == "block"
    FACTORED: tl.constexpr = (W_SCALE == "group" and DOT == "float" and W_GROUP % BLOCK_K == 0
                              and (not HAS_ZERO or ZERO_SUMS) and BLOCK_M <= 32)
    # ZERO_SUMS (a tile config's choice; tile_config.zero_sums_fit): zero-point weights take the
    # same factored dot, on code - MID (a constant, as for the types with a fixed zero code), and
    # the result then loses, for each group g, the rows' sums of the group's inputs (computed by
    # the layer before the GEMM) times s_g (z_g - MID), one small dot after the loop
    # (_less_zero_point_terms): sum_k a s (q - z) = sum_g s_g (sum_{k in g} a (q - MID) - (z_g - MID) sum_{k in g} a).
    # Subtracting each weight's loaded zero instead makes Triton convert the whole dequantised tile
    # through shared memory (offline sm_90 SASS, W8A16 asym at Mixtral's M = 64: 128 STS a step,
    # 0.27 warp instructions a weight against 0.17 without zero points). Taken in the loop (the
    # sums and zero points loaded a step) the groups' terms are slower (H100, Mixtral M = 64,
    # tools/bench.py: 681.8 us in the loop, 600.6-619.5 after it); the inputs' sums found in the
    # loop are slower still (a second dot with ones loses the input's pipelining, its operand
    # layout differing from the mixed-precision dot's).
    FACTORED_ZERO: tl.constexpr = (8 if PACKED else 128) if HAS_ZERO else W_ZERO  # the code the dot subtracts
    # GROUP_DOTS (a tile config's choice; tile_config.group_dot_width): the same for 4-bit tiles
    # that span several groups, one dot per group and each group's result taking its scale; a
    # row's groups are loaded a step ahead as one vector (two 16-bit scales or more). Offline
    # (sm_90 SASS, GPTQ int4 at M = 8 on Qwen3's shape, BLOCK_N 128, BLOCK_K 256), against the
    # same tile's per-weight scales: 6-12% fewer instructions a weight and 159-167 registers a
    # thread instead of 210-214. A config's choice, since it is not faster everywhere: on an H100
    # (tools/tune.py) the tuner picks it for GPTQ int4 at M = 8 on all three benchmark shapes and at
    # M = 64 on Qwen3's and DeepSeek-V2-Lite's (4-6% faster whole layers), not at M = 1 on Qwen3's.
    # W4A8 on few rows (variant.float_w4a8): a 16-bit dot of the codes, which the layer's quantisation
    # kernels store as 16-bit floats (int8 codes, where a caller passes them, are converted here)
    W4A8_FLOAT: tl.constexpr = float_w4a8(A_QUANT, W_TYPE, BLOCK_M)
    # (W4A8's 16-bit-dot tiles take them too: the codes' per-group dots are exact, and the token
    # scale goes on after the loop as for its int8 dot; a token the GEMM quantises itself is read
    # and quantised a group at a time; and zero-point weights with ZERO_SUMS, their dots of code -
    # MID corrected after the loop as the factored dot's are)
    GROUPED: tl.constexpr = (GROUP_DOTS and W_SCALE == "group" and (A_QUANT == "none" or W4A8_FLOAT) and PACKED
                             and (W_ZERO > 0 and not HAS_ZERO or ZERO_SUMS) and W_GROUPS > 1 and not ACT_ORDER
                             and BLOCK_M <= 32)
    tl.static_assert(not GROUPED or W_GROUP >= 32, "each group's nibble half-dot needs K >= 16")
    tl.static_assert(not ZERO_SUMS or (FACTORED or GROUPED) and (HAS_ZERO or PACKED and W_ZERO > 0),
                     "input sums are for zero points, or 4-bit codes of a fixed zero, on the factored dot or "
                     "per-group dots")
    if FACTORED or GROUPED:  # the offset code the factored (or per-group) dots' tiles subtract
        factored_zero = _offset_zero(tl.full((1, BLOCK_N), FACTORED_ZERO, tl.float32), dtype, NARROW)
    # bfloat16 4-bit ZERO_SUMS tiles go one step further: their dots run on the codes as the dequantisation's
    # lop3 leaves them, 128 + code (exact), and the terms after the loop take off z_g + 128 instead of
    # z_g - FACTORED_ZERO: no paired subtract a weight pair (offline sm_90 SASS, AWQ int4 at Qwen3's M = 8 on
    # 128x128 tiles: 362 -> 307 instructions a step, 148 -> 140 registers). The dot's sums grow by 128 times
    # the input's, which float32 accumulation holds (the products are exact). float16's offset is 1024: its
    # dots so lost accuracy (H200, int4 g128 codes: 3.3e-4 against 2.9e-4 from the layer's float32
    # reference), and keep the subtract. 4-bit codes of a fixed zero (GPTQ's uint4b8) take the same raw dots,
    # their terms (8 + 128) times each group's scale and input sum (sm_90 SASS, GPTQ int4 at Mixtral's M = 8
    # on its 128x256 tiles: 688 -> 572 instructions a step, 168 -> 143 registers; yet no faster there on an
    # H200, whose decode GEMMs wait on memory more than they issue: the tuner took it for Qwen3's GEMM1 at
    # M = 64 only); in float16 their terms would be zero (z = MID), and are not taken.
    RAW_CODES: tl.constexpr = ZERO_SUMS and PACKED and dtype == tl.bfloat16
    TERMS_MID: tl.constexpr = -BF16_NIBBLE_OFFSET if RAW_CODES else FACTORED_ZERO
    ZERO_TERMS: tl.constexpr = ZERO_SUMS and (HAS_ZERO or RAW_CODES)
    # W4A8 with group scales: each K tile's int32 dot takes its group's scale (a K tile lies in one
    # group), or each group's dot its own (GROUPED)
    INT8_GROUPS: tl.constexpr = DOT == "int8" and W_SCALE == "group" and not GROUPED
    if DOT == "int8" and not INT8_GROUPS and not W4A8_FLOAT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # W4A8's 16-bit-dot tiles load their group scale a step ahead, as GROUPED tiles do (H100, Mixtral
    # M = 64: 0.90x the time); on 128-row int8 tiles that load spilled (M = 4096: 12.2 ms against 8.5)
    INT8_SCALE_AHEAD: tl.constexpr = INT8_GROUPS and W4A8_FLOAT
    if INT8_SCALE_AHEAD:  # the first step's (each step loads the next one's)
        int8_scale_next = tl.load(scale_cols + (k_lo // W_GROUP) * stride_sk)
    if GROUPED:  # the first step's group scales (each step loads the next one's)
        scales_next, _ = _group_scales(scale_cols, zero_cols, zero, k_lo, scale_groups, stride_sk, tl.float32, W_SCALE,
                                       W_GROUP, W_GROUPS, False, NARROW, 0, W_GROUPS)
    for k_start in range(k_lo, k_hi, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_cols = offs_k
        if ACT_ORDER:  # stored weight column j multiplies input column perm[j]
            a_cols = tl.load(perm_ptr + expert * K + offs_k, mask=k_mask, other=0)
        if A_SCALE_IN != "none" and not GROUPED:  # the codes a quantisation kernel would have stored
            a_row = _codes_by_reciprocal(a_next.to(tl.float32), a_scale_in, a_reciprocal, DOT, HW_FP8_CAST)
            a_next = tl.load(a_one_row + BLOCK_K + offs_k, mask=BLOCK_K + offs_k < K, other=0.0)
            a = tl.broadcast_to(a_row[None, :], (BLOCK_M, BLOCK_K))
        elif not GROUPED and not INPUT_HALVES:  # (grouped tiles load theirs a group at a time)
            a = tl.load(a_row_ptrs[:, None] + a_cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if A_QUANT == "mxfp8":
            a_groups = k_start // A_GROUP + tl.arange(0, BLOCK_K // A_GROUP)
            a_exp = tl.load(a_scale_ptr + a_rows[:, None] * stride_as_m + a_groups[None, :] * stride_as_k,
                            mask=row_mask[:, None] & (a_groups[None, :] < tl.cdiv(K, A_GROUP)), other=127)
            a = (a.to(tl.float32) * _repeat_cols(_e8m0(a_exp), BLOCK_K)).to(dtype)

        # the weight tile's scale (and zero) groups: one load per group and column
        tile_zero = zero
        if GROUPED:  # [W_GROUPS, BN] float32, loaded a step ago
            scales = scales_next
            scales_next, _ = _group_scales(scale_cols, zero_cols, zero, k_start + BLOCK_K, scale_groups, stride_sk,
                                           tl.float32, W_SCALE, W_GROUP, W_GROUPS, False, NARROW, 0, W_GROUPS)
        elif INT8_SCALE_AHEAD:  # [1, BN], loaded a step ago; the last step reloads its own group
            scale = int8_scale_next.to(tl.float32)
            next_group = tl.minimum((k_start + BLOCK_K) // W_GROUP, scale_groups - 1)
            int8_scale_next = tl.load(scale_cols + next_group * stride_sk)
        elif FACTORED or INT8_GROUPS:
            group = k_start // W_GROUP
            scale = _scale_of(tl.load(scale_cols + group * stride_sk)).to(tl.float32)  # [1, BN]
        elif W_SCALE == "group" or W_SCALE == "mx":
            scale, tile_zero = _group_scales(scale_cols, zero_cols, zero, k_start, scale_groups, stride_sk, dtype,
                                             W_SCALE, W_GROUP, W_GROUPS, HAS_ZERO, NARROW, 0, W_ROWS,
                                             E2M1_FOLDED, E2M1_SHIFT, E4M3_FOLDED, ASM_DEQUANT)
        elif TILE_BLOCK_SCALE:  # the tile's one or two block scales, as scalars
            scale_even, scale_odd = _tile_block_scales(b_scale_ptr + expert * stride_se + (k_start // W_GROUP)
                                                       * stride_sk, block_even, block_odd, stride_sn, FUSE_ACT)
        elif W_SCALE == "block":  # one [W_GROUP_N x W_GROUP] block per scale; BLOCK_K <= W_GROUP
            scale = tl.load(b_scale_ptr + expert * stride_se + (offs_bn[None, :] // W_GROUP_N) * stride_sn
                            + (k_start // W_GROUP) * stride_sk)
        else:
            scale = 1.0  # none, or per channel: applied after the loop

        if GROUPED:  # one dot per weight group (code - zero, exact in 16 bits), its scale on the result
            for g in tl.static_range(W_GROUPS):
                offs_kp = k_start // 2 + g * (W_GROUP // 2) + tl.arange(0, W_GROUP // 2)
                group_codes = tl.load(b_cols + offs_kp[:, None], mask=offs_kp[:, None] < K_PACKED, other=0)
                cols = k_start + g * W_GROUP + tl.arange(0, W_GROUP)
                if A_SCALE_IN != "none":  # the token's group, quantised, split, then repeated down the tile
                    token = tl.load(a_one_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                    codes = _codes_by_reciprocal(token, a_scale_in, a_reciprocal, DOT, HW_FP8_CAST).to(dtype)
                    a_even, a_odd = _token_halves(codes, BLOCK_M)
                elif INPUT_HALVES:
                    a_even, a_odd = _input_halves(a_row_ptrs, row_mask, (k_start + g * W_GROUP) // 2, K_PACKED,
                                                  W_GROUP // 2)
                else:
                    a_group = tl.load(a_row_ptrs[:, None] + cols[None, :],
                                      mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)
                    a_even, a_odd = tl.split(tl.reshape(a_group.to(dtype), (BLOCK_M, W_GROUP // 2, 2)))
                if RAW_CODES:
                    low, high = _raw_nibbles(group_codes, dtype, W_TYPE == "int4", ASM_DEQUANT)
                else:
                    low, high = _dequant_nibbles(group_codes, factored_zero, 1.0, dtype, W_TYPE == "int4",
                                                 ASM_DEQUANT, False)
                part = _dot(a_even, low, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                part = _dot(a_odd, high, part)
                acc += part * _row(scales, g)
        elif PACKED:  # each byte loaded and unpacked once: low nibble column 2i, high 2i + 1
            offs_kp = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            packed_codes = tl.load(b_cols + offs_kp[:, None], mask=offs_kp[:, None] < K_PACKED, other=0)
            if A_SCALE_IN != "none":  # the token's row split before it is repeated down the tile
                if W4A8_FLOAT:  # and its codes made 16-bit floats (exact) once, not once per repeat
                    a_row = a_row.to(dtype)
                a_even, a_odd = _token_halves(a_row, BLOCK_M)
            elif INPUT_HALVES:
                a_even, a_odd = _input_halves(a_row_ptrs, row_mask, k_start // 2, K_PACKED, BLOCK_K // 2)
            else:
                a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            if W4A8_FLOAT:  # W4A8 on few rows: code - 8 in 16 bits, a float dot of the int8 codes (exact)
                low, high = _dequant_nibbles(packed_codes, zero, 1.0, dtype, False, ASM_DEQUANT, False)
                part = _dot(a_even.to(dtype), low, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                part = _dot(a_odd.to(dtype), high, part)
                if INT8_GROUPS:
                    part = part * scale
                acc += part
            elif DOT == "int8":  # W4A8: int4 codes as int8 in K order, one int8 dot (int32)
                part = tl.dot(a, _int4_as_int8_tile(packed_codes, BLOCK_K, BLOCK_N, ASM_DEQUANT),
                              tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32), out_dtype=tl.int32)
                if INT8_GROUPS:
                    acc += part.to(tl.float32) * scale
                else:
                    acc += part
            elif W_TYPE == "e2m1":  # FP4 codes (fp4_dequant): never FACTORED (mx or 16-column groups)
                low, high = _dequant_e2m1(packed_codes, scale, dtype, ASM_DEQUANT, E2M1_FOLDED)
                acc = _dot(a_even, low, acc)
                acc = _dot(a_odd, high, acc)
            elif FACTORED:
                if RAW_CODES:
                    low, high = _raw_nibbles(packed_codes, dtype, W_TYPE == "int4", ASM_DEQUANT)
                else:
                    low, high = _dequant_nibbles(packed_codes, factored_zero, 1.0, dtype, W_TYPE == "int4",
                                                 ASM_DEQUANT, False)
                part = _dot(a_even, low, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                part = _dot(a_odd, high, part)
            else:
                low, high = _dequant_nibbles(packed_codes, tile_zero, scale, dtype, W_TYPE == "int4", ASM_DEQUANT)
                acc = _dot(a_even, low, acc)
                acc = _dot(a_odd, high, acc)
        else:
            b = tl.load(b_cols + offs_k[:, None], mask=k_mask[:, None], other=0.0)
            if DOT == "int8":
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            elif DOT == "fp8_outer":  # fp8 x fp8 into float32; token and channel scales after the loop
                acc = tl.dot(a, b, acc)
            elif DOT == "fp8":
                a_scale = tl.load(a_scale_ptr + a_rows * stride_as_m + (k_start // A_GROUP) * stride_as_k,
                                  mask=row_mask, other=0.0)
                if TILE_BLOCK_SCALE:
                    acc += tl.dot(a, b) * _pair_factors(a_scale, scale_even, scale_odd, BLOCK_N, FUSE_ACT, False)
                else:
                    acc += tl.dot(a, b) * a_scale[:, None] * scale
            else:
                if W_TYPE != "float":  # 8-bit codes; FACTORED: the scale goes on the dot's result
                    codes = b.to(tl.uint8, bitcast=True)
                    if FACTORED:
                        b = _dequant_byte(codes, factored_zero, 1.0, dtype, W_TYPE, ASM_DEQUANT, False)
                    elif E4M3_FOLDED:
                        b = _dequant_e4m3(codes, scale, dtype)
                    else:
                        b = _dequant_byte(codes, tile_zero, scale, dtype, W_TYPE, ASM_DEQUANT, PER_WEIGHT_SCALE)
                if FACTORED:
                    part = _dot(a.to(dtype), b.to(dtype), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                else:
                    acc = _dot(a.to(dtype), b.to(dtype), acc)
        if FACTORED:
            acc += part * scale

    grid_release(PDL)  # the main loop is done: the next kernel may be scheduled
    # epilogue
    acc = acc.to(tl.float32)
    if ZERO_TERMS:  # (one-pair blocks sum their one row themselves)
        one_row = a_ptr + tl.max(tl.where(row_mask, a_rows, 0), axis=0).to(tl.int64) * stride_am
        acc = _less_zero_point_terms(acc, row_sums_ptr, stride_rs, one_row, a_rows, row_mask, scale_cols, zero_cols,
                                     stride_sk, scale_groups, k_lo, k_hi, K, W_GROUP, TERMS_MID, SUM_PIECES,
                                     ONE_PAIR_BLOCKS, HAS_ZERO, W_ZERO)
    if A_SCALE_IN != "none":
        acc *= a_scale_in
    elif DOT == "int8" or DOT == "fp8_outer":  # per token (or per tensor: stride 0)
        acc *= tl.load(a_scale_ptr + a_rows * stride_as_m, mask=row_mask, other=0.0)[:, None]
    acc = _weight_scale2(acc, b_scale2_ptr, expert, N, offs_bn, W_SCALE2, E2M1_SHIFT, 1)
    _finish_tile(acc, expert, c_rows, row_mask, store_rows, offs_bn, pid_n, split, N, scale_cols, bias_ptr,
                 topk_weights_ptr, c_ptr, stride_cm, stride_cs, W_SCALE, ROUTED_WEIGHT, HAS_BIAS, WRITE_EMPTY,
                 FUSE_ACT, BLOCK_M, BLOCK_N, amax_ptr, amax_parts,
                 "amax" if AMAX_OUT else "sum" if SUMS_OUT else "none", HALVES_OUT)


@triton.jit(do_not_specialize=["num_valid", "rows_per_expert"])
def _fused_moe_swap_kernel(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zero_ptr, perm_ptr, bias_ptr, c_ptr, topk_weights_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
        N, K, K_PACKED, num_valid, rows_per_expert, num_experts,
        stride_am, stride_as_m, stride_as_k, stride_be, stride_bn, stride_se, stride_sn, stride_sk, stride_cm,
        stride_cs,
        W_TYPE: tl.constexpr, HAS_ZERO: tl.constexpr, W_SCALE: tl.constexpr, W_GROUP: tl.constexpr,
        W_GROUP_N: tl.constexpr, A_QUANT: tl.constexpr, A_GROUP: tl.constexpr,
        COMPUTE: tl.constexpr, ASM_DEQUANT: tl.constexpr, BYTE_PAIRS: tl.constexpr, ACT_ORDER: tl.constexpr,
        HAS_BIAS: tl.constexpr, ROUTED_WEIGHT: tl.constexpr, TOP_K: tl.constexpr, ONE_PAIR_BLOCKS: tl.constexpr,
        FUSE_ACT: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PDL: tl.constexpr, b_scale2_ptr, W_SCALE2: tl.constexpr, E2M1_FOLDED: tl.constexpr,
        E2M1_SHIFT: tl.constexpr, E4M3_FOLDED: tl.constexpr, scale_groups,
        # one token's fp8 input quantised by the GEMM itself, and GEMM1's row-amax pieces for GEMM2's: as
        # _fused_moe_kernel's A_SCALE_IN (input_rows: its scale_rows) and AMAX_OUT
        amax_ptr=None, pair_ids_ptr=None, amax_parts=0, input_rows=0, A_SCALE_IN: tl.constexpr = "none",
        SCALE_ROWS: tl.constexpr = 1, SCALE_COLS: tl.constexpr = 16, HW_FP8_CAST: tl.constexpr = False,
        AMAX_OUT: tl.constexpr = False, TILE_BLOCK_SCALE: tl.constexpr = False):
    """_fused_moe_kernel with the operands swapped, for weights dequantised in registers (16-bit
    activations, standard format): each step computes dequant(W tile) [BLOCK_N, K] @ A^T [K,
    BLOCK_M], so the dequantised weights are the left operand of the dot, which the matrix unit
    reads from registers, instead of the right one it reads through shared memory (on Hopper the
    dot then runs asynchronously while the next tile is dequantised, where the right operand
    would wait for it); the token rows become the dot's N side. 4-bit tiles are interleaved back
    into K order after unpacking, so the activations load as one contiguous, pipelined tile.
    fp8 weights with fp8 activations (A_QUANT: codes, their scales in a_scale_ptr, as for
    _fused_moe_kernel's fp8 and fp8_outer dots) take the matrix unit's own fp8 dot, both operands
    read as they are (K-major, as Hopper's fp8 wgmma wants them): the weights its 64-row side, so
    a few tokens fill no 16-row tile of their own and no code is widened to 16 bits first; one
    token's input the GEMM may quantise itself (A_SCALE_IN), its codes repeated across the dot's
    token side. BYTE_PAIRS: 8-bit weights take the same route, two columns per 16-bit word (loaded whole
    into the dot's operand layout, ptxas serialises the matrix unit on sm_90: warning C7515). Same
    arguments and results as _fused_moe_kernel (the tile is transposed back before the epilogue)."""
    PACKED: tl.constexpr = packed(W_TYPE)
    W_ZERO: tl.constexpr = zero_code(W_TYPE)
    W_GROUPS: tl.constexpr = _groups_per_tile(BLOCK_K, W_GROUP)
    W_COLS: tl.constexpr = BLOCK_K // 2 if PACKED or BYTE_PAIRS else BLOCK_K  # weight columns per load
    PER_WEIGHT_SCALE: tl.constexpr = W_SCALE == "group" or W_SCALE == "mx"
    NARROW: tl.constexpr = PACKED
    DOT: tl.constexpr = dot_kind(A_QUANT)
    # what _fit_config (swappable variants) guarantees
    tl.static_assert(_is_pow2(BLOCK_K) and _is_pow2(BLOCK_N) and BLOCK_N >= 32)
    tl.static_assert(DOT == "float" or DOT == "fp8_outer" or DOT == "fp8", "16-bit or fp8 activations")
    tl.static_assert(W_SCALE != "block" or DOT == "fp8", "128x128 blocks take fp8 activations")
    tl.static_assert(DOT != "fp8" or W_TYPE == "fp8e4m3" and W_SCALE == "block" and A_GROUP % BLOCK_K == 0
                     and W_GROUP % BLOCK_K == 0, "a K tile lies in one activation group and one weight block")
    tl.static_assert(DOT != "fp8_outer" or W_TYPE == "fp8e4m3" and W_SCALE == "channel",
                     "per-token/tensor fp8 activations take fp8 weights with per-channel/tensor scales")
    tl.static_assert(DOT == "float" or not BYTE_PAIRS, "fp8 dots read the codes as they are")
    tl.static_assert(A_SCALE_IN == "none" or DOT == "fp8_outer" and ONE_PAIR_BLOCKS and not ACT_ORDER,
                     "the GEMM quantises one token's input, per token or per tensor, in column order")
    tl.static_assert(not AMAX_OUT or FUSE_ACT != "none", "amax pieces come from the fused activation")
    tl.static_assert(FUSE_ACT == "none" or SPLIT_K == 1, "the activation needs whole sums")
    tl.static_assert(not BYTE_PAIRS or W_TYPE != "float", "byte pairs are 1-byte codes (4-bit: PACKED wins)")
    tl.static_assert(not PACKED or BLOCK_K >= 32, "each nibble half-dot needs K >= 16")
    tl.static_assert(not E4M3_FOLDED or ASM_DEQUANT and W_TYPE == "fp8e4m3" and W_SCALE == "mx",
                     "folded e4m3 scales are for MX fp8 weights through the PTX")
    tl.static_assert(W_SCALE != "group" and W_SCALE != "mx"
                     or _is_pow2(W_GROUP) and (W_GROUP % BLOCK_K == 0 or BLOCK_K % W_GROUP == 0),
                     "a K tile holds whole weight groups or lies in one")
    grid_wait(PDL)
    pid_n, offs_m, expert, rows, k_end = _program_block(
        sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, sorted_ids_ptr, N, K, num_valid, rows_per_expert,
        num_experts, TOP_K, False, ONE_PAIR_BLOCKS, False, FUSE_ACT, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    a_rows, c_rows, row_mask, store_rows = _block_rows(offs_m, expert, rows, num_valid, rows_per_expert, TOP_K, False)
    split, k_lo, k_hi = _k_range(K, k_end, SPLIT_K, BLOCK_K)
    offs_bn = _weight_rows(pid_n, N, FUSE_ACT, BLOCK_N)
    if TILE_BLOCK_SCALE:
        block_even, block_odd = _tile_scale_blocks(pid_n, N, W_GROUP_N, FUSE_ACT, BLOCK_N)
    a_col_ptrs = a_ptr + a_rows.to(tl.int64)[None, :] * stride_am  # [1, BM]: A^T's columns
    w_rows, scale_rows, zero_rows = _expert_weight_ptrs(b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_bn, stride_be,
                                                        stride_bn, stride_se, stride_sn, 0)  # [BN, 1]
    dtype = COMPUTE
    zero = _column_zero(zero_rows, dtype, W_ZERO, HAS_ZERO, W_SCALE, NARROW)
    if A_SCALE_IN != "none":  # the block's one row, quantised a step at a time
        a_scale_in, a_reciprocal, a_one_row, a_next = _one_token_input(
            a_ptr, a_scale_ptr, amax_ptr, pair_ids_ptr, a_rows, row_mask, K, k_lo, stride_am, input_rows, amax_parts,
            num_experts, A_QUANT, DOT, A_SCALE_IN, BLOCK_M, BLOCK_K, SCALE_ROWS, SCALE_COLS)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k_start in range(k_lo, k_hi, BLOCK_K):
        tile_zero = zero
        if W_SCALE == "group" or W_SCALE == "mx":
            scale, tile_zero = _group_scales(scale_rows, zero_rows, zero, k_start, scale_groups, stride_sk, dtype,
                                             W_SCALE, W_GROUP, W_GROUPS, HAS_ZERO, NARROW, 1, W_COLS,
                                             E2M1_FOLDED, E2M1_SHIFT, E4M3_FOLDED, ASM_DEQUANT)
        else:
            scale = 1.0  # none, or per channel: applied after the loop

        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if DOT != "float":  # fp8 codes straight into the fp8 dot
            b = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        elif PACKED:  # low nibbles hold even input columns, high nibbles odd ones: interleaved back
            offs_kp = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            packed_codes = tl.load(w_rows + offs_kp[None, :], mask=offs_kp[None, :] < K_PACKED, other=0)
            if W_TYPE == "e2m1":  # FP4 codes (fp4_dequant)
                low, high = _dequant_e2m1(packed_codes, scale, dtype, ASM_DEQUANT, E2M1_FOLDED)
            else:
                low, high = _dequant_nibbles(packed_codes, tile_zero, scale, dtype, W_TYPE == "int4", ASM_DEQUANT)
            b = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
        elif BYTE_PAIRS:  # 8-bit weights read as 16-bit words of two columns, split like nibbles
            offs_kp = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            words = tl.load(w_rows.to(tl.pointer_type(tl.uint16)) + offs_kp[None, :],
                            mask=offs_kp[None, :] < K // 2, other=0)
            if E4M3_FOLDED:
                even, odd = _dequant_e4m3(words, scale, dtype, True)
            elif ASM_DEQUANT and W_TYPE != "fp8e4m3":
                even, odd = _dequant_byte_pairs(words, tile_zero, scale, dtype, W_TYPE == "int8", PER_WEIGHT_SCALE)
            else:
                even = _dequant_byte((words & 0xFF).to(tl.uint8), tile_zero, scale, dtype, W_TYPE, False,
                                     PER_WEIGHT_SCALE)
                odd = _dequant_byte((words >> 8).to(tl.uint8), tile_zero, scale, dtype, W_TYPE, False,
                                    PER_WEIGHT_SCALE)
            b = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
        else:
            b = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            if E4M3_FOLDED:
                b = _dequant_e4m3(b.to(tl.uint8, bitcast=True), scale, dtype)
            elif W_TYPE != "float":
                b = _dequant_byte(b.to(tl.uint8, bitcast=True), tile_zero, scale, dtype, W_TYPE, ASM_DEQUANT,
                                  PER_WEIGHT_SCALE)
        a_cols = offs_k
        if ACT_ORDER:
            a_cols = tl.load(perm_ptr + expert * K + offs_k, mask=k_mask, other=0)
        if A_SCALE_IN != "none":  # the codes a quantisation kernel would have stored, down the token side
            a_row = _codes_by_reciprocal(a_next.to(tl.float32), a_scale_in, a_reciprocal, DOT, HW_FP8_CAST)
            a_next = tl.load(a_one_row + BLOCK_K + offs_k, mask=BLOCK_K + offs_k < K, other=0.0)
            a_t = tl.broadcast_to(a_row[:, None], (BLOCK_K, BLOCK_M))
        else:
            a_t = tl.load(a_col_ptrs + a_cols[:, None], mask=row_mask[None, :] & k_mask[:, None], other=0.0)
        if DOT == "fp8_outer":  # token and channel scales after the loop
            acc = tl.dot(b, a_t, acc)
        elif DOT == "fp8":  # each weight row's block scale and each token's group scale on the K tile's dot
            a_scale = tl.load(a_scale_ptr + a_rows * stride_as_m + (k_start // A_GROUP) * stride_as_k,
                              mask=row_mask, other=0.0)
            if TILE_BLOCK_SCALE:
                scale_even, scale_odd = _tile_block_scales(b_scale_ptr + expert * stride_se + (k_start // W_GROUP)
                                                           * stride_sk, block_even, block_odd, stride_sn, FUSE_ACT)
                acc += tl.dot(b, a_t) * _pair_factors(a_scale, scale_even, scale_odd, BLOCK_N, FUSE_ACT, True)
            else:
                w_scale = tl.load(b_scale_ptr + expert * stride_se + (offs_bn[:, None] // W_GROUP_N) * stride_sn
                                  + (k_start // W_GROUP) * stride_sk)
                acc += tl.dot(b, a_t) * w_scale * a_scale[None, :]
        else:
            acc = _dot(b.to(dtype), a_t.to(dtype), acc)

    grid_release(PDL)
    if A_SCALE_IN != "none":
        acc *= a_scale_in
    elif DOT == "fp8_outer":  # per token (or per tensor: stride 0), down the tile's token columns
        acc *= tl.load(a_scale_ptr + a_rows * stride_as_m, mask=row_mask, other=0.0)[None, :]
    acc = _weight_scale2(acc, b_scale2_ptr, expert, N, offs_bn, W_SCALE2, E2M1_SHIFT, 0)  # weight rows down
    _, scale_cols, _ = _expert_weight_ptrs(b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_bn, stride_be, stride_bn,
                                           stride_se, stride_sn, 1)
    _finish_tile(tl.trans(acc), expert, c_rows, row_mask, store_rows, offs_bn, pid_n, split, N, scale_cols,
                 bias_ptr, topk_weights_ptr, c_ptr, stride_cm, stride_cs, W_SCALE, ROUTED_WEIGHT, HAS_BIAS,
                 False, FUSE_ACT, BLOCK_M, BLOCK_N, amax_ptr if AMAX_OUT else c_ptr, amax_parts,
                 "amax" if AMAX_OUT else "none")
