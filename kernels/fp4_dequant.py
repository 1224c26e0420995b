"""FP4 (e2m1) weight tiles dequantised in registers, for the GEMM kernels of
:mod:`moe_registry_kernels.moe_gemm`: bit moves and multiplies, no table in memory.

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


@triton.jit
def _e4m3_scale(codes, dtype, TIMES: tl.constexpr, CVT: tl.constexpr):
    """float8_e4m3fn scale bytes (uint8) -> value * TIMES (a power of two) in the 16-bit ``dtype``, exact
    (3 mantissa bits). CVT: the GPU's fp8 conversion (sm_89+: two scales an instruction); else the bit
    move of :func:`_e4m3_value` (the interpreter, older GPUs), which gives the same values. H100, NVFP4's
    loop at M = 8 and 64 (offline sm_90 SASS): 8-10% fewer instructions with CVT."""
    if CVT:  # noqa: SIM108  (a constexpr branch: the other one is not built)
        value = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * TIMES
    else:
        value = _e4m3_value(codes, TIMES)
    return value.to(dtype)


# The paired forms read a kernel-private byte order (:func:`e2m1_register_order`, written once when
# the Triton experts are built): the even column's code on bits 1..4 (sign on 4) and the odd
# column's with its sign on bit 7, its top exponent bit on bit 0 and its low exponent and mantissa
# bits on 6..5. Each byte is placed in the high byte of a 16-bit half (prmt with zero bytes), where
# bits 15 and 8 already hold the odd code's sign and top exponent bit in bfloat16's places (15, 8)
# and the even code's magnitude sits in float16's (9..11). An exhaustive search over byte orders
# and pairs of shifts with one lop3 (tools/fp4_order_search.py) finds this order the only one where
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
    admits (triton_moe.E2M1_MX_FOLD_CODES: bfloat16 0..128, float16 99..128), and finite for the
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
