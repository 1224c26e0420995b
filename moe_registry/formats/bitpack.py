"""Sub-byte codes packed into int32 words (the checkpoint side) and into nibble bytes (the ``nk``
layout side). Checkpoint formats differ only in which dimension they pack along and in the order
of the elements inside a word, so both are parameters here."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["unpack_int32", "pack_int32", "pack_nibbles", "nk_bytes", "add_to_fields"]


def unpack_int32(words: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 words -> int32 codes, ``32/bits`` times longer along ``dim``.

    Field i of a word (bits [bits·i, bits·i + bits), low first) is element ``order[i]`` of the
    word's run of ``32/bits`` elements; ``order=None`` means field i is element i.
    """
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    moved = words.movedim(dim, -1).to(torch.int32)
    fields = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, field]
    if order is not None:
        fields = fields[..., _inverse(order)]  # [..., W, element]
    return fields.flatten(-2).movedim(-1, dim)


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """The inverse of :func:`unpack_int32`: codes in [0, 2**bits) -> int32 words along ``dim``."""
    per_word = 32 // bits
    moved = codes.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"cannot pack {moved.shape[-1]} codes into words of {per_word}")
    runs = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_word, per_word)  # [..., W, element]
    if order is not None:
        runs = runs[..., list(order)]  # [..., W, field]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = ((runs & ((1 << bits) - 1)) << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., K] -> uint8 [..., K/2] as the ``nk`` layout stores them: input k in byte
    k // 2, low nibble for even k."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def nk_bytes(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 4- or 8-bit codes low field first, in element order, along ``dim`` (0: [K·bits/32, N]
    as GPTQ stores them; 1: [N, K·bits/32] as compressed-tensors does) -> the ``nk`` layout's bytes
    [N, K·bits/8]: the same as unpacking the codes and packing them again (:func:`pack_nibbles`), because a
    little-endian word's bytes already hold its fields in that order; read as bytes, which takes a fraction of
    the time of unpacking. On a big-endian machine the codes are unpacked and packed."""
    rows = (words.t() if dim == 0 else words).contiguous()
    if sys.byteorder == "little":
        return rows.view(torch.uint8)
    codes = unpack_int32(rows, bits, dim=1)
    return pack_nibbles(codes) if bits == 4 else codes.to(torch.uint8).contiguous()


def add_to_fields(words: torch.Tensor, bits: int, delta: int) -> torch.Tensor:
    """int32 words + ``delta`` in every ``bits``-wide field, as ONE int32 addition per word (mod 2^32):
    a field that overflows carries into the next one (and one that underflows borrows), which is how
    GPTQModel moves zero points between its v1 and v2 formats. A new int32 tensor."""
    step = sum(1 << (bits * i) for i in range(32 // bits))
    total = (words.to(torch.int64) + delta * step) & 0xFFFFFFFF
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)


def _inverse(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for field_index, element in enumerate(order):
        inv[element] = field_index
    return inv
