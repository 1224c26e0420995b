"""Weight tiles dequantised in registers: PTX builders for paired 16-bit dequantisation and their
plain-Triton equivalents.

A GEMM tile of integer codes becomes (code - zero) * scale in the 16-bit activation dtype without
an integer-to-float conversion: each code is OR-ed into the mantissa of a power of two whose unit
in the last place is 1 (:data:`FP16_NIBBLE_OFFSET`, :data:`BF16_NIBBLE_OFFSET` for 4-bit codes in
16 bits, :data:`F32_CODE_OFFSET` for 8-bit codes in float32), so the float reads OFFSET + code,
and subtracting the zero code plus the same offset leaves code - zero exactly.

On the GPU (sm_80+, bf16 from sm_90; :func:`_paired_halves`) the same steps run as inline PTX on
pairs of 16-bit values (:func:`_nibble_asm`, :func:`_byte_asm`): fewer instructions than Triton's
byte extraction and float32 multiply, the same values (every step is exact but the multiply,
which both round once). :func:`_dequant_nibbles`, :func:`_dequant_byte` and
:func:`_dequant_byte_pairs` are what the GEMM kernels call (:func:`_nibbles_as_int8` for the int8
dot of W4A8); :func:`_e8m0` decodes MX scales.
"""



import functools
import os

import torch
import triton
import triton.language as tl

# 4-bit codes in 16 bits: OR-ed into the mantissa of fp16 1024 (bits 0x6400) or bf16 128 (bits
# 0x4300), whose unit in the last place is 1, the half reads OFFSET + code exactly
FP16_NIBBLE_OFFSET = tl.constexpr(1024.0)
FP16_NIBBLE_BITS = tl.constexpr(0x6400)
BF16_NIBBLE_OFFSET = tl.constexpr(128.0)
BF16_NIBBLE_BITS = tl.constexpr(0x4300)
# any 8-bit (or 4-bit) code in float32: OR-ed into the mantissa of 2^23 (bits 0x4B000000)
F32_CODE_OFFSET = tl.constexpr(8388608.0)
F32_CODE_BITS = tl.constexpr(0x4B000000)
NIBBLE_MASK = tl.constexpr(0xF)
# two's complement codes read as offset binary (around 8 and 128): the sign bit flipped
INT4_SIGN_FLIP = tl.constexpr(0x88)  # both nibbles of a byte
INT8_SIGN_FLIP = tl.constexpr(0x80)
# e8m0 scales: exponent byte e is 2^(e - 127), moved into float32's exponent field (bit 23 up);
# byte 0 is the subnormal 2^-127 (float32 bits 0x400000)
F32_MANTISSA_BITS = tl.constexpr(23)
E8M0_SUBNORMAL_BITS = tl.constexpr(0x400000)


def _immediate(bits: tl.constexpr, times: int) -> str:
    """A 32-bit PTX immediate repeating a 32/times-bit pattern: _immediate(0x6400, 2) is 0x64006400."""
    return "0x" + f"{bits.value:0{8 // times}X}" * times


# the same patterns as PTX immediates, for the paired forms (one per 16-bit half, or per byte)
FP16_NIBBLE_PAIR = _immediate(FP16_NIBBLE_BITS, 2)
BF16_NIBBLE_PAIR = _immediate(BF16_NIBBLE_BITS, 2)
NIBBLE_MASK_PAIR = _immediate(NIBBLE_MASK, 2)
INT4_SIGN_FLIP_WORD = _immediate(INT4_SIGN_FLIP, 4)
INT8_SIGN_FLIP_WORD = _immediate(INT8_SIGN_FLIP, 4)
F32_CODE_WORD = _immediate(F32_CODE_BITS, 1)


@functools.cache
def compiles_ptx(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` are compiled for an NVIDIA GPU, so their inline PTX runs, not
    under the interpreter (which runs the plain-Triton equivalents: the same numbers)."""
    return device.type == "cuda" and not torch.version.hip and os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def _paired_halves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the PTX dequantisation (_nibble_asm, _byte_asm) runs: compiled for a GPU (not the
    interpreter) that converts float32 pairs to 16 bits (sm_80 and later) and, for bfloat16,
    has paired bf16 subtract/multiply (sm_90 and later)."""
    if not compiles_ptx(device):
        return False
    return paired_halves_on(torch.cuda.get_device_capability(device), dtype)


def paired_halves_on(capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """:func:`_paired_halves` for a CUDA GPU of ``capability`` (also for one that is not here)."""
    if dtype == torch.float16:
        return capability >= (8, 0)
    return dtype == torch.bfloat16 and capability >= (9, 0)


@functools.cache
def fp8_pair_convert(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 pairs to float16 (cvt.rn.f16x2.e4m3x2, sm_89 and later), which the
    float16 form of :func:`_e4m3_asm` issues; before it, fp8 weights take :func:`_e4m3_value`."""
    if not compiles_ptx(device):
        return False
    return fp8_pair_convert_on(torch.cuda.get_device_capability(device))


def fp8_pair_convert_on(capability: tuple[int, int]) -> bool:
    """:func:`fp8_pair_convert` for a CUDA GPU of ``capability``."""
    return capability >= (8, 9)


@triton.jit
def _e8m0(e):
    """Raw e8m0 exponent bytes -> 2^(e-127) as float32 (byte 0 is the subnormal 2^-127)."""
    e = e.to(tl.int32)
    return tl.where(e == 0, E8M0_SUBNORMAL_BITS, e << F32_MANTISSA_BITS).to(tl.float32, bitcast=True)



@triton.constexpr_function
def _nibble_asm(half: str, signed: bool, scaled: bool = True, raw: bool = False) -> str:
    """PTX turning 4 packed bytes (8 4-bit codes) into (code - zero) * scale for the low and the
    high nibbles, two at a time in 16-bit pairs: bytes are spread into the halves of a word
    (prmt), each nibble OR-ed into the mantissa of the pair's magic number (lop3; 128 + code in
    bf16, 1024 + code in fp16), then one paired subtract of the offset zero and one paired
    multiply by the scale. Operands: $0 $1 low pairs, $2 $3 high pairs, $4 the bytes, $5 $6 offset
    zeros, $7 $8 scales (Triton's pack=4 register order). Not ``scaled``: code - zero only (no
    scale operands), for kernels that apply the scale to the dot's result. ``raw``: OFFSET + code
    (the lop3's halves; no zero operand), for dots whose zero and offset come off after the loop."""
    magic = BF16_NIBBLE_PAIR if half == "bf16" else FP16_NIBBLE_PAIR
    flip = f"xor.b32 w, $4, {INT4_SIGN_FLIP_WORD};" if signed else "mov.b32 w, $4;"
    lines = ["{", ".reg .b32 w, z, t0, t1, u0, u1;", flip, "mov.b32 z, 0;",
             "prmt.b32 t0, w, z, 0x4140;", "prmt.b32 t1, w, z, 0x4342;"]
    for out, shift in ((0, False), (2, True)):
        if shift:
            lines += ["shr.b32 t0, t0, 4;", "shr.b32 t1, t1, 4;"]
        if raw:
            lines += [f"lop3.b32 ${out}, t0, {NIBBLE_MASK_PAIR}, {magic}, 0xEA;",
                      f"lop3.b32 ${out + 1}, t1, {NIBBLE_MASK_PAIR}, {magic}, 0xEA;"]
            continue
        lines += [f"lop3.b32 u0, t0, {NIBBLE_MASK_PAIR}, {magic}, 0xEA;",
                  f"lop3.b32 u1, t1, {NIBBLE_MASK_PAIR}, {magic}, 0xEA;"]
        if scaled:
            lines += [f"sub.rn.{half}x2 u0, u0, $5;", f"sub.rn.{half}x2 u1, u1, $6;",
                      f"mul.rn.{half}x2 ${out}, u0, $7;", f"mul.rn.{half}x2 ${out + 1}, u1, $8;"]
        else:
            lines += [f"sub.rn.{half}x2 ${out}, u0, $5;", f"sub.rn.{half}x2 ${out + 1}, u1, $6;"]
    return "\n".join([*lines, "}"])


# uint4b8 codes as int8 values code - 8, four bytes a word: code + 0x78 (at most 0x87: no carry into
# the next byte) with its top bit flipped is code + 120 - 128, two's complement
INT4_TO_INT8_BIAS = tl.constexpr(0x78)
INT4_TO_INT8_BIAS_WORD = _immediate(INT4_TO_INT8_BIAS, 4)
NIBBLE_MASK_WORD = _immediate(NIBBLE_MASK, 4)


@triton.constexpr_function
def _nibbles_to_int8_asm() -> str:
    """PTX turning 4 packed bytes (8 uint4b8 codes) into their values code - 8 as int8, four at a
    time in one 32-bit word: each nibble masked into its own byte (the high ones shifted down
    first), INT4_TO_INT8_BIAS added, each byte's top bit flipped. Operands: $0 the low nibbles'
    values, $1 the high nibbles', $2 the packed bytes (pack=4)."""
    lines = ["{", ".reg .b32 t;"]
    for out, shift in ((0, False), (1, True)):
        source = "t" if shift else "$2"
        if shift:
            lines.append("shr.b32 t, $2, 4;")
        lines += [f"and.b32 t, {source}, {NIBBLE_MASK_WORD};", f"add.u32 t, t, {INT4_TO_INT8_BIAS_WORD};",
                  f"xor.b32 ${out}, t, {INT8_SIGN_FLIP_WORD};"]
    return "\n".join([*lines, "}"])


@triton.jit
def _nibbles_as_int8(packed, ASM: tl.constexpr):
    """(low, high): the int8 values code - 8 of a packed uint4b8 tile's low (even-column) and high
    nibbles, the operands of an int8 dot (W4A8). ASM: the PTX of _nibbles_to_int8_asm, four codes
    an instruction where Triton's int8 arithmetic takes each byte on its own (a third of the K
    loop's instructions at W4A8 prefill); else plain Triton (the same values)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(_nibbles_to_int8_asm(), "=r,=r,r", [packed], dtype=(tl.int8, tl.int8),
                                              is_pure=True, pack=4)
    else:
        low = (packed & NIBBLE_MASK).to(tl.int8) - 8
        high = (packed >> 4).to(tl.int8) - 8
    return low, high


@triton.constexpr_function
def _asm_constraints(pack: int, outputs: int, operand_bits: tuple) -> str:
    """Inline-asm constraints for ``outputs`` 16-bit results and operands of these bit widths,
    ``pack`` elements per call: one 32-bit register per 32 bits of each."""
    regs = [max(1, pack * bits // 32) for bits in (16,) * outputs + tuple(operand_bits)]
    return ",".join(["=r"] * sum(regs[:outputs]) + ["r"] * sum(regs[outputs:]))


@triton.constexpr_function
def _asm_result_dtype(dtype, outputs: int):
    """inline_asm_elementwise's ``dtype``: one dtype, or a tuple of ``outputs`` of them."""
    return dtype if outputs == 1 else (dtype,) * outputs


@triton.jit
def _dequant_asm(program: tl.constexpr, codes, tile_zero, scale, dtype, OUTPUTS: tl.constexpr,
                 SCALED: tl.constexpr, PACK: tl.constexpr):
    """Run a dequantising PTX ``program`` (_nibble_asm, _byte_asm) on ``codes`` with the offset
    zero and, when SCALED, the scale (in ``dtype``) broadcast to them: OUTPUTS results in
    ``dtype``, PACK elements per call."""
    zero_t = tl.broadcast_to(tile_zero, codes.shape)
    result: tl.constexpr = _asm_result_dtype(dtype, OUTPUTS)
    if SCALED:
        scale_t = tl.broadcast_to(scale, codes.shape).to(dtype)
        bits: tl.constexpr = (codes.dtype.primitive_bitwidth, zero_t.dtype.primitive_bitwidth,
                              scale_t.dtype.primitive_bitwidth)
        out = tl.inline_asm_elementwise(program, _asm_constraints(PACK, OUTPUTS, bits), [codes, zero_t, scale_t],
                                        dtype=result.value, is_pure=True, pack=PACK)
    else:
        bits: tl.constexpr = (codes.dtype.primitive_bitwidth, zero_t.dtype.primitive_bitwidth)
        out = tl.inline_asm_elementwise(program, _asm_constraints(PACK, OUTPUTS, bits), [codes, zero_t],
                                        dtype=result.value, is_pure=True, pack=PACK)
    return out


@triton.jit
def _dequant_nibbles(packed, tile_zero, scale, dtype, SIGNED: tl.constexpr, ASM: tl.constexpr,
                     SCALED: tl.constexpr = True):
    """(low, high): the dequantised even- and odd-column weights of a packed 4-bit tile, in the
    16-bit ``dtype``. ``tile_zero`` (zero code + offset, as _offset_zero gives it) and ``scale``
    broadcast to the tile; not SCALED: code - zero only (exact; ``scale`` unused), for tiles
    whose scale multiplies the dot's result. ASM: the paired PTX of _nibble_asm (GPU); else plain
    Triton (the same values: every step is exact but the multiply, which both round once)."""
    if ASM:
        program: tl.constexpr = _nibble_asm("bf16" if dtype == tl.bfloat16 else "f16", SIGNED, SCALED)
        low, high = _dequant_asm(program, packed, tile_zero, scale, dtype, 2, SCALED, 4)
    else:
        if SIGNED:  # two's complement nibbles -> offset binary around 8
            packed = packed ^ INT4_SIGN_FLIP
        low = _offset_codes(packed & NIBBLE_MASK, dtype, True) - tile_zero
        high = _offset_codes(packed >> 4, dtype, True) - tile_zero
        if SCALED:
            low, high = low * scale, high * scale
        low, high = low.to(dtype), high.to(dtype)
    return low, high


@triton.jit
def _raw_nibbles(packed, dtype, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """(low, high): OFFSET + code (:func:`_offset_codes`, exact) of a packed 4-bit tile's even- and odd-column
    codes in the 16-bit ``dtype``: the lop3 of :func:`_nibble_asm` without the paired subtract of the zero,
    for a dot whose zero and OFFSET come off after the loop with the input's sums (``ZERO_SUMS``: the
    RAW_CODES of the GEMM kernel). ASM: the PTX (GPU); else plain Triton (the same values)."""
    if ASM:
        program: tl.constexpr = _nibble_asm("bf16" if dtype == tl.bfloat16 else "f16", SIGNED, False, True)
        result: tl.constexpr = _asm_result_dtype(dtype, 2)
        low, high = tl.inline_asm_elementwise(program, _asm_constraints(4, 2, (8,)), [packed], dtype=result.value,
                                              is_pure=True, pack=4)
    else:
        if SIGNED:  # two's complement nibbles -> offset binary around 8
            packed = packed ^ INT4_SIGN_FLIP
        low = _offset_codes(packed & NIBBLE_MASK, dtype, True)
        high = _offset_codes(packed >> 4, dtype, True)
    return low, high


@triton.constexpr_function
def _byte_asm(half: str, signed: bool, scaled: bool, word_pairs: bool = False) -> str:
    """PTX turning 4 packed 8-bit integer codes into (code - zero) [* scale]: each byte is placed
    into the mantissa of float32 2^23 by one prmt (2^23 + code, exact), one float32 subtract of
    the offset zero leaves code - zero (exact), one convert packs two of them into 16-bit halves
    (exact: |code - zero| < 256), and one paired 16-bit multiply applies the scale, rounding once
    as the float32 product would. ``signed``: two's complement bytes, read as offset binary (xor
    0x80) first. Operands: $0 $1 the result pairs, $2 the 4 bytes, then the float32 offset zeros
    and the 16-bit scale pairs:
    - bytes in order (pack=4): $0 = codes 0, 1 and $1 = codes 2, 3; zeros $3-$6, scales $7 $8;
    - ``word_pairs`` (two 16-bit words of an even and an odd code each, pack=2): $0 = the even
      codes, $1 = the odd ones; one zero ($3 $4) and one scale ($5, a pair) per word."""
    flip = f"xor.b32 w, $2, {INT8_SIGN_FLIP_WORD};" if signed else "mov.b32 w, $2;"
    lines = ["{", ".reg .b32 w, m, f0, f1, f2, f3;", flip, f"mov.b32 m, {F32_CODE_WORD};"]
    for i in range(4):
        zero = 3 + i // 2 if word_pairs else 3 + i
        lines += [f"prmt.b32 f{i}, w, m, 0x765{i};", f"sub.rn.f32 f{i}, f{i}, ${zero};"]
    pairs = (("f2", "f0"), ("f3", "f1")) if word_pairs else (("f1", "f0"), ("f3", "f2"))
    scales = ("$5", "$5") if word_pairs else ("$7", "$8")
    for out in range(2):  # (no tuple targets: Triton 3.6 reads this source for its cache key)
        high, low = pairs[out]
        lines.append(f"cvt.rn.{half}x2.f32 ${out}, {high}, {low};")
        if scaled:
            lines.append(f"mul.rn.{half}x2 ${out}, ${out}, {scales[out]};")
    return "\n".join([*lines, "}"])


@triton.jit
def _dequant_byte_pairs(words, tile_zero, scale, dtype, SIGNED: tl.constexpr, SCALED: tl.constexpr):
    """(even, odd): the dequantised codes of 16-bit words holding two 8-bit integer codes each
    (low byte: the even column), with _byte_asm; ``tile_zero`` (float32, offset) and ``scale``
    (in ``dtype``) broadcast to the words. GPU only (PTX)."""
    program: tl.constexpr = _byte_asm("bf16" if dtype == tl.bfloat16 else "f16", SIGNED, SCALED, True)
    return _dequant_asm(program, words, tile_zero, scale, dtype, 2, SCALED, 2)


# MX fp8 weights as 16-bit values times a folded scale (_e4m3_asm): bfloat16 halves read the e4m3
# value * 2^-120, which the scale takes back (launch.E4M3_MX_FOLD_CODES: where that is exact)
E4M3_BF16_UNSCALE = tl.constexpr(2.0 ** 120)
# e4m3 bits 6..0 (exponent and mantissa) moved to bfloat16 bits 10..4, the sign to bit 15
E4M3_BF16_FIELDS_PAIR = "0x87F087F0"


@triton.constexpr_function
def _e4m3_byte_pairs(word_pairs: bool) -> tuple:
    """The bytes of a 32-bit word that make each output pair (low half, high half): in order
    (codes 0, 1 and 2, 3), or ``word_pairs`` (two 16-bit words of an even and an odd code each:
    the even codes 0, 2 and the odd ones 1, 3)."""
    return ((0, 2), (1, 3)) if word_pairs else ((0, 1), (2, 3))


@triton.constexpr_function
def _e4m3_asm(half: str, word_pairs: bool = False) -> str:
    """PTX turning 4 e4m3 codes (one 32-bit word) into value * scale, two at a time in 16-bit pairs,
    the scale folded (:func:`_e4m3_folded_scale`):
    - float16: one hardware convert a pair (exact) and one paired multiply;
    - bfloat16: one prmt places each code's byte in its half's low byte and its sign, replicated,
      in the high byte; one shift and one mask leave sign, exponent and mantissa where bfloat16
      has them, value * 2^-120 (subnormal codes too), and one paired multiply by scale * 2^120.
    Operands: $0 $1 the result pairs (:func:`_e4m3_byte_pairs`), $2 the word, $3 $4 the scale pairs
    (bytes in order, pack=4: one scale a byte) or $3 the two words' scales (``word_pairs``, pack=2)."""
    pairs = _e4m3_byte_pairs(word_pairs)
    scales = ("$3", "$3") if word_pairs else ("$3", "$4")
    lines = ["{", ".reg .b32 z, t0, t1;", ".reg .b16 h0, h1;", "mov.b32 z, 0;"]
    if half == "f16":  # each pair's two bytes in a 16-bit half, converted by the hardware
        if word_pairs:
            lines += [f"prmt.b32 t0, $2, z, 0x{pairs[1][1]}{pairs[1][0]}{pairs[0][1]}{pairs[0][0]};",
                      "mov.b32 {h0, h1}, t0;"]
        else:
            lines.append("mov.b32 {h0, h1}, $2;")
        lines += ["cvt.rn.f16x2.e4m3x2 t0, h0;", "cvt.rn.f16x2.e4m3x2 t1, h1;"]
    for out in range(2):  # (no tuple targets: Triton 3.6 reads this source for its cache key)
        low, high = pairs[out][0], pairs[out][1]
        if half == "bf16":  # byte `high` with its sign replicated (selector bit 3) above it, `low` likewise
            lines += [f"prmt.b32 t{out}, $2, z, 0x{high | 8:X}{high}{low | 8:X}{low};",
                      f"shl.b32 t{out}, t{out}, 4;", f"and.b32 t{out}, t{out}, {E4M3_BF16_FIELDS_PAIR};"]
        lines.append(f"mul.rn.{half}x2 ${out}, t{out}, {scales[out]};")
    return "\n".join([*lines, "}"])


@triton.jit
def _e4m3_folded_scale(scale, dtype):
    """An MX group scale (float32 power of two) times the unscale of :func:`_e4m3_asm`'s halves, in
    ``dtype``: exact for the codes launch.E4M3_MX_FOLD_CODES admits (finite for the pad code 0)."""
    if dtype == tl.bfloat16:
        scale = scale * E4M3_BF16_UNSCALE
    return scale.to(dtype)


@triton.jit
def _dequant_e4m3(codes, scale, dtype, WORD_PAIRS: tl.constexpr = False):
    """e4m3 weight codes (uint8 bytes in order, or ``WORD_PAIRS``: uint16 words of an even and an odd
    code) times a folded MX scale (:func:`_e4m3_folded_scale`, broadcast to them), in the 16-bit
    ``dtype``, with _e4m3_asm: the values _dequant_byte gives. GPU only (PTX); WORD_PAIRS returns
    (even, odd) as _dequant_byte_pairs does."""
    program: tl.constexpr = _e4m3_asm("bf16" if dtype == tl.bfloat16 else "f16", WORD_PAIRS)
    PACK: tl.constexpr = 2 if WORD_PAIRS else 4
    result: tl.constexpr = _asm_result_dtype(dtype, 2 if WORD_PAIRS else 1)
    scale_t = tl.broadcast_to(scale, codes.shape).to(dtype)
    bits: tl.constexpr = (codes.dtype.primitive_bitwidth, 16)
    return tl.inline_asm_elementwise(program, _asm_constraints(PACK, 2 if WORD_PAIRS else 1, bits), [codes, scale_t],
                                     dtype=result.value, is_pure=True, pack=PACK)


# e4m3 codes whose exponent and mantissa bits sit at float16's read value * 2^-8 (_e4m3_value)
E4M3_F16_UNSCALE = tl.constexpr(256.0)


@triton.jit
def _e4m3_value(codes):
    """e4m3 codes (uint8 bits) -> their float32 values, exactly, by integer operations and a float16
    widening: no fp8 type, which Triton refuses below sm_89 (Ampere runs fp8 weights so). Exponent and
    mantissa move to float16's places, which read value * 2^-8 (subnormal codes as float16 subnormals),
    the sign to bit 15; the widened value times 2^8 is exact. (The NaN codes read +-480: checkpoints
    hold none.)"""
    bits = codes.to(tl.uint16)
    half = (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * E4M3_F16_UNSCALE


@triton.jit
def _dequant_byte(codes, tile_zero, scale, dtype, W_TYPE: tl.constexpr, ASM: tl.constexpr = False,
                  SCALED: tl.constexpr = True):
    """8-bit weight codes (uint8 bits) -> (code - zero) * scale, or the e4m3 value * scale,
    rounded once to ``dtype``; not SCALED: ``scale`` is 1 (unused). ASM (integer codes, scales
    already in ``dtype``): the PTX of _byte_asm, which gives the same values in fewer
    instructions than Triton's byte extraction and float32 multiply."""
    if ASM and W_TYPE != "fp8e4m3":
        program: tl.constexpr = _byte_asm("bf16" if dtype == tl.bfloat16 else "f16", W_TYPE == "int8", SCALED)
        out = _dequant_asm(program, codes, tile_zero, scale, dtype, 1, SCALED, 4)
    else:
        if W_TYPE == "fp8e4m3":
            out = _e4m3_value(codes)
        else:
            if W_TYPE == "int8":  # two's complement -> offset binary around 128
                codes = codes ^ INT8_SIGN_FLIP
            out = _offset_codes(codes, dtype, False) - tile_zero
        if SCALED:
            out = out * scale
        out = out.to(dtype)
    return out


@triton.jit
def _offset_codes(codes, dtype, NARROW: tl.constexpr):
    """Unsigned integer codes as floats OFFSET + code, without an integer-to-float conversion: the
    code is OR-ed into the mantissa of a power of two whose unit in the last place is 1
    (FP16_NIBBLE_OFFSET and BF16_NIBBLE_OFFSET for 4-bit codes when NARROW, else F32_CODE_OFFSET). Subtracting
    :func:`_offset_zero` then gives code - zero exactly."""
    if NARROW and dtype == tl.float16:
        v = (codes.to(tl.uint16) | FP16_NIBBLE_BITS).to(tl.float16, bitcast=True)
    elif NARROW and dtype == tl.bfloat16:
        v = (codes.to(tl.uint16) | BF16_NIBBLE_BITS).to(tl.bfloat16, bitcast=True)
    else:
        v = (codes.to(tl.uint32) | F32_CODE_BITS).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _offset_zero(zero, dtype, NARROW: tl.constexpr):
    """float32 zero codes + the OFFSET of :func:`_offset_codes`, in the type it returns (exact)."""
    if NARROW and dtype == tl.float16:
        z = (zero + FP16_NIBBLE_OFFSET).to(tl.float16)
    elif NARROW and dtype == tl.bfloat16:
        z = (zero + BF16_NIBBLE_OFFSET).to(tl.bfloat16)
    else:
        z = zero + F32_CODE_OFFSET
    return z
