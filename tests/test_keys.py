"""QuantKeys: every one-line form parses and prints back, group shapes, and bad keys by message."""

from __future__ import annotations

import pytest

from moe_registry.core.keys import (
    PER_CHANNEL,
    PER_TENSOR,
    SCALAR_TYPES,
    UNQUANTIZED,
    GroupShape,
    KeyError_,
    ScaleSpec,
    canonical_pattern,
    parse_group_shape,
    parse_quant_key,
    scalar_type,
)

# Canonical strings: str(parse(s)) == s.
CANONICAL = [
    "unquantized",
    "uint4 scale:float16:group(128):static zp:group",
    "uint4 scale:float16:channel:static zp:group",
    "uint4 scale:bfloat16:group(32):static zp:group",
    "uint4b8 scale:float16:group(128):static",
    "uint4b8 scale:float16:channel:static",
    "uint4b8 scale:bfloat16:group(64):static",
    "uint8b128 scale:float16:group(128):static",
    "int4 scale:fp8e4m3:group(16):static scale2:float32:tensor:static",
    "int8 scale:float32:channel:static",
    "int8 scale:float32:tensor:static",
    "int8 scale:float32:token:dynamic",
    "int8 scale:float32:tensor:dynamic",
    "uint8 scale:float32:tensor:static zp:group",
    "fp8e4m3 scale:float32:tensor:static",
    "fp8e4m3 scale:float32:block(128x128):static",
    "fp8e4m3 scale:float32:group(128):dynamic",
    "fp8e4m3 scale:e8m0:group(32):static",
    "fp8e4m3 scale:e8m0:group(32):dynamic",
    "fp8e4m3 scale:float32:block(64x32):static",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_round_trip(text: str):
    key = parse_quant_key(text)
    assert str(key) == text
    assert parse_quant_key(str(key)) == key
    assert hash(parse_quant_key(text)) == hash(key)


# Other spellings of the same keys: they parse to the canonical one.
ALIASES = {
    "uint4b8 scale:float16:group(-1):static": "uint4b8 scale:float16:channel:static",
    "fp8e4m3 scale:e8m0:block(1x32):static": "fp8e4m3 scale:e8m0:group(32):static",
    "fp8e4m3 scale:e8m0:block(1x32):dynamic": "fp8e4m3 scale:e8m0:group(32):dynamic",
    "int8 scale:float32:channel:dynamic": "int8 scale:float32:token:dynamic",
    "int8 scale:float32:token:static": "int8 scale:float32:channel:static",
    "int8 scale:float32:channel": "int8 scale:float32:channel:static",  # static is the default
    "uint4 scale:float16:group(128):static zp:none": "uint4 scale:float16:group(128):static",
    "uint4 zp:group scale:float16:group(128):static": "uint4 scale:float16:group(128):static zp:group",
    "  int8   scale:float32:tensor:static  ": "int8 scale:float32:tensor:static",
    "bfloat16": "unquantized",
    "float16": "unquantized",
    "float32": "unquantized",
}


@pytest.mark.parametrize("text,canonical", sorted(ALIASES.items()))
def test_other_spellings_parse_to_the_canonical_key(text: str, canonical: str):
    key = parse_quant_key(text)
    assert str(key) == canonical
    assert key == parse_quant_key(canonical)
    assert parse_quant_key(str(key)) == key


def test_key_fields():
    awq = parse_quant_key("uint4 scale:float16:group(128):static zp:group")
    assert awq.dtype is SCALAR_TYPES["uint4"]
    assert awq.scale == ScaleSpec(SCALAR_TYPES["float16"], GroupShape(1, 128), dynamic=False)
    assert awq.zero_point == "group"
    assert awq.scale2 is None
    assert awq.quantized and awq.group_size == 128

    act = parse_quant_key("int8 scale:float32:token:dynamic")
    assert act.scale is not None and act.scale.dynamic and act.scale.group == PER_CHANNEL
    assert act.group_size == -1

    nv = parse_quant_key("int4 scale:fp8e4m3:group(16):static scale2:float32:tensor:static")
    assert nv.scale2 == ScaleSpec(SCALAR_TYPES["float32"], PER_TENSOR, False)

    assert parse_quant_key("unquantized") is UNQUANTIZED
    assert not UNQUANTIZED.quantized and UNQUANTIZED.group_size is None


def test_keys_differ_by_every_field():
    base = "uint4 scale:float16:group(128):static zp:group"
    variants = [
        "uint4b8 scale:float16:group(128):static",
        "uint4 scale:bfloat16:group(128):static zp:group",
        "uint4 scale:float16:group(64):static zp:group",
        "uint4 scale:float16:group(128):dynamic zp:group",
        "uint4 scale:float16:group(128):static",
        "uint4 scale:float16:group(128):static zp:group scale2:float32:tensor:static",
    ]
    keys = {parse_quant_key(base), *map(parse_quant_key, variants)}
    assert len(keys) == 1 + len(variants)


def test_scalar_types():
    assert (scalar_type("uint4").min_value, scalar_type("uint4").max_value) == (0, 15)
    assert (scalar_type("int4").min_value, scalar_type("int4").max_value) == (-8, 7)
    assert (scalar_type("int8").min_value, scalar_type("int8").max_value) == (-128, 127)
    assert scalar_type("uint4b8").bias == 8 and scalar_type("uint8b128").bias == 128
    assert scalar_type("fp8e4m3").is_float and scalar_type("fp8e4m3").bits == 8
    assert not scalar_type("e8m0").signed
    assert str(scalar_type("bfloat16")) == "bfloat16"
    with pytest.raises(KeyError_, match=r"unknown scalar type 'int3'; known: uint4, uint4b8, int4"):
        scalar_type("int3")


@pytest.mark.parametrize("text,shape,printed", [
    ("tensor", GroupShape(-1, -1), "tensor"),
    ("channel", GroupShape(1, -1), "channel"),
    ("token", GroupShape(1, -1), "channel"),
    ("group(128)", GroupShape(1, 128), "group(128)"),
    ("group(-1)", GroupShape(1, -1), "channel"),
    ("group(1)", GroupShape(1, 1), "group(1)"),
    ("block(128x128)", GroupShape(128, 128), "block(128x128)"),
    ("block(1x32)", GroupShape(1, 32), "group(32)"),
    ("block(32x1)", GroupShape(32, 1), "block(32x1)"),
])
def test_group_shapes(text: str, shape: GroupShape, printed: str):
    assert parse_group_shape(text) == shape
    assert str(shape) == printed
    assert parse_group_shape(printed) == shape


@pytest.mark.parametrize("text,message", [
    ("group(0)", "bad group size 0 in 'group(0)'; wanted a positive integer or -1"),
    ("group(-2)", "bad group size -2 in 'group(-2)'"),
    ("block(0x32)", "bad block 'block(0x32)'; rows and cols must be positive"),
    ("block(128)", "bad group shape 'block(128)'; wanted tensor, channel, token, group(<n>) or block(<r>x<c>)"),
    ("group(128x128)", "bad group shape 'group(128x128)'"),
    ("group()", "bad group shape 'group()'"),
    ("per_channel", "bad group shape 'per_channel'"),
    ("block(-1x32)", "bad group shape 'block(-1x32)'"),
])
def test_bad_group_shapes(text: str, message: str):
    with pytest.raises(KeyError_) as info:
        parse_group_shape(text)
    assert message in str(info.value)


@pytest.mark.parametrize("text,message", [
    ("", "empty quant key ''"),
    ("   ", "empty quant key"),
    ("uint5 scale:float16:group(128):static", "unknown scalar type 'uint5'"),
    ("int8", "quant key 'int8' has no scale; a quantized key needs scale:<dtype>:<group>"),
    ("fp8e4m3", "quant key 'fp8e4m3' has no scale"),
    ("bfloat16 zp:group", "has a zero point or second scale but no scale:"),
    ("int8 scale2:float32:tensor:static", "has a zero point or second scale but no scale:"),
    ("fp8e4m3 scale:float32:tensor:static zp:group", "a float type cannot carry a zero point"),
    ("uint4 scale:int8:group(128):static", "scale dtype 'int8' is not a float type"),
    ("uint4 scale:float16", "bad scale 'float16'; wanted <dtype>:<group>[:static|dynamic]"),
    ("uint4 scale:float16:group(128):static:x", "bad scale 'float16:group(128):static:x'"),
    ("uint4 scale:float16:group(128):sometimes", "bad scale mode 'sometimes'; wanted static or dynamic"),
    ("uint4 scale:float16:group(12x8):static", "bad group shape 'group(12x8)'"),
    ("uint4 scale:float16:group(128):static zp:channel", "bad zero point 'channel'"),
    ("uint4 scale:float16:group(128):static bias:none", "unknown token 'bias:none'"),
    ("int8 scale:float32:tensor:static scale:float32:tensor:static", "'scale' given twice"),
    ("uint4 scale:float16:group(128):static zp:group zp:group", "'zp' given twice"),
    ("unquantized scale:float32:tensor:static", "unknown scalar type 'unquantized'"),
])
def test_bad_keys(text: str, message: str):
    with pytest.raises(KeyError_) as info:
        parse_quant_key(text)
    assert message in str(info.value)


def test_non_string_key():
    with pytest.raises(KeyError_, match="empty quant key None"):
        parse_quant_key(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("pattern,canonical", [
    ("fp8e4m3 scale:e8m0:block(1x32):static", "fp8e4m3 scale:e8m0:group(32):static"),
    ("int8 scale:float32:channel:dynamic", "int8 scale:float32:token:dynamic"),
    ("int8 scale:float32:token:static", "int8 scale:float32:channel:static"),
    ("uint4 scale:float16:group(*):static zp:group", "uint4 scale:float16:group(*):static zp:group"),
    ("uint4b8 scale:float16:group(-1):static", "uint4b8 scale:float16:channel:static"),
    ("*", "*"),
    ("unquantized", "unquantized"),
])
def test_canonical_pattern(pattern: str, canonical: str):
    assert canonical_pattern(pattern) == canonical
