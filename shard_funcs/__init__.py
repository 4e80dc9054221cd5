"""Built-in step functions, registered as ``shard_funcs.<name>``.

Each takes the input tensor first, then the extra arguments written in shard_info.json, and
declares a shape rule and a box rule. Steps for one concern live in their own submodule:
``segments`` (fused-segment splits with GQA replication and pack factors), ``quant``
(quantized layouts) and ``padding`` (zero padding so N divides a dim, e.g. a vocabulary), all
imported here so they register too.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sized
from typing import TYPE_CHECKING

from shardload.errors import StepArgumentError
from shardload.planning.registry import Box, Shape, register

if TYPE_CHECKING:
    import torch

__all__ = ["pad_dim", "replicate", "reorder_segments", "shard_dim", "shard_segments"]


def _norm_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative index into an ``ndim``-d input; out of range is a step argument error."""
    if not -ndim <= dim < ndim:
        raise StepArgumentError(f"dim {dim} is out of range for a {ndim}-d input")
    return dim % ndim


def _check_n(num_shards: int) -> None:
    """Refuse a ``num_shards`` below 1 (every built-in step checks it the same way)."""
    if num_shards < 1:
        raise StepArgumentError(f"num_shards must be >= 1, got {num_shards}")


MAX_SEGMENT_PIECES = 1 << 22
"""Segments x ranks a segment step may make: each (segment, rank) piece costs memory, and a list of segments comes
from a file (a fused dim has a few; the layers' experts stacked, a few hundred)."""


def _check_segments(segments: Sized, num_shards: int) -> None:
    """Refuse a segment list that would make more than :data:`MAX_SEGMENT_PIECES` pieces, before any is built."""
    pieces = len(segments) * num_shards
    if pieces > MAX_SEGMENT_PIECES:
        raise StepArgumentError(
            f"{len(segments)} segments split {num_shards} ways make {pieces} pieces, over the limit of "
            f"{MAX_SEGMENT_PIECES}"
        )


# --- shard_dim ---------------------------------------------------------------------------


def _shard_dim_shape(in_shape: Shape, dtype: str, dim: int, num_shards: int) -> tuple[Shape, str]:
    _check_n(num_shards)
    d = _norm_dim(dim, len(in_shape))
    size = in_shape[d]
    if size % num_shards:
        raise StepArgumentError(f"dim {d} of size {size} is not divisible by num_shards={num_shards}")
    out = list(in_shape)
    out[d] = size // num_shards
    return (num_shards, *out), dtype


def _shard_dim_boxes(out_box: Box, in_shape: Shape, dim: int, num_shards: int) -> list[tuple[Box, Box]]:
    d = _norm_dim(dim, len(in_shape))
    step = in_shape[d] // num_shards
    (r0, r1), rest = out_box[0], list(out_box[1:])
    pieces = []
    for r in range(r0, r1):
        src = list(rest)
        a, b = rest[d]
        src[d] = (r * step + a, r * step + b)
        pieces.append((tuple(src), ((r, r + 1), *rest)))
    return pieces


@register("shard_funcs.shard_dim", shape=_shard_dim_shape, boxes=_shard_dim_boxes)
def shard_dim(x: torch.Tensor, dim: int, num_shards: int) -> torch.Tensor:
    """Split ``x`` into ``num_shards`` equal parts along ``dim``; output ``[N, ..., size/N, ...]``."""
    d = dim % x.dim()
    return x.unflatten(d, (num_shards, x.shape[d] // num_shards)).movedim(d, 0)


# --- reorder_segments ----------------------------------------------------------------------


def _segment_layout(
    in_shape: Shape, dim: int, segments: list[int], num_shards: int, unit: int
) -> tuple[int, list[int]]:
    """Check the segment arguments; return the normalised dim and the segment lengths in elements."""
    _check_n(num_shards)
    _check_segments(segments, num_shards)
    d = _norm_dim(dim, len(in_shape))
    if unit < 1:
        raise StepArgumentError(f"unit must be >= 1, got {unit}")
    if not segments or any(s < 1 for s in segments):
        raise StepArgumentError(f"segments must be a non-empty list of positive sizes, got {segments}")
    total = sum(segments) * unit
    if total != in_shape[d]:
        unit_note = f" x unit {unit}" if unit != 1 else ""
        raise StepArgumentError(f"segments {segments}{unit_note} add up to {total}, but dim {d} has size {in_shape[d]}")
    for i, seg in enumerate(segments):
        if seg % num_shards:
            if unit != 1:
                fused = "in a fused QKV: " if len(segments) > 1 else ""  # one segment: a projection of its own
                raise StepArgumentError(
                    f"segment {i} holds {seg} units of {unit} ({fused}{seg} heads of head_dim {unit}); "
                    f"{seg} is not divisible by num_shards={num_shards}, so a head would be cut"
                )
            raise StepArgumentError(f"segment {i} of size {seg} is not divisible by num_shards={num_shards}")
    return d, [s * unit for s in segments]


def _reorder_shape(
    in_shape: Shape, dtype: str, dim: int, segments: list[int], num_shards: int, unit: int = 1
) -> tuple[Shape, str]:
    _segment_layout(in_shape, dim, segments, num_shards, unit)
    return tuple(in_shape), dtype


def _reorder_boxes(
    out_box: Box, in_shape: Shape, dim: int, segments: list[int], num_shards: int, unit: int = 1
) -> list[tuple[Box, Box]]:
    d, lengths = _segment_layout(in_shape, dim, segments, num_shards, unit)
    per_rank = [n // num_shards for n in lengths]
    block = sum(per_rank)
    starts = [0, *itertools.accumulate(lengths)][:-1]
    offsets = [0, *itertools.accumulate(per_rank)][:-1]
    a, b = out_box[d]
    pieces = []
    p = a
    while p < b:
        r, q = divmod(p, block)
        i = bisect.bisect_right(offsets, q) - 1  # the segment holding q (every segment has rows per rank)
        run = min(b - p, offsets[i] + per_rank[i] - q)
        src_start = starts[i] + r * per_rank[i] + (q - offsets[i])
        src = list(out_box)
        dst = list(out_box)
        src[d] = (src_start, src_start + run)
        dst[d] = (p, p + run)
        pieces.append((tuple(src), tuple(dst)))
        p += run
    return pieces


@register("shard_funcs.reorder_segments", shape=_reorder_shape, boxes=_reorder_boxes)
def reorder_segments(x: torch.Tensor, dim: int, segments: list[int], num_shards: int, unit: int = 1) -> torch.Tensor:
    """Reorder a fused ``dim`` made of ``segments`` (sizes in ``unit``s) so a contiguous split by N
    gives each rank its slice of every segment (fused QKV, gate_up)."""
    import torch

    d = dim % x.dim()
    parts = torch.split(x, [s * unit for s in segments], dim=d)
    chunks = [p.chunk(num_shards, dim=d) for p in parts]
    return torch.cat([c[r] for r in range(num_shards) for c in chunks], dim=d)


# --- replicate -------------------------------------------------------------------------


def _replicate_shape(in_shape: Shape, dtype: str, num_shards: int) -> tuple[Shape, str]:
    _check_n(num_shards)
    return (num_shards, *in_shape), dtype


def _replicate_boxes(out_box: Box, in_shape: Shape, num_shards: int) -> list[tuple[Box, Box]]:
    (r0, r1), rest = out_box[0], tuple(out_box[1:])
    return [(rest, ((r, r + 1), *rest)) for r in range(r0, r1)]


@register("shard_funcs.replicate", shape=_replicate_shape, boxes=_replicate_boxes)
def replicate(x: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Give every rank the whole tensor: ``[N, *x.shape]`` as a broadcast view (no copy)."""
    return x.unsqueeze(0).expand(num_shards, *x.shape)


# the submodules register their steps and need the helpers above
from . import quant  # noqa: E402,F401
from .padding import pad_dim  # noqa: E402
from .segments import shard_segments  # noqa: E402
