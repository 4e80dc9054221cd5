"""Attention-head sharding: ``shard_funcs.shard_heads`` splits a (fused) projection by whole heads.

Segments (q, k, v of a fused ``qkv_proj``, or the one segment of a ``k_proj``) are counted in
heads of ``head_dim`` elements. A segment whose head count divides by N is split into contiguous
groups of heads; a KV segment with fewer heads than N is replicated so that rank r holds KV head
``r // (N // num_kv_heads)``, the head its query heads attend with (vLLM's rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardload.errors import StepArgumentError
from shardload.registry import Box, Shape, register

if TYPE_CHECKING:
    import torch

__all__ = ["shard_heads"]


def _layout(
    in_shape: Shape, dim: int, heads: list[int], kv: list[int], num_shards: int, head_dim: int
) -> tuple[int, list[int]]:
    """Check the arguments; return the normalised dim and the heads each rank holds per segment."""
    if num_shards < 1:
        raise StepArgumentError(f"num_shards must be >= 1, got {num_shards}")
    ndim = len(in_shape)
    if not -ndim <= dim < ndim:
        raise StepArgumentError(f"dim {dim} is out of range for a {ndim}-d input")
    d = dim % ndim
    if head_dim < 1:
        raise StepArgumentError(f"head_dim must be >= 1, got {head_dim}")
    if not heads or any(h < 1 for h in heads):
        raise StepArgumentError(f"heads must be a non-empty list of positive head counts, got {heads}")
    if len(kv) != len(heads) or any(f not in (0, 1) for f in kv):
        raise StepArgumentError(f"kv must hold one 0/1 flag per segment of heads {heads}, got {kv}")
    if sum(heads) * head_dim != in_shape[d]:
        raise StepArgumentError(
            f"heads {heads} x head_dim {head_dim} add up to {sum(heads) * head_dim}, but dim {d} has size {in_shape[d]}"
        )
    query = [h for h, f in zip(heads, kv, strict=True) if not f]
    per_rank = []
    for i, (h, f) in enumerate(zip(heads, kv, strict=True)):
        if h % num_shards == 0:
            per_rank.append(h // num_shards)
        elif f and num_shards % h == 0:
            per_rank.append(1)
        elif f:
            with_q = f" (query heads: {sum(query)})" if query else ""
            raise StepArgumentError(
                f"segment {i}: num_shards={num_shards} neither divides its {h} KV heads nor is a multiple of them"
                f"{with_q}"
            )
        else:
            raise StepArgumentError(
                f"segment {i} of {h} heads cannot be split across num_shards={num_shards} without cutting a head"
            )
    return d, per_rank


def _source_head(h: int, num_shards: int, rank: int) -> int:
    """First source head of ``rank`` in a segment of ``h`` heads (a replicated KV head when h < N)."""
    return rank * (h // num_shards) if h % num_shards == 0 else rank // (num_shards // h)


def _shape(
    in_shape: Shape, dtype: str, dim: int, heads: list[int], kv: list[int], num_shards: int, head_dim: int
) -> tuple[Shape, str]:
    d, per_rank = _layout(in_shape, dim, heads, kv, num_shards, head_dim)
    out = list(in_shape)
    out[d] = sum(per_rank) * head_dim
    return (num_shards, *out), dtype


def _boxes(
    out_box: Box, in_shape: Shape, dim: int, heads: list[int], kv: list[int], num_shards: int, head_dim: int
) -> list[tuple[Box, Box]]:
    d, per_rank = _layout(in_shape, dim, heads, kv, num_shards, head_dim)
    lengths = [n * head_dim for n in per_rank]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    starts = [sum(heads[:i]) * head_dim for i in range(len(heads))]
    (r0, r1), rest = out_box[0], list(out_box[1:])
    a, b = rest[d]
    pieces = []
    for r in range(r0, r1):
        p = a
        while p < b:
            i = next(i for i in range(len(lengths)) if offsets[i] <= p < offsets[i] + lengths[i])
            q = p - offsets[i]
            run = min(b - p, lengths[i] - q)
            src_start = starts[i] + _source_head(heads[i], num_shards, r) * head_dim + q
            src, dst = list(rest), list(rest)
            src[d] = (src_start, src_start + run)
            dst[d] = (p, p + run)
            pieces.append((tuple(src), ((r, r + 1), *dst)))
            p += run
    return pieces


@register("shard_funcs.shard_heads", shape=_shape, boxes=_boxes)
def shard_heads(
    x: torch.Tensor, dim: int, heads: list[int], kv: list[int], num_shards: int, head_dim: int
) -> torch.Tensor:
    """Split ``dim`` (segments of ``heads`` heads, ``head_dim`` each) by whole heads; KV segments
    (``kv`` flag 1) with fewer heads than N are replicated. Output ``[N, ..., per-rank size, ...]``."""
    import torch

    d = dim % x.dim()
    index: list[int] = []
    for r in range(num_shards):
        start = 0
        for h in heads:
            first = start + _source_head(h, num_shards, r) * head_dim
            index.extend(range(first, first + max(h // num_shards, 1) * head_dim))
            start += h * head_dim
    picked = x.index_select(d, torch.tensor(index, dtype=torch.long))
    return picked.unflatten(d, (num_shards, len(index) // num_shards)).movedim(d, 0)
