"""Quantisation numerics: the one definition every kernel (torch and Triton) reproduces, plus the
inverse of :func:`dequantize` used to build test weights for any weight key.

Activation quantisation (x: [M, K], computed in float32 whatever x's dtype; ``/`` is a true
division, never a multiply by a reciprocal):

- int8, per-token dynamic (``int8 scale:float32:token:dynamic``)::

      amax  = max(|x[m, :]|) clamped to >= 1e-10
      scale = amax / 127                                   -> float32 [M, 1]
      q     = round_half_even(x / scale) clamped to [-128, 127]   (int8)

- int8 / fp8e4m3, per-tensor static (``... scale:float32:tensor:static``): the given float32 [1]
  scale s; int8: q = round_half_even(x / s) clamped to [-128, 127]; fp8: as below with s.
- fp8e4m3, per-group(g) dynamic (``fp8e4m3 scale:float32:group(128):dynamic``)::

      amax  = max(|x[m, j*g:(j+1)*g]|) clamped to >= 1e-10   (last group may be short)
      scale = amax / 448                                   -> float32 [M, ceil(K/g)]
      q     = (x / scale).clamp(-448, 448).to(float8_e4m3fn)

  Per-token (g = K) and per-tensor dynamic are the same with larger groups; int8 dynamic groups
  use 127 instead of 448 and the int8 rounding above.
- MXFP8, fp8e4m3 with an e8m0 scale per block(1x32), dynamic (``fp8e4m3 scale:e8m0:block(1x32):dynamic``)::

      amax  = max(|x[m, 32j:32j+32]|)
      e     = floor(log2(amax)) - 8      (8 = emax of e4m3; -127 when amax == 0), clamped to [-127, 127]
      scale = 2**e, stored as uint8 e + 127                -> uint8 [M, ceil(K/32)]
      q     = (x / 2**e).clamp(-448, 448).to(float8_e4m3fn)

  floor(log2(amax)) is taken exactly from the float32 exponent (frexp), not from a rounded log2.
  An all-zero block gives q = 0; a kernel that flushes subnormals must not divide by a flushed
  2**-127 (it would produce NaN there).

Dequantisation is q * scale (e8m0: q * 2**(e-127)), in float32 unless asked otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from moe_registry_kernels.dequant import e8m0_to_float, pack_int4
from moe_registry_kernels.fp4 import E2M1_MAX, float_to_e2m1

from moe_registry.core.keys import GroupShape, QuantKey
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights

__all__ = [
    "QuantizedActivation",
    "quantize_activation",
    "dequantize_activation",
    "fake_quantize_activation",
    "quantize_weight_to_layout",
    "make_random_expert_weights",
    "e8m0_exponent",
    "torch_dtype",
]

AMAX_FLOOR = 1e-10
FP8_MAX = 448.0
INT8_MAX = 127.0
E4M3_EMAX = 8

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
    "fp8e4m3": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a scalar type name is stored as (scales and activations)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        known = ", ".join(_TORCH_DTYPES)
        raise ValueError(f"no torch dtype for scalar type {name!r}; known: {known}") from None


@dataclass(frozen=True)
class QuantizedActivation:
    """Quantised activations: ``q`` int8 or float8_e4m3fn [M, K]; ``scale`` float32 [M, 1]
    (per token), [M, ceil(K/g)] (per group), [1] (per tensor) or raw e8m0 uint8 [M, ceil(K/32)]."""

    q: torch.Tensor
    scale: torch.Tensor


def e8m0_exponent(amax: torch.Tensor, emax: int = E4M3_EMAX) -> torch.Tensor:
    """Shared MX exponent floor(log2(amax)) - emax, clamped to [-127, 127]; -127 for amax == 0 (int32)."""
    _, ex = torch.frexp(amax.float())  # amax = m * 2**ex, m in [0.5, 1): floor(log2) = ex - 1
    e = (ex.to(torch.int32) - 1 - emax)
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


def _qmax(key: QuantKey) -> float:
    if key.dtype.name == "int8":
        return INT8_MAX
    if key.dtype.name == "fp8e4m3":
        return FP8_MAX
    raise ValueError(f"activation type {key.dtype.name} is not supported; wanted int8 or fp8e4m3")


def _cast(v: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """Scaled float32 values -> stored codes (int8: round half even + clamp; fp8: clamp + cast)."""
    if key.dtype.name == "int8":
        return torch.round(v).clamp(-128, 127).to(torch.int8)
    return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _act_group(key: QuantKey, k: int) -> int:
    """Columns sharing one activation scale (k for per-token)."""
    g = key.scale.group
    if g.rows not in (1, -1):
        raise ValueError(f"activation group {g} spans several tokens; wanted token, group(<n>) or tensor")
    return k if g.cols == -1 else g.cols


def _group_amax(x: torch.Tensor, g: int) -> torch.Tensor:
    """max |x| over each run of g columns of [M, K] -> [M, ceil(K/g)] (zero padding is harmless)."""
    m, k = x.shape
    ng = -(-k // g)
    if ng * g != k:
        x = torch.nn.functional.pad(x, (0, ng * g - k))
    return x.abs().view(m, ng, g).amax(-1)


def _expand_cols(s: torch.Tensor, g: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(g, dim=1)[:, :k] if s.shape[1] != k else s


def per_tensor_dynamic(key: QuantKey) -> bool:
    """One activation scale per GEMM input found at run time: its amax runs over every row of it
    (all tokens, all experts' intermediates), as vLLM's fp8 MoE quantises, so experts cannot be
    computed one at a time from end to end (the reference and torch-cpu-native both ask)."""
    return key.quantized and key.scale.dynamic and key.scale.group.rows == -1 and key.scale.group.cols == -1


def quantize_activation(x: torch.Tensor, key: QuantKey,
                        static_scale: torch.Tensor | None = None) -> QuantizedActivation:
    """Quantise activations [M, K] with ``key`` (formulas in the module docstring). ``x`` is not modified."""
    if not key.quantized:
        raise ValueError("quantize_activation called with an unquantized key")
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}")
    if key.scale2 is not None or key.zero_point != "none":
        raise ValueError(f"activation key {key} has a zero point or second scale; not supported")
    qmax = _qmax(key)
    xf = x.float()
    m, k = xf.shape
    spec = key.scale

    if not spec.dynamic:
        if spec.group != GroupShape(-1, -1):
            raise ValueError(f"static activation scales must be per tensor, got {spec.group}")
        if static_scale is None:
            raise ValueError(f"activation key {key} is static but no input_scale was given")
        s = static_scale.float().reshape(-1)
        if s.numel() != 1:
            raise ValueError(f"static activation scale must have one element, got shape {tuple(s.shape)}")
        return QuantizedActivation(_cast(xf / s, key), s.clone())

    if spec.group == GroupShape(-1, -1):
        amax = xf.abs().amax().reshape(1)
        if spec.dtype.name == "e8m0":
            raise ValueError("e8m0 activation scales must be per block, not per tensor")
        s = amax.clamp(min=AMAX_FLOOR) / qmax
        return QuantizedActivation(_cast(xf / s, key), s)

    g = _act_group(key, k)
    amax = _group_amax(xf, g)
    if spec.dtype.name == "e8m0":
        if key.dtype.name != "fp8e4m3":
            raise ValueError(f"e8m0 scales are defined here for fp8e4m3 only, got {key.dtype.name}")
        e = e8m0_exponent(amax)
        s = torch.exp2(e.float())
        q = _cast(xf / _expand_cols(s, g, k), key)
        return QuantizedActivation(q, (e + 127).to(torch.uint8))
    if spec.dtype.name != "float32":
        raise ValueError(f"activation scale dtype {spec.dtype.name} is not supported; wanted float32 or e8m0")
    s = amax.clamp(min=AMAX_FLOOR) / qmax
    q = _cast(xf / _expand_cols(s, g, k), key)
    return QuantizedActivation(q, s)


def dequantize_activation(qa: QuantizedActivation, key: QuantKey,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale as ``dtype`` [M, K] (e8m0 scales read as 2**(e-127))."""
    m, k = qa.q.shape
    s = e8m0_to_float(qa.scale, dtype) if key.scale.dtype.name == "e8m0" else qa.scale.to(dtype)
    if s.dim() == 1:  # per tensor
        return qa.q.to(dtype) * s
    g = _act_group(key, k)
    return qa.q.to(dtype) * _expand_cols(s, g, k)


def fake_quantize_activation(x: torch.Tensor, key: QuantKey, static_scale: torch.Tensor | None = None,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantise then dequantise (what the GEMM sees), as ``dtype``; unquantized keys pass x through."""
    if not key.quantized:
        return x.to(dtype)
    return dequantize_activation(quantize_activation(x, key, static_scale), key, dtype)


# ---------------------------------------------------------------------------------------------
# weights


def _block_reduce(w: torch.Tensor, group: GroupShape, op: str) -> torch.Tensor:
    """Reduce [E, N, K] over each rows x cols block -> [E, ceil(N/r), ceil(K/c)] (zero padded)."""
    e, n, k = w.shape
    r = n if group.rows == -1 else group.rows
    c = k if group.cols == -1 else group.cols
    nb, kb = -(-n // r), -(-k // c)
    w = torch.nn.functional.pad(w, (0, kb * c - k, 0, nb * r - n))
    blocks = w.view(e, nb, r, kb, c)
    if op == "amax":
        return blocks.abs().amax(dim=(2, 4))
    if op == "min":
        return blocks.amin(dim=(2, 4))
    return blocks.amax(dim=(2, 4))


def _expand_blocks(s: torch.Tensor, group: GroupShape, n: int, k: int) -> torch.Tensor:
    r = n if group.rows == -1 else group.rows
    c = k if group.cols == -1 else group.cols
    return s.repeat_interleave(r, dim=1)[:, :n].repeat_interleave(c, dim=2)[:, :, :k]


def _store_scale(s: torch.Tensor, group: GroupShape, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Cast scales to their storage dtype; per-channel/per-tensor are stored [E, N, 1] float32."""
    if group.cols == -1:
        return s.expand(s.shape[0], n, 1).float().contiguous() if s.shape[1] == 1 else s.float()
    tiny = torch.finfo(dtype).tiny
    return s.clamp(min=tiny).to(dtype)


def quantize_weight_to_layout(w: torch.Tensor, key: QuantKey, *, act_order: bool = False,
                              generator: torch.Generator | None = None,
                              dtype: torch.dtype = torch.float32) -> ProjectionWeights:
    """Real weights [E, N, K] -> the kernel layout of ``key`` (the inverse of ``dequantize``).

    uint4/uint8 with zero point: asymmetric per group over [min(w, 0), max(w, 0)]; uint4b8, int4,
    int8, uint8b128: symmetric, scale = amax / (largest positive code); fp8e4m3: scale = amax / 448
    (float32) or an e8m0 exponent per block as for MXFP8 activations. Scales are rounded to their
    storage dtype before coding so the round trip only carries the coding error. ``act_order``
    draws a random column permutation per expert from ``generator``; groups are contiguous in
    stored order. ``dtype`` is the storage dtype of unquantized weights. ``w`` is not modified.
    """
    if w.dim() != 3:
        raise ValueError(f"weights must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    e, n, k = wf.shape
    perm = None
    if act_order:
        if not key.quantized or key.scale.group.rows != 1:
            raise ValueError(f"act_order needs per-group or per-channel weight scales, got key {key}")
        perm = torch.stack([torch.randperm(k, generator=generator) for _ in range(e)]).to(torch.int32)
        wf = wf.gather(2, perm.to(torch.int64).unsqueeze(1).expand(e, n, k))
    if not key.quantized:
        return ProjectionWeights(weight=wf.to(dtype), perm=perm)
    if key.dtype.name == "e2m1":
        return _quantize_e2m1(wf, key, perm)
    if key.scale2 is not None:
        raise ValueError(f"weight key {key} has a second-level scale; only e2m1 (NVFP4) weights take one here")

    group, st, sdt = key.scale.group, key.dtype, key.scale.dtype
    if st.bits == 4 and k % 2:
        raise ValueError(f"4-bit weights need an even K, got {k}")

    if st.name == "fp8e4m3":
        amax = _block_reduce(wf, group, "amax")
        if sdt.name == "e8m0":
            ex = e8m0_exponent(amax)
            s_stored = (ex + 127).to(torch.uint8)
            s_real = torch.exp2(ex.float())
        else:
            s_stored = _store_scale(amax.clamp(min=AMAX_FLOOR) / FP8_MAX, group, n, torch_dtype(sdt.name))
            s_real = s_stored.float()
        q = (wf / _expand_full(s_real, group, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return ProjectionWeights(weight=q, scale=s_stored, perm=perm)
    if st.is_float:
        raise ValueError(f"no weight quantisation for float type {st.name}")
    if sdt.name == "e8m0":
        raise ValueError(f"e8m0 scales are defined for fp8e4m3 weights only, got {st.name}")
    storage = torch_dtype(sdt.name)

    zero_stored = None
    if key.zero_point == "group":
        qmax = float(st.max_value)
        lo = _block_reduce(wf, group, "min").clamp(max=0)
        hi = _block_reduce(wf, group, "max").clamp(min=0)
        s_stored = _store_scale((hi - lo).clamp(min=AMAX_FLOOR) / qmax, group, n, storage)
        s_real = s_stored.float()
        if s_real.shape[1] != lo.shape[1]:  # per-channel stored expanded over rows
            lo = lo.expand_as(s_real)
        zero = torch.round(-lo / s_real).clamp(0, qmax)
        zero_stored = zero.to(torch.uint8)
        codes = torch.round(wf / _expand_full(s_real, group, n, k)) + _expand_full(zero, group, n, k)
        codes = codes.clamp(0, qmax)
    else:
        if not st.signed and st.bias == 0:
            raise ValueError(f"unsigned weight type {st.name} without bias needs a zero point (zp:group)")
        pos_max = float(st.max_value - st.bias) if not st.signed else float(st.max_value)
        neg_min = float(st.min_value - st.bias) if not st.signed else float(st.min_value)
        amax = _block_reduce(wf, group, "amax")
        s_stored = _store_scale(amax.clamp(min=AMAX_FLOOR) / pos_max, group, n, storage)
        s_real = s_stored.float()
        codes = torch.round(wf / _expand_full(s_real, group, n, k)).clamp(neg_min, pos_max)
        codes = codes + st.bias
    codes = codes.to(torch.int32)
    if st.bits == 4:
        weight = pack_int4((codes & 0x0F).to(torch.uint8))
    elif st.name == "int8":
        weight = codes.to(torch.int8)
    else:
        weight = codes.to(torch.uint8)
    return ProjectionWeights(weight=weight, scale=s_stored, zero=zero_stored, perm=perm)


def _quantize_e2m1(wf: torch.Tensor, key: QuantKey, perm: torch.Tensor | None) -> ProjectionWeights:
    """FP4 weights [E, N, K] float32 -> packed e2m1 codes with their scales, as the producers do:
    MXFP4 an e8m0 exponent floor(log2 amax) - 2 per group (OCP MX); NVFP4 an e4m3 scale amax / 6
    per group, divided by the expert's global scale amax / (6 * 448) when the key has scale2."""
    e, n, k = wf.shape
    group, sdt = key.scale.group, key.scale.dtype.name
    if k % 2:
        raise ValueError(f"4-bit weights need an even K, got {k}")
    amax = _block_reduce(wf, group, "amax")
    scale2 = None
    if sdt == "e8m0":
        if key.scale2 is not None:
            raise ValueError(f"weight key {key}: e8m0 (MX) scales take no second-level scale")
        ex = e8m0_exponent(amax, emax=2)
        s_stored = (ex + 127).to(torch.uint8)
        s_real = torch.exp2(ex.float())
    elif sdt == "fp8e4m3":
        g = torch.ones(e, 1, 1)
        if key.scale2 is not None:
            g = (wf.abs().amax(dim=(1, 2), keepdim=True) / (E2M1_MAX * FP8_MAX)).clamp(min=AMAX_FLOOR)
            scale2 = g.expand(e, n, 1).contiguous()
        s_stored = (amax / E2M1_MAX / g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
        s_real = s_stored.float() * g
    else:
        raise ValueError(f"e2m1 weights take e8m0 or fp8e4m3 group scales, got {key}")
    full = _expand_full(s_real, group, n, k)
    codes = float_to_e2m1(torch.where(full > 0, wf / full.clamp(min=AMAX_FLOOR), torch.zeros_like(wf)))
    return ProjectionWeights(weight=pack_int4(codes), scale=s_stored, perm=perm, scale2=scale2)


def _expand_full(s: torch.Tensor, group: GroupShape, n: int, k: int) -> torch.Tensor:
    """Scale (or zero) as stored -> [E, N, K], also for the [E, N, 1] per-channel storage."""
    if s.shape[1] == n and s.shape[2] == 1:
        return s.expand(s.shape[0], n, k)
    return _expand_blocks(s, group, n, k)


def static_input_scale(key: QuantKey, amax: float) -> torch.Tensor | None:
    if not key.quantized or key.scale.dynamic:
        return None
    return torch.tensor([amax / _qmax(key)], dtype=torch.float32)


def make_random_expert_weights(weight_key: QuantKey, activation_key: QuantKey, *, num_experts: int,
                               hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16,
                               bias: bool = False, act_order: bool = False, seed: int = 0) -> ExpertWeights:
    """Random experts in ``weight_key``'s layout: N(0, 1/K) weights like a trained layer's.

    Biases are float32 N(0, 0.1^2). For static activation keys ``input_scale`` covers |x| <= 6
    (the tail of unit-normal hidden states and of the gated intermediate), so tests should feed
    hidden states ~ N(0, 1).
    """
    gen = torch.Generator().manual_seed(seed)
    e, h, i = num_experts, hidden, intermediate
    w13 = torch.randn(e, 2 * i, h, generator=gen) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=gen) / math.sqrt(i)
    p13 = quantize_weight_to_layout(w13, weight_key, act_order=act_order, generator=gen, dtype=dtype)
    p2 = quantize_weight_to_layout(w2, weight_key, act_order=act_order, generator=gen, dtype=dtype)
    extra13: dict[str, torch.Tensor | None] = {"input_scale": static_input_scale(activation_key, 6.0)}
    extra2: dict[str, torch.Tensor | None] = {"input_scale": static_input_scale(activation_key, 6.0)}
    if bias:
        extra13["bias"] = 0.1 * torch.randn(e, 2 * i, generator=gen)
        extra2["bias"] = 0.1 * torch.randn(e, h, generator=gen)
    return ExpertWeights(dataclasses.replace(p13, **extra13), dataclasses.replace(p2, **extra2),
                         weight_key, activation_key)
