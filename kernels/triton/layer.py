"""The fused MoE layer in Triton, as torch custom ops (``fused_experts``, ``fused_experts_batched``):
the whole layer is one opaque op for torch.compile.

The layer (standard format) is::

    align(topk_ids) (+ quantise(hidden), same launch at decode)
        -> GEMM1 (w13, + bias, act_and_mul in its epilogue) -> quantise?
        -> GEMM2 (w2, + bias, × router weight, split-K) -> sum over top-k (and splits)

Weights are the ``nk`` layout of :mod:`moe_registry.formats.weights` ([E, N, K], K contiguous), which
is also what fp8 and int8 tensor-core dots want for B, as
:class:`~moe_registry_kernels.triton.layout.TritonWeightLayout` packs it. The GEMM kernel is specialised by
constexprs that say how a weight tile becomes something a ``tl.dot`` takes:

- 16-bit weights: used as they are.
- integer codes (uint4 with zero points, uint4b8, int4, uint8b128, int8 as W8A16): 4-bit tiles are
  loaded once as bytes and split into low (even k) and high (odd k) nibbles, each multiplied
  with the matching even/odd half of the activation tile, so no byte is loaded twice; one scale
  (and zero) per group and column is loaded per tile and broadcast over the group's rows.
- W8A8 int8: int8 × int8 dot accumulating in int32; per-token and per-channel scales are applied
  once after the K loop.
- FP4 (e2m1; MXFP4, NVFP4): dequantised in registers to the 16-bit activation dtype, from codes the
  layout puts once in the decoders' byte order (:func:`~moe_registry_kernels.triton.fp4_dequant.e2m1_register_order`),
  NVFP4's e4m3 group scales as exponent codes (:func:`~moe_registry_kernels.triton.fp4_dequant.e4m3_scale_codes`).
- fp8 with e8m0 per-32 scales (MXFP8): dequantised to the 16-bit activation dtype in registers
  (Hopper has no MX dot); MXFP8 activations, when the variant quantises them, are dequantised the
  same way, so the numerics are the variant's.
- fp8 with 128×128 block scales (W8A8): fp8 dot per K tile, scaled there by the token-group and
  weight-block scales (they change every 128 columns).
- fp8 with per-tensor or per-channel weight scales (W8A8: AutoFP8, ModelOpt FP8, compressed-tensors
  FP8 / FP8_DYNAMIC): fp8 × fp8 dot accumulating in float32 over all of K; the activation scale
  (static per tensor, dynamic per token or per tensor, see :mod:`~moe_registry_kernels.triton.fp8_act`)
  and
  the per-channel scale are applied once after the loop, as for int8.

The rooms of the package (:mod:`moe_registry_kernels.triton`): the keys read as kernel choices in
:mod:`~moe_registry_kernels.triton.variant`, the weight layout in :mod:`~moe_registry_kernels.triton.layout`,
tile configs in :mod:`~moe_registry_kernels.triton.tile_config`, what a call launches in
:mod:`~moe_registry_kernels.triton.plan`, the GEMM launchers in :mod:`~moe_registry_kernels.triton.launch`
and the kernels in :mod:`~moe_registry_kernels.triton.gemm`, the glue ops in
:mod:`~moe_registry_kernels.triton.align`, :mod:`~moe_registry_kernels.triton.activation_quant`,
:mod:`~moe_registry_kernels.triton.fp8_act` and :mod:`~moe_registry_kernels.triton.reduce`.

Nothing here reads a device value on the host: buffers are sized by worst cases and kernels
skip blocks past ``num_tokens_post_padded``, so the layer can be captured in a CUDA graph.
"""

import torch

from . import launch
from .align import align, align_quant, align_row_sums
from .chain import pdl_supported
from .fp8_act import FP8_DYNAMIC_MODES, align_quant_fp8, quant_fp8_from_pieces
from .launch import STATIC_QUANTS, _gemm, _InputScale, _Rows, _RowSums, _zero_sums
from .layout import _Proj
from .plan import (
    _amax_pieces_shape,
    _codes_dtype,
    _gemm1_sum_pieces,
    _input_halves,
    _input_row_sums,
    _quantised_in_gemm,
    _quantize,
)
from .reduce import sum_topk
from .tile_config import _layer_configs
from .variant import variant_from_keys


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
    variant = variant_from_keys(weight_key, activation_key)
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
    row_scale = weights if on_input and variant.act_quant != "none" else None
    # the layer's launches form one programmatic-dependent-launch chain where the GPU has it: each
    # kernel is scheduled while the one before drains, and waits for its writes before starting
    pdl = pdl_supported(hidden.device)
    # one token whose activations take one scale per token or per tensor: both GEMMs quantise
    # their input themselves (SCALE_IN_GEMM), no quantisation launch; int8 activations on int4 or
    # int8 weights for a few tokens: the decode GEMV, which quantises its input by its own launch
    in_gemm = _quantised_in_gemm(variant, m, top_k, w13, w2, row_scale, routed_experts)
    config1, config2 = _layer_configs(m, top_k, num_experts, w13, w2, weight_key, activation_key, variant,
                                      hidden.device, split_gemm2=True,
                                      tiles_read=(not in_gemm.gemv1, not in_gemm.gemv2))
    static = variant.act_quant in STATIC_QUANTS
    scale1 = _InputScale(rows=1, static=static, gemv=in_gemm.gemv1) if in_gemm.gemm1 else None
    sums1 = None  # a ZERO_SUMS GEMM1's input sums
    if m == 1:  # one token: a row block per expert it picked, straight from the router's ids
        if in_gemm.gemm1:
            a1, a1_scale = hidden, w13.input_scale if static else None
        else:
            a1, a1_scale = _quantize(hidden, variant, w13.input_scale, row_scale=row_scale, pdl=pdl,
                                     **_codes_dtype(variant, config1, dt))
        rows = _Rows(expert_ids=topk_ids.reshape(-1).contiguous(), num_valid=top_k, one_pair_blocks=True)
        sums1 = None if in_gemm.gemv1 else _input_row_sums(a1, config1, w13, variant, rows, pdl)
    elif in_gemm.gemv1:  # the GEMV's row blocks: GEMV_BLOCK_M aligned pairs of one expert
        # (read at the call: the GEMV's launch reads the same module attribute)
        sorted_ids, expert_ids, num_post = align(topk_ids, num_experts, launch.GEMV_BLOCK_M, pdl=pdl)
        a1, a1_scale = hidden, w13.input_scale if static else None
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    elif variant.act_quant in FP8_DYNAMIC_MODES:  # fp8_act's alignment and quantisation
        sorted_ids, expert_ids, num_post, a1, a1_scale = align_quant_fp8(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, variant.act_quant, row_scale=row_scale, pdl=pdl)
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    elif _zero_sums(config1, w13):  # 16-bit input: its row sums come with the alignment, in one launch at decode
        sorted_ids, expert_ids, num_post, sums = align_row_sums(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, variant.weight_group, pdl=pdl)
        a1, a1_scale, sums1 = hidden, None, _RowSums(sums)
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    else:
        sorted_ids, expert_ids, num_post, a1, a1_scale = align_quant(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, variant.act_quant, static_scale=w13.input_scale,
            row_scale=row_scale, group=variant.act_group or 128, pdl=pdl, **_codes_dtype(variant, config1, dt))
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    gemm1_weight = "input" if on_input and variant.act_quant == "none" else "none"
    inter = torch.empty(m * top_k, w13.n // 2, dtype=dt, device=dev)
    # (a GEMV GEMM2 finds its rows' amax itself; a GEMV GEMM1 leaves none)
    gemv = in_gemm.gemv1 or in_gemm.gemv2
    pieces = None if gemv else _amax_pieces_shape(variant, m, top_k, config1, w13, activation)
    amax = torch.empty(pieces, dtype=torch.float32, device=dev) if pieces else None
    # a ZERO_SUMS GEMM2's input sums, left in pieces by GEMM1's epilogue where it can
    pieces2 = _gemm1_sum_pieces(rows, m * top_k, config1, config2, w13, w2, variant, activation, dev)
    halves = _input_halves(config2, w2, activation)
    _gemm(a1, a1_scale, w13, variant, inter, rows, config1, compute_dtype=dt, top_k=top_k,
          routed_weight=gemm1_weight, topk_weights=weights, fuse_act=activation, amax_pieces=amax, pdl=pdl,
          input_scale=scale1, row_sums=sums1, sums_out=pieces2.sums if pieces2 else None, halves_out=halves)

    scale2 = None
    pair_ids = topk_ids.reshape(-1).contiguous()  # each pair's expert
    if in_gemm.gemv2:  # the GEMV quantises each intermediate row itself
        a2, a2_scale = inter, w2.input_scale if static else None
        scale2 = _InputScale(rows=m * top_k, pair_ids=pair_ids, static=static, gemv=True)
    elif in_gemm.gemm2 and (static or amax is not None):  # GEMM2 quantises the token's intermediates itself
        a2, a2_scale = inter, w2.input_scale if static else None
        scale2 = _InputScale(rows=top_k, pieces=amax, pair_ids=pair_ids, static=static)
    elif amax is not None and variant.act_quant in FP8_DYNAMIC_MODES:
        a2, a2_scale = quant_fp8_from_pieces(inter, variant.act_quant, amax, pair_ids, num_experts, pdl=pdl)
    elif variant.act_quant in FP8_DYNAMIC_MODES:
        # fp8_tensor's one amax skips the rows of pairs routed to another rank's expert (never written)
        a2, a2_scale = _quantize(inter, variant, None, pair_ids=pair_ids, num_experts=num_experts, pdl=pdl)
    else:  # (the row of a pair routed to another rank's expert, never written, is left alone)
        a2, a2_scale = _quantize(inter, variant, w2.input_scale, amax_pieces=amax, pair_experts=pair_ids,
                                 num_experts=num_experts, pdl=pdl, **_codes_dtype(variant, config2, dt))
    split = 1 if in_gemm.gemv2 else config2["SPLIT_K"]
    if split > 1:
        partial = torch.empty(split, m * top_k, w2.n, dtype=torch.float32, device=dev)
    else:
        partial = out if top_k == 1 else torch.empty(m * top_k, w2.n, dtype=dt, device=dev)
    sums2 = None if in_gemm.gemv2 else pieces2 or _input_row_sums(a2, config2, w2, variant, rows, pdl)
    _gemm(a2, a2_scale, w2, variant, partial, rows, config2, compute_dtype=dt,
          routed_weight="none" if on_input else "output", topk_weights=weights, pdl=pdl, input_scale=scale2,
          row_sums=sums2, input_halves=halves)
    if partial is not out:
        sum_topk(partial.view(split, m, top_k, w2.n), out=out, pdl=pdl, topk_ids=topk_ids,
                            num_experts=num_experts)
    return out


def _fused_experts_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor, w13: _Proj, w2: _Proj,
                           weight_key: str, activation_key: str, activation: str) -> torch.Tensor:
    variant = variant_from_keys(weight_key, activation_key)
    num_experts, capacity, hidden_size = x.shape
    out = torch.empty_like(x)
    if capacity == 0:
        return out
    # the capacity as rows per expert: tokens = capacity, top-k 1 over one expert's slab
    config1, config2 = _layer_configs(capacity, 1, 1, w13, w2, weight_key, activation_key, variant, x.device,
                                      split_gemm2=False)
    rows = _Rows(expert_num_tokens=expert_num_tokens, capacity=capacity)
    # rows past an expert's count are skipped (left unwritten) until GEMM2 writes them as zeros
    counts = {"expert_num_tokens": expert_num_tokens, "capacity": capacity}
    a1, a1_scale = _quantize(x.reshape(num_experts * capacity, hidden_size), variant, w13.input_scale, **counts,
                             **_codes_dtype(variant, config1, x.dtype))
    inter = torch.empty(num_experts * capacity, w13.n // 2, dtype=x.dtype, device=x.device)
    sums1 = _input_row_sums(a1, config1, w13, variant, rows, False)
    pieces2 = _gemm1_sum_pieces(rows, num_experts * capacity, config1, config2, w13, w2, variant, activation,
                                x.device)
    _gemm(a1, a1_scale, w13, variant, inter, rows, config1, compute_dtype=x.dtype, fuse_act=activation,
          row_sums=sums1, sums_out=pieces2.sums if pieces2 else None)
    a2, a2_scale = _quantize(inter, variant, w2.input_scale, **counts, **_codes_dtype(variant, config2, x.dtype))
    sums2 = pieces2 or _input_row_sums(a2, config2, w2, variant, rows, False)
    _gemm(a2, a2_scale, w2, variant, out.view(num_experts * capacity, hidden_size), rows, config2,
          compute_dtype=x.dtype, write_empty=True, row_sums=sums2)
    return out


# ---------------------------------------------------------------------------------------------
# custom ops: the whole layer is one opaque op for torch.compile


def run_fused_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
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
    (TritonWeightLayout.pack puts them there); the keys are QuantKey strings; ``mx_scale_codes``:
    see mx_scale_codes; ``routed_experts``: the experts the router picks among where more than these
    (ExpertsConfig.routed_experts)."""
    p13, p2 = _projections(hidden.shape[1], w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale,
                           w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale, w13_scale2, w2_scale2,
                           mx_scale_codes)
    return _fused_experts(hidden, topk_weights, topk_ids, p13, p2, weight_key, activation_key, activation,
                          router_weight_on_input, routed_experts)


# The op is what torch.compile sees (one opaque call); an eager caller runs the function itself, as the op's
# dispatch (custom-op glue, autograd and dynamo wrappers) costs more host time than a launch.
fused_experts = torch.library.custom_op("moe_registry::fused_experts", mutates_args=())(run_fused_experts)


@fused_experts.register_fake
def _(hidden, *args):
    return torch.empty_like(hidden)


def run_fused_experts_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor,
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


fused_experts_batched = torch.library.custom_op("moe_registry::fused_experts_batched",
                                                mutates_args=())(run_fused_experts_batched)


@fused_experts_batched.register_fake
def _(x, *args):
    return torch.empty_like(x)
