"""Launchers of the GEMM kernels: one GEMM of the layer (:func:`_gemm`: the tile kernels, or the
decode GEMV, :func:`_gemv`), from a projection as the kernels hold it (``_Proj``), the rows each
expert owns (``_Rows``) and a tile config; the constexprs a launch derives from the variant, the
weights and the device.
"""

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import decode_gemv
from .activation_quant import act_quant
from .chain import pdl_launch
from .decode_gemv import _decode_gemv_kernel
from .dequant_ptx import _paired_halves, compiles_ptx, fp8_pair_convert
from .gemm import _fused_moe_kernel, _fused_moe_swap_kernel
from .layout import _Proj, _word_halves_for
from .variant import KernelVariant

# the activation quantisations a GEMM can do for one token (one scale per token or per tensor)
ONE_TOKEN_QUANTS = ("fp8_tensor", "fp8_token", "int8_token", "fp8_static", "int8_static")
STATIC_QUANTS = ("fp8_static", "int8_static")
SCALE_TILE = 8192


# per-token or static int8 activations on int4 (W4A8) or int8 weights at decode: both GEMMs run
# as decode_gemv's GEMV, each after a launch quantising its input rows, whatever the weights'
# size, while uniform routing would give the experts it hits at most GEMV_PAIRS_PER_EXPERT pairs
# each (the GEMV reads an expert's weights once a pair, the tile kernels once a block); past one
# token on blocks of GEMV_BLOCK_M aligned pairs, row blocks side by side so that a second pair's
# read of an expert finds it in L2. (H100, against the tile kernels: faster up to 1.24-1.46
# pairs an expert on the three benchmark shapes, slower from 1.53; blocks of 2 or 4 pairs slower
# than 1 everywhere: tools/bench.py --m 1 2 4 8 16). 16-bit activations keep the tile kernels at
# decode: without dp4a a GEMV takes a CUDA-core FMA and two integer operations per code, 0.19 warp
# instructions a weight against the tile kernels' 0.11 (sm_90 SASS, GPTQ at Mixtral's shape), and
# such a GEMV ran the GPTQ and AWQ layers 1.4-2.6x slower than the tile kernels (H200, M = 1 and 8 on
# the three benchmark shapes)
DECODE_GEMV = True
GEMV_BLOCK_M = 1
GEMV_QUANTS = ("int8_token", "int8_static")
GEMV_WEIGHTS = {"uint4b8": 8, "int8": 4}  # weight type -> codes per 32-bit word
GEMV_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class _RowSums:
    """A ZERO_SUMS GEMM's input sums: [A rows, groups * pieces] float32, each weight group's sum in
    ``pieces`` consecutive values (1: :func:`align.row_group_sums`; more: the per-tile sums a
    GEMM1 with ``sums_out`` left, see _gemm1_sum_pieces); None: the kernel finds them itself from
    each one-pair block's one row (one token: no launch, nothing left by GEMM1)."""

    sums: torch.Tensor | None
    pieces: int = 1


@dataclass(frozen=True)
class _Rows:
    """Which rows of A and C each expert owns: aligned pairs (standard) or per-expert slabs."""

    sorted_ids: torch.Tensor | None = None
    expert_ids: torch.Tensor | None = None
    num_post_padded: torch.Tensor | None = None
    num_valid: int = 0
    expert_num_tokens: torch.Tensor | None = None
    capacity: int = 0
    one_pair_blocks: bool = False  # expert_ids are the router's ids, a block per pair (one token)

    @property
    def batched(self) -> bool:
        return self.expert_num_tokens is not None


@dataclass(frozen=True)
class _InputScale:
    """A GEMM quantising one token's input itself (the kernel's A_SCALE_IN): at the static scale
    (``static``), or the dynamic scale from the first ``rows`` rows of A (``pieces`` None) or from
    GEMM1's row-amax ``pieces`` [pairs, column tiles] (per tensor: over the pairs ``pair_ids``
    routes to this rank's experts)."""

    rows: int
    pieces: torch.Tensor | None = None
    pair_ids: torch.Tensor | None = None
    static: bool = False
    gemv: bool = False  # the GEMM runs as decode_gemv's GEMV (_takes_gemv), each row at the static scale or its own

    @property
    def source(self) -> str:
        return "static" if self.static else "rows" if self.pieces is None else "pieces"

    def search_tile(self, width: int, block_m: int, per_token: bool) -> dict:
        """SCALE_ROWS x SCALE_COLS, at most SCALE_TILE values: whole rows of ``width`` where they
        fit (a step is a round trip to L2); per-token pieces take the tile's BLOCK_M rows."""
        if per_token and self.pieces is not None:
            return {"SCALE_ROWS": 1, "SCALE_COLS": min(triton.next_power_of_2(width), max(SCALE_TILE // block_m, 16))}
        cols = min(triton.next_power_of_2(width), SCALE_TILE)
        return {"SCALE_ROWS": max(1, min(SCALE_TILE // cols, triton.next_power_of_2(self.rows))), "SCALE_COLS": cols}


_NO_SCALE_SEARCH = {"A_SCALE_IN": "none", "SCALE_ROWS": 1, "SCALE_COLS": 16, "HW_FP8_CAST": False}


@functools.cache
def _hardware_fp8_cast(device: torch.device) -> bool:
    """Whether a kernel's float32 -> e4m3 cast is the GPU's saturating round-to-nearest-even
    conversion: not under the interpreter, whose cast rounds differently."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _byte_pairs(weight: torch.Tensor) -> bool:
    """Whether 8-bit weights [E, N, K] can be read as 16-bit words of two columns (even K and
    row strides, 2-byte aligned): the swapped kernel's route for them."""
    return (weight.element_size() == 1 and weight.shape[-1] % 2 == 0 and weight.data_ptr() % 2 == 0
            and weight.stride(-1) == 1 and all(s % 2 == 0 for s in weight.stride()[:-1]))


def _column_tiles(n: int, block_n: int, fuse_act: str) -> int:
    """Column tiles of a GEMM with N outputs (with a fused activation a tile holds BLOCK_N / 2
    gate rows and their up rows, so N / 2 columns come out)."""
    return triton.cdiv(n // 2, block_n // 2) if fuse_act != "none" else triton.cdiv(n, block_n)


def _gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: _Proj, variant: KernelVariant, c: torch.Tensor,
          rows: _Rows, config: dict, *, compute_dtype: torch.dtype, top_k: int = 1,
          routed_weight: str = "none", topk_weights: torch.Tensor | None = None, write_empty: bool = False,
          fuse_act: str = "none", amax_pieces: torch.Tensor | None = None, pdl: bool = False,
          input_scale: _InputScale | None = None, row_sums: _RowSums | None = None,
          sums_out: torch.Tensor | None = None, input_halves: bool = False, halves_out: bool = False) -> None:
    """Launch one fused MoE GEMM writing C (see _fused_moe_kernel): [rows, N], [rows, N / 2] with
    ``fuse_act``, or [SPLIT_K, rows, N] float32 partial sums when the config splits K.
    ``amax_pieces`` [rows, column tiles] (fused activation only): also write each row's max |C|
    per column tile there (see _amax_pieces_shape); ``pdl``: as part of a
    programmatic-dependent-launch chain; ``input_scale``: A is one token's 16-bit input, which
    the kernel quantises (``a_scale``: the static scale, else None); ``row_sums``: A's per-group row
    sums, given exactly where the config takes ZERO_SUMS (_zero_sums); ``sums_out`` [rows, column
    tiles] (fused activation only): also write each row's sum per column tile there (the next
    GEMM's row_sums, in pieces); ``input_halves``: A holds each row's even columns, then its odd ones
    (a config with INPUT_HALVES, tile_config.input_halves_fit); ``halves_out`` (fused activation only):
    write C so."""
    if w.perm is not None and variant.act_quant in ("fp8_group", "mxfp8"):
        raise ValueError("act-order weights cannot take group-quantised activations (their groups "
                         "follow the original column order)")
    if input_scale is not None and input_scale.gemv:
        if not _takes_gemv(variant, w) or rows.batched or (a_scale is not None) != input_scale.static \
                or amax_pieces is not None or row_sums is not None or sums_out is not None:
            raise ValueError("the decode GEMV takes int8 activations (a static scale given) on int4 or int8 weights "
                             "it can read as words, in the standard format, and leaves no pieces")
        _gemv(a, a_scale, w, variant, c, rows, top_k=top_k, routed_weight=routed_weight, topk_weights=topk_weights,
              fuse_act=fuse_act, pdl=pdl, pair_ids=input_scale.pair_ids)
        return
    bm, bn, split_k = config["BLOCK_M"], config["BLOCK_N"], config["SPLIT_K"]
    dummy = w.weight
    w = _word_halves_for(w, config)
    scale = w.scale if w.scale is not None else dummy
    if scale.dtype == torch.float8_e4m3fn:
        raise ValueError("NVFP4's e4m3 group scales reach the Triton GEMMs as exponent codes (uint8, "
                         "fp4_dequant.e4m3_scale_codes, as TritonExperts holds them), not as float8_e4m3fn")
    s_strides = (scale.stride(0), scale.stride(1), scale.stride(2)) if w.scale is not None else (0, 0, 0)
    if a_scale is None or a_scale.numel() == 1:
        as_strides = (0, 0)
    else:
        as_strides = (a_scale.stride(0), a_scale.stride(1) if a_scale.dim() == 2 else 0)
    n_tiles = _column_tiles(w.n, bn, fuse_act)
    if amax_pieces is not None and (fuse_act == "none" or amax_pieces.shape[1] != n_tiles):
        raise ValueError("row-amax pieces come from the fused-activation kernel, one per column tile")
    if input_scale is not None and (variant.act_quant not in ONE_TOKEN_QUANTS
                                    or not rows.one_pair_blocks or w.perm is not None
                                    or (a_scale is not None) != input_scale.static
                                    or input_scale.pieces is not None and amax_pieces is not None):
        raise ValueError("a GEMM quantises its own input for one token, per token or per tensor (a static "
                         "scale given), in column order, and not from pieces while it leaves pieces of its own")
    scale_search = _NO_SCALE_SEARCH
    if input_scale is not None:
        width = w.k if input_scale.pieces is None else input_scale.pieces.shape[1]
        scale_search = {"A_SCALE_IN": input_scale.source, "HW_FP8_CAST": _hardware_fp8_cast(a.device),
                        **input_scale.search_tile(width, bm, variant.act_quant != "fp8_tensor")}
    pieces = amax_pieces if amax_pieces is not None else input_scale.pieces if input_scale is not None else None
    if (row_sums is not None) != _zero_sums(config, w):
        raise ValueError("input row sums go with a ZERO_SUMS tile on weights in column order, and only there")
    if row_sums is not None and (row_sums.sums is None) != rows.one_pair_blocks:
        raise ValueError("a ZERO_SUMS GEMM finds its input sums itself on one-pair blocks (one token), and is "
                         "given them everywhere else")
    if sums_out is not None and (fuse_act == "none" or config["SWAP_AB"] or pieces is not None
                                 or sums_out.shape[1] != n_tiles):
        raise ValueError("row-sum pieces come from the fused-activation kernel, one per column tile, without amax "
                         "pieces")
    if sums_out is not None:
        pieces = sums_out
    if input_halves and (not config.get("INPUT_HALVES") or w.perm is not None):
        raise ValueError("an input in halves goes with an INPUT_HALVES tile on weights in column order")
    if halves_out and (fuse_act == "none" or config["SWAP_AB"] or w.n % 4):
        raise ValueError("halves are stored by the standard kernel's fused activation, of an even width")
    if rows.batched:
        rows_per_expert, expert_grid = rows.capacity, w.weight.shape[0]
    elif rows.one_pair_blocks:
        rows_per_expert, expert_grid = rows.expert_ids.numel() * bm, 1
    else:
        rows_per_expert, expert_grid = rows.sorted_ids.numel(), 1
    grid = (triton.cdiv(rows_per_expert, bm) * n_tiles, expert_grid, split_k)
    tile_block_scale = _tile_block_scale(variant, w.n, bn, fuse_act)
    sorted_ids = rows.sorted_ids if rows.sorted_ids is not None else dummy
    num_post_padded = rows.num_post_padded if rows.num_post_padded is not None else dummy
    asm = variant.paired_dequant and _paired_halves(a.device, compute_dtype)
    groups = scale.shape[2] if w.scale is not None and variant.weight_scale in ("group", "mx") else 0
    if config["SWAP_AB"]:
        _fused_moe_swap_kernel[grid](
            a, a_scale if a_scale is not None else dummy, w.weight, scale,
            w.zero if w.zero is not None else dummy, w.perm if w.perm is not None else dummy,
            w.bias if w.bias is not None else dummy, c, topk_weights if topk_weights is not None else dummy,
            sorted_ids, rows.expert_ids, num_post_padded,
            w.n, w.k, w.k // 2, rows.num_valid, rows_per_expert, w.weight.shape[0],
            a.stride(0), *as_strides, w.weight.stride(0), w.weight.stride(1), *s_strides, c.stride(-2),
            c.stride(0) if split_k > 1 else 0,
            W_TYPE=variant.weight_type, HAS_ZERO=w.zero is not None, W_SCALE=variant.weight_scale,
            W_GROUP=variant.weight_group, W_GROUP_N=variant.weight_group_n, A_QUANT=variant.act_quant,
            A_GROUP=max(variant.act_group, 1), COMPUTE=_TL_DTYPE[compute_dtype], ASM_DEQUANT=asm,
            BYTE_PAIRS=variant.dot == "float" and _byte_pairs(w.weight), ACT_ORDER=w.perm is not None,
            HAS_BIAS=w.bias is not None, ROUTED_WEIGHT=routed_weight, TOP_K=top_k,
            ONE_PAIR_BLOCKS=rows.one_pair_blocks, FUSE_ACT=fuse_act, SPLIT_K=split_k,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"],
            GROUP_M=config["GROUP_M"], PDL=pdl, scale_groups=groups, **_scale2_args(w, variant, dummy),
            **_e2m1_fold(w, variant, compute_dtype),
            E4M3_FOLDED=_e4m3_folded(w, variant, compute_dtype, asm, a.device),
            amax_ptr=pieces if pieces is not None else dummy,
            pair_ids_ptr=input_scale.pair_ids if input_scale is not None and input_scale.pair_ids is not None
            else dummy, amax_parts=pieces.shape[1] if pieces is not None else 0,
            input_rows=input_scale.rows if input_scale is not None else 0, AMAX_OUT=amax_pieces is not None,
            TILE_BLOCK_SCALE=tile_block_scale, **scale_search, **_launch_options(config), **pdl_launch(pdl))
        return
    _fused_moe_kernel[grid](
        a, a_scale if a_scale is not None else dummy, w.weight, scale,
        w.zero if w.zero is not None else dummy, w.perm if w.perm is not None else dummy,
        w.bias if w.bias is not None else dummy, c,
        topk_weights if topk_weights is not None else dummy,
        sorted_ids, rows.expert_ids if rows.expert_ids is not None else dummy, num_post_padded,
        rows.expert_num_tokens if rows.expert_num_tokens is not None else dummy,
        pieces if pieces is not None else dummy,
        input_scale.pair_ids if input_scale is not None and input_scale.pair_ids is not None else dummy,
        w.n, w.k, w.k // 2, rows.num_valid, rows_per_expert, w.weight.shape[0],
        pieces.shape[1] if pieces is not None else 0, input_scale.rows if input_scale is not None else 0,
        a.stride(0), *as_strides, w.weight.stride(0), w.weight.stride(1), *s_strides, c.stride(-2),
        c.stride(0) if split_k > 1 else 0,
        W_TYPE=variant.weight_type, HAS_ZERO=w.zero is not None, W_SCALE=variant.weight_scale,
        W_GROUP=variant.weight_group, W_GROUP_N=variant.weight_group_n, A_QUANT=variant.act_quant,
        A_GROUP=max(variant.act_group, 1), COMPUTE=_TL_DTYPE[compute_dtype], ASM_DEQUANT=asm,
        ACT_ORDER=w.perm is not None, HAS_BIAS=w.bias is not None, ROUTED_WEIGHT=routed_weight,
        TOP_K=top_k, BATCHED=rows.batched, ONE_PAIR_BLOCKS=rows.one_pair_blocks, WRITE_EMPTY=write_empty,
        FUSE_ACT=fuse_act, SPLIT_K=split_k, AMAX_OUT=amax_pieces is not None, **scale_search,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"], PDL=pdl,
        scale_groups=groups, **_scale2_args(w, variant, dummy), **_e2m1_fold(w, variant, compute_dtype),
        E4M3_FOLDED=_e4m3_folded(w, variant, compute_dtype, asm, a.device),
        GROUP_DOTS=config.get("GROUP_DOTS", False), INPUT_HALVES=input_halves, HALVES_OUT=halves_out,
        TILE_BLOCK_SCALE=tile_block_scale, **_row_sums_args(row_sums, sums_out), **_launch_options(config),
        **pdl_launch(pdl))


def _tile_block_scale(variant: KernelVariant, n: int, block_n: int, fuse_act: str) -> bool:
    """Whether each column tile's weight rows lie in one weight block (with a fused activation its gate
    rows in one and its up rows in one, N / 2 a whole number of blocks), so an fp8 dot's K step takes
    its block scales as scalars (_fused_moe_kernel's TILE_BLOCK_SCALE): a multiply-add a value where a
    vector of scales takes a multiply too. (Tiles start at multiples of their width, which divides the
    power-of-two block.)"""
    rows = block_n // 2 if fuse_act != "none" else block_n
    return (variant.dot == "fp8" and variant.weight_scale == "block" and rows <= variant.weight_group_n
            and variant.weight_group_n % rows == 0 and (fuse_act == "none" or n // 2 % variant.weight_group_n == 0))


def _takes_gemv(variant: KernelVariant, w: _Proj) -> bool:
    """Whether a decode GEMM given its 16-bit input runs as decode_gemv's GEMV, after a launch
    of act_quant of its own (DECODE_GEMV): int8 activations per token or static,
    int4 (W4A8) or int8 codes with no zero points in column order, per-channel scales or 16/32-bit
    group scales of whole words a group (at most a step's), and weight rows the kernel can read as
    aligned 32-bit words."""
    codes = GEMV_WEIGHTS.get(variant.weight_type)
    if not (DECODE_GEMV and codes and variant.act_quant in GEMV_QUANTS and w.zero is None and w.perm is None
            and w.scale is not None and w.scale.dtype in GEMV_SCALE_DTYPES):
        return False
    if variant.weight_scale == "group":
        group_words = variant.weight_group // codes
        if variant.weight_group % codes or decode_gemv.STEP_WORDS % group_words:
            return False
    elif variant.weight_scale != "channel":
        return False
    weight = w.weight
    return (w.k % codes == 0 and weight.stride(-1) == 1 and weight.data_ptr() % 4 == 0
            and all(stride * weight.element_size() % 4 == 0 for stride in weight.stride()[:-1]))


def _gemv(a: torch.Tensor, a_scale: torch.Tensor | None, w: _Proj, variant: KernelVariant, c: torch.Tensor,
          rows: _Rows, *,
          top_k: int, routed_weight: str, topk_weights: torch.Tensor | None, fuse_act: str, pdl: bool,
          pair_ids: torch.Tensor | None) -> None:
    """A decode GEMM as two launches: A's rows quantised to int8 codes by activation_quant.act_quant (at
    ``a_scale``, the static scale, or each row's own; int4 weights: in nibble halves; ``pair_ids``:
    A's rows are the pairs', these their experts, and a foreign pair's row is skipped), then
    decode_gemv's GEMV writing C [pairs, N] (or [pairs, N / 2] with ``fuse_act``), a program per
    (row block, column tile): one pair each (one token), or GEMV_BLOCK_M aligned pairs."""
    dummy = w.weight
    codes, a_scales = act_quant(a, "none", variant.act_quant, static_scale=a_scale, pdl=pdl,
                                           nibble_halves=variant.packed, pair_experts=pair_ids,
                                           num_experts=w.weight.shape[0])
    scale = w.scale
    group = variant.weight_scale == "group"
    grid = (rows.expert_ids.numel(), _column_tiles(w.n, decode_gemv.BLOCK_N, fuse_act))
    _decode_gemv_kernel[grid](
        codes, a_scales, w.weight, scale, w.bias if w.bias is not None else dummy, c,
        topk_weights if topk_weights is not None else dummy,
        rows.sorted_ids if rows.sorted_ids is not None else dummy, rows.expert_ids,
        rows.num_post_padded if rows.num_post_padded is not None else dummy, w.n, w.k, rows.num_valid,
        w.weight.shape[0], 0 if a_scale is not None else a_scales.stride(0), w.weight.stride(0), w.weight.stride(1),
        scale.stride(0), scale.stride(1), scale.stride(2) if group else 0, c.stride(-2), PACKED=variant.packed,
        W_SCALE=variant.weight_scale, W_GROUP=variant.weight_group, HAS_BIAS=w.bias is not None,
        ROUTED_WEIGHT=routed_weight, TOP_K=top_k, FUSE_ACT=fuse_act, PTX=compiles_ptx(a.device),
        ONE_PAIR_BLOCKS=rows.one_pair_blocks, BLOCK_M=1 if rows.one_pair_blocks else GEMV_BLOCK_M,
        BLOCK_N=decode_gemv.BLOCK_N, STEP_WORDS=decode_gemv.STEP_WORDS, PDL=pdl, num_warps=decode_gemv.NUM_WARPS,
        num_stages=1, **pdl_launch(pdl))


def _zero_sums(config: dict, w: _Proj) -> bool:
    """Whether a GEMM runs its zero points on the factored dot (the ZERO_SUMS key, which
    tile_config keeps where the tile can take it): for weights in column order (an act-order
    permutation would take each group's sums over permuted input columns)."""
    return bool(config.get("ZERO_SUMS")) and w.perm is None


def _row_sums_args(row_sums: _RowSums | None, sums_out: torch.Tensor | None) -> dict:
    args = {}
    if row_sums is not None:
        args |= {"ZERO_SUMS": True, "SUM_PIECES": row_sums.pieces}
    if row_sums is not None and row_sums.sums is not None:
        args |= {"row_sums_ptr": row_sums.sums, "stride_rs": row_sums.sums.stride(0)}
    if sums_out is not None:  # in the amax pieces' place (a GEMM leaves one or the other)
        args["SUMS_OUT"] = True
    return args


def _launch_options(config: dict) -> dict:
    """The compile options a tile config sets: warps, pipeline stages and, where a tuned entry
    caps it (``maxnreg``), the registers per thread (fewer registers, more programs per SM)."""
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    if config.get("maxnreg"):
        options["maxnreg"] = config["maxnreg"]
    return options


def _scale2_args(w: _Proj, variant: KernelVariant, dummy: torch.Tensor) -> dict:
    """The GEMM kernels' second-level weight scale arguments (NVFP4's global scale, [E, N] float32)."""
    if variant.weight_scale2 != (w.scale2 is not None):
        raise ValueError(f"weight key {'has' if variant.weight_scale2 else 'has no'} second-level scale, but the "
                         f"projection {'has none' if w.scale2 is None else 'has one'}")
    return {"b_scale2_ptr": w.scale2 if w.scale2 is not None else dummy, "W_SCALE2": variant.weight_scale2}


# FP4 tiles folded (fp4_dequant's module note): the power of two NVFP4 tiles leave to the result, and
# the e8m0 codes an MX scale may have, by activation dtype, for scale * 2^U to be a normal number
E2M1_E4M3_SHIFT = 8
E2M1_MX_FOLD_CODES = {torch.bfloat16: (0, 128), torch.float16: (99, 128)}


def _e2m1_fold(w: _Proj, variant: KernelVariant, compute_dtype: torch.dtype) -> dict:
    """Whether an FP4 GEMM's group scales carry the codes' unscale (one multiply a weight pair, not
    two; H100: see fp4_dequant), and the shift its result takes back. NVFP4's e4m3 scales always
    may; MX ones where every scale code is known to lie in E2M1_MX_FOLD_CODES."""
    if variant.weight_type != "e2m1" or compute_dtype not in E2M1_MX_FOLD_CODES:
        return {"E2M1_FOLDED": False, "E2M1_SHIFT": 0}
    if variant.weight_scale != "mx":  # e4m3 group scales, at most 448
        return {"E2M1_FOLDED": True, "E2M1_SHIFT": E2M1_E4M3_SHIFT}
    return {"E2M1_FOLDED": _scale_codes_within(w, E2M1_MX_FOLD_CODES[compute_dtype]), "E2M1_SHIFT": 0}


def _scale_codes_within(w: _Proj, codes: tuple[int, int]) -> bool:
    """Whether every MX scale code of the experts is known (mx_scale_codes) to lie in [codes]."""
    return w.scale_codes is not None and codes[0] <= w.scale_codes[0] and w.scale_codes[1] <= codes[1]


# MX fp8 tiles folded (dequant_ptx._e4m3_asm): the e8m0 codes an MX scale may have, by activation
# dtype, for scale * the halves' unscale to be exact in it (bfloat16: 2^-127 * 2^120 .. 2^7 * 2^120;
# float16: 2^-24 .. 2^15, subnormal below 2^-14)
E4M3_MX_FOLD_CODES = {torch.bfloat16: (0, 134), torch.float16: (103, 142)}


def _e4m3_folded(w: _Proj, variant: KernelVariant, compute_dtype: torch.dtype, asm: bool,
                 device: torch.device) -> bool:
    """Whether an MX fp8 GEMM decodes its weights with dequant_ptx._e4m3_asm (bfloat16: three instructions
    a weight pair and a multiply, float16: one and a multiply, against six through float32): on the PTX
    path, where every scale code of the experts is known to lie in E4M3_MX_FOLD_CODES; in float16 only on a
    GPU that converts e4m3 pairs (sm_89+; before it the codes take dequant_ptx._e4m3_value)."""
    return (asm and variant.weight_type == "fp8e4m3" and variant.weight_scale == "mx"
            and compute_dtype in E4M3_MX_FOLD_CODES and _scale_codes_within(w, E4M3_MX_FOLD_CODES[compute_dtype])
            and (compute_dtype != torch.float16 or fp8_pair_convert(device)))
