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


def rank_part(
    w: np.ndarray, dim: int, n: int, r: int, segments: tuple[int, ...] = (), kv: tuple[int, ...] = (), unit: int = 1
) -> np.ndarray:
    """Rank r's part of a dense tensor along ``dim``: each fused segment (in ``unit``s) split N ways, or, for a
    segment flagged ``kv`` with fewer units than N, the single unit ``r // (N / count)`` (vLLM's GQA rule)."""
    counts = segments or (w.shape[dim] // unit,)
    flags = kv or (0,) * len(counts)
    parts, start = [], 0
    for count, is_kv in zip(counts, flags, strict=True):
        if count % n == 0:
            take = count // n
            lo = start + r * take * unit
        else:
            assert is_kv and n % count == 0
            take = 1
            lo = start + (r // (n // count)) * unit
        parts.append(np.take(w, np.arange(lo, lo + take * unit), axis=dim))
        start += count * unit
    return np.concatenate(parts, axis=dim)


def shard_segments(
    x: np.ndarray, dim: int, segments: list[int], kv: list[int], n: int, unit: int = 1, pack: int = 1
) -> np.ndarray:
    """Output [n, ...]: rank r's part of every segment (see ``rank_part``) of the logical dim, where each
    stored element stands for ``pack`` logical ones."""
    logical = np.repeat(x, pack, axis=dim)
    ranks = []
    for r in range(n):
        part = rank_part(logical, dim, n, r, tuple(segments), tuple(kv), unit)
        ranks.append(np.take(part, np.arange(0, part.shape[dim], pack), axis=dim))
    return np.stack(ranks)


def pad_dim(x: np.ndarray, dim: int, multiple: int, n: int) -> np.ndarray:
    """``x`` with zero rows appended along ``dim`` up to the next multiple of ``multiple``, unless n divides it."""
    size = x.shape[dim]
    if size % n == 0:
        return x
    target = size + (multiple - size % multiple) % multiple
    shape = list(x.shape)
    shape[dim] = target
    out = np.zeros(shape, dtype=x.dtype)
    index = [slice(None)] * x.ndim
    index[dim] = slice(0, size)
    out[tuple(index)] = x
    return out


def rank_slices(x: np.ndarray, steps: list[tuple], n: int) -> list[np.ndarray]:
    """Apply ``steps`` ((name, *args) with args already evaluated) and split the result by rank."""
    funcs = {"shard_dim": shard_dim, "reorder_segments": reorder_segments, "replicate": replicate}
    funcs["shard_segments"] = shard_segments
    funcs["pad_dim"] = pad_dim
    for name, *args in steps:
        x = funcs[name](x, *args)
    return [np.ascontiguousarray(x[r]) for r in range(n)]
