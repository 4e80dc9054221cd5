"""Step functions for quantized layouts, registered as ``shard_funcs.<name>``.

A quantized tensor stores several logical elements per stored element along some dims: int4
values packed 8 per int32 word, one scale per group of 128 inputs, one FP8 scale per 128x128
block, one GGUF block of 32 or 256 values. A split of the logical weight must then fall on
pack, group or block boundaries, and a few companions hold values that change per rank
(``weight_shape``, act-order ``g_idx``). Fused segments on a packed or grouped dim compose
``reorder_segments`` (with a unit in stored elements) and the splits below; when KV heads are
fewer than ranks, ``shard_segments`` replicates them (GQA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shard_funcs import _check_n, _norm_dim, _shard_dim_boxes
from shardload.errors import StepArgumentError
from shardload.registry import Box, Shape, register

if TYPE_CHECKING:
    import torch

__all__ = ["shard_group_index", "shard_groups", "shard_packed", "shard_segments", "shard_shape"]

_INT_DTYPES = ("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8")


def _split(in_shape: Shape, d: int, n: int) -> Shape:
    out = list(in_shape)
    out[d] //= n
    return (n, *out)


def _even_split(x: torch.Tensor, d: int, n: int) -> torch.Tensor:
    return x.unflatten(d, (n, x.shape[d] // n)).movedim(d, 0)


# --- shard_packed ----------------------------------------------------------------------


def _packed_shape(in_shape: Shape, dtype: str, dim: int, pack: int, num_shards: int) -> tuple[Shape, str]:
    _check_n(num_shards)
    d = _norm_dim(dim, len(in_shape))
    if pack < 1:
        raise StepArgumentError(f"pack must be >= 1, got {pack}")
    words = in_shape[d]
    if words % num_shards:
        raise StepArgumentError(
            f"{words} packs along dim {d} cannot be split across {num_shards} ranks "
            f"({pack} values per {dtype}; a split must fall on a pack boundary)"
        )
    return _split(in_shape, d, num_shards), dtype


def _packed_boxes(out_box: Box, in_shape: Shape, dim: int, pack: int, num_shards: int) -> list[tuple[Box, Box]]:
    return _shard_dim_boxes(out_box, in_shape, dim, num_shards)


@register("shard_funcs.shard_packed", shape=_packed_shape, boxes=_packed_boxes)
def shard_packed(x: torch.Tensor, dim: int, pack: int, num_shards: int) -> torch.Tensor:
    """Split a dim that packs ``pack`` values per element (int4 in int32: 8) into N parts on pack boundaries.

    Moves the same elements as ``shard_dim``; it exists so a bad N is reported in packs.
    """
    return _even_split(x, dim % x.dim(), num_shards)


# --- shard_groups ----------------------------------------------------------------------


def _groups_shape(
    in_shape: Shape, dtype: str, dim: int, group_size: int, num_shards: int, size: int = 0
) -> tuple[Shape, str]:
    _check_n(num_shards)
    d = _norm_dim(dim, len(in_shape))
    if group_size < 1:
        raise StepArgumentError(f"group_size must be >= 1, got {group_size}")
    count = in_shape[d]
    total = size or count * group_size
    needed = -(-total // group_size)
    if needed != count:
        raise StepArgumentError(f"dim {d} holds {count} groups, but {total} in groups of {group_size} need {needed}")
    if num_shards == 1:
        return _split(in_shape, d, 1), dtype
    partial = " (the last one partial)" if total % group_size else ""
    head = f"{count} groups along dim {d}{partial} cannot be split across {num_shards} ranks (group size {group_size})"
    if total % num_shards:
        raise StepArgumentError(f"{head}: {total} elements do not divide by {num_shards}")
    per_rank = total // num_shards
    if per_rank % group_size:  # the first rank boundary falls inside a group
        raise StepArgumentError(f"{head}: group {per_rank // group_size} would straddle ranks 0 and 1")
    return _split(in_shape, d, num_shards), dtype


def _groups_boxes(
    out_box: Box, in_shape: Shape, dim: int, group_size: int, num_shards: int, size: int = 0
) -> list[tuple[Box, Box]]:
    return _shard_dim_boxes(out_box, in_shape, dim, num_shards)


@register("shard_funcs.shard_groups", shape=_groups_shape, boxes=_groups_boxes)
def shard_groups(x: torch.Tensor, dim: int, group_size: int, num_shards: int, size: int = 0) -> torch.Tensor:
    """Split a dim of per-group values (scales, zero points, FP8 block scales, GGUF blocks) on group boundaries.

    ``size`` is the logical length the groups cover (default: groups x group_size); with a
    partial last group (ceil division) no split can work for N > 1, which is reported.
    """
    return _even_split(x, dim % x.dim(), num_shards)


# --- shard_segments (GQA-aware) -----------------------------------------------------------


def _segment_runs(
    in_shape: Shape, dim: int, segments: Sequence[int], num_shards: int, unit: int, pack: int
) -> tuple[int, list[list[tuple[int, int]]]]:
    """Per rank, the ``(start, length)`` runs of stored elements along ``dim``, one per segment."""
    _check_n(num_shards)
    d = _norm_dim(dim, len(in_shape))
    if unit < 1 or pack < 1:
        raise StepArgumentError(f"unit and pack must be >= 1, got unit={unit}, pack={pack}")
    if not segments or any(s < 1 for s in segments):
        raise StepArgumentError(f"segments must be a non-empty list of positive sizes, got {list(segments)}")
    total = sum(segments) * unit
    if total % pack or total // pack != in_shape[d]:
        raise StepArgumentError(
            f"segments {list(segments)} x unit {unit} = {total} elements, packed {pack} per stored element, "
            f"do not match dim {d} of size {in_shape[d]}"
        )
    runs: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
    start = 0
    for i, count in enumerate(segments):
        if count % num_shards == 0:
            take = count // num_shards
            first = [r * take for r in range(num_shards)]
        elif num_shards % count == 0:  # fewer heads than ranks: replicate (vLLM: rank r gets head r // (N / count))
            take = 1
            first = [r // (num_shards // count) for r in range(num_shards)]
        else:
            raise StepArgumentError(
                f"segment {i} has {count} units of {unit}: "
                f"num_shards={num_shards} neither divides it nor is a multiple of it"
            )
        for r in range(num_shards):
            lo, length = start + first[r] * unit, take * unit
            if lo % pack or length % pack:
                raise StepArgumentError(
                    f"segment {i}: a rank's part (elements {lo}..{lo + length}) does not fall on "
                    f"boundaries of {pack} (pack or group size) for num_shards={num_shards}"
                )
            runs[r].append((lo // pack, length // pack))
        start += count * unit
    return d, runs


def _segments_shape(
    in_shape: Shape, dtype: str, dim: int, segments: list[int], num_shards: int, unit: int = 1, pack: int = 1
) -> tuple[Shape, str]:
    d, runs = _segment_runs(in_shape, dim, segments, num_shards, unit, pack)
    out = list(in_shape)
    out[d] = sum(length for _, length in runs[0])
    return (num_shards, *out), dtype


def _segments_boxes(
    out_box: Box, in_shape: Shape, dim: int, segments: list[int], num_shards: int, unit: int = 1, pack: int = 1
) -> list[tuple[Box, Box]]:
    d, runs = _segment_runs(in_shape, dim, segments, num_shards, unit, pack)
    (r0, r1), rest = out_box[0], list(out_box[1:])
    a, b = rest[d]
    pieces = []
    for r in range(r0, r1):
        offset = 0
        for src_start, length in runs[r]:
            lo, hi = max(a, offset), min(b, offset + length)
            if lo < hi:
                src = list(rest)
                src[d] = (src_start + lo - offset, src_start + hi - offset)
                dst = list(rest)
                dst[d] = (lo, hi)
                pieces.append((tuple(src), ((r, r + 1), *dst)))
            offset += length
    return pieces


@register("shard_funcs.shard_segments", shape=_segments_shape, boxes=_segments_boxes)
def shard_segments(
    x: torch.Tensor, dim: int, segments: list[int], num_shards: int, unit: int = 1, pack: int = 1
) -> torch.Tensor:
    """Split a fused dim of ``segments`` (in ``unit``s) so each rank gets its part of every segment, ``[N, ...]``.

    GQA-aware: a segment with fewer units than ranks (KV heads) is replicated, rank r taking
    unit ``r // (N / count)`` as vLLM does. ``pack`` logical elements share a stored element
    (packed int4, scale groups, FP8 blocks); a rank's part must fall on their boundaries.
    """
    import torch

    d, runs = _segment_runs(tuple(x.shape), dim, segments, num_shards, unit, pack)
    return torch.stack([torch.cat([x.narrow(d, s, n) for s, n in rank], dim=d) for rank in runs])


# --- shard_shape (compute: compressed-tensors weight_shape) ----------------------------------


def _shape_shape(
    in_shape: Shape, dtype: str, dim: int, num_shards: int, segments: Sequence[int] = (), unit: int = 1
) -> tuple[Shape, str]:
    _check_n(num_shards)
    if len(in_shape) != 1 or dtype not in _INT_DTYPES:
        raise StepArgumentError(f"expects a 1-d integer shape vector, got {list(in_shape)} {dtype}")
    _norm_dim(dim, in_shape[0])
    if segments:
        _segment_runs((sum(segments) * unit,), 0, segments, num_shards, unit, 1)
    return (num_shards, in_shape[0]), dtype


@register("shard_funcs.shard_shape", shape=_shape_shape)
def shard_shape(
    x: torch.Tensor, dim: int, num_shards: int, segments: Sequence[int] = (), unit: int = 1
) -> torch.Tensor:
    """Rewrite a stored logical-shape vector (compressed-tensors ``weight_shape``) to each rank's shape.

    Entry ``dim`` becomes its N-th part, or with ``segments`` (GQA) the rank's sum over segments.
    A compute step: the values change, so no rank can just copy its bytes.
    """
    d = dim % x.shape[0]
    size = int(x[d])
    if segments:
        if sum(segments) * unit != size:
            raise StepArgumentError(
                f"shape entry {d} is {size}, but segments {list(segments)} x unit {unit} "
                f"add up to {sum(segments) * unit}"
            )
        _, runs = _segment_runs((size,), 0, segments, num_shards, unit, 1)
        per_rank = sum(length for _, length in runs[0])
    elif size % num_shards:
        raise StepArgumentError(f"shape entry {d} is {size}, which does not divide by num_shards={num_shards}")
    else:
        per_rank = size // num_shards
    out = x.unsqueeze(0).repeat(num_shards, 1)
    out[:, d] = per_rank
    return out


# --- shard_group_index (compute: GPTQ / compressed-tensors g_idx) -----------------------------


def _group_index_shape(in_shape: Shape, dtype: str, num_groups: int, num_shards: int) -> tuple[Shape, str]:
    _check_n(num_shards)
    if len(in_shape) != 1 or dtype not in _INT_DTYPES:
        raise StepArgumentError(f"expects a 1-d integer group index, got {list(in_shape)} {dtype}")
    if in_shape[0] % num_shards:
        raise StepArgumentError(f"{in_shape[0]} inputs cannot be split across {num_shards} ranks")
    if num_groups < 1 or num_groups % num_shards:
        raise StepArgumentError(f"{num_groups} groups cannot be split across {num_shards} ranks")
    return _split(in_shape, 0, num_shards), dtype


@register("shard_funcs.shard_group_index", shape=_group_index_shape)
def shard_group_index(x: torch.Tensor, num_groups: int, num_shards: int) -> torch.Tensor:
    """Split a per-input group index (``g_idx``) and make it local: rank r's values minus r x groups per rank.

    For checkpoints whose groups follow input order (no act-order), so each rank's scales are its own
    slice; a value outside the rank's groups is an error (act-order needs replicated scales).
    """
    per_rank = num_groups // num_shards
    parts = _even_split(x, 0, num_shards)
    import torch

    offsets = (torch.arange(num_shards, dtype=x.dtype) * per_rank).unsqueeze(1)
    local = parts - offsets
    bad = (local < 0) | (local >= per_rank)
    if bool(bad.any()):
        r = int(bad.any(dim=1).nonzero()[0])
        raise StepArgumentError(
            f"rank {r}'s inputs use groups outside its own {r * per_rank}..{(r + 1) * per_rank}: "
            "act-order (desc_act) indices need the scales replicated"
        )
    return local
