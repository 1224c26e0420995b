"""Writers: quantize float weights [out, in] into each checkpoint format's tensors, as the format's
own tools lay them out. They build example checkpoints and the broken checkpoints of the tests;
each returns a new dict of tensors named as the scheme spec names them (bias not included).

Rounding follows the producing tools closely enough to look like their files (AWQ min/max with
zero points, GPTQ symmetric scale 2·amax/maxq, OCP MX shared exponents), not to be accurate
quantizers: no calibration, no error compensation.
"""

from __future__ import annotations

import torch

from moe_registry.formats.awq_gemm import AWQ_ORDER
from moe_registry.formats.bitpack import pack_int32

__all__ = [
    "pack_awq_gemm",
    "pack_gptq",
    "pack_quark_int8",
    "pack_compressed_tensors_int8",
    "pack_modelopt_mxfp8",
    "pack_fp8_block",
    "pack_unquantized",
    "pack_compressed_tensors_int4",
]

FP8_MAX = 448.0
_E4M3_EMAX = 8  # largest power of two below FP8_MAX


def _group(k: int, group: int) -> int:
    g = k if group == -1 else group
    if g <= 0 or k % g:
        raise ValueError(f"group size {group} does not divide the input size {k}")
    return g


def _float(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"weights must be 2-D [out, in], got shape {tuple(w.shape)}")
    return w.detach().to(torch.float32)


def pack_awq_gemm(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: asymmetric uint4 per (input group, output column), zero points stored as-is,
    eight output columns per int32 in AutoAWQ's interleaved order."""
    wt = _float(w).t()  # [K, N]
    k, n = wt.shape
    g = _group(k, group)
    blocks = wt.reshape(k // g, g, n)
    lo, hi = blocks.amin(1), blocks.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15)
    codes = (torch.round(blocks / s[:, None]) + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return {
        "qweight": pack_int32(codes, 4, dim=1, order=AWQ_ORDER),
        "qzeros": pack_int32(zeros, 4, dim=1, order=AWQ_ORDER),
        "scales": scales,
    }


def pack_gptq(w: torch.Tensor, bits: int, group: int, order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Symmetric GPTQ v1 (bits 4 or 8). ``order`` is the act-order column order (the j-th column
    quantized is ``order[j]``; groups are runs of ``group`` in that order); None: natural order."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ packer supports 4 or 8 bits, got {bits}")
    wf = _float(w)  # [N, K]
    n, k = wf.shape
    g = _group(k, group)
    maxq, bias = (1 << bits) - 1, 1 << (bits - 1)
    order = torch.arange(k) if order is None else order.to(torch.int64)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // g
    amax = wf.abs()[:, order].reshape(n, k // g, g).amax(-1).t()  # [groups, N]; group i = order[i·g:(i+1)·g]
    scales = (2 * amax / maxq).clamp(min=1e-6).to(torch.float16)
    per_column = scales.float()[g_idx].t()  # [N, K]
    codes = (torch.round(wf / per_column) + bias).clamp(0, maxq)
    return {
        "qweight": pack_int32(codes.t(), bits, dim=0),
        "qzeros": pack_int32(torch.full((k // g, n), bias - 1), bits, dim=1),
        "scales": scales.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def _int8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)


def pack_quark_int8(w: torch.Tensor, per_tensor: bool = False, scale_dtype: torch.dtype = torch.float32,
                    input_scale: float | None = None) -> dict[str, torch.Tensor]:
    """Quark INT8: symmetric weight, scale amax/127 per output channel ([out]) or per tensor ([]);
    ``input_scale`` adds a static per-tensor activation scale ([] float32)."""
    wf = _float(w)
    amax = wf.abs().amax() if per_tensor else wf.abs().amax(1)
    scale = (amax / 127).clamp(min=1e-8).to(scale_dtype)
    out = {"weight": _int8(wf, scale if per_tensor else scale[:, None]), "weight_scale": scale}
    if input_scale is not None:
        out["input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return out


def pack_compressed_tensors_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """compressed-tensors 'int-quantized' channel strategy: int8 weight, weight_scale [out, 1]."""
    wf = _float(w)
    scale = (wf.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8).to(scale_dtype)
    return {"weight": _int8(wf, scale), "weight_scale": scale}


def pack_modelopt_mxfp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP8 (OCP MX): per 32 inputs a shared exponent floor(log2 amax) − 8, stored biased by 127
    as uint8; elements w / 2^exp saturated to ±448 in float8_e4m3fn."""
    wf = _float(w)
    n, k = wf.shape
    if k % 32:
        raise ValueError(f"MXFP8 needs the input size to be a multiple of 32, got {k}")
    blocks = wf.reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.frexp(amax).exponent - 1 - _E4M3_EMAX  # floor(log2 amax) - emax
    biased = torch.where(amax > 0, exponent + 127, torch.full_like(exponent, 127)).clamp(0, 254)
    scale = torch.exp2(biased.to(torch.float64) - 127).to(torch.float32)
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q.reshape(n, k), "weight_scale": biased.to(torch.uint8)}


def pack_fp8_block(w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 FP8: per block×block tile a float32 multiplier amax/448 (``weight_scale_inv``)."""
    wf = _float(w)
    n, k = wf.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = wf
    amax = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    q = (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}


def pack_unquantized(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A plain float checkpoint tensor in ``dtype``."""
    return {"weight": _float(w).to(dtype)}


def pack_compressed_tensors_int4(w: torch.Tensor, group: int,
                                 scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """compressed-tensors 'pack-quantized' symmetric int4: q = clamp(round(w/s), −8, 7) with
    s = amax/7.5 per (row, group), stored q + 8 eight per int32 along the input, low first."""
    wf = _float(w)
    n, k = wf.shape
    g = _group(k, group)
    blocks = wf.reshape(n, k // g, g)
    scale = (blocks.abs().amax(-1) / 7.5).clamp(min=1e-6).to(scale_dtype)
    q = torch.round(blocks / scale.float()[..., None]).clamp(-8, 7).reshape(n, k)
    return {
        "weight_packed": pack_int32(q + 8, 4, dim=1),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
