"""Independent numpy references for the built-in steps, written from their definitions.

They share no code with shard_funcs: rank r's slice is computed directly, not through the
library's functions or box rules.
"""

from __future__ import annotations

import numpy as np


def shard_dim(x: np.ndarray, dim: int, n: int) -> np.ndarray:
    """Output [n, ...]: slice r is the r-th of n equal contiguous blocks along ``dim``."""
    size = x.shape[dim] // n
    blocks = []
    for r in range(n):
        index = [slice(None)] * x.ndim
        index[dim] = slice(r * size, (r + 1) * size)
        blocks.append(x[tuple(index)])
    return np.stack(blocks)


def reorder_segments(x: np.ndarray, dim: int, segments: list[int], n: int, unit: int = 1) -> np.ndarray:
    """Same shape as x; along ``dim``, rank r's block holds the r-th 1/n of every segment, in segment order."""
    bounds = np.cumsum([0] + [s * unit for s in segments])
    order = []
    for r in range(n):
        for i in range(len(segments)):
            length = (bounds[i + 1] - bounds[i]) // n
            start = bounds[i] + r * length
            order.extend(range(start, start + length))
    return np.take(x, np.array(order, dtype=np.int64), axis=dim)


def replicate(x: np.ndarray, n: int) -> np.ndarray:
    """Output [n, *x.shape], every slice a copy of x."""
    return np.stack([x.copy() for _ in range(n)])


def shard_heads(x: np.ndarray, dim: int, heads: list[int], kv: list[int], n: int, head_dim: int) -> np.ndarray:
    """Output [n, ...]: rank r holds, per segment, its 1/n of the heads, or (a KV segment with fewer
    heads than n) the single head r * heads // n that its query heads use."""
    per_rank = []
    for r in range(n):
        rows = []
        base = 0
        for h, is_kv in zip(heads, kv, strict=True):
            if h >= n:
                chosen = list(range(r * h // n, (r + 1) * h // n))
            else:
                assert is_kv and n % h == 0
                chosen = [r * h // n]
            for head in chosen:
                rows.extend(range(base + head * head_dim, base + (head + 1) * head_dim))
            base += h * head_dim
        per_rank.append(np.take(x, np.array(rows, dtype=np.int64), axis=dim))
    return np.stack(per_rank)


def rank_slices(x: np.ndarray, steps: list[tuple], n: int) -> list[np.ndarray]:
    """Apply ``steps`` ((name, *args) with args already evaluated) and split the result by rank."""
    funcs = {"shard_dim": shard_dim, "reorder_segments": reorder_segments, "replicate": replicate}
    funcs["shard_heads"] = shard_heads
    for name, *args in steps:
        x = funcs[name](x, *args)
    return [np.ascontiguousarray(x[r]) for r in range(n)]
