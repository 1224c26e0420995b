"""The numerics every Triton kernel that quantises or activates shares (constexpr constants and jit
helpers): rounding, e4m3 and int8 codes, group and MX scales, row amax, the gated activations.

They reproduce :mod:`moe_registry_kernels.quant_ref` bit for bit: a true division (``div_rn``),
round half to even, and fp8 rounding done in float32 arithmetic before the final (then exact)
cast, because the Triton interpreter's own float8 cast rounds differently.
"""

import triton
import triton.language as tl

# numerics of quant_ref and activations (constexpr so the kernels can read them)
SWIGLUOAI_ALPHA = tl.constexpr(1.702)
SWIGLUOAI_LIMIT = tl.constexpr(7.0)
FP8_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)
AMAX_FLOOR = tl.constexpr(1e-10)
# 1.5·2^23: float32 values this large have no fraction bits, so adding and subtracting it rounds
# to an integer (half to even) for |x| < 2^22
RINT_SHIFT = tl.constexpr(12582912.0)


@triton.jit
def _rint(x):
    """Round half to even for |x| < 2^22 (adding 1.5·2^23 leaves no fraction bits); larger values
    stay large, which the callers' clamps handle."""
    return (x + RINT_SHIFT) - RINT_SHIFT


@triton.jit
def _pow2(e):
    """2^e as float32 for integer e in [-127, 127] (2^-127 is the one subnormal)."""
    bits = tl.where(e > -127, (e + 127) << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v):
    """float32 -> float8e4m3fn, saturating at ±448, round half to even (subnormals included),
    keeping the sign of zero. The code is built with integer arithmetic (e4m3 code = 8 per binade
    plus the rounded steps inside it), so it is exact on every backend: the interpreter's fp8 cast
    rounds differently, and a float cast on the GPU drops the sign of a rounded-away zero."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.minimum(tl.abs(v), FP8_MAX)
    biased = tl.maximum((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # below 2^-6: subnormal spacing
    steps = _rint(mag * ((257 - biased) << 23).to(tl.float32, bitcast=True))  # mag / 2^(biased-130): 0..16
    code = (biased - 121) * 8 + steps.to(tl.int32) + ((bits >> 31) & 1) * 128
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _to_int8(v):
    return tl.minimum(tl.maximum(_rint(v), -128.0), 127.0).to(tl.int8)


@triton.jit
def _mx_exponent(amax):
    """floor(log2(amax)) - 8 from the float32 exponent bits, clamped to [-127, 127]; zero and
    subnormal amax land on -127, as in quant_ref."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(biased - 127 - 8, -127), 127)


@triton.jit
def _as_stored(codes, out_ptr):
    """int8 codes in the type ``out_ptr`` holds (INT8_CODE_DTYPES): themselves, or their values as
    16-bit floats (exact; through float32, which the interpreter's int8 -> bfloat16 cast skips)."""
    if out_ptr.dtype.element_ty != tl.int8:
        codes = codes.to(tl.float32).to(out_ptr.dtype.element_ty)
    return codes


@triton.jit
def _int8_codes(v, scale):
    """float32 values -> int8 codes at this scale, as quant_ref rounds them (correctly rounded
    division, then round half to even and saturate)."""
    return _to_int8(tl.math.div_rn(v, scale))


@triton.jit
def _fp8_codes(v, scale):
    """float32 values -> e4m3 codes at this scale, as quant_ref rounds them."""
    return _to_e4m3(tl.math.div_rn(v, scale))


@triton.jit
def _group_scale(amax, QUANT: tl.constexpr):
    """(scale, stored form) of fp8 groups from their amax: fp8_group float32 amax / 448 (floored),
    mxfp8 the e8m0 power of two (stored as its biased exponent byte)."""
    if QUANT == "fp8_group":
        scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
        stored = scale
    else:
        e = _mx_exponent(amax)
        scale = _pow2(e)
        stored = (e + 127).to(tl.uint8)
    return scale, stored


@triton.jit
def _rows_amax(ptr, rows, row_ok, stride, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Each row's max |value| over its first ``width`` columns (float32 [ROWS]; rows not ok: 0),
    COLS columns a step (one wide load each: a step is a round trip to L2)."""
    amax = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for c in range(0, width, COLS):
        cols = c + tl.arange(0, COLS)
        v = tl.load(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                    mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    return tl.max(amax, axis=1)


@triton.jit
def _holds_data(pair_ids_ptr, rows, num_experts, mask):
    """Whether each row holds data: its pair routes to one of this rank's ``num_experts`` (expert
    parallelism marks a pair routed elsewhere -1; its rows were never written). Read from the ids
    themselves, so no mask tensor (elementwise launches ahead of the kernel) is built first."""
    ids = tl.load(pair_ids_ptr + rows, mask=mask, other=-1)
    return (ids >= 0) & (ids < num_experts)


@triton.jit
def _span_amax(ptr, stride, width, row_lo, row_hi, ids_ptr, num_experts, SKIP_FOREIGN: tl.constexpr,
               ROWS: tl.constexpr, COLS: tl.constexpr):
    """max |value| (float32) over rows [row_lo, row_hi) and their first ``width`` columns, a
    [ROWS, COLS] tile a step; SKIP_FOREIGN: only rows whose pair ``ids_ptr`` routes to one of
    this rank's ``num_experts`` (rows of pairs routed elsewhere were never written)."""
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for r in range(row_lo, row_hi, ROWS):
        rows = r + tl.arange(0, ROWS)
        ok = rows < row_hi
        if SKIP_FOREIGN:
            ok = ok & _holds_data(ids_ptr, rows, num_experts, ok)
        amax = tl.maximum(amax, _rows_amax(ptr, rows, ok, stride, width, ROWS, COLS))
    return tl.max(amax, axis=0)


@triton.jit
def _int8_token_scale(amax):
    """A row's int8 scale from its amax (floored so an all-zero row divides by a positive)."""
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), INT8_MAX)


@triton.jit
def gated_act(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in float32 (silu, gelu with erf, or gpt-oss's clamped swigluoai); shared by
    this module's row kernel and the GEMM1 epilogue of the fused MoE kernel."""
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    if ACTIVATION == "silu":
        out = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == "gelu":
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:  # swigluoai (gpt-oss)
        gate = tl.minimum(gate, SWIGLUOAI_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLUOAI_LIMIT), SWIGLUOAI_LIMIT)
        out = (up + 1.0) * gate / (1.0 + tl.exp(gate * -SWIGLUOAI_ALPHA))
    return out
