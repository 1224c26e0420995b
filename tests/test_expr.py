"""Shape expressions: evaluation, exact division, ceil/floor/groups, and the whitelist."""

from __future__ import annotations

import pytest

from moe_registry.spec.expr import MAX_EXPR_CHARS, ExprError, parse_expr

SIZES = {"in": 4096, "out": 14336, "$group": 128, "$bits": 4}


@pytest.mark.parametrize("text,value", [
    ("in", 4096),
    ("out / 8", 1792),
    ("in / 8", 512),
    ("ceil(in / $group)", 32),
    ("floor(in / $group)", 32),
    ("groups(in, $group)", 32),
    ("out * $bits / 32", 1792),
    ("in // 3", 1365),
    ("in % 3", 1),
    ("-in + 2 * out", 24576),
    ("(in + out) / 2", 9216),
    ("in + out / 2", 11264),
    ("min(in, out, 5000)", 4096),
    ("max(in, out)", 14336),
    ("min(ceil(in / 3), 2000)", 1366),
    (16, 16),
    ("0", 0),
])
def test_evaluation(text, value):
    assert parse_expr(text).evaluate(SIZES) == value


def test_ceil_floor_round_the_right_way():
    values = {"in": 100, "$group": 32}
    assert parse_expr("ceil(in / $group)").evaluate(values) == 4
    assert parse_expr("floor(in / $group)").evaluate(values) == 3
    assert parse_expr("groups(in, $group)").evaluate(values) == 4
    assert parse_expr("ceil(in)").evaluate(values) == 100  # no division: the value itself
    assert parse_expr("ceil(in / 4)").evaluate(values) == 25


@pytest.mark.parametrize("group,count", [(-1, 1), (128, 32), (100, 41), (4096, 1), (5000, 1)])
def test_groups(group, count):
    assert parse_expr("groups(in, $group)").evaluate({"in": 4096, "$group": group}) == count


@pytest.mark.parametrize("group", [0, -2])
def test_groups_rejects_bad_group(group):
    with pytest.raises(ExprError, match=rf"group size {group} in 'groups\(in, \$group\)' must be positive or -1"):
        parse_expr("groups(in, $group)").evaluate({"in": 4096, "$group": group})


def test_division_must_be_exact():
    expr = parse_expr("out / 8")
    assert expr.evaluate({"out": 64}) == 8
    with pytest.raises(ExprError) as info:
        expr.evaluate({"out": 100})
    assert str(info.value) == "100 / 8 is not exact in 'out / 8' (wrap it in ceil() or floor())"
    with pytest.raises(ExprError, match="is not exact"):
        parse_expr("ceil(in / 3) / 7").evaluate({"in": 100})  # 34 / 7: only the inner one is rounded


@pytest.mark.parametrize("text", ["in / 0", "ceil(in / 0)", "in % 0", "in // 0", "floor(in / (out - out))"])
def test_division_by_zero(text):
    with pytest.raises(ExprError, match="division by zero in"):
        parse_expr(text).evaluate(SIZES)


def test_names_and_bindings():
    expr = parse_expr("ceil(in / $group) * out + $bits")
    assert expr.names == frozenset({"in", "out"})
    assert expr.bindings == frozenset({"group", "bits"})
    assert str(expr) == "ceil(in / $group) * out + $bits"
    assert parse_expr(8).names == frozenset() and parse_expr(8).bindings == frozenset()
    # `in` is a Python keyword, but only the whole word is our name.
    assert parse_expr("in_size + in").names == frozenset({"in_size", "in"})


def test_unknown_names_at_evaluation():
    with pytest.raises(ExprError) as info:
        parse_expr("hidden / 2").evaluate({"in": 8, "out": 8})
    assert str(info.value) == "expression 'hidden / 2' uses 'hidden', which is not known here (known: in, out)"
    with pytest.raises(ExprError, match=r"uses '\$group', which is not known here \(known: in\)"):
        parse_expr("in / $group").evaluate({"in": 8})
    with pytest.raises(ExprError, match=r"known: none"):
        parse_expr("in").evaluate({})


@pytest.mark.parametrize("value", [4.0, "8", True, None])
def test_values_must_be_integers(value):
    with pytest.raises(ExprError, match=r"in = .* is not an integer \(in 'in / 2'\)"):
        parse_expr("in / 2").evaluate({"in": value})


def test_wrong_argument_counts():
    with pytest.raises(ExprError, match=r"ceil\(\) takes one argument"):
        parse_expr("ceil(in, out)").evaluate(SIZES)
    with pytest.raises(ExprError, match=r"groups\(\) takes \(size, group\)"):
        parse_expr("groups(in)").evaluate(SIZES)


@pytest.mark.parametrize("text,message", [
    ("__import__('os').system('true')", "name '__import__' is not allowed"),
    ("__builtins__", "name '__builtins__' is not allowed"),
    ("__b_group", "name '__b_group' is not allowed"),  # our own spelling of $group: not writable
    ("__in", "name '__in' is not allowed"),
    ("in.__class__", "name '__class__' is not allowed"),
    ("open(in)", "Call is not allowed in expression 'open(in)'"),
    ("exec(in)", "Call is not allowed"),
    ("out.bit_length()", "Call is not allowed"),
    ("out.real", "Attribute is not allowed in expression 'out.real'"),
    ("lambda x: x", "Lambda is not allowed"),
    ("(lambda: 1)()", "Call is not allowed"),
    ("in[0]", "Subscript is not allowed"),
    ("in ** 2", "BinOp is not allowed"),
    ("in << 2", "BinOp is not allowed"),
    ("in & out", "BinOp is not allowed"),
    ("in > 2", "Compare is not allowed"),
    ("in and out", "BoolOp is not allowed"),
    ("in if out else 1", "IfExp is not allowed"),
    ("~in", "UnaryOp is not allowed"),
    ("not out", "UnaryOp is not allowed"),
    ("[in, out]", "List is not allowed"),
    ("(x := 1)", "NamedExpr is not allowed"),
    ("f'{in}'", "JoinedStr is not allowed"),
    ("max(in, key=out)", "Call is not allowed"),
    ("min()", "Call is not allowed"),
    ("'abc'", "only integer constants are allowed in \"'abc'\", got a string"),
    ("in / 2.5", "only integer constants are allowed in 'in / 2.5', got 2.5"),
    ("True", "only integer constants are allowed in 'True', got True"),
    ("None", "only integer constants are allowed in 'None', got None"),
    ("in / / 8", "cannot parse expression 'in / / 8'"),
    ("in; out", "cannot parse expression"),
    ("$1", "bad binding reference in '$1'; write $name"),
    ("in $ 2", "bad binding reference"),
    ("-" * 30 + "in", "nests too deeply"),
    ("in" + " + in" * 50, f"expression longer than {MAX_EXPR_CHARS} characters"),
])
def test_whitelist_rejections(text, message):
    with pytest.raises(ExprError) as info:
        parse_expr(text)
    assert message in str(info.value)


@pytest.mark.parametrize("value,message", [
    (True, "expected an integer or expression, got True"),
    (2.5, "expected an integer or expression string, got float"),
    (None, "expected an integer or expression string, got NoneType"),
    ([1], "expected an integer or expression string, got list"),
])
def test_non_expression_inputs(value, message):
    parse_expr(1)  # cached: True, equal to 1 as a key, must still be refused
    with pytest.raises(ExprError, match=message.replace("(", r"\(")):
        parse_expr(value)


def test_length_and_depth_limits():
    text = "in + " + "1" * (MAX_EXPR_CHARS - 5)
    assert len(text) == MAX_EXPR_CHARS
    assert parse_expr(text).evaluate({"in": 0}) == int("1" * (MAX_EXPR_CHARS - 5))
    with pytest.raises(ExprError, match="longer than"):
        parse_expr(text + "1")
    assert parse_expr(" + ".join(["in"] * 20)).evaluate({"in": 2}) == 40
    with pytest.raises(ExprError, match="nests too deeply"):
        parse_expr(" + ".join(["in"] * 25))
