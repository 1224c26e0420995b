"""The PTX of moe_registry_kernels.triton.dequant_ptx and .fp4_dequant run on the CPU: a few-line
evaluator of the instructions they use (32-bit and, add, xor, shr, shl, mov, prmt, lop3, a funnel
rotate, paired 16-bit multiplies, the e4m3 pair convert), so the PTX text the GPU runs is checked
against the values it stands for on every input, here in CI; tests/test_triton_gpu.py checks the
same PTX on a GPU against the plain Triton path."""

import re

import pytest
import torch
from moe_registry_kernels.triton import dequant_ptx, fp4_dequant
from moe_registry_kernels.triton import launch as triton_launch

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: byte q of the result is byte (selector's nibble q, low 3 bits) of b:a,
    or, where the nibble's bit 3 is set, that byte's sign bit replicated over 8 bits."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]

    def byte(nibble: int) -> int:
        chosen = pool[nibble & 0x7]
        return (0xFF if chosen & 0x80 else 0) if nibble & 0x8 else chosen

    return sum(byte((selector >> (4 * q)) & 0xF) << (8 * q) for q in range(4))


def _e4m3_pair(x: int) -> int:
    """cvt.rn.f16x2.e4m3x2: the two e4m3 bytes of a 16-bit value as a float16 pair (exact)."""
    codes = torch.tensor([x & 0xFF, (x >> 8) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    bits = codes.float().to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def _lop3(a: int, b: int, c: int, table: int) -> int:
    """lop3.b32: each result bit is bit (4a + 2b + c) of the table."""
    return sum(((table >> (4 * ((a >> p) & 1) + 2 * ((b >> p) & 1) + ((c >> p) & 1))) & 1) << p for p in range(32))


def _pair_product(half: torch.dtype):
    """mul.rn.bf16x2 / .f16x2: each half's product, rounded once to ``half`` (exact in float32 first)."""

    def product(x: int, y: int) -> int:
        halves = torch.tensor([x & 0xFFFF, x >> 16, y & 0xFFFF, y >> 16], dtype=torch.int32).to(torch.int16)
        values = halves.view(half).float()
        bits = (values[:2] * values[2:]).to(half).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(bits[0]) | int(bits[1]) << 16

    return product


OPS = {"and": lambda x, y: x & y, "add": lambda x, y: (x + y) & MASK32, "xor": lambda x, y: x ^ y,
       "shr": lambda x, y: x >> y, "shl": lambda x, y: (x << y) & MASK32, "prmt": _prmt, "lop3": _lop3,
       "shf.l.wrap": lambda lo, hi, n: (((hi << 32 | lo) << (n & 31)) >> 32) & MASK32,
       "mul.rn.bf16x2": _pair_product(torch.bfloat16), "mul.rn.f16x2": _pair_product(torch.float16),
       "cvt.rn.f16x2.e4m3x2": _e4m3_pair}


def run_ptx(program: str, operands: dict[str, int]) -> dict[str, int]:
    """Evaluate ``program`` (one instruction a line, braces and .reg lines skipped) on 32-bit
    registers; ``operands``: the $N inputs. Returns every register, outputs ($N) included."""
    regs = dict(operands)

    def value(token: str) -> int:
        token = token.strip()
        if token.startswith("0x"):
            return int(token, 16)
        if token.isdigit():
            return int(token)
        return regs[token]

    for line in program.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        halves = re.fullmatch(r"mov\.b32 \{(\w+), (\w+)\}, (\$?\w+)", line)
        if halves:  # a 32-bit value split into its 16-bit halves
            regs[halves.group(1)], regs[halves.group(2)] = value(halves.group(3)) & 0xFFFF, value(halves.group(3)) >> 16
            continue
        match = re.fullmatch(r"([\w.]+?)\.(b32|u32|bf16x2|f16x2|e4m3x2) (\$?\w+), (.+)", line)
        op = match and (match.group(1) if match.group(2) in ("b32", "u32") else f"{match.group(1)}.{match.group(2)}")
        assert op in OPS or op == "mov", f"an instruction this evaluator does not know: {line}"
        dest, sources = match.group(3), [value(t) for t in match.group(4).split(",")]
        regs[dest] = sources[0] if op == "mov" else OPS[op](*sources)
    return regs


def test_nibbles_to_int8_ptx_gives_code_minus_8_for_every_byte():
    program = dequant_ptx._nibbles_to_int8_asm()
    # every byte value in every position of the word
    data = torch.arange(256, dtype=torch.int64)
    words = [data.roll(shift).view(64, 4) for shift in range(4)]
    for word_bytes in torch.cat(words):
        word = sum(int(b) << (8 * i) for i, b in enumerate(word_bytes))
        out = run_ptx(program, {"$2": word})
        for i, byte in enumerate(word_bytes.tolist()):
            low = (out["$0"] >> (8 * i)) & 0xFF
            high = (out["$1"] >> (8 * i)) & 0xFF
            # int8 two's complement of code - 8
            assert low == ((byte & 0xF) - 8) & 0xFF, f"byte {byte:#04x} at {i}: low {low:#04x}"
            assert high == ((byte >> 4) - 8) & 0xFF, f"byte {byte:#04x} at {i}: high {high:#04x}"


def test_the_evaluator_refuses_what_it_does_not_know():
    with pytest.raises(AssertionError, match="does not know: mul.lo.u32"):
        run_ptx("mul.lo.u32 $0, $1, 3;", {"$1": 1})


def test_e2m1_register_order_is_a_bijection_written_a_chunk_at_a_time(monkeypatch):
    """Every byte maps to a distinct one (0 to 0), the codes where the decoders look for them, and a
    tensor longer than a chunk (and not contiguous) comes out as the bytes' order one by one."""
    every = torch.arange(256, dtype=torch.uint8)
    ordered = fp4_dequant.e2m1_register_order(every).to(torch.int64)
    assert int(ordered[0]) == 0 and len(set(ordered.tolist())) == 256
    even, odd = every.to(torch.int64) & 0xF, every.to(torch.int64) >> 4
    assert torch.equal((ordered >> 1) & 0xF, even)
    assert torch.equal(((ordered >> 4) & 0x8) | ((ordered & 0x1) << 2) | ((ordered >> 5) & 0x3), odd)
    table = ordered.to(torch.uint8)
    monkeypatch.setattr(fp4_dequant, "REGISTER_ORDER_CHUNK", 7)
    packed = torch.randint(0, 256, (3, 10, 6), dtype=torch.uint8).transpose(1, 2)
    got = fp4_dequant.e2m1_register_order(packed)
    assert got.is_contiguous() and torch.equal(got, table[packed.to(torch.int64)])


@pytest.mark.parametrize("folded", [False, True], ids=["two-multiplies", "folded"])
@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_e2m1_ptx_gives_value_times_scale_for_every_byte(half, folded):
    """Every packed byte in every position of the word, put in the decoders' register order: each
    output pair holds the two codes' table values (even columns: the low nibbles) times their
    element's scale, rounded once (folded: the scale carries the unscale 2^U and a 2^-8 the GEMM
    takes back, as NVFP4's e4m3 scales do)."""
    from moe_registry_kernels.fp4 import e2m1_to_float

    dtype = torch.bfloat16 if half == "bf16" else torch.float16
    unscale = 126 if half == "bf16" else 14
    program = fp4_dequant._e2m1_asm(half, folded)
    scales = torch.tensor([0.75, 448.0, 2.0 ** -6, 1.0])  # elements 0..3: e4m3 values
    given = (scales * 2.0 ** (unscale - 8) if folded else scales).to(dtype)
    assert torch.equal(given.float(), scales * 2.0 ** (unscale - 8) if folded else scales)

    def pair(values: torch.Tensor) -> int:
        bits = values.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(bits[0]) | int(bits[1]) << 16

    data = torch.arange(256, dtype=torch.int64)
    for word_bytes in torch.cat([data.roll(shift).view(64, 4) for shift in range(4)]):
        ordered = fp4_dequant.e2m1_register_order(word_bytes.to(torch.uint8))
        word = sum(int(b) << (8 * i) for i, b in enumerate(ordered))
        out = run_ptx(program, {"$4": word, "$5": pair(given[:2]), "$6": pair(given[2:])})
        for nibbles, first in ((word_bytes & 0xF, 0), (word_bytes >> 4, 2)):
            want = (e2m1_to_float(nibbles.to(torch.uint8)) * scales).to(dtype).float()
            if folded:
                want = want * 2.0 ** -8
            for i in range(2):
                got = out[f"${first + i}"]
                assert got == pair(want[2 * i:2 * i + 2]), f"{half} word {word:#010x}, ${first + i}: {got:#010x}"


@pytest.mark.parametrize("word_pairs", [False, True], ids=["bytes", "word-pairs"])
@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_e4m3_ptx_gives_value_times_scale_for_every_byte(half, word_pairs):
    """Every e4m3 byte but the NaNs in every position of the word (subnormals, zeros and both signs
    included): each output pair holds its two codes' values times the MX scale, rounded once, from
    the scale folded as the GEMMs fold it (bfloat16: times 2^120), over the fold's whole code range."""
    dtype = torch.bfloat16 if half == "bf16" else torch.float16
    program = dequant_ptx._e4m3_asm(half, word_pairs)
    pairs = dequant_ptx._e4m3_byte_pairs(word_pairs)
    lowest, highest = triton_launch.E4M3_MX_FOLD_CODES[dtype]
    unscale = 2.0 ** 120 if half == "bf16" else 1.0

    def pair(values: torch.Tensor) -> int:
        bits = values.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(bits[0]) | int(bits[1]) << 16

    data = torch.arange(256, dtype=torch.int64)
    data = data[(data & 0x7F) != 0x7F]  # the e4m3fn NaN codes, refused where checkpoints are read
    words = torch.cat([data.roll(shift)[:252].view(63, 4) for shift in range(4)])
    for n, word_bytes in enumerate(words):
        # one scale an element: a byte (in order) or a 16-bit word of two (word pairs)
        codes = [lowest, highest, lowest + n % (highest - lowest), highest - n % 7]
        scales = torch.exp2(torch.tensor(codes, dtype=torch.float64) - 127)
        folded = (scales * unscale).to(dtype)
        assert torch.equal(folded.double(), scales * unscale), "the folded scale is exact"
        word = sum(int(b) << (8 * i) for i, b in enumerate(word_bytes))
        operands = {"$2": word, "$3": pair(folded[:2]), "$4": pair(folded[2:])}
        out = run_ptx(program, operands)
        byte_scales = scales[[0, 0, 1, 1]] if word_pairs else scales
        want_all = word_bytes.to(torch.uint8).view(torch.float8_e4m3fn).double() * byte_scales
        for i in range(2):
            want = want_all[list(pairs[i])].to(dtype)
            assert out[f"${i}"] == pair(want), f"{half} word {word:#010x}, ${i}: {out[f'${i}']:#010x}"
