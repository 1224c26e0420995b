"""GPTQ (v1, symmetric) checkpoints -> ``nk``.

Per projection: qweight int32 [in·bits/32, out] packed along the INPUT (element i of a word at bits
[bits·i, bits·i + bits), low first); qzeros int32 [groups, out·bits/32] packed along the output and
storing zero − 1 (GPTQ v1); scales float16 [groups, out]; optional g_idx int32 [in] (group of each
input column). Only symmetric checkpoints are supported: every zero must equal the type's bias
(8 for uint4b8, 128 for uint8b128), i.e. be stored as 7 / 127.

Act-order (desc_act): g_idx is not i // g. The ``nk`` layout keeps groups contiguous, so columns are
stored sorted by group: perm = stable argsort of g_idx, stored column j = original column perm[j].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.errors import CheckpointError
from moe_registry.formats.assemble import (
    Namer,
    ProjectionPart,
    assemble,
    expect_weight_type,
    group_size,
    layout_scale_dtype,
)
from moe_registry.formats.bitpack import pack_nibbles, unpack_int32
from moe_registry.formats.checks import cast_scales, check_scales, describe_bad, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors, register_converter
from moe_registry.weights import ExpertWeights

__all__ = ["convert_gptq", "act_order_perm"]


_ZEROS = "stored zero points [group, output column]"


def _check_symmetric(zeros_minus_one: torch.Tensor, bits: int, bias: int, full_name: str) -> None:
    """GPTQ v1 stores zero − 1; symmetric means every zero equals the type's bias."""
    expected = bias - 1
    bad = zeros_minus_one != expected
    if not bool(bad.any()):
        return
    top = (1 << bits) - 1
    overflow = zeros_minus_one == top
    if bool(overflow.any()):
        raise CheckpointError(
            f"{full_name}: zero point out of range: "
            f"{describe_bad(zeros_minus_one, overflow, f'stored as {top}', _ZEROS)}, meaning {top + 1} "
            f"(GPTQ v1 stores zero − 1), outside 0..{top}; "
            f"expected {expected} (zero = {bias}, symmetric)"
        )
    raise CheckpointError(
        f"{full_name}: asymmetric zero points: {describe_bad(zeros_minus_one, bad, f'not {expected}', _ZEROS)} "
        f"(GPTQ v1 stores zero − 1); expected {expected} everywhere (zero = {bias}); "
        "only symmetric GPTQ checkpoints are supported"
    )


def act_order_perm(g_idx: torch.Tensor, k: int, group: int, full_name: str) -> torch.Tensor | None:
    """None for the trivial g_idx (i // g); otherwise the stable argsort of g_idx (int64 [K]),
    checked to put exactly ``group`` columns in each group, in group order."""
    trivial = torch.arange(k) // group
    g = g_idx.to(torch.int64).reshape(-1)
    if torch.equal(g, trivial):
        return None
    groups = -(-k // group)
    outside = (g < 0) | (g >= groups)
    if bool(outside.any()):
        raise CheckpointError(
            f"{full_name}: {describe_bad(g, outside, f'outside 0..{groups - 1}')}; "
            f"expected group indices of {k} columns in groups of {group}"
        )
    perm = torch.argsort(g, stable=True)
    sorted_groups = g[perm]
    if not torch.equal(sorted_groups, trivial):
        counts = torch.bincount(g, minlength=groups)
        wrong = int((counts != torch.bincount(trivial, minlength=groups)).nonzero()[0, 0])
        raise CheckpointError(
            f"{full_name}: group {wrong} has {int(counts[wrong])} columns; expected every group to "
            f"hold {group} columns (the last one fewer when {k} is not a multiple), as act-order g_idx does"
        )
    return perm


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    key = ctx.weight_key
    bits = key.dtype.bits
    qweight = require(tensors, "qweight", name("qweight"))
    qzeros = require(tensors, "qzeros", name("qzeros"))
    scales = require(tensors, "scales", name("scales"))
    check_scales(scales, name("scales"))
    _check_symmetric(unpack_int32(qzeros, bits, dim=1), bits, key.dtype.bias, name("qzeros"))
    codes = unpack_int32(qweight, bits, dim=0).t()  # [N, K]
    k = int(codes.shape[1])
    perm = None
    if "g_idx" in tensors:
        perm = act_order_perm(tensors["g_idx"], k, group_size(key, k), name("g_idx"))
    if perm is not None:
        codes = codes[:, perm]
    weight = pack_nibbles(codes) if bits == 4 else codes.to(torch.uint8).contiguous()
    return ProjectionPart(
        weight=weight,
        scale=cast_scales(scales.t(), layout_scale_dtype(key), name("scales")).contiguous(),
        perm=perm,
        perm_tensor=None if perm is None else "g_idx",
    )


@register_converter("gptq", "nk")
def convert_gptq(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """Symmetric GPTQ v1 (uint4b8 or uint8b128), with or without act-order, to ``nk``."""
    expect_weight_type(ctx, "gptq", "uint4b8", "uint8b128")
    return assemble(experts, ctx, _projection)
