"""Integer expressions over ``num_shards`` in shard_info shapes and arguments, evaluated without ``eval``.

Grammar: integers, the name ``num_shards``, ``+ - * //``, unary minus and parentheses.
``//`` must divide exactly: a remainder means the file does not fit this N.
"""

from __future__ import annotations

import ast
import functools

from ..errors import StepArgumentError

MAX_EXPR_LEN = 200
MAX_ABS_VALUE = 1 << 62
NAME = "num_shards"


class ExprError(StepArgumentError):
    """A malformed expression, or one that does not evaluate to an exact integer."""


def _check(value: int, text: str) -> int:
    if abs(value) > MAX_ABS_VALUE:
        raise ExprError(f"expression {text!r} overflows (|value| > 2**62)")
    return value


def _eval(node: ast.AST, num_shards: int | None, text: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _check(node.value, text)
    if isinstance(node, ast.Name) and node.id == NAME:
        if num_shards is None:
            raise ExprError(f"expression {text!r} needs num_shards, which is not known here")
        return num_shards
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, num_shards, text)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
        left = _eval(node.left, num_shards, text)
        right = _eval(node.right, num_shards, text)
        if isinstance(node.op, ast.Add):
            return _check(left + right, text)
        if isinstance(node.op, ast.Sub):
            return _check(left - right, text)
        if isinstance(node.op, ast.Mult):
            return _check(left * right, text)
        if right == 0:
            raise ExprError(f"expression {text!r} divides by zero")
        if left % right:
            raise ExprError(f"expression {text!r}: {left} is not divisible by {right}")
        return left // right
    raise ExprError(f"expression {text!r} is not allowed: only integers, {NAME}, + - * // and parentheses")


_ALLOWED = (
    ast.Expression, ast.Constant, ast.Name, ast.Load, ast.UnaryOp, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
)  # fmt: skip


def parse(text: str) -> ast.Expression:
    """Parse ``text`` into a syntax tree made only of allowed nodes, or raise ExprError."""
    return _parse(text) if len(text) <= MAX_EXPR_LEN else _parse_uncached(text)


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> ast.Expression:
    """:func:`parse`, remembered: a model's files repeat the same few expressions in every layer (the trees are
    only read, never changed)."""
    return _parse_uncached(text)


def _parse_uncached(text: str) -> ast.Expression:
    if len(text) > MAX_EXPR_LEN:
        raise ExprError(f"expression of {len(text)} characters is too long (limit {MAX_EXPR_LEN})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ExprError(f"malformed expression {text!r}") from None
    for node in ast.walk(tree):
        bad_name = isinstance(node, ast.Name) and node.id != NAME
        bad_const = isinstance(node, ast.Constant) and type(node.value) is not int
        if not isinstance(node, _ALLOWED) or bad_name or bad_const:
            raise ExprError(f"expression {text!r} is not allowed: only integers, {NAME}, + - * // and parentheses")
    return tree


def evaluate(value: int | str, num_shards: int | None) -> int:
    """Evaluate an int or an expression string to an int for the given ``num_shards``."""
    if type(value) is int:
        return _check(value, str(value))
    if not isinstance(value, str):
        raise ExprError(f"expected an integer or an expression string, got {value!r}")
    return _eval(parse(value).body, num_shards, value)
