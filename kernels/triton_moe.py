"""Fused MoE in Triton: the launchers of the GEMM kernels, the layer built on them (as torch custom
ops), and the Experts classes the kernel specs name (``TritonExperts``, ``TritonBatchedExperts``).

The layer (standard format) is::

    align(topk_ids) (+ quantise(hidden), same launch at decode)
        -> GEMM1 (w13, + bias, act_and_mul in its epilogue) -> quantise?
        -> GEMM2 (w2, + bias, × router weight, split-K) -> sum over top-k (and splits)

Weights are in the ``nk`` layout of :mod:`moe_registry.formats.weights` ([E, N, K], K contiguous), which
is also what fp8 and int8 tensor-core dots want for B. The GEMM kernel is specialised by
constexprs that say how a weight tile becomes something a ``tl.dot`` takes:

- 16-bit weights: used as they are.
- integer codes (uint4 with zero points, uint4b8, int4, uint8b128, int8 as W8A16): 4-bit tiles are
  loaded once as bytes and split into low (even k) and high (odd k) nibbles, each multiplied
  with the matching even/odd half of the activation tile, so no byte is loaded twice; one scale
  (and zero) per group and column is loaded per tile and broadcast over the group's rows.
- W8A8 int8: int8 × int8 dot accumulating in int32; per-token and per-channel scales are applied
  once after the K loop.
- FP4 (e2m1; MXFP4, NVFP4): dequantised in registers to the 16-bit activation dtype, from codes the
  experts put once in the decoders' byte order (:func:`moe_registry_kernels.fp4_dequant.e2m1_register_order`),
  NVFP4's e4m3 group scales as exponent codes (:func:`~moe_registry_kernels.fp4_dequant.e4m3_scale_codes`).
- fp8 with e8m0 per-32 scales (MXFP8): dequantised to the 16-bit activation dtype in registers
  (Hopper has no MX dot); MXFP8 activations, when the scheme quantises them, are dequantised the
  same way, so the numerics are the scheme's.
- fp8 with 128×128 block scales (W8A8): fp8 dot per K tile, scaled there by the token-group and
  weight-block scales (they change every 128 columns).
- fp8 with per-tensor or per-channel weight scales (W8A8: AutoFP8, ModelOpt FP8, compressed-tensors
  FP8 / FP8_DYNAMIC): fp8 × fp8 dot accumulating in float32 over all of K; the activation scale
  (static per tensor, dynamic per token or per tensor, see :mod:`moe_registry_kernels.fp8_act`) and
  the per-channel scale are applied once after the loop, as for int8.

Where the rest lives: the keys read as kernel choices in :mod:`moe_registry_kernels.scheme`, tile
configs in :mod:`moe_registry_kernels.tile_config`, the GEMM kernels in
:mod:`moe_registry_kernels.moe_gemm`, weight dequantisation (PTX) in
:mod:`moe_registry_kernels.dequant_ptx`, and the glue ops (alignment, activation and
quantisation, top-k sum) in :mod:`moe_registry_kernels.triton_ops`. Their public names, and the
internals tools and tests reach for, are re-exported here.

Nothing here reads a device value on the host: buffers are sized by worst cases and kernels
skip blocks past ``num_tokens_post_padded``, so the layer can be captured in a CUDA graph.
"""


import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_registry.formats.weights import BULK_FIELDS, ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

from . import decode_gemv, triton_ops
from .decode_gemv import _decode_gemv_kernel, dp4a_in_ptx
from .dequant_ptx import (  # noqa: F401  (re-exported: tests reach for them here)
    _dequant_byte,
    _dequant_byte_pairs,
    _dequant_nibbles,
    _offset_zero,
    _paired_halves,
)
from .fp4_dequant import e2m1_register_order, e4m3_scale_codes
from .fp8_act import FP8_DYNAMIC_MODES, align_quant_fp8, quant_fp8_dynamic, quant_fp8_from_pieces
from .moe_gemm import _fused_moe_kernel, _fused_moe_swap_kernel
from .scheme import Scheme, packed, scheme_from_keys, swappable
from .tile_config import (  # noqa: F401  (re-exported: tools/tune.py and tests reach for them here)
    CONFIG_DIR,
    _device_name,
    _fit_config,
    _fit_pair,
    _layer_configs,
    _load_config_file,
    _num_sms,
    config_file,
    config_override,
    default_config,
    get_config,
    group_dot_width,
    shape_key,
    takes_zero_sums,
    zero_sums_fit,
)

__all__ = [
    "Scheme",
    "scheme_from_keys",
    "swappable",
    "get_config",
    "default_config",
    "config_file",
    "shape_key",
    "config_override",
    "fused_experts",
    "fused_experts_batched",
    "TritonExperts",
    "TritonBatchedExperts",
]

# GEMM1 leaves its intermediates their amax in pieces (see _amax_pieces_shape) for per-token
# int8 up to this many tokens, and past them where act_quant would cut rows into more than this
# many chunks; for dynamic fp8 up to this many tokens (per tensor: up to FP8_TENSOR_PIECES pieces,
# since each row's quantisation reads them all)
AMAX_PIECES = True
AMAX_PIECES_MAX_TOKENS = 64
AMAX_PIECES_MIN_CHUNKS = 8
FP8_TENSOR_PIECES = 16384
# one token's activations (one scale per token or per tensor) are quantised by the GEMM that
# reads them (_InputScale): GEMM1 finds the scale in the token's hidden state, GEMM2 in GEMM1's
# row-amax pieces, and each program quantises the token's row once a K step, so the layer
# launches no quantisation kernel. That costs the GEMMs time in proportion to the weights they
# read and saves a fixed few microseconds: taken up to SCALE_IN_GEMM_MAX_BYTES of the token's
# experts' weights (H100, M = 1, against the same layer with its quantisation launches:
# 1.02-1.20x on Qwen3-30B-A3B's 38 MB and DeepSeek-V2-Lite's 52 MB of int8/fp8 experts,
# 0.88-1.01x on Mixtral's 176-352 MB). GEMM2 alone (its scale from GEMM1's amax pieces, the
# hidden state quantised by a launch) has its own budget by activation quantisation,
# SCALE_IN_GEMM2_MAX_BYTES (H100, Mixtral M = 1, two rounds each against the launch: dynamic
# fp8 per token 1.04x, per tensor 1.03x; per-token int8 0.98-0.99x, W4A8 0.98x, static scales
# 0.98-1.00x: those keep SCALE_IN_GEMM_MAX_BYTES). SCALE_TILE: values a step of the scale search reads
SCALE_IN_GEMM = True
SCALE_IN_GEMM_MAX_BYTES = 64 << 20
SCALE_IN_GEMM2_MAX_BYTES = {"fp8_token": 1 << 62, "fp8_tensor": 1 << 62}
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
# than 1 everywhere: tools/bench.py --m 1 2 4 8 16)
DECODE_GEMV = True
GEMV_PAIRS_PER_EXPERT = 1.5
GEMV_BLOCK_M = 1
GEMV_QUANTS = ("int8_token", "int8_static")
GEMV_WEIGHTS = {"uint4b8": 8, "int8": 4}  # weight type -> codes per 32-bit word
GEMV_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# launching


@dataclass(frozen=True)
class _Proj:
    """One projection's tensors and its logical GEMM shape (N outputs, K inputs)."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    perm: torch.Tensor | None
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None
    n: int
    k: int
    scale2: torch.Tensor | None = None  # second-level weight scale per (expert, row), float32 [E, N] (NVFP4)
    # MX scales: their lowest and highest e8m0 code where known, which decide _e2m1_fold
    scale_codes: tuple[int, int] | None = None


@dataclass(frozen=True)
class _RowSums:
    """A ZERO_SUMS GEMM's input sums: [A rows, groups * pieces] float32, each weight group's sum in
    ``pieces`` consecutive values (1: :func:`triton_ops.row_group_sums`; more: the per-tile sums a
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


def _gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: _Proj, scheme: Scheme, c: torch.Tensor,
          rows: _Rows, config: dict, *, compute_dtype: torch.dtype, top_k: int = 1,
          routed_weight: str = "none", topk_weights: torch.Tensor | None = None, write_empty: bool = False,
          fuse_act: str = "none", amax_pieces: torch.Tensor | None = None, pdl: bool = False,
          input_scale: _InputScale | None = None, row_sums: _RowSums | None = None,
          sums_out: torch.Tensor | None = None) -> None:
    """Launch one fused MoE GEMM writing C (see _fused_moe_kernel): [rows, N], [rows, N / 2] with
    ``fuse_act``, or [SPLIT_K, rows, N] float32 partial sums when the config splits K.
    ``amax_pieces`` [rows, column tiles] (fused activation only): also write each row's max |C|
    per column tile there (see _amax_pieces_shape); ``pdl``: as part of a
    programmatic-dependent-launch chain; ``input_scale``: A is one token's 16-bit input, which
    the kernel quantises (``a_scale``: the static scale, else None); ``row_sums``: A's per-group row
    sums, given exactly where the config takes ZERO_SUMS (_zero_sums); ``sums_out`` [rows, column
    tiles] (fused activation only): also write each row's sum per column tile there (the next
    GEMM's row_sums, in pieces)."""
    if w.perm is not None and scheme.act_quant in ("fp8_group", "mxfp8"):
        raise ValueError("act-order weights cannot take group-quantised activations (their groups "
                         "follow the original column order)")
    if input_scale is not None and input_scale.gemv:
        if not _takes_gemv(scheme, w) or rows.batched or (a_scale is not None) != input_scale.static \
                or amax_pieces is not None or row_sums is not None or sums_out is not None:
            raise ValueError("the decode GEMV takes int8 activations (a static scale given) on int4 or int8 weights "
                             "it can read as words, in the standard format, and leaves no pieces")
        _gemv(a, a_scale, w, scheme, c, rows, top_k=top_k, routed_weight=routed_weight, topk_weights=topk_weights,
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
    if amax_pieces is not None and (fuse_act == "none" or config["SWAP_AB"] or amax_pieces.shape[1] != n_tiles):
        raise ValueError("row-amax pieces come from the fused-activation kernel, one per column tile")
    if input_scale is not None and (scheme.act_quant not in ONE_TOKEN_QUANTS or config["SWAP_AB"]
                                    or not rows.one_pair_blocks or w.perm is not None
                                    or (a_scale is not None) != input_scale.static
                                    or input_scale.pieces is not None and amax_pieces is not None):
        raise ValueError("a GEMM quantises its own input for one token, per token or per tensor (a static "
                         "scale given), in column order, and not from pieces while it leaves pieces of its own")
    scale_search = _NO_SCALE_SEARCH
    if input_scale is not None:
        width = w.k if input_scale.pieces is None else input_scale.pieces.shape[1]
        scale_search = {"A_SCALE_IN": input_scale.source, "HW_FP8_CAST": _hardware_fp8_cast(a.device),
                        **input_scale.search_tile(width, bm, scheme.act_quant != "fp8_tensor")}
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
    if rows.batched:
        rows_per_expert, expert_grid = rows.capacity, w.weight.shape[0]
    elif rows.one_pair_blocks:
        rows_per_expert, expert_grid = rows.expert_ids.numel() * bm, 1
    else:
        rows_per_expert, expert_grid = rows.sorted_ids.numel(), 1
    grid = (triton.cdiv(rows_per_expert, bm) * n_tiles, expert_grid, split_k)
    sorted_ids = rows.sorted_ids if rows.sorted_ids is not None else dummy
    num_post_padded = rows.num_post_padded if rows.num_post_padded is not None else dummy
    asm = scheme.paired_dequant and _paired_halves(a.device, compute_dtype)
    groups = scale.shape[2] if w.scale is not None and scheme.weight_scale in ("group", "mx") else 0
    if config["SWAP_AB"]:
        _fused_moe_swap_kernel[grid](
            a, w.weight, scale, w.zero if w.zero is not None else dummy, w.perm if w.perm is not None else dummy,
            w.bias if w.bias is not None else dummy, c, topk_weights if topk_weights is not None else dummy,
            sorted_ids, rows.expert_ids, num_post_padded,
            w.n, w.k, w.k // 2, rows.num_valid, rows_per_expert, w.weight.shape[0],
            a.stride(0), w.weight.stride(0), w.weight.stride(1), *s_strides, c.stride(-2),
            c.stride(0) if split_k > 1 else 0,
            W_TYPE=scheme.weight_type, HAS_ZERO=w.zero is not None, W_SCALE=scheme.weight_scale,
            W_GROUP=scheme.weight_group, COMPUTE=_TL_DTYPE[compute_dtype], ASM_DEQUANT=asm,
            BYTE_PAIRS=_byte_pairs(w.weight), ACT_ORDER=w.perm is not None,
            HAS_BIAS=w.bias is not None, ROUTED_WEIGHT=routed_weight, TOP_K=top_k,
            ONE_PAIR_BLOCKS=rows.one_pair_blocks, FUSE_ACT=fuse_act, SPLIT_K=split_k,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"],
            GROUP_M=config["GROUP_M"], PDL=pdl, scale_groups=groups, **_scale2_args(w, scheme, dummy),
            **_e2m1_fold(w, scheme, compute_dtype),
            E4M3_FOLDED=_e4m3_folded(w, scheme, compute_dtype, asm),
            **_launch_options(config), **triton_ops.pdl_launch(pdl))
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
        W_TYPE=scheme.weight_type, HAS_ZERO=w.zero is not None, W_SCALE=scheme.weight_scale,
        W_GROUP=scheme.weight_group, W_GROUP_N=scheme.weight_group_n, A_QUANT=scheme.act_quant,
        A_GROUP=max(scheme.act_group, 1), COMPUTE=_TL_DTYPE[compute_dtype], ASM_DEQUANT=asm,
        ACT_ORDER=w.perm is not None, HAS_BIAS=w.bias is not None, ROUTED_WEIGHT=routed_weight,
        TOP_K=top_k, BATCHED=rows.batched, ONE_PAIR_BLOCKS=rows.one_pair_blocks, WRITE_EMPTY=write_empty,
        FUSE_ACT=fuse_act, SPLIT_K=split_k, AMAX_OUT=amax_pieces is not None, **scale_search,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"], PDL=pdl,
        scale_groups=groups, **_scale2_args(w, scheme, dummy), **_e2m1_fold(w, scheme, compute_dtype),
        E4M3_FOLDED=_e4m3_folded(w, scheme, compute_dtype, asm),
        GROUP_DOTS=config.get("GROUP_DOTS", False),
        **_row_sums_args(row_sums, sums_out), **_launch_options(config), **triton_ops.pdl_launch(pdl))


def _takes_gemv(scheme: Scheme, w: _Proj) -> bool:
    """Whether a decode GEMM given its 16-bit input runs as decode_gemv's GEMV, after a launch
    of act_quant of its own (DECODE_GEMV): int8 activations per token or static,
    int4 (W4A8) or int8 codes with no zero points in column order, per-channel scales or 16/32-bit
    group scales of whole words a group (at most a step's), and weight rows the kernel can read as
    aligned 32-bit words."""
    codes = GEMV_WEIGHTS.get(scheme.weight_type)
    if not (DECODE_GEMV and codes and scheme.act_quant in GEMV_QUANTS and w.zero is None and w.perm is None
            and w.scale is not None and w.scale.dtype in GEMV_SCALE_DTYPES):
        return False
    if scheme.weight_scale == "group":
        group_words = scheme.weight_group // codes
        if scheme.weight_group % codes or decode_gemv.STEP_WORDS % group_words:
            return False
    elif scheme.weight_scale != "channel":
        return False
    weight = w.weight
    return (w.k % codes == 0 and weight.stride(-1) == 1 and weight.data_ptr() % 4 == 0
            and all(stride * weight.element_size() % 4 == 0 for stride in weight.stride()[:-1]))


def _gemv(a: torch.Tensor, a_scale: torch.Tensor | None, w: _Proj, scheme: Scheme, c: torch.Tensor, rows: _Rows, *,
          top_k: int, routed_weight: str, topk_weights: torch.Tensor | None, fuse_act: str, pdl: bool,
          pair_ids: torch.Tensor | None) -> None:
    """A decode GEMM as two launches: A's rows quantised to int8 codes by triton_ops.act_quant (at
    ``a_scale``, the static scale, or each row's own; int4 weights: in nibble halves; ``pair_ids``:
    A's rows are the pairs', these their experts, and a foreign pair's row is skipped), then
    decode_gemv's GEMV writing C [pairs, N] (or [pairs, N / 2] with ``fuse_act``), a program per
    (row block, column tile): one pair each (one token), or GEMV_BLOCK_M aligned pairs."""
    dummy = w.weight
    codes, a_scales = triton_ops.act_quant(a, "none", scheme.act_quant, static_scale=a_scale, pdl=pdl,
                                           nibble_halves=scheme.packed, pair_experts=pair_ids,
                                           num_experts=w.weight.shape[0])
    scale = w.scale
    group = scheme.weight_scale == "group"
    grid = (rows.expert_ids.numel(), _column_tiles(w.n, decode_gemv.BLOCK_N, fuse_act))
    _decode_gemv_kernel[grid](
        codes, a_scales, w.weight, scale, w.bias if w.bias is not None else dummy, c,
        topk_weights if topk_weights is not None else dummy,
        rows.sorted_ids if rows.sorted_ids is not None else dummy, rows.expert_ids,
        rows.num_post_padded if rows.num_post_padded is not None else dummy, w.n, w.k, rows.num_valid,
        w.weight.shape[0], 0 if a_scale is not None else a_scales.stride(0), w.weight.stride(0), w.weight.stride(1),
        scale.stride(0), scale.stride(1), scale.stride(2) if group else 0, c.stride(-2), PACKED=scheme.packed,
        W_SCALE=scheme.weight_scale, W_GROUP=scheme.weight_group, HAS_BIAS=w.bias is not None,
        ROUTED_WEIGHT=routed_weight, TOP_K=top_k, FUSE_ACT=fuse_act, PTX=dp4a_in_ptx(a.device),
        ONE_PAIR_BLOCKS=rows.one_pair_blocks, BLOCK_M=1 if rows.one_pair_blocks else GEMV_BLOCK_M,
        BLOCK_N=decode_gemv.BLOCK_N, STEP_WORDS=decode_gemv.STEP_WORDS, PDL=pdl, num_warps=decode_gemv.NUM_WARPS,
        num_stages=1, **triton_ops.pdl_launch(pdl))


def _zero_sums(config: dict, w: _Proj) -> bool:
    """Whether a GEMM runs its zero points on the factored dot (the ZERO_SUMS key, which
    tile_config keeps where the tile can take it): for weights in column order (an act-order
    permutation would take each group's sums over permuted input columns)."""
    return bool(config.get("ZERO_SUMS")) and w.perm is None


def _sum_pieces_per_group(config1: dict, config2: dict, w2: _Proj, scheme: Scheme) -> int:
    """How many of GEMM1's per-tile row sums (its epilogue's ``sums_out``) make one weight group of
    a ZERO_SUMS GEMM2's input, or 0 where GEMM2 takes no sums or GEMM1 cannot leave them: the
    standard kernel's column tiles (BLOCK_N / 2 outputs with the fused activation) must divide the
    group."""
    width = config1["BLOCK_N"] // 2
    if not _zero_sums(config2, w2) or config1["SWAP_AB"] or scheme.weight_group % width:
        return 0
    return scheme.weight_group // width


def _gemm1_sum_pieces(rows: _Rows, pairs: int, config1: dict, config2: dict, w13: _Proj, w2: _Proj,
                      scheme: Scheme, activation: str, device: torch.device) -> _RowSums | None:
    """The buffer GEMM1's epilogue fills with a ZERO_SUMS GEMM2's input sums (its ``sums_out``), as
    GEMM2 reads it, where GEMM1 can leave them (_sum_pieces_per_group) and GEMM2 does not find
    them itself (one-pair blocks)."""
    pieces = _sum_pieces_per_group(config1, config2, w2, scheme)
    if not pieces or rows.one_pair_blocks:
        return None
    tiles = _column_tiles(w13.n, config1["BLOCK_N"], activation)
    return _RowSums(torch.empty(pairs, tiles, dtype=torch.float32, device=device), pieces)


def _input_row_sums(a: torch.Tensor, config: dict, w: _Proj, scheme: Scheme, rows: _Rows,
                    pdl: bool) -> _RowSums | None:
    """A GEMM's input sums where its config takes ZERO_SUMS and nothing before it left them: found by
    the kernel itself on one-pair blocks, else by their own launch."""
    if not _zero_sums(config, w):
        return None
    if rows.one_pair_blocks:
        return _RowSums(None)
    return _RowSums(triton_ops.row_group_sums(a, scheme.weight_group, pdl))


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


def _scale2_args(w: _Proj, scheme: Scheme, dummy: torch.Tensor) -> dict:
    """The GEMM kernels' second-level weight scale arguments (NVFP4's global scale, [E, N] float32)."""
    if scheme.weight_scale2 != (w.scale2 is not None):
        raise ValueError(f"weight key {'has' if scheme.weight_scale2 else 'has no'} second-level scale, but the "
                         f"projection {'has none' if w.scale2 is None else 'has one'}")
    return {"b_scale2_ptr": w.scale2 if w.scale2 is not None else dummy, "W_SCALE2": scheme.weight_scale2}


# FP4 tiles folded (fp4_dequant's module note): the power of two NVFP4 tiles leave to the result, and
# the e8m0 codes an MX scale may have, by activation dtype, for scale * 2^U to be a normal number
E2M1_E4M3_SHIFT = 8
E2M1_MX_FOLD_CODES = {torch.bfloat16: (0, 128), torch.float16: (99, 128)}


def _e2m1_fold(w: _Proj, scheme: Scheme, compute_dtype: torch.dtype) -> dict:
    """Whether an FP4 GEMM's group scales carry the codes' unscale (one multiply a weight pair, not
    two; H100: see fp4_dequant), and the shift its result takes back. NVFP4's e4m3 scales always
    may; MX ones where every scale code is known to lie in E2M1_MX_FOLD_CODES."""
    if scheme.weight_type != "e2m1" or compute_dtype not in E2M1_MX_FOLD_CODES:
        return {"E2M1_FOLDED": False, "E2M1_SHIFT": 0}
    if scheme.weight_scale != "mx":  # e4m3 group scales, at most 448
        return {"E2M1_FOLDED": True, "E2M1_SHIFT": E2M1_E4M3_SHIFT}
    return {"E2M1_FOLDED": _scale_codes_within(w, E2M1_MX_FOLD_CODES[compute_dtype]), "E2M1_SHIFT": 0}


def _scale_codes_within(w: _Proj, codes: tuple[int, int]) -> bool:
    """Whether every MX scale code of the experts is known (mx_scale_codes) to lie in [codes]."""
    return w.scale_codes is not None and codes[0] <= w.scale_codes[0] and w.scale_codes[1] <= codes[1]


# MX fp8 tiles folded (dequant_ptx._e4m3_asm): the e8m0 codes an MX scale may have, by activation
# dtype, for scale * the halves' unscale to be exact in it (bfloat16: 2^-127 * 2^120 .. 2^7 * 2^120;
# float16: 2^-24 .. 2^15, subnormal below 2^-14)
E4M3_MX_FOLD_CODES = {torch.bfloat16: (0, 134), torch.float16: (103, 142)}


def _e4m3_folded(w: _Proj, scheme: Scheme, compute_dtype: torch.dtype, asm: bool) -> bool:
    """Whether an MX fp8 GEMM decodes its weights with dequant_ptx._e4m3_asm (bfloat16: three instructions
    a weight pair and a multiply, float16: one and a multiply, against six through float32): on the PTX
    path, where every scale code of the experts is known to lie in E4M3_MX_FOLD_CODES."""
    return (asm and scheme.weight_type == "fp8e4m3" and scheme.weight_scale == "mx"
            and compute_dtype in E4M3_MX_FOLD_CODES and _scale_codes_within(w, E4M3_MX_FOLD_CODES[compute_dtype]))


def mx_scale_codes(weights: ExpertWeights, scheme: Scheme) -> list[int] | None:
    """[lowest, highest] e8m0 code of MX FP4 or fp8 experts' scales (None for any other key), read once
    where the weights are set up: the layer's custom ops take it as ``mx_scale_codes`` (_e2m1_fold,
    _e4m3_folded)."""
    if scheme.weight_type not in ("e2m1", "fp8e4m3") or scheme.weight_scale != "mx":
        return None
    codes = torch.cat([p.scale.reshape(-1).view(torch.uint8) for p in (weights.w13, weights.w2)])
    lowest, highest = torch.aminmax(codes)
    return [int(lowest), int(highest)]


def _amax_pieces_shape(scheme: Scheme, tokens: int, top_k: int, config1: dict, w13: _Proj,
                       activation: str) -> tuple[int, int] | None:
    """The shape [rows, column tiles] of the amax pieces GEMM1 leaves, or None: dynamic fp8
    intermediates at decode (_fp8_pieces_shape) and per-token int8 ones (AMAX_PIECES). The int8
    ones' quantisation then cuts rows into chunks like the group modes and reads each value once:
    at decode, instead of one program reading a whole row (14336 columns on Mixtral); at prefill,
    only instead of an amax pass and a codes pass over many chunks (1408 columns in 11 on
    DeepSeek-V2-Lite: the layer 2-3% faster on an H100; on Qwen3's 768 in 3 and Mixtral's 14336
    in 7, 1% slower: the epilogue's row max costs more)."""
    if scheme.act_quant in FP8_DYNAMIC_MODES:
        return _fp8_pieces_shape(scheme, tokens, top_k, config1, w13, activation)
    if scheme.act_quant != "int8_token" or not AMAX_PIECES or config1["SWAP_AB"]:
        return None
    width = w13.n // 2 if activation != "none" else w13.n
    if tokens > AMAX_PIECES_MAX_TOKENS and triton_ops.prefill_row_chunks(width) <= AMAX_PIECES_MIN_CHUNKS:
        return None
    return tokens * top_k, _column_tiles(w13.n, config1["BLOCK_N"], activation)


@dataclass(frozen=True)
class _QuantisedInGemm:
    """Which GEMMs of a decode layer take its 16-bit input and quantise it themselves: one token's
    tile kernels (SCALE_IN_GEMM), or the decode GEMV (``gemv1``, ``gemv2``; its own launch)."""

    gemm1: bool = False
    gemm2: bool = False
    gemv1: bool = False  # GEMM1 does so as decode_gemv's GEMV (_takes_gemv)
    gemv2: bool = False


def _quantised_in_gemm(scheme: Scheme, tokens: int, top_k: int, w13: _Proj, w2: _Proj,
                       row_scale: torch.Tensor | None, routed_experts: int | None = None) -> _QuantisedInGemm:
    """Which GEMMs quantise the layer's input themselves, with no router weight to apply first.
    The decode GEMV (_takes_gemv) where it pays (_gemv_pays, over the ``routed_experts`` the router
    picks among where more than these hold), whatever the weights' size (its
    input quantised once, by its own launch), past one token both GEMMs or neither (they share its
    blocks). Else one token's tile kernels (SCALE_IN_GEMM): one scale per token or per tensor, the
    GEMM's weights in column order, and the token's experts' weights within
    SCALE_IN_GEMM_MAX_BYTES (GEMM1, which finds the scale in the hidden state) or GEMM2's budget
    for the activation quantisation (SCALE_IN_GEMM2_MAX_BYTES, else the same; GEMM2 finds the
    scale in GEMM1's amax pieces)."""
    if row_scale is not None:
        return _QuantisedInGemm()
    few = _gemv_pays(tokens, top_k, routed_experts or w13.weight.shape[0])
    gemv1, gemv2 = few and _takes_gemv(scheme, w13), few and _takes_gemv(scheme, w2)
    if tokens > 1:
        both = gemv1 and gemv2
        return _QuantisedInGemm(both, both, both, both)
    if not (SCALE_IN_GEMM and scheme.act_quant in ONE_TOKEN_QUANTS):
        return _QuantisedInGemm(gemv1, gemv2, gemv1, gemv2)
    weight_bytes = _expert_weight_bytes(w13, w2) * top_k
    gemm2_budget = SCALE_IN_GEMM2_MAX_BYTES.get(scheme.act_quant, SCALE_IN_GEMM_MAX_BYTES)
    return _QuantisedInGemm(gemm1=gemv1 or w13.perm is None and weight_bytes <= SCALE_IN_GEMM_MAX_BYTES,
                            gemm2=gemv2 or w2.perm is None and weight_bytes <= gemm2_budget, gemv1=gemv1, gemv2=gemv2)


def _gemv_pays(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether ``tokens`` tokens routed uniformly at random among ``num_experts`` (the router's: under
    expert parallelism every rank's, of which a rank holds a share and sees that share's pairs, as
    many a held expert) would give the experts they hit at most GEMV_PAIRS_PER_EXPERT pairs each (the
    decode GEMV's range; one token: one pair each)."""
    if tokens == 1:
        return True
    hit = num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** tokens)
    return tokens * top_k <= GEMV_PAIRS_PER_EXPERT * hit


def _expert_weight_bytes(w13: _Proj, w2: _Proj) -> int:
    """Bytes of one expert's weights (both projections; scales left out)."""
    return (w13.weight.numel() + w2.weight.numel()) * w13.weight.element_size() // w13.weight.shape[0]


def _fp8_pieces_shape(scheme: Scheme, tokens: int, top_k: int, config1: dict, w13: _Proj,
                      activation: str) -> tuple[int, int] | None:
    """The amax pieces of a dynamic fp8 intermediate at decode: for GEMM2 itself to quantise one
    token's (SCALE_IN_GEMM), else for fp8_act.quant_fp8_from_pieces (AMAX_PIECES; per tensor,
    at most FP8_TENSOR_PIECES of them)."""
    if activation == "none" or config1["SWAP_AB"]:
        return None
    shape = tokens * top_k, _column_tiles(w13.n, config1["BLOCK_N"], activation)
    if tokens == 1 and SCALE_IN_GEMM:
        return shape
    if not AMAX_PIECES or tokens > AMAX_PIECES_MAX_TOKENS:
        return None
    return shape if scheme.act_quant == "fp8_token" or shape[0] * shape[1] <= FP8_TENSOR_PIECES else None


def _quantize(x: torch.Tensor, scheme: Scheme, input_scale: torch.Tensor | None, **kwargs
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM input as the activation key wants it (x itself when unquantized); kwargs go to
    triton_ops.act_quant."""
    if scheme.act_quant == "none":
        return x, None
    if scheme.act_quant in FP8_DYNAMIC_MODES:  # per-token / per-tensor dynamic fp8 (fp8_act)
        if kwargs.get("expert_num_tokens") is not None:  # the batched format's padding rows would join the amax
            raise ValueError(f"{scheme.act_quant} activations run in the standard activation format only")
        return quant_fp8_dynamic(x, scheme.act_quant, row_scale=kwargs.get("row_scale"),
                                 pair_ids=kwargs.get("pair_ids"), num_experts=kwargs.get("num_experts", 0),
                                 pdl=kwargs.get("pdl", False))
    return triton_ops.act_quant(x, "none", scheme.act_quant, static_scale=input_scale,
                                group=scheme.act_group or 128, **kwargs)


def _codes_dtype(scheme: Scheme, config: dict, compute_dtype: torch.dtype) -> dict:
    """triton_ops.act_quant's ``out_dtype`` for the input of a GEMM with this tile config: int8
    codes as 16-bit floats where its tiles run a 16-bit dot of them (scheme.float_w4a8), else the
    default (no argument)."""
    if scheme.float_w4a8(config["BLOCK_M"]):
        return {"out_dtype": compute_dtype}
    return {}


def _projections(hidden_size: int, w13: torch.Tensor, w13_scale, w13_zero, w13_perm, w13_bias,
                 w13_input_scale, w2: torch.Tensor, w2_scale, w2_zero, w2_perm, w2_bias,
                 w2_input_scale, w13_scale2=None, w2_scale2=None,
                 mx_scale_codes: list[int] | None = None) -> tuple[_Proj, _Proj]:
    n13 = w13.shape[1]
    codes = (mx_scale_codes[0], mx_scale_codes[1]) if mx_scale_codes is not None else None
    return (_Proj(w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale, n13, hidden_size, w13_scale2,
                  codes),
            _Proj(w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale, w2.shape[1], n13 // 2, w2_scale2,
                  codes))


def _fused_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w13: _Proj, w2: _Proj, weight_key: str, activation_key: str, activation: str,
                   router_weight_on_input: bool, routed_experts: int | None = None) -> torch.Tensor:
    """align (+ quantise(hidden); one token: quantise only) -> GEMM1 + act -> quantise? -> GEMM2
    (split-K) -> sum (top-k, splits). ``routed_experts``: see :func:`fused_experts`."""
    scheme = scheme_from_keys(weight_key, activation_key)
    m, top_k = topk_ids.shape
    # top-1 layers may write GEMM2 straight into out, where the row of a foreign pair (expert
    # parallelism: id outside [0, E), never computed) must read zero; the top-k sum skips them.
    # Zeroed here, ahead of the launch chain, not between its kernels.
    out = torch.zeros_like(hidden) if top_k == 1 else torch.empty_like(hidden)
    if m == 0:
        return out
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    num_experts = w13.weight.shape[0]
    on_input = router_weight_on_input
    if on_input and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got {top_k}")
    weights = topk_weights.reshape(-1).to(torch.float32)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    dev, dt = hidden.device, hidden.dtype

    # quantised activations take the router weight before quantising (as the reference does);
    # 16-bit ones take it in GEMM1's epilogue, before the bias. Alignment and the input's
    # quantisation share one launch at decode.
    row_scale = weights if on_input and scheme.act_quant != "none" else None
    # the layer's launches form one programmatic-dependent-launch chain where the GPU has it: each
    # kernel is scheduled while the one before drains, and waits for its writes before starting
    pdl = triton_ops.pdl_supported(hidden.device)
    # one token whose activations take one scale per token or per tensor: both GEMMs quantise
    # their input themselves (SCALE_IN_GEMM), no quantisation launch; int8 activations on int4 or
    # int8 weights for a few tokens: the decode GEMV, which quantises its input by its own launch
    in_gemm = _quantised_in_gemm(scheme, m, top_k, w13, w2, row_scale, routed_experts)
    config1, config2 = _layer_configs(m, top_k, num_experts, w13, w2, weight_key, activation_key, scheme,
                                      hidden.device, split_gemm2=True,
                                      tiles_read=(not in_gemm.gemv1, not in_gemm.gemv2))
    static = scheme.act_quant in STATIC_QUANTS
    scale1 = _InputScale(rows=1, static=static, gemv=in_gemm.gemv1) if in_gemm.gemm1 else None
    sums1 = None  # a ZERO_SUMS GEMM1's input sums
    if m == 1:  # one token: a row block per expert it picked, straight from the router's ids
        if in_gemm.gemm1:
            a1, a1_scale = hidden, w13.input_scale if static else None
        else:
            a1, a1_scale = _quantize(hidden, scheme, w13.input_scale, row_scale=row_scale, pdl=pdl,
                                     **_codes_dtype(scheme, config1, dt))
        rows = _Rows(expert_ids=topk_ids.reshape(-1).contiguous(), num_valid=top_k, one_pair_blocks=True)
        sums1 = None if in_gemm.gemv1 else _input_row_sums(a1, config1, w13, scheme, rows, pdl)
    elif in_gemm.gemv1:  # the GEMV's row blocks: GEMV_BLOCK_M aligned pairs of one expert
        sorted_ids, expert_ids, num_post = triton_ops.align(topk_ids, num_experts, GEMV_BLOCK_M, pdl=pdl)
        a1, a1_scale = hidden, w13.input_scale if static else None
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    elif scheme.act_quant in FP8_DYNAMIC_MODES:  # fp8_act's alignment and quantisation
        sorted_ids, expert_ids, num_post, a1, a1_scale = align_quant_fp8(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, scheme.act_quant, row_scale=row_scale, pdl=pdl)
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    elif _zero_sums(config1, w13):  # 16-bit input: its row sums come with the alignment, in one launch at decode
        sorted_ids, expert_ids, num_post, sums = triton_ops.align_row_sums(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, scheme.weight_group, pdl=pdl)
        a1, a1_scale, sums1 = hidden, None, _RowSums(sums)
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    else:
        sorted_ids, expert_ids, num_post, a1, a1_scale = triton_ops.align_quant(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, scheme.act_quant, static_scale=w13.input_scale,
            row_scale=row_scale, group=scheme.act_group or 128, pdl=pdl, **_codes_dtype(scheme, config1, dt))
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    gemm1_weight = "input" if on_input and scheme.act_quant == "none" else "none"
    inter = torch.empty(m * top_k, w13.n // 2, dtype=dt, device=dev)
    # (a GEMV GEMM2 finds its rows' amax itself; a GEMV GEMM1 leaves none)
    gemv = in_gemm.gemv1 or in_gemm.gemv2
    pieces = None if gemv else _amax_pieces_shape(scheme, m, top_k, config1, w13, activation)
    amax = torch.empty(pieces, dtype=torch.float32, device=dev) if pieces else None
    # a ZERO_SUMS GEMM2's input sums, left in pieces by GEMM1's epilogue where it can
    pieces2 = _gemm1_sum_pieces(rows, m * top_k, config1, config2, w13, w2, scheme, activation, dev)
    _gemm(a1, a1_scale, w13, scheme, inter, rows, config1, compute_dtype=dt, top_k=top_k,
          routed_weight=gemm1_weight, topk_weights=weights, fuse_act=activation, amax_pieces=amax, pdl=pdl,
          input_scale=scale1, row_sums=sums1, sums_out=pieces2.sums if pieces2 else None)

    scale2 = None
    pair_ids = topk_ids.reshape(-1).contiguous()  # each pair's expert
    if in_gemm.gemv2:  # the GEMV quantises each intermediate row itself
        a2, a2_scale = inter, w2.input_scale if static else None
        scale2 = _InputScale(rows=m * top_k, pair_ids=pair_ids, static=static, gemv=True)
    elif in_gemm.gemm2 and (static or amax is not None):  # GEMM2 quantises the token's intermediates itself
        a2, a2_scale = inter, w2.input_scale if static else None
        scale2 = _InputScale(rows=top_k, pieces=amax, pair_ids=pair_ids, static=static)
    elif amax is not None and scheme.act_quant in FP8_DYNAMIC_MODES:
        a2, a2_scale = quant_fp8_from_pieces(inter, scheme.act_quant, amax, pair_ids, num_experts, pdl=pdl)
    elif scheme.act_quant in FP8_DYNAMIC_MODES:
        # fp8_tensor's one amax skips the rows of pairs routed to another rank's expert (never written)
        a2, a2_scale = _quantize(inter, scheme, None, pair_ids=pair_ids, num_experts=num_experts, pdl=pdl)
    else:  # (the row of a pair routed to another rank's expert, never written, is left alone)
        a2, a2_scale = _quantize(inter, scheme, w2.input_scale, amax_pieces=amax, pair_experts=pair_ids,
                                 num_experts=num_experts, pdl=pdl, **_codes_dtype(scheme, config2, dt))
    split = 1 if in_gemm.gemv2 else config2["SPLIT_K"]
    if split > 1:
        partial = torch.empty(split, m * top_k, w2.n, dtype=torch.float32, device=dev)
    else:
        partial = out if top_k == 1 else torch.empty(m * top_k, w2.n, dtype=dt, device=dev)
    sums2 = None if in_gemm.gemv2 else pieces2 or _input_row_sums(a2, config2, w2, scheme, rows, pdl)
    _gemm(a2, a2_scale, w2, scheme, partial, rows, config2, compute_dtype=dt,
          routed_weight="none" if on_input else "output", topk_weights=weights, pdl=pdl, input_scale=scale2,
          row_sums=sums2)
    if partial is not out:
        triton_ops.sum_topk(partial.view(split, m, top_k, w2.n), out=out, pdl=pdl, topk_ids=topk_ids,
                            num_experts=num_experts)
    return out


def _fused_experts_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor, w13: _Proj, w2: _Proj,
                           weight_key: str, activation_key: str, activation: str) -> torch.Tensor:
    scheme = scheme_from_keys(weight_key, activation_key)
    num_experts, capacity, hidden_size = x.shape
    out = torch.empty_like(x)
    if capacity == 0:
        return out
    # the capacity as rows per expert: tokens = capacity, top-k 1 over one expert's slab
    config1, config2 = _layer_configs(capacity, 1, 1, w13, w2, weight_key, activation_key, scheme, x.device,
                                      split_gemm2=False)
    rows = _Rows(expert_num_tokens=expert_num_tokens, capacity=capacity)
    # rows past an expert's count are skipped (left unwritten) until GEMM2 writes them as zeros
    counts = {"expert_num_tokens": expert_num_tokens, "capacity": capacity}
    a1, a1_scale = _quantize(x.reshape(num_experts * capacity, hidden_size), scheme, w13.input_scale, **counts,
                             **_codes_dtype(scheme, config1, x.dtype))
    inter = torch.empty(num_experts * capacity, w13.n // 2, dtype=x.dtype, device=x.device)
    sums1 = _input_row_sums(a1, config1, w13, scheme, rows, False)
    pieces2 = _gemm1_sum_pieces(rows, num_experts * capacity, config1, config2, w13, w2, scheme, activation,
                                x.device)
    _gemm(a1, a1_scale, w13, scheme, inter, rows, config1, compute_dtype=x.dtype, fuse_act=activation,
          row_sums=sums1, sums_out=pieces2.sums if pieces2 else None)
    a2, a2_scale = _quantize(inter, scheme, w2.input_scale, **counts, **_codes_dtype(scheme, config2, x.dtype))
    sums2 = pieces2 or _input_row_sums(a2, config2, w2, scheme, rows, False)
    _gemm(a2, a2_scale, w2, scheme, out.view(num_experts * capacity, hidden_size), rows, config2,
          compute_dtype=x.dtype, write_empty=True, row_sums=sums2)
    return out


# ---------------------------------------------------------------------------------------------
# custom ops: the whole layer is one opaque op for torch.compile


@torch.library.custom_op("moe_registry::fused_experts", mutates_args=())
def fused_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor | None, w13_zero: torch.Tensor | None,
                  w13_perm: torch.Tensor | None, w13_bias: torch.Tensor | None,
                  w13_input_scale: torch.Tensor | None,
                  w2: torch.Tensor, w2_scale: torch.Tensor | None, w2_zero: torch.Tensor | None,
                  w2_perm: torch.Tensor | None, w2_bias: torch.Tensor | None,
                  w2_input_scale: torch.Tensor | None,
                  weight_key: str, activation_key: str, activation: str,
                  router_weight_on_input: bool, w13_scale2: torch.Tensor | None = None,
                  w2_scale2: torch.Tensor | None = None, mx_scale_codes: list[int] | None = None,
                  routed_experts: int | None = None) -> torch.Tensor:
    """The standard-format MoE layer [M, H] -> [M, H] on ``nk``-layout weights (ProjectionWeights
    fields, flattened) but for FP4 codes, which it reads in their decoders' byte order
    (:func:`_kernel_tensors` puts them there); the keys are QuantKey strings; ``mx_scale_codes``:
    see mx_scale_codes; ``routed_experts``: the experts the router picks among where more than these
    (ExpertsConfig.routed_experts)."""
    p13, p2 = _projections(hidden.shape[1], w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale,
                           w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale, w13_scale2, w2_scale2,
                           mx_scale_codes)
    return _fused_experts(hidden, topk_weights, topk_ids, p13, p2, weight_key, activation_key, activation,
                          router_weight_on_input, routed_experts)


@fused_experts.register_fake
def _(hidden, *args):
    return torch.empty_like(hidden)


@torch.library.custom_op("moe_registry::fused_experts_batched", mutates_args=())
def fused_experts_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor,
                          w13: torch.Tensor, w13_scale: torch.Tensor | None, w13_zero: torch.Tensor | None,
                          w13_perm: torch.Tensor | None, w13_bias: torch.Tensor | None,
                          w13_input_scale: torch.Tensor | None,
                          w2: torch.Tensor, w2_scale: torch.Tensor | None, w2_zero: torch.Tensor | None,
                          w2_perm: torch.Tensor | None, w2_bias: torch.Tensor | None,
                          w2_input_scale: torch.Tensor | None,
                          weight_key: str, activation_key: str, activation: str,
                          w13_scale2: torch.Tensor | None = None, w2_scale2: torch.Tensor | None = None,
                          mx_scale_codes: list[int] | None = None) -> torch.Tensor:
    """The batched-format layer: x [E, T, H] with expert_num_tokens [E] -> [E, T, H] (rows past a
    count are zero; no router weights). Weights as :func:`fused_experts` reads them."""
    p13, p2 = _projections(x.shape[2], w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale,
                           w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale, w13_scale2, w2_scale2,
                           mx_scale_codes)
    return _fused_experts_batched(x, expert_num_tokens, p13, p2, weight_key, activation_key, activation)


@fused_experts_batched.register_fake
def _(x, *args):
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# Experts


# one-byte group scales (MX e8m0, NVFP4 e4m3), and group scales with zero points, are kept with their
# group count padded to a multiple of this
SCALE_GROUPS_PAD = 16


def _padded_groups(t: torch.Tensor | None) -> torch.Tensor | None:
    """Per-group scales [E, N, G] with G padded (zeros) to a multiple of SCALE_GROUPS_PAD: a K tile's
    groups then load as one masked vector per weight row, whose mask the compiler sees constant
    over the vector (Triton marks integer arguments divisible by 16), and the pipeliner streams
    such loads ahead like the codes. H100: MXFP4's four single-byte scale loads per step were
    waited on inside the step (sm_90 SASS, tools/kernel_sass.py); streamed, decode is 1.02-1.10x
    faster, NVFP4's 1.09-1.41x. 16-bit scales are left as they are (a tile's one or two groups per
    row are too few bytes for a streamed copy, and padding them would hold up to 5% more bytes)
    but with zero points: a ZERO_SUMS tile's epilogue reads 16 groups of a row's scales and zero
    points at once (moe_gemm._less_zero_point_terms), as vectors where padded, else as 32
    scalar loads a thread (sm_90 SASS, AWQ's GEMM2 at Qwen3's shape, 6 groups: 36 loads a
    thread in the epilogue's loop, whose instructions then outnumbered the main loop's; H100,
    AWQ at Qwen3's M = 64 on GPTQ int4's tiles, 181.1 -> 164.7 us a layer). The cost: that GEMM's
    6 groups a row are held as 16 (AWQ: 64 bytes of scale-and-zero words a row beside 384 of codes,
    where the checkpoint has 15 of scales and zero points; Qwen3's whole AWQ layer is held in 5.6%
    more bytes than its checkpoint's); the kernels read only the groups K holds."""
    if t is None or t.shape[2] % SCALE_GROUPS_PAD == 0:
        return t
    pad = SCALE_GROUPS_PAD - t.shape[2] % SCALE_GROUPS_PAD
    return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], pad)], dim=2)


def _scale_zero_words(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 group scales and their integer zero points [E, N, G] as one int32 word each, given
    as both tensors (moe_gemm._scale_of, _zero_of): the scale's bits low, the zero point (signed)
    high. A tile's scale and zero of a column are then one 4-byte load, which the pipeliner streams
    ahead of the step like the codes (cp.async), where a 2-byte scale and a 1-byte zero point were
    two loads the step waited on (sm_90 SASS, tools/kernel_sass.py: AWQ's GEMM2 at Qwen3's M = 8,
    4 such loads a step -> none). TritonExperts packs 4-bit codes' only. H100, tools/bench.py, on
    tables tuned for two tensors: AWQ's Mixtral M = 1 108.9 -> 103.7 us, M = 8
    312.1 -> 301.6, Qwen3 M = 64 164.3 -> 159.1, but DeepSeek-V2-Lite M = 8 88.6 -> 91.3 (its
    M = 64 re-tuned since); W8A16 asym's M = 64 241.8 -> 260.1 (Qwen3), 231.9 -> 251.4
    (DeepSeek-V2-Lite). Other scales and zero points are left as they are."""
    if scale.dtype != torch.float16 or zero.is_floating_point():
        return scale, zero
    words = (scale.view(torch.int16).to(torch.int32) & 0xFFFF) | (zero.to(torch.int32) << 16)
    return words, words


# the non-swapped tiles of at least this many rows read scale-and-zero words as their two 16-bit
# halves (_word_halves_for)
WORD_HALVES_MIN_ROWS = 128


def _word_halves_for(w: _Proj, config: dict) -> _Proj:
    """The projection as a tile reads it: scale-and-zero words (_scale_zero_words) as they are, or,
    for non-swapped tiles of WORD_HALVES_MIN_ROWS rows or more, as their two 16-bit halves, the
    scales and the zero points (int16 views of the same storage, strides doubled). A 4-byte word is
    one load the pipeliner streams through shared memory (faster at decode, and for the swapped
    prefill tiles); a 2-byte one is a load into registers, which the large non-swapped tiles take
    better. H100, AWQ at M = 4096 (tools/bench.py --m 4096 --schemes awq-w4a16): words 1183.4 ->
    halves 1131.8 us on Qwen3-30B-A3B's shape, 1466.3 -> 1402.4 on DeepSeek-V2-Lite's; Mixtral's
    swapped tiles, words against two tensors, 6288.2 against 7285.1."""
    if config["SWAP_AB"] or config["BLOCK_M"] < WORD_HALVES_MIN_ROWS:  # (every decode launch stops here)
        return w
    words = w.scale is not None and w.scale.dtype == torch.int32 and w.zero is not None and (
        w.zero.dtype == torch.int32 and w.zero.data_ptr() == w.scale.data_ptr())
    if not words:
        return w
    halves = w.scale.view(torch.int16)
    strides = tuple(2 * stride for stride in w.scale.stride())
    scales = halves.as_strided(w.scale.shape, strides, halves.storage_offset())
    zeros = halves.as_strided(w.scale.shape, strides, halves.storage_offset() + 1)
    return dataclasses.replace(w, scale=scales, zero=zeros)


def _kernel_tensors(p: ProjectionWeights, scheme: Scheme) -> list[torch.Tensor | None]:
    """The projection's tensors in custom-op order, contiguous, router-side dtypes fixed once, one-byte
    group scales and zero-point weights' group scales padded (:func:`_padded_groups`; zero points
    share the scales' strides, and are padded with them), 4-bit codes' group scales and zero points
    as one word each (:func:`_scale_zero_words`), NVFP4's e4m3 scales as exponent codes
    (:func:`e4m3_scale_codes`), FP4 codes in their decoders' byte order (:func:`e2m1_register_order`)."""
    def ready(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t if dtype is None else t.to(dtype)
        return t.contiguous()

    scale, zero, codes = ready(p.scale), ready(p.zero), p.weight
    if scale is not None and scale.dtype == torch.float8_e4m3fn:  # NVFP4's scales as the kernels read them
        codes, scale = e4m3_scale_codes(codes, scale)
    if scheme.weight_scale in ("group", "mx") and scale is not None and (scale.element_size() == 1
                                                                         or zero is not None):
        scale, zero = _padded_groups(scale), _padded_groups(zero)
    if scheme.weight_scale == "group" and zero is not None and packed(scheme.weight_type):
        scale, zero = _scale_zero_words(scale, zero)
    weight = e2m1_register_order(codes) if scheme.weight_type == "e2m1" else ready(codes)
    return [weight, scale, zero, ready(p.perm, torch.int32), ready(p.bias, torch.float32),
            ready(p.input_scale, torch.float32)]


def _kept(p: ProjectionWeights, held: list[torch.Tensor | None]) -> ProjectionWeights:
    """What the experts keep of a projection besides their kernel tensors ``held`` (_kernel_tensors'):
    each converted code, scale and zero-point tensor where the kernel reads that very tensor, else a
    stand-in (FP4 codes in another byte order, padded scales, scale-and-zero words, a contiguous copy),
    so none is pinned twice."""
    copied = p.not_held_in(dict(zip(BULK_FIELDS, held[:len(BULK_FIELDS)], strict=True)))
    return p.with_stand_ins(*copied) if copied else p


class _TritonBase(Experts):
    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        super().__init__(weights, config)
        if weights.layout != "nk":
            raise ValueError(f"the Triton MoE kernel reads layout 'nk', got {weights.layout!r}")
        self.weight_key = str(weights.weight_key)
        self.activation_key = str(weights.activation_key)
        self.scheme = scheme_from_keys(self.weight_key, self.activation_key)  # raises early if unsupported
        t13, t2 = _kernel_tensors(weights.w13, self.scheme), _kernel_tensors(weights.w2, self.scheme)
        self._tensors = t13 + t2
        self.weights = dataclasses.replace(weights, w13=_kept(weights.w13, t13), w2=_kept(weights.w2, t2))
        # by keyword, absent for every other key: second-level weight scales (NVFP4), [E, N] float32,
        # and MX FP4 scales' code range (whether their tiles may fold, _e2m1_fold)
        self._options: dict[str, object] = {
            f"{name}_scale2": p.scale2.reshape(p.scale2.shape[0], -1).to(torch.float32).contiguous()
            for name, p in (("w13", weights.w13), ("w2", weights.w2)) if p.scale2 is not None}
        codes = mx_scale_codes(weights, self.scheme)
        if codes is not None:
            self._options["mx_scale_codes"] = codes
        self._routed: dict[str, object] = {}  # the standard format's estimate of the routing (fused_experts)
        if config.routed_experts is not None:
            self._routed["routed_experts"] = config.routed_experts


class TritonExperts(_TritonBase):
    """Standard activation format: hidden [M, H] with top-k routing."""

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.moe_registry.fused_experts(
            hidden, topk_weights, topk_ids, *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, self.config.apply_router_weight_on_input, **self._options, **self._routed)


class TritonBatchedExperts(_TritonBase):
    """Batched activation format (expert parallelism): x [E, T, H] and expert_num_tokens [E]."""

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """[E, T, H] -> [E, T, H]: the first expert_num_tokens[e] rows of x[e] through expert e,
        rows past the count zero. No router weights (finalize applies them)."""
        return torch.ops.moe_registry.fused_experts_batched(
            x, expert_num_tokens.to(torch.int32), *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, **self._options)

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The standard format through the same weights (for callers that hold both formats)."""
        return torch.ops.moe_registry.fused_experts(
            hidden, topk_weights, topk_ids, *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, self.config.apply_router_weight_on_input, **self._options, **self._routed)
