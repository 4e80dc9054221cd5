"""Expressions over num_shards: arithmetic, exact division, and rejection of anything else."""

from __future__ import annotations

import pytest

from shardload.format import expr


@pytest.mark.parametrize(
    ("text", "n", "want"),
    [
        ("num_shards", 8, 8),
        ("6144 // num_shards", 8, 768),
        ("(num_shards + 1) * 2", 3, 8),
        ("-num_shards", 4, -4),
        ("4096 - 1024 // num_shards", 2, 3584),
        (128, 5, 128),
    ],
)
def test_evaluates(text: str | int, n: int, want: int) -> None:
    assert expr.evaluate(text, n) == want


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("7 // num_shards", "not divisible"),
        ("1 // 0", "divides by zero"),
        ("1 / 2", "not allowed"),
        ("2 ** 8", "not allowed"),
        ("__import__('os').system('true')", "not allowed"),
        ("num_shards.real", "not allowed"),
        ("world_size", "not allowed"),
        ("1.5 * num_shards", "not allowed"),
        ("True + 1", "not allowed"),
        ("(1 +", "malformed"),
        ("", "malformed"),
        ("1" * 300, "too long"),
        ("9" * 30 + " * num_shards", "overflows"),
    ],
)
def test_rejects(text: str, reason: str) -> None:
    with pytest.raises(expr.ExprError, match=reason):
        expr.evaluate(text, 2)


def test_rejects_non_int_values() -> None:
    for value in (1.0, True, None, [1]):
        with pytest.raises(expr.ExprError):
            expr.evaluate(value, 2)  # type: ignore[arg-type]


def test_needs_num_shards_when_unknown() -> None:
    with pytest.raises(expr.ExprError, match="needs num_shards"):
        expr.evaluate("num_shards * 2", None)
    assert expr.evaluate("3 * 2", None) == 6
