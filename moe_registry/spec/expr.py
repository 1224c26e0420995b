"""Symbolic shape expressions such as ``ceil(in / $group)`` or ``out / 8``.

Parsed by Python's ``ast`` and evaluated by walking a whitelist of node types — never ``eval``.
Names are the projection's sizes (``in``, ``out``) or the dimensions a context provides; ``$name``
refers to a scheme binding. Division must be exact unless wrapped in ``ceil``/``floor``, so a
shape that does not divide is an error, not a silently truncated size.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from moe_registry.core.errors import MoERegistryError

MAX_EXPR_CHARS = 200
_BINDING_RE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_FUNCS = {"ceil", "floor", "min", "max", "groups"}


class ExprError(MoERegistryError, ValueError):
    """An expression that is unsafe, malformed, or cannot be evaluated with the given names (one of
    the project's errors, so the CLI prints it as one line; a ValueError for pydantic validators)."""


@dataclass(frozen=True)
class Expr:
    """A validated expression; ``names`` are the plain names it reads, ``bindings`` the $names."""

    text: str
    tree: ast.Expression
    names: frozenset[str]
    bindings: frozenset[str]

    def __str__(self) -> str:
        return self.text

    def evaluate(self, values: Mapping[str, int]) -> int:
        """Evaluate with ``values`` holding plain names and ``$binding`` names (with the $)."""
        return _eval(self.tree.body, values, self.text)


def parse_expr(text: str | int) -> Expr:
    """Validate ``text`` against the whitelist; ints are accepted as constants. Cached: a load checks every
    expert's tensor shapes against the same few expressions (an Expr is immutable)."""
    if isinstance(text, (str, int)):
        return _parse_cached(text)
    return _parse(text)  # refused with the type's name (a list is no cache key)


@functools.lru_cache(maxsize=4096, typed=True)  # typed: True is refused where 1 is taken
def _parse_cached(text: str | int) -> Expr:
    return _parse(text)


def _parse(text: str | int) -> Expr:
    if isinstance(text, bool):
        raise ExprError(f"expected an integer or expression, got {text!r}")
    if isinstance(text, int):
        if text.bit_length() > 64:
            digits = len(str(abs(text))) if text.bit_length() < 14000 else int(text.bit_length() * 0.30103) + 1
            raise ExprError(f"integer of {digits} digits; at most 64 bits")
        text = str(text)
    if not isinstance(text, str):
        raise ExprError(f"expected an integer or expression string, got {type(text).__name__}")
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression longer than {MAX_EXPR_CHARS} characters")
    dunder = re.search(r"(?<![\w$])__\w*", text)  # (__in and __b_x are this module's own spellings)
    if dunder:
        raise ExprError(f"name {dunder.group()!r} is not allowed in {text!r}; names may not start with __")
    bindings = frozenset(_BINDING_RE.findall(text))
    source = _BINDING_RE.sub(lambda m: f"__b_{m.group(1)}", text)
    if "$" in source:
        raise ExprError(f"bad binding reference in {text!r}; write $name")
    source = re.sub(r"\bin\b", "__in", source)  # `in` is a Python keyword but our favourite name
    try:
        with warnings.catch_warnings():  # "2in" would print Python's SyntaxWarning to the user
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ExprError(f"cannot parse expression {text!r}") from None
    names: set[str] = set()
    _check(tree.body, text, names, depth=0)
    plain = frozenset("in" if n == "__in" else n for n in names if not n.startswith("__b_"))
    return Expr(text, tree, plain, bindings)


def _check(node: ast.AST, text: str, names: set[str], depth: int) -> None:
    if depth > 20:
        raise ExprError(f"expression {text!r} nests too deeply")
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, int) or isinstance(node.value, bool):
            seen = "a string" if isinstance(node.value, str) else repr(node.value)  # (strings are mangled)
            raise ExprError(f"only integer constants are allowed in {text!r}, got {seen}")
        return
    if isinstance(node, ast.Name):
        names.add(node.id)
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div |
                                                        ast.FloorDiv | ast.Mod):
        _check(node.left, text, names, depth + 1)
        _check(node.right, text, names, depth + 1)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and _const(node.right) == 0:
            raise ExprError(f"division by zero in {text!r}")
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check(node.operand, text, names, depth + 1)
        return
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords and node.args):
        for arg in node.args:
            _check(arg, text, names, depth + 1)
        if node.func.id == "groups":
            group = _const(node.args[1]) if len(node.args) == 2 else None
            if len(node.args) != 2:
                raise ExprError(f"groups() takes (size, group) in {text!r}")
            if group is not None and group <= 0 and group != -1:
                raise ExprError(f"group size {group} in {text!r} must be positive or -1")
        elif node.func.id in ("ceil", "floor") and len(node.args) != 1:
            raise ExprError(f"{node.func.id}() takes one argument in {text!r}")
        return
    raise ExprError(
        f"{type(node).__name__} is not allowed in expression {text!r}; "
        "allowed: integers, names, $bindings, + - * / // %, ceil() floor() min() max() groups()"
    )


def _const(node: ast.AST) -> int | None:
    """The value of a sub-expression without names (``64 // 0``'s ``0``), else None."""
    if any(isinstance(n, ast.Name) for n in ast.walk(node)):
        return None
    try:
        return _eval(node, {}, "")
    except (ExprError, ArithmeticError, ValueError):
        return None


SAMPLE_SIZE = 4096 * 3 * 5 * 7  # divisible by every power of two a group uses, and by 3, 5, 7


def parse_shape_dim(dim: object) -> Expr:
    """A checkpoint tensor's shape dimension: an integer >= 0 or an expression that is positive for
    a sample projection (in = out = SAMPLE_SIZE, each $binding 128). Booleans and negative sizes
    are refused here, at validation, not when a checkpoint is read."""
    if isinstance(dim, bool):
        raise ExprError(f"shape dimension {dim!r} is a boolean; wanted an integer or an expression")
    expr = parse_expr(dim)  # type: ignore[arg-type]
    if not expr.names and not expr.bindings and expr.evaluate({}) < 0:
        raise ExprError(f"shape dimension {expr.text!r} is negative; wanted a size >= 0")
    values = {"in": SAMPLE_SIZE, "out": SAMPLE_SIZE, **{f"${b}": 128 for b in expr.bindings}}
    if expr.names <= {"in", "out"}:
        try:
            value = expr.evaluate(values)
        except ExprError:
            return expr  # inexact for the sample: the bindings decide, checked on real shapes
        if value < 0 or (value == 0 and (expr.names or expr.bindings)):
            raise ExprError(f"shape dimension {expr.text!r} is {value} for in = out = {SAMPLE_SIZE}"
                            f"{' and $bindings 128' if expr.bindings else ''}; wanted a positive size")
    return expr


def parse_limit(value: object, field: str) -> Expr:
    """A kernel shape limit (``multiple_of``, ``min``, ``max``): an integer or an expression over
    $bindings; a constant ``multiple_of`` must be >= 1 and a constant min/max >= 0."""
    if isinstance(value, bool):
        raise ExprError(f"{field} {value!r} is a boolean; wanted an integer or an expression")
    expr = parse_expr(value)  # type: ignore[arg-type]
    if not expr.names and not expr.bindings:
        v = expr.evaluate({})
        low = 1 if field == "multiple_of" else 0
        if v < low:
            raise ExprError(f"{field} {expr.text!r} is {v}; wanted an integer >= {low}")
    return expr


def _name_value(name: str, values: Mapping[str, int], text: str) -> int:
    key = "in" if name == "__in" else ("$" + name[4:] if name.startswith("__b_") else name)
    if key not in values:
        raise ExprError(f"expression {text!r} uses {key!r}, which is not known here "
                        f"(known: {', '.join(sorted(values)) or 'none'})")
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExprError(f"{key} = {value!r} is not an integer (in {text!r})")
    return value


def _eval(node: ast.AST, values: Mapping[str, int], text: str) -> int:
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.Name):
        return _name_value(node.id, values, text)
    if isinstance(node, ast.UnaryOp):
        return -_eval(node.operand, values, text)
    if isinstance(node, ast.Call):
        fn = node.func.id  # type: ignore[attr-defined]
        if fn in ("ceil", "floor"):
            if len(node.args) != 1:
                raise ExprError(f"{fn}() takes one argument in {text!r}")
            return _eval_division(node.args[0], values, text, math.ceil if fn == "ceil" else math.floor)
        args = [_eval(a, values, text) for a in node.args]
        if fn == "groups":
            # groups(n, g): how many groups of g cover n elements; g = -1 means one group.
            if len(args) != 2:
                raise ExprError(f"groups() takes (size, group) in {text!r}")
            size, group = args
            return 1 if group == -1 else -(-size // group) if group > 0 else _bad_group(group, text)
        return min(args) if fn == "min" else max(args)
    assert isinstance(node, ast.BinOp)
    left, right = _eval(node.left, values, text), _eval(node.right, values, text)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    if right == 0:
        raise ExprError(f"division by zero in {text!r}")
    if isinstance(node.op, ast.Mod):
        return left % right
    if isinstance(node.op, ast.FloorDiv):
        return left // right
    if left % right:
        raise ExprError(f"{left} / {right} is not exact in {text!r} (wrap it in ceil() or floor())")
    return left // right


def _bad_group(group: int, text: str) -> int:
    raise ExprError(f"group size {group} in {text!r} must be positive or -1")


def _eval_division(node: ast.AST, values: Mapping[str, int], text: str, rounding) -> int:  # type: ignore[no-untyped-def]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _eval(node.left, values, text), _eval(node.right, values, text)
        if right == 0:
            raise ExprError(f"division by zero in {text!r}")
        return -(-left // right) if rounding is math.ceil else left // right  # exact for any size
    return _eval(node, values, text)
