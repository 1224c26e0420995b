"""The top-k reduction: each token's k expert rows (and split-K partial sums) added into one row."""

import torch
import triton
import triton.language as tl

from .chain import grid_dependency, pdl_launch


@triton.jit
def _moe_sum_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, H, num_experts, stride_xs, stride_xm, stride_xk, stride_om,
                    SPLITS: tl.constexpr, TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                    HAS_IDS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[row] = sum over splits s and top-k j of x[s, row, j] (× w[row, j]), in float32. With
    ids, pairs whose expert is outside [0, E) (foreign: never computed, x unwritten) add nothing."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        width = H
        if HAS_IDS:  # a foreign pair reads no columns
            expert = tl.load(ids_ptr + row * TOP_K + j)
            width = tl.where((expert >= 0) & (expert < num_experts), H, 0)
        mask = cols < width
        v = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            v += tl.load(x_ptr + s * stride_xs + row * stride_xm + j * stride_xk + cols, mask=mask,
                         other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v *= tl.load(w_ptr + row * TOP_K + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def sum_topk(x: torch.Tensor, topk_weights: torch.Tensor | None = None,
             out: torch.Tensor | None = None, pdl: bool = False,
             topk_ids: torch.Tensor | None = None, num_experts: int = 0) -> torch.Tensor:
    """Plain implementation of :func:`moe_sum` (optionally into ``out``). ``x`` may also be
    [S, M, k, H]: S split-K partial sums of the same pairs, added here in the same pass. ``pdl``:
    launch as part of a programmatic-dependent-launch chain. ``topk_ids`` [M, k]: pairs routed
    outside [0, num_experts) are skipped (their rows of x were never written)."""
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    splits, m, top_k, h = x4.shape
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    if out is None:
        out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if topk_weights is not None:
        topk_weights = topk_weights.contiguous()
    if topk_ids is not None:
        topk_ids = topk_ids.contiguous()
    block_h = min(triton.next_power_of_2(h), 1024)
    _moe_sum_kernel[(m, triton.cdiv(h, block_h))](
        x4, topk_weights if topk_weights is not None else x4, topk_ids if topk_ids is not None else x4, out,
        h, num_experts, x4.stride(0), x4.stride(1), x4.stride(2), out.stride(0), SPLITS=splits, TOP_K=top_k,
        HAS_WEIGHTS=topk_weights is not None, HAS_IDS=topk_ids is not None, BLOCK_H=block_h, PDL=pdl,
        num_warps=4, **pdl_launch(pdl))
    return out


@torch.library.custom_op("moe_registry::moe_sum", mutates_args=())
def moe_sum(x: torch.Tensor, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """[M, k, H] -> [M, H] in x's dtype: sum over k, weighted by ``topk_weights`` [M, k] when the
    router weights were not applied already. Accumulates in float32."""
    return sum_topk(x, topk_weights)


@moe_sum.register_fake
def _(x, topk_weights=None):
    return x.new_empty(x.shape[0], x.shape[2])
