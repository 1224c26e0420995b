"""Search the byte orders of packed FP4 codes for the cheapest paired bfloat16 decode (issue #19).

The GEMMs place each byte of four in a 16-bit half of a 32-bit word (one prmt with zero bytes: in
the half's low byte, ``place`` 0, or its high byte, 8), then build each pair of codes with one lop3
of two operands -- the placed word shifted by k1 and by k2 bits (0: the word itself) -- and a free
immediate. A code is decoded when the lop3 puts its sign on bfloat16 bit 15 and its two exponent and
one mantissa bits on bits 8, 7, 6 of both halves, and 0 on every other bit, whatever the byte's
other code holds. This tool tries every placement, every byte position of a code's four bits
(8 * 7 * 6 * 5 orders), every pair of shifts in -15..15 and every lop3 table, and prints the forms
that need the fewest shifts. ``kernels/fp4_dequant.e2m1_register_order`` is the order it finds.

    python tools/fp4_order_search.py             # the forms with at most one shift (a second)
    python tools/fp4_order_search.py --shifts 2  # every two-shift form too (about a minute)
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

FIELDS = ("sign", "e1", "e0", "m")  # a code's bits, high to low: sign, two exponent bits, mantissa
BF16_PLACES = {15: "sign", 8: "e1", 7: "e0", 6: "m"}  # where bfloat16 wants them in each half
SHIFTS = range(-15, 16)  # left (> 0) or right (< 0)

Symbol = tuple[str, int] | None  # ("low" or "high" half's byte, bit) or None: a bit that is 0


@dataclass(frozen=True)
class Form:
    """One way to decode one code of each byte: its bit positions in the byte, the placement, the
    two shifts, a lop3 table that works and the immediate (one bit per word position) it takes."""

    positions: tuple[int, int, int, int]  # byte bits of sign, e1, e0, m
    place: int
    shifts: tuple[int, int]
    table: int
    immediate: int

    @property
    def shift_count(self) -> int:
        return sum(1 for k in self.shifts if k)


@functools.cache
def _placed_word(place: int) -> tuple[Symbol, ...]:
    """The word after placement: each half holds its byte at bits place..place + 7, zeros elsewhere."""
    word: list[Symbol] = [None] * 32
    for bit in range(8):
        word[place + bit] = ("low", bit)
        word[16 + place + bit] = ("high", bit)
    return tuple(word)


@functools.cache
def _shifted(place: int, k: int) -> tuple[Symbol, ...]:
    """The placed word shifted left by k bits (right for k < 0), zeros shifted in."""
    word = _placed_word(place)
    return tuple(word[p - k] if 0 <= p - k < 32 else None for p in range(32))


@functools.cache
def _target(positions: tuple[int, int, int, int]) -> tuple[Symbol, ...]:
    bit_of = dict(zip(FIELDS, positions, strict=True))
    target: list[Symbol] = [None] * 32
    for place, field in BF16_PLACES.items():
        target[place] = ("low", bit_of[field])
        target[16 + place] = ("high", bit_of[field])
    return tuple(target)


def _pattern(a: Symbol, b: Symbol, want: Symbol) -> tuple[int, int, int]:
    """(a, b, want) up to renaming: 0 for a zero bit, else which distinct byte bit it is (1, 2, 3)."""
    names: dict[Symbol, int] = {}
    return tuple(0 if s is None else names.setdefault(s, len(names) + 1) for s in (a, b, want))  # type: ignore[return-value]


def _gives(table: int, pattern: tuple[int, int, int], c: int) -> bool:
    """Whether lop3(a, b, c) under ``table`` gives ``want`` whatever the byte bits involved hold (bit
    4a + 2b + c of the table is the result)."""
    a, b, want = pattern
    symbols = sorted({s for s in pattern if s})
    return all(((table >> (4 * env[a] + 2 * env[b] + c)) & 1) == env[want]
               for env in ({0: 0, **dict(zip(symbols, values, strict=True))}
                           for values in itertools.product((0, 1), repeat=len(symbols))))


def _immediate_bit(table: int, pattern: tuple[int, int, int]) -> int | None:
    """An immediate bit for which the lop3 gives what the pattern wants (:func:`_gives`), or None."""
    return next((c for c in (0, 1) if _gives(table, pattern, c)), None)


# every (pattern, table) answer, computed once, and per pattern the tables that have one (a 256-bit mask)
_ANSWERS = {(pattern, table): _immediate_bit(table, pattern)
            for pattern in itertools.product(range(4), repeat=3) for table in range(256)}
_TABLES = {pattern: sum(1 << table for table in range(256) if _ANSWERS[(pattern, table)] is not None)
           for pattern in itertools.product(range(4), repeat=3)}


def _patterns(positions: tuple[int, int, int, int], place: int, shifts: tuple[int, int]) -> list[tuple[int, int, int]]:
    a, b, want = _shifted(place, shifts[0]), _shifted(place, shifts[1]), _target(positions)
    return [_pattern(a[p], b[p], want[p]) for p in range(32)]


def decode_form(positions: tuple[int, int, int, int], place: int, shifts: tuple[int, int]) -> Form | None:
    """The first lop3 table (and its immediate) that decodes a code at ``positions`` from the word
    placed at ``place`` shifted by ``shifts``, or None."""
    patterns = _patterns(positions, place, shifts)
    tables = functools.reduce(lambda acc, pattern: acc & _TABLES[pattern], set(patterns), (1 << 256) - 1)
    if not tables:
        return None
    table = (tables & -tables).bit_length() - 1  # the lowest
    immediate = sum(_ANSWERS[(pattern, table)] << p for p, pattern in enumerate(patterns))  # type: ignore[operator]
    return Form(positions, place, shifts, table, immediate)


def decodes(positions: tuple[int, int, int, int], place: int, shifts: tuple[int, int], table: int,
            immediate: int) -> bool:
    """Whether lop3(word << shifts[0], word << shifts[1], immediate) under ``table`` decodes the code
    at ``positions`` exactly (the PTX's own constants checked against the bits, not by running them)."""
    return all(_gives(table, pattern, (immediate >> p) & 1)
               for p, pattern in enumerate(_patterns(positions, place, shifts)))


def search(max_shifts: int) -> Iterator[Form]:
    """Every decodable form with at most ``max_shifts`` nonzero shifts (one form per order, placement
    and shift pair)."""
    pairs = [(k1, k2) for k1 in SHIFTS for k2 in SHIFTS if k1 <= k2 and sum(1 for k in (k1, k2) if k) <= max_shifts]
    for place in (0, 8):
        for positions in itertools.permutations(range(8), 4):
            for shifts in pairs:
                form = decode_form(positions, place, shifts)  # type: ignore[arg-type]
                if form is not None:
                    yield form


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shifts", type=int, default=1, choices=(1, 2), help="most nonzero shifts a form may take")
    args = parser.parse_args()
    print(f"{'place':>5}  {'sign e1 e0 m':>12}  {'shifts':>8}  {'lop3':>5}  immediate")
    for form in sorted(search(args.shifts), key=lambda f: (f.shift_count, f.place, f.positions)):
        print(f"{form.place:>5}  {' '.join(map(str, form.positions)):>12}  {str(form.shifts):>8}  "
              f"{form.table:#5x}  {form.immediate:#010x}")


if __name__ == "__main__":
    main()
