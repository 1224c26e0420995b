"""What a layer call launches, decided on the host from shapes alone: which GEMMs quantise their own
input or run as the decode GEMV, which amax or row-sum pieces GEMM1 leaves for GEMM2, and how a
GEMM's input is quantised (:func:`_quantize`).
"""

from dataclasses import dataclass

import torch

from .activation_quant import act_quant, prefill_row_chunks
from .align import row_group_sums
from .fp8_act import FP8_DYNAMIC_MODES, quant_fp8_dynamic
from .launch import ONE_TOKEN_QUANTS, _column_tiles, _Rows, _RowSums, _takes_gemv, _zero_sums
from .layout import _Proj
from .variant import KernelVariant

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


GEMV_PAIRS_PER_EXPERT = 1.5


def _sum_pieces_per_group(config1: dict, config2: dict, w2: _Proj, variant: KernelVariant) -> int:
    """How many of GEMM1's per-tile row sums (its epilogue's ``sums_out``) make one weight group of
    a ZERO_SUMS GEMM2's input, or 0 where GEMM2 takes no sums or GEMM1 cannot leave them: the
    standard kernel's column tiles (BLOCK_N / 2 outputs with the fused activation) must divide the
    group."""
    width = config1["BLOCK_N"] // 2
    if not _zero_sums(config2, w2) or config1["SWAP_AB"] or variant.weight_group % width:
        return 0
    return variant.weight_group // width


def _gemm1_sum_pieces(rows: _Rows, pairs: int, config1: dict, config2: dict, w13: _Proj, w2: _Proj,
                      variant: KernelVariant, activation: str, device: torch.device) -> _RowSums | None:
    """The buffer GEMM1's epilogue fills with a ZERO_SUMS GEMM2's input sums (its ``sums_out``), as
    GEMM2 reads it, where GEMM1 can leave them (_sum_pieces_per_group) and GEMM2 does not find
    them itself (one-pair blocks)."""
    pieces = _sum_pieces_per_group(config1, config2, w2, variant)
    if not pieces or rows.one_pair_blocks:
        return None
    tiles = _column_tiles(w13.n, config1["BLOCK_N"], activation)
    return _RowSums(torch.empty(pairs, tiles, dtype=torch.float32, device=device), pieces)


def _input_row_sums(a: torch.Tensor, config: dict, w: _Proj, variant: KernelVariant, rows: _Rows,
                    pdl: bool) -> _RowSums | None:
    """A GEMM's input sums where its config takes ZERO_SUMS and nothing before it left them: found by
    the kernel itself on one-pair blocks, else by their own launch."""
    if not _zero_sums(config, w):
        return None
    if rows.one_pair_blocks:
        return _RowSums(None)
    return _RowSums(row_group_sums(a, variant.weight_group, pdl))


def _amax_pieces_shape(variant: KernelVariant, tokens: int, top_k: int, config1: dict, w13: _Proj,
                       activation: str) -> tuple[int, int] | None:
    """The shape [rows, column tiles] of the amax pieces GEMM1 leaves, or None: dynamic fp8
    intermediates at decode (_fp8_pieces_shape) and per-token int8 ones (AMAX_PIECES). The int8
    ones' quantisation then cuts rows into chunks like the group modes and reads each value once:
    at decode, instead of one program reading a whole row (14336 columns on Mixtral); at prefill,
    only instead of an amax pass and a codes pass over many chunks (1408 columns in 11 on
    DeepSeek-V2-Lite: the layer 2-3% faster on an H100; on Qwen3's 768 in 3 and Mixtral's 14336
    in 7, 1% slower: the epilogue's row max costs more)."""
    if variant.act_quant in FP8_DYNAMIC_MODES:
        return _fp8_pieces_shape(variant, tokens, top_k, config1, w13, activation)
    if variant.act_quant != "int8_token" or not AMAX_PIECES:
        return None
    width = w13.n // 2 if activation != "none" else w13.n
    if tokens > AMAX_PIECES_MAX_TOKENS and prefill_row_chunks(width) <= AMAX_PIECES_MIN_CHUNKS:
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


def _quantised_in_gemm(variant: KernelVariant, tokens: int, top_k: int, w13: _Proj, w2: _Proj,
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
    gemv1, gemv2 = few and _takes_gemv(variant, w13), few and _takes_gemv(variant, w2)
    if tokens > 1:
        both = gemv1 and gemv2
        return _QuantisedInGemm(both, both, both, both)
    if not (SCALE_IN_GEMM and variant.act_quant in ONE_TOKEN_QUANTS):
        return _QuantisedInGemm(gemv1, gemv2, gemv1, gemv2)
    weight_bytes = _expert_weight_bytes(w13, w2) * top_k
    gemm2_budget = SCALE_IN_GEMM2_MAX_BYTES.get(variant.act_quant, SCALE_IN_GEMM_MAX_BYTES)
    return _QuantisedInGemm(gemm1=gemv1 or w13.perm is None and weight_bytes <= SCALE_IN_GEMM_MAX_BYTES,
                            gemm2=gemv2 or w2.perm is None and weight_bytes <= gemm2_budget, gemv1=gemv1, gemv2=gemv2)


def _input_halves(config2: dict, w2: _Proj, activation: str) -> bool:
    """Whether GEMM1 stores its output as each row's even columns, then its odd ones, for GEMM2 to read
    so: GEMM2's tile asks (INPUT_HALVES, fitted), its weights are in column order, GEMM1 fuses the
    activation (whose epilogue writes them)."""
    return bool(config2.get("INPUT_HALVES")) and w2.perm is None and activation != "none"


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


def _fp8_pieces_shape(variant: KernelVariant, tokens: int, top_k: int, config1: dict, w13: _Proj,
                      activation: str) -> tuple[int, int] | None:
    """The amax pieces of a dynamic fp8 intermediate at decode: for GEMM2 itself to quantise one
    token's (SCALE_IN_GEMM), else for fp8_act.quant_fp8_from_pieces (AMAX_PIECES; per tensor,
    at most FP8_TENSOR_PIECES of them)."""
    if activation == "none":
        return None
    shape = tokens * top_k, _column_tiles(w13.n, config1["BLOCK_N"], activation)
    if tokens == 1 and SCALE_IN_GEMM:
        return shape
    if not AMAX_PIECES or tokens > AMAX_PIECES_MAX_TOKENS:
        return None
    return shape if variant.act_quant == "fp8_token" or shape[0] * shape[1] <= FP8_TENSOR_PIECES else None


def _quantize(x: torch.Tensor, variant: KernelVariant, input_scale: torch.Tensor | None, **kwargs
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM input as the activation key wants it (x itself when unquantized); kwargs go to
    activation_quant.act_quant."""
    if variant.act_quant == "none":
        return x, None
    if variant.act_quant in FP8_DYNAMIC_MODES:  # per-token / per-tensor dynamic fp8 (fp8_act)
        if kwargs.get("expert_num_tokens") is not None:  # the batched format's padding rows would join the amax
            raise ValueError(f"{variant.act_quant} activations run in the standard activation format only")
        return quant_fp8_dynamic(x, variant.act_quant, row_scale=kwargs.get("row_scale"),
                                 pair_ids=kwargs.get("pair_ids"), num_experts=kwargs.get("num_experts", 0),
                                 pdl=kwargs.get("pdl", False))
    return act_quant(x, "none", variant.act_quant, static_scale=input_scale,
                                group=variant.act_group or 128, **kwargs)


def _codes_dtype(variant: KernelVariant, config: dict, compute_dtype: torch.dtype) -> dict:
    """activation_quant.act_quant's ``out_dtype`` for the input of a GEMM with this tile config: int8
    codes as 16-bit floats where its tiles run a 16-bit dot of them (variant.float_w4a8), else the
    default (no argument)."""
    if variant.float_w4a8(config["BLOCK_M"]):
        return {"out_dtype": compute_dtype}
    return {}
