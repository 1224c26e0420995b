"""FP4 (e2m1) weight tiles dequantised in registers, for the GEMM kernels of
:mod:`moe_registry_kernels.moe_gemm`: bit moves and multiplies, no table in memory.

An e2m1 code's sign (bit 3) goes to float16's sign bit and its 3 magnitude bits (2 exponent, 1
mantissa) to float16 bits 9..11, the top of the exponent field and of the mantissa: the half then
reads value * 2^-14 exactly (codes 0 and 1 become float16 subnormals 0 and 2^-15, which the
float16-to-float32 convert keeps). Times 2^14 (exact) it is the code's value; times the group's
scale (e8m0 power of two, or e4m3) it is exact in float32 and rounds once to the 16-bit
activation dtype, where a 2-bit or 6-bit significand is exact too: the tile equals the torch
reference's dequantised weights bit for bit (the NVFP4 global scale is applied after the dot).

On the GPU the same moves run as paired PTX (:func:`_e2m1_asm`), two weights per instruction in
16-bit halves (bfloat16: its shifts as integer multiplies, off the saturated ALU pipe), as
:mod:`moe_registry_kernels.dequant_ptx` does for integer codes: the half times 2^14 (float16) or
2^126 (bfloat16, 8 exponent bits) is the code's value exactly, and one paired multiply by the scale
rounds once -- the same value again. The group scale arrives in the 16-bit dtype (an e4m3 scale is
exact in either; an e8m0 power of two is exact in bfloat16 and in float16 from 2^-24 to 2^15, which
holds every float16 weight but those below 2^-24).

FOLDED: the scale arrives already times 2^U / 2^D (U the half's unscale exponent, 14 or 126; D a
shift the GEMM's epilogue takes back in float32), so each pair costs one multiply, not two: the
tile then holds value * scale * 2^-D, still rounded once. The GEMM folds only where that is exact
(triton_moe._e2m1_fold): NVFP4's e4m3 scales (at most 448) with D = 8 always -- value * scale is a
multiple of 2^-10 below 2688, so times 2^-8 it is exact in either 16-bit type -- and MX's powers
of two with D = 0 where every scale times 2^U stays a normal number of the 16-bit type, built from
the code's bits (_folded_e8m0).
"""

import triton
import triton.language as tl

from .dequant_ptx import _asm_constraints, _asm_result_dtype, _immediate

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
def _e4m3_value(codes, TIMES: tl.constexpr = 1.0):
    """float8_e4m3fn bytes (uint8) -> their values in float32, by the same bit move as _e2m1_value (the
    half reads value * 2^-8; e4m3 subnormals become float16 subnormals, exactly): no fp8 conversion, which
    Triton has only from sm_89, and no masked fp8 load, which cannot fill in 0. NaN codes are refused at load.
    TIMES: a power of two to multiply in as well, in the same multiply (exact where it stays finite)."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << E4M3_SIGN_SHIFT) | ((c & 0x7F) << E4M3_MAGNITUDE_SHIFT)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * (E4M3_UNSCALE * TIMES)


# the paired form: a code moved to the top nibble of a 16-bit half (bits 12..15) keeps its sign
# bit there and shifts its 3 magnitude bits down into the exponent's low bits and the mantissa's top
E2M1_TOP_SIGN = tl.constexpr(0x8000)
E2M1_TOP_MAGNITUDE = tl.constexpr(0x7000)
E2M1_F16_SHIFT = tl.constexpr(3)  # bits 12..14 -> float16 bits 9..11
E2M1_F16_UNSCALE_BITS = tl.constexpr(0x7400)  # 2^14 in float16
E2M1_BF16_UNSCALE_BITS = tl.constexpr(0x7E80)  # 2^126 in bfloat16
# the same as PTX immediates, one per 16-bit half
E2M1_TOP_SIGN_PAIR = _immediate(E2M1_TOP_SIGN, 2)
E2M1_TOP_MAGNITUDE_PAIR = _immediate(E2M1_TOP_MAGNITUDE, 2)
E2M1_F16_UNSCALE_PAIR = _immediate(E2M1_F16_UNSCALE_BITS, 2)
E2M1_BF16_UNSCALE_PAIR = _immediate(E2M1_BF16_UNSCALE_BITS, 2)


E2M1_F16_UNSCALE_EXPONENT = tl.constexpr(14)  # U: a moved code's half reads value * 2^-U in float16
E2M1_BF16_UNSCALE_EXPONENT = tl.constexpr(126)  # and in bfloat16


@triton.constexpr_function
def _e2m1_half_unit(dtype) -> float:
    """2^-U: what a moved e2m1 code of value 1 reads as a half of ``dtype``."""
    unscale = E2M1_BF16_UNSCALE_EXPONENT if dtype == tl.bfloat16 else E2M1_F16_UNSCALE_EXPONENT
    return 2.0 ** -unscale.value


@triton.constexpr_function
def e2m1_fold_factor(dtype, folded: bool, shift: int) -> float:
    """What a group scale is multiplied by before its tile takes it: 2^(U - shift) when ``folded``
    (see the module note), else 1."""
    unscale = E2M1_BF16_UNSCALE_EXPONENT if dtype == tl.bfloat16 else E2M1_F16_UNSCALE_EXPONENT
    return 2.0 ** (unscale.value - shift) if folded else 1.0


@triton.constexpr_function
def _folded_e8m0_exponent(dtype) -> int:
    """What an e8m0 code adds up to in ``dtype``'s exponent field once times 2^U: the type's bias
    - 127 + U (bfloat16: 126, float16: -98)."""
    if dtype == tl.bfloat16:
        return 127 - 127 + E2M1_BF16_UNSCALE_EXPONENT.value
    return 15 - 127 + E2M1_F16_UNSCALE_EXPONENT.value


@triton.constexpr_function
def _mantissa_bits(dtype) -> int:
    return 7 if dtype == tl.bfloat16 else 10


@triton.jit
def _folded_e8m0(codes, dtype):
    """MX scale codes (uint8) -> 2^(e - 127) * 2^U in the 16-bit ``dtype``, straight from the
    code's bits (one integer multiply-add each, no float32 detour): normal for every code the fold
    admits (triton_moe.E2M1_MX_FOLD_CODES: bfloat16 0..128, float16 99..128), and finite for the
    code 0 that pads a row's groups (float16: 2^15, int16 wrap-around), which meets zero codes."""
    field = codes.to(tl.int16) + _folded_e8m0_exponent(dtype)
    return (field << _mantissa_bits(dtype)).to(dtype, bitcast=True)


# bfloat16 in one lop3 a pair: a byte alone in each half of a word (bits 0..7 and 16..23, zero bytes
# between), its low nibble's code times 2^12 puts the sign (bit 3) on bit 15 and times 2^6 the
# magnitude (bits 0..2) on bits 6..8; OR-ed and masked, every other bit is 0 -- the two products
# overlap only where both hold other bits of the byte, outside the mask. The shifts are integer
# multiplies, which ptxas issues on the FMA pipe (IMAD.SHL), so the ALU pipe (half-rate on sm_90, and
# what the and/shr/lop3 form kept busy: ncu's math_pipe_throttle) has two byte moves and one lop3 a
# pair left. Offline sm_90 SASS of MXFP4 at M = 8 on Qwen3's shape: 56 ALU instructions per 1000
# weights a warp, from 76 (GPTQ int4: 52).
E2M1_BF16_SIGN_LSHIFT = tl.constexpr(12)  # code bit 3 -> bfloat16 bit 15 (times 2^12)
E2M1_BF16_MAGNITUDE_LSHIFT = tl.constexpr(6)  # code bits 0..2 -> bfloat16 bits 6..8 (times 2^6)
E2M1_BF16_PAIR_MASK = tl.constexpr(0x81C081C0)  # both halves' bits 15 and 6..8
E2M1_BF16_PAIR_MASK_WORD = _immediate(E2M1_BF16_PAIR_MASK, 1)
LOP3_OR_THEN_AND = tl.constexpr(0xA8)  # lop3 table of (a | b) & c


@triton.constexpr_function
def _e2m1_bf16_asm(folded: bool = False) -> str:
    """The bfloat16 form of :func:`_e2m1_asm`: each byte's low nibble is placed alone in a half as
    described above (prmt with zero bytes); the high nibbles first rotate down a nibble, so byte
    k's high nibble is the low nibble of byte k + 1 (mod 4), then the same."""
    lines = ["{", ".reg .b32 z, k, r, s0, s1, s2, s3, x, y, v;", "mov.b32 z, 0;",
             f"mov.b32 k, {E2M1_BF16_UNSCALE_PAIR};",
             "prmt.b32 s0, $4, z, 0x4140;", "prmt.b32 s1, $4, z, 0x4342;",  # bytes 0, 1 and 2, 3
             "shf.l.wrap.b32 r, $4, $4, 4;",  # byte k's high nibble -> bits 0..3 of byte k + 1
             "prmt.b32 s2, r, z, 0x4241;", "prmt.b32 s3, r, z, 0x4043;"]  # the high ones of bytes 0, 1 and 2, 3
    for out in range(4):  # $0 $1 low pairs (bytes 0, 1 and 2, 3), $2 $3 high pairs; scales $5 (bytes 0, 1), $6
        lines += [f"shl.b32 x, s{out}, {E2M1_BF16_SIGN_LSHIFT.value};",
                  f"shl.b32 y, s{out}, {E2M1_BF16_MAGNITUDE_LSHIFT.value};",
                  f"lop3.b32 v, x, y, {E2M1_BF16_PAIR_MASK_WORD}, {LOP3_OR_THEN_AND.value:#x};"]
        if not folded:
            lines += ["mul.rn.bf16x2 v, v, k;"]
        lines += [f"mul.rn.bf16x2 ${out}, v, ${5 + out % 2};"]
    return "\n".join([*lines, "}"])


@triton.constexpr_function
def _e2m1_asm(half: str, folded: bool = False) -> str:
    """PTX turning 4 packed bytes (8 e2m1 codes) into value * scale for the low and the high
    nibbles, two at a time in 16-bit pairs, then one paired multiply by 2^14 or 2^126 (exact;
    ``folded``: already in the scale) and one by the scale. Float16: each byte is moved to the
    high byte of a half (prmt), a nibble's sign kept and its magnitude shifted into place (and,
    shr, lop3; float16's magnitude bits 9..11 admit no single-lop3 form); bfloat16:
    :func:`_e2m1_bf16_asm`. Operands: $0 $1 low pairs, $2 $3 high pairs, $4 the bytes, $5 $6 the
    scales in ``half`` (Triton's pack=4 register order)."""
    if half == "bf16":
        return _e2m1_bf16_asm(folded)
    sign, magnitude, unscale = E2M1_TOP_SIGN_PAIR, E2M1_TOP_MAGNITUDE_PAIR, E2M1_F16_UNSCALE_PAIR
    shift = E2M1_F16_SHIFT.value
    lines = ["{", ".reg .b32 z, k, t0, t1, v0, v1, m0, m1;", "mov.b32 z, 0;", f"mov.b32 k, {unscale};",
             "prmt.b32 t0, $4, z, 0x1404;", "prmt.b32 t1, $4, z, 0x3424;"]  # bytes 0, 1 and 2, 3
    for out in (0, 2):  # (no tuple targets: Triton 3.6 reads this source for its cache key)
        if out == 0:  # the low nibble up into bits 12..15 (the high one lands in the next half's bits 0..3: masked)
            lines += ["shl.b32 v0, t0, 4;", "shl.b32 v1, t1, 4;"]
        else:
            lines += ["mov.b32 v0, t0;", "mov.b32 v1, t1;"]
        for i in range(2):
            lines += [f"and.b32 m{i}, v{i}, {magnitude};", f"shr.b32 m{i}, m{i}, {shift};",
                      f"lop3.b32 v{i}, v{i}, {sign}, m{i}, 0xEA;"]  # (v & sign) | m
            if not folded:
                lines += [f"mul.rn.f16x2 v{i}, v{i}, k;"]
            lines += [f"mul.rn.f16x2 ${out + i}, v{i}, ${5 + i};"]
    return "\n".join([*lines, "}"])


@triton.jit
def _dequant_e2m1(packed, scale, dtype, ASM: tl.constexpr = False, FOLDED: tl.constexpr = False):
    """(low, high): a packed FP4 tile (uint8, low nibble the even input column) times ``scale``
    (broadcast to the tile; e8m0 or e4m3 values in ``dtype``; FOLDED: times 2^U / 2^D, see the
    module note), in the 16-bit ``dtype``. ASM: the paired PTX of _e2m1_asm (GPU); else plain
    Triton (the same values)."""
    if ASM:
        program: tl.constexpr = _e2m1_asm("bf16" if dtype == tl.bfloat16 else "f16", FOLDED)
        result: tl.constexpr = _asm_result_dtype(dtype, 2)
        scale_t = tl.broadcast_to(scale.to(dtype), packed.shape)
        low, high = tl.inline_asm_elementwise(program, _asm_constraints(4, 2, (8, 16)), [packed, scale_t],
                                              dtype=result.value, is_pure=True, pack=4)
    else:
        s = scale.to(tl.float32)
        if FOLDED:  # value * (scale * 2^-U): exact in float32, as the PTX's one multiply of the half
            s = s * _e2m1_half_unit(dtype)
        low = (_e2m1_value(packed & 0xF) * s).to(dtype)
        high = (_e2m1_value(packed >> 4) * s).to(dtype)
    return low, high
