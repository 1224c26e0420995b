"""Decode GEMMs with int8 activations on int4 (W4A8) or int8 weights as a GEMV on four-way integer
dot products (dp4a): a program per (token, expert) pair and column tile at decode (or per block of
aligned pairs of one expert), where each expert a step reads takes few of its pairs.

A one-token GEMM is a matrix-vector product: the tile kernels (:mod:`moe_registry_kernels.triton.gemm`)
pad the token to a 16-row matrix-unit tile and move its row into the operand layout through
shared memory every K step, and at M = 1 they were held by instructions and latency, not by
memory (H100, Qwen3-30B-A3B W4A8: 20.7 us of GEMMs for 18.9 MB of weights, 0.9 TB/s). Here each
thread streams whole 32-bit words of codes and takes their products with the token's int8 codes
four at a time (``dp4a``, int32): an int4 word is 8 codes, its low nibbles the even columns, its
high nibbles the odd ones (the converted layout, see ``KernelVariant.weight_type`` uint4b8), each
moved into the top of its byte so that the byte reads 16 * (code - 8) as int8 (the offset
binary's top bit flipped: no subtraction, the 16 leaves with the token's scale); int8 words are
4 codes as they are.

The GEMV reads its input as the codes ``activation_quant.act_quant`` wrote just before it (per token or
static, its rows' codes for int4 words in nibble halves: even columns, then odd ones). (Each GEMV
program quantising its row itself into one shared buffer ran the layer 1.6-1.9x slower than the
tile kernels on Mixtral's shape, H100, tools/bench.py: thousands of programs writing the same
few kilobytes.) Per-group weight scales multiply each group's int32
sum; per-channel ones, the bias, the router weight and the fused activation are the tile
kernels' epilogue (:func:`gemm_common._finish_tile`).
"""

import triton
import triton.language as tl

from .chain import grid_release, grid_wait
from .gemm_common import _block_pairs, _block_rows, _finish_tile, _scale_of, _weight_rows

# weight words one program reads of a row in one K step (512 int4 or 256 int8 columns), and the
# weight rows a program takes (a tile holds BLOCK_N / 2 gate rows and their up rows with a fused
# activation); measured on an H100 over 8-64 rows and 32-64 words a step (tools/bench.py --m 1 8)
STEP_WORDS = 64
BLOCK_N = 16
NUM_WARPS = 4
# 0xF0F0F0F0 and 0x80808080 as int32: each byte's high nibble, each byte's top bit
HIGH_NIBBLES = tl.constexpr(-0x0F0F0F10)
BYTE_SIGNS = tl.constexpr(-0x7F7F7F80)
# an int4 byte holds 16 * (code - 8) once its nibble is moved up (see the module note)
NIBBLE_UNIT = tl.constexpr(0.0625)


@triton.jit
def _dp4a(a, b, acc, PTX: tl.constexpr):
    """acc + the sum of the four products of the signed bytes of int32 words ``a`` and ``b``."""
    if PTX:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = acc
        for i in tl.static_range(4):  # byte i, sign-extended: to the top, then arithmetically down
            out += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    return out


@triton.jit
def _step(acc, w, x_words, row_mask, scale_ptrs, w0, x_word, k_words, stride_sk, PACKED: tl.constexpr,
          W_SCALE: tl.constexpr, GROUP_WORDS: tl.constexpr, PTX: tl.constexpr, MASKED: tl.constexpr):
    """``acc`` [BM, BN, groups, words] + one K step: the weight words ``w`` [1, BN, groups, words]
    from word ``w0`` of their rows times the block's rows' codes there (``x_words`` [BM, 1, 1, 1]:
    the rows' codes as words; ``row_mask`` [BM, 1, 1, 1]: the rows that hold a pair), each group's
    int32 sums times the group's scales (per channel: left to the epilogue). MASKED: the step runs
    past K (the words past it are zero). Every tile is built in the 4-D shape it is used in: a
    3-D one expanded after its load went through shared memory a step."""
    in_k = row_mask
    if MASKED:
        in_k = in_k & (w0 + x_word < k_words)
    if PACKED:
        even = tl.load(x_words + w0 + x_word, mask=in_k, other=0)
        odd = tl.load(x_words + k_words + w0 + x_word, mask=in_k, other=0)
        # low nibbles (even columns) and high nibbles (odd), each the top of its byte
        sums = _dp4a((w << 4) & HIGH_NIBBLES ^ BYTE_SIGNS, even, tl.zeros(acc.shape, tl.int32), PTX)
        sums = _dp4a(w & HIGH_NIBBLES ^ BYTE_SIGNS, odd, sums, PTX)
    else:
        x = tl.load(x_words + w0 + x_word, mask=in_k, other=0)
        sums = _dp4a(w, x, tl.zeros(acc.shape, tl.int32), PTX)
    if W_SCALE == "group":
        first = w0 // GROUP_WORDS
        if MASKED:
            groups = first + tl.arange(0, w.shape[2])[None, None, :, None]
            s = tl.load(scale_ptrs + first * stride_sk, mask=groups * GROUP_WORDS < k_words, other=0)
        else:
            s = tl.load(scale_ptrs + first * stride_sk)
        acc += sums.to(tl.float32) * _scale_of(s).to(tl.float32)
    else:
        acc += sums.to(tl.float32)
    return acc


@triton.jit
def _decode_gemv_kernel(
        codes_ptr, a_scales_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr,
        expert_ids_ptr, num_post_padded_ptr, N, K, num_valid, num_experts, stride_as, stride_be, stride_bn,
        stride_se, stride_sn, stride_sk, stride_cm,
        PACKED: tl.constexpr, W_SCALE: tl.constexpr, W_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROUTED_WEIGHT: tl.constexpr, TOP_K: tl.constexpr, FUSE_ACT: tl.constexpr, PTX: tl.constexpr,
        ONE_PAIR_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_WORDS: tl.constexpr,
        PDL: tl.constexpr):
    """C[rows of block ``program_id(0)``, column tile ``program_id(1)``]: the int32 dot products of
    the block's input rows' codes (codes [A rows, K] as activation_quant.act_quant wrote them, their
    scales a_scales_ptr[row * stride_as]: 0 for a static one) with its expert's weight rows a word at a time, each
    word read once for the block's BLOCK_M rows, through the tile kernels' epilogue. The blocks
    are the tile kernels' (gemm_common._block_pairs): aligned pairs of one expert, or ONE_PAIR_BLOCKS
    a pair each with the router's ids (BLOCK_M 1). The weights' K is a multiple of a word's codes
    and their rows start at word boundaries (launch._takes_gemv)."""
    CODES: tl.constexpr = 8 if PACKED else 4  # codes per weight word
    # a step's words as [groups, words of a group]: one scale per group and row (per-channel
    # weights: a step is one "group" of scale 1, their scale left to the epilogue)
    GROUP_WORDS: tl.constexpr = W_GROUP // CODES if W_SCALE == "group" else STEP_WORDS
    STEP_GROUPS: tl.constexpr = STEP_WORDS // GROUP_WORDS
    tl.static_assert(W_SCALE == "channel" or W_SCALE == "group" and W_GROUP % CODES == 0
                     and STEP_WORDS % GROUP_WORDS == 0, "a step holds whole weight groups of whole words")
    tl.static_assert(not ONE_PAIR_BLOCKS or BLOCK_M == 1, "one-pair blocks hold one row")
    # row blocks vary fastest: aligned blocks of one expert run side by side, and a weight tile
    # the second one reads is still in L2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # the router's ids or the alignment's blocks: written before the kernel this one follows
    # started (see the first load below)
    pairs, expert = _block_pairs(pid_m, offs_m, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, num_valid,
                                 num_experts, BLOCK_M, ONE_PAIR_BLOCKS)
    if expert < 0:  # past the aligned blocks, or another rank's expert
        return
    k_words = K // CODES
    offs_bn = _weight_rows(pid_n, N, FUSE_ACT, BLOCK_N)
    word = (tl.arange(0, STEP_GROUPS)[None, None, :, None] * GROUP_WORDS
            + tl.arange(0, GROUP_WORDS)[None, None, None, :])  # [1, 1, groups, words]
    w_ptrs = (b_ptr + expert * stride_be + offs_bn.to(tl.int64)[None, :, None, None] * stride_bn).to(
        tl.pointer_type(tl.int32)) + word  # [1, BN, groups, words]
    # the first step's weights (which no kernel writes) are on their way while the kernel before
    # this one (the quantisation, which waited for everything before it) drains
    w_next = tl.load(w_ptrs, mask=word < k_words, other=0)
    grid_wait(PDL)
    a_rows, c_rows, row_mask, store_rows = _block_rows(offs_m, expert, pairs, num_valid, 0, TOP_K, False)
    x_words = (codes_ptr + a_rows.to(tl.int64)[:, None, None, None] * K).to(tl.pointer_type(tl.int32))
    x_word = word
    rows_in = row_mask[:, None, None, None]
    scale_ptrs = (b_scale_ptr + expert * stride_se + offs_bn[None, :, None, None] * stride_sn
                  + tl.arange(0, STEP_GROUPS)[None, None, :, None] * stride_sk)  # [1, BN, groups, 1]

    # whole steps unmasked in K (the next one's weights loaded before this one's are used; the
    # last step loads itself again rather than past the row), then the masked rest of K
    whole = k_words // STEP_WORDS * STEP_WORDS
    acc = tl.zeros([BLOCK_M, BLOCK_N, STEP_GROUPS, GROUP_WORDS], tl.float32)
    for w0 in tl.range(0, whole, STEP_WORDS, num_stages=1):
        w = w_next
        w_next = tl.load(w_ptrs + tl.minimum(w0 + STEP_WORDS, whole - STEP_WORDS))
        acc = _step(acc, w, x_words, rows_in, scale_ptrs, w0, x_word, k_words, stride_sk, PACKED, W_SCALE,
                    GROUP_WORDS, PTX, False)
    if whole < k_words:
        w = tl.load(w_ptrs + whole, mask=whole + word < k_words, other=0)
        acc = _step(acc, w, x_words, rows_in, scale_ptrs, whole, x_word, k_words, stride_sk, PACKED, W_SCALE,
                    GROUP_WORDS, PTX, True)
    grid_release(PDL)

    scale = tl.load(a_scales_ptr + a_rows * stride_as, mask=row_mask, other=0.0)
    out = tl.sum(tl.sum(acc, axis=3), axis=2) * (scale * NIBBLE_UNIT if PACKED else scale)[:, None]
    scale_cols = b_scale_ptr + expert * stride_se + offs_bn[None, :] * stride_sn
    _finish_tile(out, expert, c_rows, row_mask, store_rows, offs_bn, pid_n, 0, N, scale_cols, bias_ptr,
                 topk_weights_ptr, c_ptr, stride_cm, 0, W_SCALE, ROUTED_WEIGHT, HAS_BIAS, False, FUSE_ACT, BLOCK_M,
                 BLOCK_N, c_ptr, 0, "none")
