"""FP4 (e2m1) weight tiles dequantised in registers, for the GEMM kernels of
:mod:`moe_registry_kernels.triton.gemm`: bit moves and multiplies, no table in memory.

An e2m1 code's sign (bit 3) goes to float16's sign bit and its 3 magnitude bits (2 exponent, 1
mantissa) to float16 bits 9..11, the top of the exponent field and of the mantissa: the half then
reads value * 2^-14 exactly (codes 0 and 1 become float16 subnormals 0 and 2^-15, which the
float16-to-float32 convert keeps). Times 2^14 (exact) it is the code's value; times the group's
scale (e8m0 power of two, or e4m3) it is exact in float32 and rounds once to the 16-bit
activation dtype, where a 2-bit or 6-bit significand is exact too: the tile equals the torch
reference's dequantised weights bit for bit (the NVFP4 global scale is applied after the dot).

The GEMMs read the packed codes in a kernel-private byte order (:func:`e2m1_register_order`, see the
note above _e2m1_asm), which the Triton experts write once when built. On the GPU the moves run as
paired PTX (:func:`_e2m1_asm`), two weights per instruction in 16-bit halves, as
:mod:`moe_registry_kernels.triton.dequant_ptx` does for integer codes: the half times 2^14 (float16) or
2^126 (bfloat16, 8 exponent bits) is the code's value exactly, and one paired multiply by the scale
rounds once -- the same value again. The group scale arrives in the 16-bit dtype (an e4m3 scale is
exact in either; an e8m0 power of two is exact in bfloat16 and in float16 from 2^-24 to 2^15, which
holds every float16 weight but those below 2^-24).

FOLDED: the scale arrives already times 2^U / 2^D (U the half's unscale exponent, 14 or 126; D a
shift the GEMM's epilogue takes back in float32), so each pair costs one multiply, not two: the
tile then holds value * scale * 2^-D, still rounded once. The GEMM folds only where that is exact
(launch._e2m1_fold): NVFP4's e4m3 scales (at most 448) with D = 8 always -- value * scale is a
multiple of 2^-10 below 2688, so times 2^-8 it is exact in either 16-bit type -- and MX's powers
of two with D = 0 where every scale times 2^U stays a normal number of the 16-bit type, built from
the code's bits (_folded_e8m0).
"""

import math

import torch
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


# NVFP4's e4m3 group scales reach the GEMMs as kernel-private exponent codes (:func:`e4m3_scale_codes`,
# written once when the Triton experts are built): a positive e4m3 value 2^e * (1 + m/8), subnormals
# normalised (e from -9 to 8), as the byte ((e + SCALE_CODE_BIAS) << 3) | m. Its bits times 2^(mantissa
# bits - 3), plus a constant exponent, are the value in any float type (:func:`_scale_code_value`): one
# integer multiply-add a scale, where the e4m3 byte took a load pair, two converts through float32, a
# multiply and a pack. (Offline sm_90 SASS, NVFP4 GEMM1 at DeepSeek-V2-Lite's M = 8: 270 instructions a
# step against 290.) Zero and negative scales have no code: their groups' FP4 codes take them instead
# (zeroed, or their signs flipped), which leaves every product the same.
SCALE_CODE_BIAS = tl.constexpr(10)  # e = -9 is code field 1; field 0 (the groups' padding) reads 2^-10
SCALE_CODE_MANTISSA = 3
SCALE_CODE_EXPONENTS = (-9, 8)  # the smallest e4m3 subnormal, 2^-9, and the largest normal's 2^8
GROUP_CODE_BYTES = 8  # packed FP4 bytes an e4m3 scale's group of 16 holds


def _group_bytes(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., G] per-group values -> [..., groups * GROUP_CODE_BYTES], each repeated over its group's bytes."""
    return t.repeat_interleave(GROUP_CODE_BYTES, dim=-1)[..., :groups]


def e4m3_scale_codes(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed FP4 codes, float8_e4m3fn group scales of 16) -> (the codes, exponent-code scales uint8):
    the GEMMs' form of NVFP4's scales (see above). A group whose scale is zero has its codes zeroed, one
    whose scale is negative their signs flipped (new tensors; the codes are returned as given where
    every scale is positive). NaN scales are refused."""
    if scale.dtype != torch.float8_e4m3fn or packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 scale codes take uint8 FP4 codes and float8_e4m3fn scales, got {packed.dtype} "
                         f"and {scale.dtype}")
    value = scale.to(torch.float32)
    if value.isnan().any():
        raise ValueError("NVFP4 group scales hold a NaN code (0x7f or 0xff)")
    if (value <= 0).any():
        packed = packed.clone()
        for e in range(packed.shape[0]):  # one expert at a time: the byte masks stay small
            s = _group_bytes(value[e], packed.shape[-1])
            packed[e] = torch.where(s == 0, 0, torch.where(s < 0, packed[e] ^ 0x88, packed[e]))
    mantissa, exponent = torch.frexp(value.abs())  # |value| = mantissa * 2^exponent, mantissa in [0.5, 1)
    fraction = (mantissa * 2 - 1) * (1 << SCALE_CODE_MANTISSA)  # exact: e4m3 keeps 3 fraction bits
    field = exponent - 1 + SCALE_CODE_BIAS.value
    codes = torch.where(value == 0, 0, (field << SCALE_CODE_MANTISSA) + fraction.to(torch.int32))
    return packed, codes.to(torch.uint8)



def e4m3_scale_values(codes: torch.Tensor) -> torch.Tensor:
    """Exponent-code scales (:func:`e4m3_scale_codes`) back to float8_e4m3fn: code 0 is 0, a code
    (field << 3) | m is 2^(field - SCALE_CODE_BIAS) * (1 + m / 8), exact in e4m3 (subnormals included)."""
    c = codes.to(torch.int32)
    field, mantissa = c >> SCALE_CODE_MANTISSA, c & ((1 << SCALE_CODE_MANTISSA) - 1)
    value = torch.ldexp(1 + mantissa.to(torch.float32) / (1 << SCALE_CODE_MANTISSA),
                        (field - SCALE_CODE_BIAS.value).to(torch.float32))
    return torch.where(c == 0, 0.0, value).to(torch.float8_e4m3fn)

@triton.constexpr_function
def _float_layout(dtype) -> tuple[int, int]:
    """(exponent bias, mantissa bits) of a float type."""
    if dtype == tl.bfloat16:
        return 127, 7
    if dtype == tl.float16:
        return 15, 10
    return 127, 23


@triton.constexpr_function
def _scale_code_shift(dtype) -> int:
    return _float_layout(dtype)[1] - SCALE_CODE_MANTISSA


@triton.constexpr_function
def _scale_code_offset(dtype, times: float) -> int:
    """What a scale code's exponent field gains in ``dtype``'s bits for the value times ``times`` (a
    power of two), shifted into place; asserted to keep every code's value a normal number."""
    bias, mantissa = _float_layout(dtype)
    gain = bias - SCALE_CODE_BIAS.value + int(math.log2(times))
    top = (1 << (8 if dtype != tl.float16 else 5)) - 2  # the largest finite exponent field
    low, high = SCALE_CODE_EXPONENTS
    assert gain + low + SCALE_CODE_BIAS.value >= 1 and gain + high + SCALE_CODE_BIAS.value <= top, (dtype, times)
    return gain << mantissa


@triton.constexpr_function
def _scale_code_pair_asm(dtype, times: float) -> str:
    """PTX decoding two scale codes at once, as two 16-bit halves of a register: one multiply-add
    (each half's code times 2^shift plus its offset, no carry between them: every result is below 2^15)."""
    offset = _scale_code_offset(dtype, times)
    return f"mad.lo.u32 $0, $1, {1 << _scale_code_shift(dtype)}, {offset << 16 | offset};"


@triton.jit
def _scale_code_value(codes, dtype, TIMES: tl.constexpr, ASM: tl.constexpr = False):
    """Exponent-code scales (uint8, :func:`e4m3_scale_codes`) -> value * TIMES (a power of two) in
    ``dtype``, exactly: the code's bits moved into the type's and its exponent raised, one integer
    multiply-add each (the padding code 0 reads a finite power of two). ASM (16-bit types, an even
    number of codes): two codes a multiply-add, their values left paired in one register as the
    paired multiplies take them (offline sm_90 SASS, NVFP4 GEMM1 at Mixtral's M = 1: 168 registers a
    thread, against 192 decoding one code a register, which left room for one block fewer a SM)."""
    if ASM and dtype != tl.float32 and codes.numel % 2 == 0:
        program: tl.constexpr = _scale_code_pair_asm(dtype, TIMES)
        result: tl.constexpr = _asm_result_dtype(dtype, 1)
        return tl.inline_asm_elementwise(program, "=r,r", [codes.to(tl.uint16)], dtype=result.value, is_pure=True,
                                         pack=2)
    bits = (codes.to(tl.int32) << _scale_code_shift(dtype)) + _scale_code_offset(dtype, TIMES)
    if dtype != tl.float32:
        bits = bits.to(tl.int16)  # (below 2^15: no sign bit)
    return bits.to(dtype, bitcast=True)


# The paired forms read a kernel-private byte order (:func:`e2m1_register_order`, written once when
# the Triton experts are built): the even column's code on bits 1..4 (sign on 4) and the odd
# column's with its sign on bit 7, its top exponent bit on bit 0 and its low exponent and mantissa
# bits on 6..5. Each byte is placed in the high byte of a 16-bit half (prmt with zero bytes), where
# bits 15 and 8 already hold the odd code's sign and top exponent bit in bfloat16's places (15, 8)
# and the even code's magnitude sits in float16's (9..11). An exhaustive search over byte orders
# and pairs of shifts with one lop3 (kept in git under the tag bench-history) finds this order the only one where
# a code needs a single shift: bfloat16 costs 2 moves for the odd pair and 3 for the even (4.25 a
# pair in the checkpoint's nibble order), float16 4 a pair in either order. H100, whole layer, bfloat16, side by side
# with the nibble order's form (shifts as IMAD.SHL): MXFP4 1.07-1.09x at M = 8 and 64 on Qwen3-30B-A3B
# and Mixtral, NVFP4 0.99-1.05x. The right shifts stay shifts (SHF, ALU pipe): as integer multiplies
# (mul.hi, IMAD.HI) the loop was 15% shorter but the layer up to 1.16x slower.
E2M1_PLACE_HIGH = ("0x1404", "0x3424")  # prmt selectors: bytes 0, 1 and 2, 3 to the halves' high bytes
E2M1_BF16_MASK = _immediate(tl.constexpr(0x81C0), 2)  # bfloat16's sign and magnitude bits 15, 8..6
E2M1_BF16_ODD_KEEP = _immediate(tl.constexpr(0x813E), 2)  # where the odd form keeps the placed word
E2M1_F16_SIGN = _immediate(tl.constexpr(0x8000), 2)
E2M1_F16_EVEN_MAGNITUDE = _immediate(tl.constexpr(0x0E00), 2)  # float16 bits 9..11, in place already
E2M1_F16_LOW_BITS = _immediate(tl.constexpr(0x0600), 2)
E2M1_F16_KEEP_SIGN_TOP = _immediate(tl.constexpr(0x8800), 2)
E2M1_F16_UNSCALE_BITS = tl.constexpr(0x7400)  # 2^14 in float16
E2M1_BF16_UNSCALE_BITS = tl.constexpr(0x7E80)  # 2^126 in bfloat16
E2M1_F16_UNSCALE_PAIR = _immediate(E2M1_F16_UNSCALE_BITS, 2)
E2M1_BF16_UNSCALE_PAIR = _immediate(E2M1_BF16_UNSCALE_BITS, 2)
# lop3 tables (bit 4a + 2b + c of the table is the result)
LOP3_OR_THEN_AND = tl.constexpr(0xA8)  # (a | b) & c
LOP3_B_WHERE_C_ELSE_A_NOT_B = tl.constexpr(0x98)  # c ? b : a & ~b
LOP3_A_AND_C_OR_B = tl.constexpr(0xEC)  # (a & c) | b
LOP3_A_WHERE_C_ELSE_B = tl.constexpr(0xE4)  # c ? a : b


REGISTER_ORDER_CHUNK = 1 << 24  # bytes rewritten at a time: the temporaries stay small beside a layer's codes


def e2m1_register_order(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes (low nibble the even column) -> the byte order the GEMMs' decoders read (see
    above): even code << 1, the odd code's sign to bit 7, its exponent bits to 0 and 6, its mantissa
    bit to 5. A bijection that keeps byte 0 as 0 (what a masked load fills in). A new contiguous
    tensor, written REGISTER_ORDER_CHUNK bytes at a time."""
    source = packed.contiguous().view(-1)
    out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
    target = out.view(-1)
    for start in range(0, source.numel(), REGISTER_ORDER_CHUNK):
        piece = source[start:start + REGISTER_ORDER_CHUNK]
        even, odd = piece & 0xF, piece >> 4
        target[start:start + REGISTER_ORDER_CHUNK] = ((even << 1) | ((odd & 0x8) << 4) | ((odd >> 2) & 0x1)
                                                      | ((odd & 0x3) << 5))
    return out



def e2m1_nibble_order(ordered: torch.Tensor) -> torch.Tensor:
    """:func:`e2m1_register_order`'s inverse: the decoders' bytes back to packed FP4 (low nibble the even
    column). A new contiguous tensor, written REGISTER_ORDER_CHUNK bytes at a time."""
    source = ordered.contiguous().view(-1)
    out = torch.empty(ordered.shape, dtype=ordered.dtype, device=ordered.device)
    target = out.view(-1)
    for start in range(0, source.numel(), REGISTER_ORDER_CHUNK):
        b = source[start:start + REGISTER_ORDER_CHUNK]
        even = (b >> 1) & 0xF
        odd = ((b >> 4) & 0x8) | ((b & 0x1) << 2) | ((b >> 5) & 0x3)
        target[start:start + REGISTER_ORDER_CHUNK] = even | (odd << 4)
    return out

@triton.jit
def _e2m1_codes(packed):
    """(even, odd) codes 0..15 of bytes in :func:`e2m1_register_order`."""
    even = (packed >> 1) & 0xF
    odd = ((packed >> 4) & 0x8) | ((packed & 0x1) << 2) | ((packed >> 5) & 0x3)
    return even, odd


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
    admits (launch.E2M1_MX_FOLD_CODES: bfloat16 0..128, float16 99..128), and finite for the
    code 0 that pads a row's groups (float16: 2^15, int16 wrap-around), which meets zero codes."""
    field = codes.to(tl.int16) + _folded_e8m0_exponent(dtype)
    return (field << _mantissa_bits(dtype)).to(dtype, bitcast=True)


@triton.constexpr_function
def _e2m1_asm(half: str, folded: bool = False) -> str:
    """PTX turning 4 bytes in register order (8 e2m1 codes) into value * scale for the even and the
    odd columns, two at a time in 16-bit pairs: each half then reads value * 2^-U, one paired multiply
    by 2^U (exact; ``folded``: already in the scale) and one by the scale round once. Operands: $0 $1
    even pairs (bytes 0, 1 and 2, 3), $2 $3 odd pairs, $4 the bytes, $5 $6 the scales in ``half``
    (Triton's pack=4 register order)."""
    bf16 = half == "bf16"
    lines = ["{", ".reg .b32 z, k, w0, w1, x, y, u, v;", "mov.b32 z, 0;",
             f"mov.b32 k, {E2M1_BF16_UNSCALE_PAIR if bf16 else E2M1_F16_UNSCALE_PAIR};",
             f"prmt.b32 w0, $4, z, {E2M1_PLACE_HIGH[0]};", f"prmt.b32 w1, $4, z, {E2M1_PLACE_HIGH[1]};"]
    for out in range(4):
        w = f"w{out % 2}"
        if bf16 and out < 2:  # even: sign 12 -> 15, magnitude 9..11 -> 6..8
            lines += [f"shr.b32 x, {w}, 3;", f"shl.b32 y, {w}, 3;",
                      f"lop3.b32 v, x, y, {E2M1_BF16_MASK}, {LOP3_OR_THEN_AND.value:#x};"]
        elif bf16:  # odd: sign and top exponent bit in place, the low two 13..14 -> 6..7
            lines += [f"shr.b32 x, {w}, 7;",
                      f"lop3.b32 v, x, {w}, {E2M1_BF16_ODD_KEEP}, {LOP3_B_WHERE_C_ELSE_A_NOT_B.value:#x};"]
        elif out < 2:  # float16, even: magnitude in place, sign 12 -> 15
            lines += [f"shl.b32 y, {w}, 3;", f"and.b32 u, y, {E2M1_F16_SIGN};",
                      f"lop3.b32 v, {w}, u, {E2M1_F16_EVEN_MAGNITUDE}, {LOP3_A_AND_C_OR_B.value:#x};"]
        else:  # float16, odd: sign in place, top exponent bit 8 -> 11, the low two 13..14 -> 9..10
            lines += [f"shl.b32 y, {w}, 3;",
                      f"lop3.b32 v, {w}, y, {E2M1_F16_SIGN}, {LOP3_A_WHERE_C_ELSE_B.value:#x};",
                      f"shr.b32 x, {w}, 4;", f"and.b32 x, x, {E2M1_F16_LOW_BITS};",
                      f"lop3.b32 v, v, x, {E2M1_F16_KEEP_SIGN_TOP}, {LOP3_A_AND_C_OR_B.value:#x};"]
        if not folded:
            lines += [f"mul.rn.{'bf16x2' if bf16 else 'f16x2'} v, v, k;"]
        lines += [f"mul.rn.{'bf16x2' if bf16 else 'f16x2'} ${out}, v, ${5 + out % 2};"]
    return "\n".join([*lines, "}"])


@triton.jit
def _dequant_e2m1(packed, scale, dtype, ASM: tl.constexpr = False, FOLDED: tl.constexpr = False):
    """(low, high): a packed FP4 tile (uint8 in :func:`e2m1_register_order`; low: the even input
    columns) times ``scale`` (broadcast to the tile; e8m0 or e4m3 values in ``dtype``; FOLDED: times
    2^U / 2^D, see the module note), in the 16-bit ``dtype``. ASM: the paired PTX of _e2m1_asm (GPU);
    else plain Triton (the same values)."""
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
        even, odd = _e2m1_codes(packed)
        low = (_e2m1_value(even) * s).to(dtype)
        high = (_e2m1_value(odd) * s).to(dtype)
    return low, high
