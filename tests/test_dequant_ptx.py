"""The PTX of moe_registry_kernels.dequant_ptx run on the CPU: a few-line evaluator of the 32-bit
integer instructions it uses (and, add, xor, shr, mov on .b32/.u32 registers and immediates),
so the PTX text the GPU runs is checked against the values it stands for on every input, here
in CI; tests/test_triton_gpu.py checks the same PTX on a GPU against the plain Triton path."""

import re

import pytest
import torch
from moe_registry_kernels import dequant_ptx

MASK32 = 0xFFFFFFFF
OPS = {"and": lambda x, y: x & y, "add": lambda x, y: (x + y) & MASK32, "xor": lambda x, y: x ^ y,
       "shr": lambda x, y: x >> y}


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
        match = re.fullmatch(r"(\w+)\.(?:b32|u32) (\$?\w+), (.+)", line)
        assert match, f"an instruction this evaluator does not know: {line}"
        op, dest, sources = match.group(1), match.group(2), [value(t) for t in match.group(3).split(",")]
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
