"""GPTQ checkpoints (v1 ``gptq`` and GPTQModel's ``gptq_v2``) -> ``nk``.

Per projection: qweight int32 [in·bits/32, out] packed along the INPUT (element i of a word at bits
[bits·i, bits·i + bits), low first); qzeros int32 [groups, out·bits/32] packed along the output;
scales float16 [groups, out]; optional g_idx int32 [in] (group of each input column).

Zero points. ``gptq_v2`` stores them as they are. v1 (``gptq``) stores zero − 1, and GPTQModel
(which writes both) converts between the two by adding or subtracting 0x11111111 (4-bit; 0x01010101
for 8-bit) to each int32 WORD, so a zero of 0 is stored with a borrow into the next field (a word
of zeros 0 is 0xEEEEEEEF in v1). The v1 converter therefore reads zeros as
unpack((word + 0x11111111) mod 2^32), exactly as the library loads them; per field "+1" would be
wrong in exactly those words. Which one applies is the converter's registration ("gptq" or
"gptq-v2"), found by (format, layout) from the scheme spec, never by an ``if`` on the config.

Symmetric schemes (weight key uint4b8 / uint8b128, no zero point): every zero must equal the type's
bias (8 / 128), i.e. be stored as 7 / 127 in v1 and 8 / 128 in v2. Asymmetric schemes (``sym:
false``, key uint4 / uint8 with ``zp:group``): the zeros are converted into the layout's per-group
zero points.

Act-order (desc_act): g_idx is not i // g. The ``nk`` layout keeps groups contiguous, so columns are
stored sorted by group: perm = stable argsort of g_idx, stored column j = original column perm[j].
Zero points, like scales, are indexed by group and need no permutation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.checkpoint.values import describe_bad
from moe_registry.core.errors import CheckpointError
from moe_registry.formats.assemble import (
    Namer,
    ProjectionPart,
    assemble,
    group_size,
    layout_scale_dtype,
)
from moe_registry.formats.bitpack import add_to_fields, nk_bytes, pack_nibbles, unpack_int32
from moe_registry.formats.checks import cast_scales, check_scales, require
from moe_registry.formats.registry import ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights

__all__ = ["convert_gptq", "convert_gptq_v2", "act_order_perm"]


_ZEROS = "stored zero points [group, output column]"
_STORED = {0: "GPTQ v2 stores the zero itself", 1: "GPTQ v1 stores zero − 1"}


def _check_symmetric(stored: torch.Tensor, bits: int, bias: int, offset: int, full_name: str) -> None:
    """A symmetric key has no zero points: every stored zero must mean the type's bias."""
    expected = bias - offset
    bad = stored != expected
    if not bool(bad.any()):
        return
    top = (1 << bits) - 1
    overflow = stored + offset > top
    if bool(overflow.any()):
        raise CheckpointError(
            f"{full_name}: zero point out of range: "
            f"{describe_bad(stored, overflow, f'stored as {top}', _ZEROS)}, meaning {top + offset} "
            f"({_STORED[offset]}), outside 0..{top}; expected {expected} (zero = {bias}, symmetric)"
        )
    raise CheckpointError(
        f"{full_name}: asymmetric zero points: {describe_bad(stored, bad, f'not {expected}', _ZEROS)} "
        f"({_STORED[offset]}); expected {expected} everywhere (zero = {bias}); "
        "only symmetric GPTQ zero points fit this scheme's key (sym: false checkpoints bind a zp:group key)"
    )


def _zero_points(qzeros: torch.Tensor, bits: int, offset: int) -> torch.Tensor:
    """Real zero points int32 [groups, out]: GPTQModel's whole-word offset, then unpacked."""
    return unpack_int32(add_to_fields(qzeros, bits, offset) if offset else qzeros, bits, dim=1)


def act_order_perm(g_idx: torch.Tensor, k: int, group: int, full_name: str) -> torch.Tensor | None:
    """None for the trivial g_idx (i // g); otherwise the stable argsort of g_idx (int64 [K]),
    checked to put exactly ``group`` columns in each group, in group order."""
    trivial = torch.arange(k, device=g_idx.device) // group
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


def _projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext,
                zero_offset: int) -> ProjectionPart:
    key = ctx.weight_key
    bits = key.dtype.bits
    qweight = require(tensors, "qweight", name("qweight"))
    qzeros = require(tensors, "qzeros", name("qzeros"))
    scales = require(tensors, "scales", name("scales"))
    check_scales(scales, name("scales"), signed=ctx.bindings.get("signed_scales") is True)
    zero = None
    if key.zero_point == "group":
        zero = _zero_points(qzeros, bits, zero_offset).t().to(torch.uint8).contiguous()  # [N, G]
    else:
        # every word holds the one stored zero in each field: compared as words, unpacked only to say what is wrong
        expected = key.dtype.bias - zero_offset
        word = sum(expected << (bits * i) for i in range(32 // bits))
        if not bool((qzeros.to(torch.int64) & 0xFFFFFFFF == word).all()):
            _check_symmetric(unpack_int32(qzeros, bits, dim=1), bits, key.dtype.bias, zero_offset, name("qzeros"))
    k = int(qweight.shape[0]) * 32 // bits
    perm = None
    if "g_idx" in tensors:
        perm = act_order_perm(tensors["g_idx"], k, group_size(key, k), name("g_idx"))
    if perm is None:
        weight = nk_bytes(qweight, bits, dim=0)
    else:  # act order: the columns in group order
        codes = unpack_int32(qweight, bits, dim=0).t()[:, perm]  # [N, K]
        weight = pack_nibbles(codes) if bits == 4 else codes.to(torch.uint8).contiguous()
    return ProjectionPart(
        weight=weight,
        scale=cast_scales(scales.t(), layout_scale_dtype(key), name("scales")).contiguous(),
        zero=zero,
        perm=perm,
        perm_tensor=None if perm is None else "g_idx",
    )


_TYPES = ("uint4b8", "uint8b128", "uint4", "uint8")


def _v1(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    return _projection(tensors, name, ctx, zero_offset=1)


def _v2(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    return _projection(tensors, name, ctx, zero_offset=0)


def convert_gptq(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """GPTQ v1 (zeros stored − 1), symmetric (uint4b8 / uint8b128) or with zero points (uint4 / uint8
    zp:group), with or without act-order, to ``nk``."""
    return assemble(experts, ctx, _v1)


def convert_gptq_v2(experts: Sequence[ExpertTensors], ctx: ConvertContext) -> ExpertWeights:
    """GPTQModel's gptq_v2 (zeros stored as they are), otherwise as :func:`convert_gptq`."""
    return assemble(experts, ctx, _v2)
