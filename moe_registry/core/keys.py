"""Quantization vocabulary: scalar types, group shapes and QuantKeys as frozen, hashable values.

A QuantKey says exactly how one tensor is stored, so that a scheme (what a checkpoint holds) and
a kernel (what it can compute) can be matched by equality instead of by code.

One-line string form (round-trips through :func:`parse_quant_key` and ``str``)::

    unquantized
    uint4 scale:float16:group(128):static zp:group
    uint4b8 scale:float16:channel:static
    int8 scale:float32:token:dynamic
    fp8e4m3 scale:e8m0:block(1x32):static
    fp8e4m3 scale:float32:block(128x128):static
    e2m1 scale:e8m0:group(32):static
    e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static

``block(1xN)`` is written back as ``group(N)``, and a dynamic ``channel`` scale as ``token``
(they are the same shapes); parse(str(key)) == key always holds.

Tokens after the scalar type are ``scale:<dtype>:<group>:<static|dynamic>``,
``zp:<none|group>`` and ``scale2:<dtype>:<group>:<static|dynamic>`` (a second-level scale).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from moe_registry.core.errors import MoERegistryError
from moe_registry.core.vocab import DTYPES

MAX_KEY_CHARS = 256


class KeyError_(MoERegistryError, ValueError):
    """A key string that does not parse; the message says which token and what was wanted (one of
    the project's errors, so it is never a traceback; a ValueError for pydantic validators)."""


@dataclass(frozen=True)
class ScalarType:
    """What one stored value is: its width, signedness, integer bias, and whether it is a float."""

    name: str
    bits: int
    is_float: bool
    signed: bool
    bias: int = 0  # stored value minus bias = real value (uint4b8: bias 8)

    @property
    def min_value(self) -> int:
        """Smallest stored integer (integers only)."""
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def max_value(self) -> int:
        """Largest stored integer (integers only)."""
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    def __str__(self) -> str:
        return self.name


SCALAR_TYPES: dict[str, ScalarType] = {
    t.name: t
    for t in (
        ScalarType("uint4", 4, False, False),
        ScalarType("uint4b8", 4, False, False, bias=8),
        ScalarType("int4", 4, False, True),
        ScalarType("int8", 8, False, True),
        ScalarType("uint8", 8, False, False),
        ScalarType("uint8b128", 8, False, False, bias=128),
        ScalarType("fp8e4m3", 8, True, True),
        ScalarType("e2m1", 4, True, True),  # FP4 (OCP MX / NVFP4): 1 sign, 2 exponent, 1 mantissa bit, max 6
        ScalarType("e8m0", 8, True, False),
        ScalarType("float16", 16, True, True),
        ScalarType("bfloat16", 16, True, True),
        ScalarType("float32", 32, True, True),
    )
}
ACTIVATION_DTYPES = DTYPES


def scalar_type(name: str) -> ScalarType:
    """Look a scalar type up by name, with an error listing the known names."""
    try:
        return SCALAR_TYPES[name]
    except KeyError:
        raise KeyError_(f"unknown scalar type {name!r}; known: {', '.join(SCALAR_TYPES)}") from None


@dataclass(frozen=True)
class GroupShape:
    """How many elements share one scale, as [rows, cols] over a [out, in] (or [tokens, hidden])
    matrix; -1 means the whole extent of that dimension."""

    rows: int
    cols: int

    def __str__(self) -> str:
        named = {(-1, -1): "tensor", (1, -1): "channel"}
        if (self.rows, self.cols) in named:
            return named[(self.rows, self.cols)]
        if self.rows == 1:
            return f"group({self.cols})"
        return f"block({self.rows}x{self.cols})"

    @property
    def group_size(self) -> int:
        """Elements along the input dimension sharing a scale (-1: all of them)."""
        return self.cols


PER_TENSOR = GroupShape(-1, -1)
PER_CHANNEL = GroupShape(1, -1)
PER_TOKEN = GroupShape(1, -1)

# ASCII digits, at most 9 of them: no Unicode digits, no integers too long to convert.
_GROUP_RE = re.compile(r"^(?:group\((-?[0-9]{1,9})\)|block\(([0-9]{1,9})x([0-9]{1,9})\)|tensor|channel|token)$")


def parse_group_shape(text: str) -> GroupShape:
    """Parse ``tensor``, ``channel``, ``token``, ``group(g)`` (g=-1 is per-channel) or ``block(rxc)``."""
    if not isinstance(text, str):
        raise KeyError_(f"bad group shape {text!r}; wanted a string such as group(128)")
    text = text.strip()
    m = _GROUP_RE.match(text)
    if not m:
        raise KeyError_(
            f"bad group shape {text!r}; wanted tensor, channel, token, group(<n>) or block(<r>x<c>)"
        )
    if text == "tensor":
        return PER_TENSOR
    if text in ("channel", "token"):
        return PER_CHANNEL
    if m.group(1) is not None:
        g = int(m.group(1))
        if g == -1:
            return PER_CHANNEL
        if g <= 0:
            raise KeyError_(f"bad group size {g} in {text!r}; wanted a positive integer or -1")
        return GroupShape(1, g)
    r, c = int(m.group(2)), int(m.group(3))
    if r <= 0 or c <= 0:
        raise KeyError_(f"bad block {text!r}; rows and cols must be positive")
    return GroupShape(r, c)


@dataclass(frozen=True)
class ScaleSpec:
    """One level of scaling: its stored dtype, the group sharing it, and whether it is computed at
    run time (dynamic) or stored in the checkpoint (static)."""

    dtype: ScalarType
    group: GroupShape
    dynamic: bool = False

    def __str__(self) -> str:
        # A dynamic scale over one row is a per-token activation scale: say so.
        group = "token" if self.dynamic and self.group == PER_TOKEN else str(self.group)
        return f"{self.dtype}:{group}:{'dynamic' if self.dynamic else 'static'}"


ZeroPoint = Literal["none", "group"]


@dataclass(frozen=True)
class QuantKey:
    """A tensor's quantized form. ``scale is None`` means unquantized (stored as ``dtype``)."""

    dtype: ScalarType
    scale: ScaleSpec | None = None
    zero_point: ZeroPoint = "none"
    scale2: ScaleSpec | None = None

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def group_size(self) -> int | None:
        """Input elements sharing a scale; None when unquantized."""
        return None if self.scale is None else self.scale.group.cols

    def __str__(self) -> str:
        if self.scale is None:
            return "unquantized"
        parts = [str(self.dtype), f"scale:{self.scale}"]
        if self.zero_point != "none":
            parts.append(f"zp:{self.zero_point}")
        if self.scale2 is not None:
            parts.append(f"scale2:{self.scale2}")
        return " ".join(parts)


UNQUANTIZED = QuantKey(SCALAR_TYPES["float32"])


def _parse_scale(token: str, body: str) -> ScaleSpec:
    fields = body.split(":")
    if len(fields) not in (2, 3):
        raise KeyError_(
            f"bad {token} {body!r}; wanted <dtype>:<group>[:static|dynamic], "
            "e.g. float16:group(128):static"
        )
    dtype = scalar_type(fields[0])
    if not dtype.is_float:
        raise KeyError_(f"scale dtype {fields[0]!r} is not a float type")
    group = parse_group_shape(fields[1])
    mode = fields[2] if len(fields) == 3 else "static"
    if mode not in ("static", "dynamic"):
        raise KeyError_(f"bad scale mode {mode!r}; wanted static or dynamic")
    return ScaleSpec(dtype, group, mode == "dynamic")


def parse_quant_key(text: str) -> QuantKey:
    """Parse the one-line key form (see module docstring). Raises KeyError_ naming the bad token."""
    if not isinstance(text, str) or not text.strip():
        raise KeyError_(f"empty quant key {text!r}"[:120])
    if len(text) > MAX_KEY_CHARS:
        raise KeyError_(f"quant key of {len(text)} characters; at most {MAX_KEY_CHARS}")
    tokens = text.split()
    if tokens == ["unquantized"]:
        return UNQUANTIZED
    head, rest = tokens[0], tokens[1:]
    dtype = scalar_type(head)
    scale: ScaleSpec | None = None
    scale2: ScaleSpec | None = None
    zp: ZeroPoint = "none"
    seen: set[str] = set()
    for tok in rest:
        name, _, body = tok.partition(":")
        if name in seen:
            raise KeyError_(f"{name!r} given twice in quant key {text!r}")
        seen.add(name)
        if name == "scale":
            scale = _parse_scale(name, body)
        elif name == "scale2":
            scale2 = _parse_scale(name, body)
        elif name == "zp":
            if body not in ("none", "group"):
                raise KeyError_(f"bad zero point {body!r} in {text!r}; wanted none or group")
            zp = body  # type: ignore[assignment]
        else:
            raise KeyError_(f"unknown token {tok!r} in quant key {text!r}; wanted scale:, zp: or scale2:")
    if scale is None:
        if zp != "none" or scale2 is not None:
            raise KeyError_(f"quant key {text!r} has a zero point or second scale but no scale:")
        if dtype.is_float and dtype.bits >= 16 and not rest:
            return UNQUANTIZED
        raise KeyError_(f"quant key {text!r} has no scale; a quantized key needs scale:<dtype>:<group>")
    if zp == "group" and dtype.is_float:
        raise KeyError_(f"quant key {text!r}: a float type cannot carry a zero point")
    return QuantKey(dtype, scale, zp, scale2)


def key_matches(key: QuantKey, patterns: Iterable[str]) -> bool:
    """Whether ``key``'s canonical string matches one of the key patterns (``*`` any run of characters;
    group shapes compared in canonical form, see :func:`canonical_pattern`)."""
    text = str(key)
    return any(fnmatch.fnmatchcase(text, canonical_pattern(p)) for p in patterns)


def canonical_pattern(pattern: str) -> str:
    """A key pattern with each wildcard-free group shape written as ``str(GroupShape)`` does, so
    that ``block(1x32)`` in a spec matches the canonical ``group(32)``."""
    out = []
    for token in pattern.split():
        name, _, body = token.partition(":")
        fields = body.split(":")
        if name in ("scale", "scale2") and len(fields) >= 2 and "*" not in fields[1]:
            try:
                shape = parse_group_shape(fields[1])
            except KeyError_:
                shape = None
            if shape is not None:
                dynamic = len(fields) > 2 and fields[2] == "dynamic"
                fields[1] = "token" if dynamic and shape == PER_TOKEN else str(shape)
            token = f"{name}:{':'.join(fields)}"
        out.append(token)
    return " ".join(out)
