"""Dequantisation of converted expert weights back to real values: the definition of what every
weight layout in :mod:`moe_registry.formats.weights` means. The torch reference and the tests read weights
only through here, so a layout has exactly one meaning.
"""

from __future__ import annotations

import torch
from moe_registry_kernels.fp4 import e2m1_to_float

from moe_registry.core.keys import GroupShape, QuantKey
from moe_registry.formats.weights import ProjectionWeights

__all__ = ["dequantize", "unpack_int4", "pack_int4", "expand_groups", "e8m0_to_float"]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] raw nibble codes; input k is byte k//2, low nibble for even k."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 wants uint8 packed codes, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes in 0..15 -> uint8 [..., K/2]; the inverse of :func:`unpack_int4`."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 wants an even last dimension, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def e8m0_to_float(raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw e8m0 exponent bytes -> 2**(e-127) (exact in float32, subnormal at e=0)."""
    return torch.exp2(raw.to(torch.int32).to(torch.float64) - 127.0).to(dtype)


def _repeat_for(stored: int, extent: int, group: int, what: str) -> int:
    """How many elements along one dimension share one stored scale entry."""
    if stored == extent:
        return 1
    if stored == 1:
        return extent
    if group > 0 and -(-extent // group) == stored:
        return group
    raise ValueError(
        f"{what} has {stored} entries along a dimension of size {extent}; wanted 1, {extent} "
        f"or ceil({extent}/{group})"
    )


def expand_groups(t: torch.Tensor, n: int, k: int, group: GroupShape, what: str = "scale") -> torch.Tensor:
    """[E, n', k'] per-group values -> [E, n, k]: each entry repeated over the rows x cols it covers.

    Per-channel/per-tensor scales stored expanded as [E, N, 1] are accepted as well as the
    nominal [E, ceil(N/rows), ceil(K/cols)].
    """
    if t.dim() != 3:
        raise ValueError(f"{what} must be 3-D [E, N/rows, K/cols], got shape {tuple(t.shape)}")
    rr = _repeat_for(t.shape[1], n, group.rows, what)
    rc = _repeat_for(t.shape[2], k, group.cols, what)
    if rr > 1:
        t = t.repeat_interleave(rr, dim=1)[:, :n]
    if rc > 1:
        t = t.repeat_interleave(rc, dim=2)[:, :, :k]
    return t


def _codes(proj: ProjectionWeights, key: QuantKey, k: int) -> torch.Tensor:
    """Stored values as integers with the type's bias removed (zero point not yet applied), int32."""
    st = key.dtype
    w = proj.weight
    if st.bits == 4:
        codes = unpack_int4(w).to(torch.int32)
        if codes.shape[-1] != k:
            raise ValueError(f"packed 4-bit weight unpacks to K={codes.shape[-1]}, expected {k}")
        if st.signed:  # int4: two's complement nibble
            codes = torch.where(codes >= 8, codes - 16, codes)
        return codes - st.bias
    if st.name == "int8":
        if w.dtype != torch.int8:
            raise ValueError(f"int8 weight must be stored as torch.int8, got {w.dtype}")
        return w.to(torch.int32)
    if st.name in ("uint8", "uint8b128"):
        if w.dtype != torch.uint8:
            raise ValueError(f"{st.name} weight must be stored as torch.uint8, got {w.dtype}")
        return w.to(torch.int32) - st.bias
    raise ValueError(f"no integer decoding for weight type {st.name}")


def _e2m1_values(w: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed FP4 codes uint8 [E, N, K/2] -> their e2m1 values [E, N, K] in ``dtype``."""
    if w.dtype != torch.uint8:
        raise ValueError(f"e2m1 weight must be packed uint8 codes, got {w.dtype}")
    codes = unpack_int4(w)
    if codes.shape[-1] != k:
        raise ValueError(f"packed e2m1 weight unpacks to K={codes.shape[-1]}, expected {k}")
    return e2m1_to_float(codes, dtype)


def _logical_k(proj: ProjectionWeights, key: QuantKey) -> int:
    k = int(proj.weight.shape[-1])
    return 2 * k if key.quantized and key.dtype.bits == 4 else k


def dequantize(proj: ProjectionWeights, key: QuantKey, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Real-valued weights [E, N, K] (``dtype``, default float32) in the ORIGINAL input-column order.

    value = (code - type bias - zero) * scale for integer types, fp8 * scale for fp8, e2m1 value *
    (scale * scale2) for FP4 (the product of the group and global scales first, as ModelOpt's
    NVFP4QTensor.dequantize), with e8m0 scales read as 2**(e-127); act-order ``perm`` is undone
    (stored column j -> column perm[j]).
    ``proj`` is not modified. Bias and input_scale are not applied here.
    """
    w = proj.weight
    if w.dim() != 3:
        raise ValueError(f"weight must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    e, n = int(w.shape[0]), int(w.shape[1])
    k = _logical_k(proj, key)

    if not key.quantized:
        out = w.to(dtype)
    else:
        if key.scale2 is not None and proj.scale2 is None:
            raise ValueError(f"weight key {key} has a second-level scale but the projection has no scale2")
        if proj.scale is None:
            raise ValueError(f"weight key {key} is quantized but the projection has no scale")
        group = key.scale.group
        if key.scale.dtype.name == "e8m0":
            if proj.scale.dtype != torch.uint8:
                raise ValueError(f"e8m0 scales must be raw uint8 exponents, got {proj.scale.dtype}")
            scale = e8m0_to_float(proj.scale, dtype)
        else:
            scale = proj.scale.to(dtype)
        if key.scale2 is not None:  # the global scale [E, N, 1] times each group scale first, as ModelOpt does
            scale = scale * proj.scale2.to(dtype).reshape(e, n, 1)
        scale = expand_groups(scale, n, k, group, "scale")

        if key.dtype.name == "e2m1":
            out = _e2m1_values(w, k, dtype) * scale
        elif key.dtype.is_float:
            if key.dtype.name != "fp8e4m3":
                raise ValueError(f"no decoding for float weight type {key.dtype.name}")
            if w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"fp8e4m3 weight must be torch.float8_e4m3fn, got {w.dtype}")
            out = w.to(dtype) * scale
        else:
            codes = _codes(proj, key, k)
            if key.zero_point == "group":
                if proj.zero is None:
                    raise ValueError(f"weight key {key} has a zero point but the projection has no zero")
                zero = expand_groups(proj.zero.to(torch.int32), n, k, group, "zero")
                codes = codes - zero
            out = codes.to(dtype) * scale

    if proj.perm is not None:
        perm = proj.perm.to(torch.int64)
        if perm.shape != (e, k):
            raise ValueError(f"perm must be [E, K] = [{e}, {k}], got {tuple(perm.shape)}")
        inv = torch.argsort(perm, dim=1)  # original column c sits at stored column inv[c]
        out = out.gather(2, inv.unsqueeze(1).expand(e, n, k))
    return out
