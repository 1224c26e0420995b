"""FP4 (e2m1) weight tiles dequantised in registers, for the GEMM kernels of
:mod:`moe_registry_kernels.moe_gemm`: bit moves and one float32 multiply per weight, no table in
memory.

An e2m1 code's sign (bit 3) goes to float16's sign bit and its 3 magnitude bits (2 exponent, 1
mantissa) to float16 bits 9..11, the top of the exponent field and of the mantissa: the half then
reads value * 2^-14 exactly (codes 0 and 1 become float16 subnormals 0 and 2^-15, which the
float16-to-float32 convert keeps). Times 2^14 (exact) it is the code's value; times the group's
scale (e8m0 power of two, or e4m3) it is exact in float32 and rounds once to the 16-bit
activation dtype, where a 2-bit or 6-bit significand is exact too: the tile equals the torch
reference's dequantised weights bit for bit (the NVFP4 global scale is applied after the dot).
"""

import triton
import triton.language as tl

E2M1_SIGN_SHIFT = tl.constexpr(12)  # code bit 3 -> float16 bit 15
E2M1_MAGNITUDE_SHIFT = tl.constexpr(9)  # code bits 0..2 -> float16 bits 9..11
E2M1_UNSCALE = tl.constexpr(16384.0)  # 2^14: the half reads value * 2^-14


@triton.jit
def _e2m1_value(codes):
    """4-bit e2m1 codes (integers 0..15) -> their values in float32 (exact)."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x8) << E2M1_SIGN_SHIFT) | ((c & 0x7) << E2M1_MAGNITUDE_SHIFT)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * E2M1_UNSCALE


E4M3_SIGN_SHIFT = tl.constexpr(8)  # e4m3 bit 7 -> float16 bit 15
E4M3_MAGNITUDE_SHIFT = tl.constexpr(7)  # e4m3 bits 0..6 (4 exponent, 3 mantissa) -> float16 bits 7..13
E4M3_UNSCALE = tl.constexpr(256.0)  # 2^8: float16's exponent bias 15 minus e4m3's 7


@triton.jit
def _e4m3_value(codes):
    """float8_e4m3fn bytes (uint8) -> their values in float32, by the same bit move as _e2m1_value (the
    half reads value * 2^-8; e4m3 subnormals become float16 subnormals, exactly): no fp8 conversion, which
    Triton has only from sm_89, and no masked fp8 load, which cannot fill in 0. NaN codes are refused at load."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << E4M3_SIGN_SHIFT) | ((c & 0x7F) << E4M3_MAGNITUDE_SHIFT)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * E4M3_UNSCALE


@triton.jit
def _dequant_e2m1(packed, scale, dtype):
    """(low, high): a packed FP4 tile (uint8, low nibble the even input column) times ``scale``
    (broadcast to the tile; float32 e8m0 values or 16-bit e4m3 values), in the 16-bit ``dtype``."""
    s = scale.to(tl.float32)
    low = (_e2m1_value(packed & 0xF) * s).to(dtype)
    high = (_e2m1_value(packed >> 4) * s).to(dtype)
    return low, high
