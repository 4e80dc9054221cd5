"""Fused-segment splits: ``shard_funcs.shard_segments`` gives each rank its part of every segment of a dim.

A fused dim (QKV, gate_up, or the one segment of a ``k_proj``) is made of segments counted in
``unit``s (heads of ``head_dim`` elements). A segment whose count divides by N is split into N
contiguous runs; a segment flagged ``kv`` (KV heads) with fewer units than N is replicated so that
rank r holds unit ``r // (N / count)``, the KV head its query heads use (vLLM's rule). ``pack``
logical elements share one stored element (int4 in int32, a scale group, an FP8 block), so a
quantized companion follows the same split of its logical weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shard_funcs import _check_n, _check_segments, _norm_dim
from shardload.errors import StepArgumentError
from shardload.planning.registry import Box, Shape, register

if TYPE_CHECKING:
    import torch

__all__ = ["shard_segments"]


def segment_runs(
    in_shape: Shape, dim: int, segments: Sequence[int], kv: Sequence[int], num_shards: int, unit: int = 1, pack: int = 1
) -> tuple[int, list[list[tuple[int, int]]]]:
    """Check the arguments; return the normalised dim and, per rank, its ``(start, length)`` stored runs."""
    _check_n(num_shards)
    _check_segments(segments, num_shards)
    d = _norm_dim(dim, len(in_shape))
    if unit < 1 or pack < 1:
        raise StepArgumentError(f"unit and pack must be >= 1, got unit={unit}, pack={pack}")
    if not segments or any(s < 1 for s in segments):
        raise StepArgumentError(f"segments must be a non-empty list of positive sizes, got {list(segments)}")
    if len(kv) != len(segments) or any(f not in (0, 1) for f in kv):
        raise StepArgumentError(f"kv must hold one 0/1 flag per segment of {list(segments)}, got {list(kv)}")
    total = sum(segments) * unit
    if total % pack or total // pack != in_shape[d]:
        packed = f", packed {pack} per stored element," if pack != 1 else ""
        raise StepArgumentError(
            f"segments {list(segments)} x unit {unit} = {total} elements{packed} do not match dim {d} "
            f"of size {in_shape[d]}"
        )
    query = sum(c for c, f in zip(segments, kv, strict=True) if not f)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
    start = 0
    for i, (count, is_kv) in enumerate(zip(segments, kv, strict=True)):
        if count % num_shards == 0:
            take = count // num_shards
            first = [r * take for r in range(num_shards)]
        elif is_kv and num_shards % count == 0:  # fewer KV heads than ranks: rank r gets head r // (N / count)
            take = 1
            first = [r // (num_shards // count) for r in range(num_shards)]
        elif is_kv:
            with_q = f" (query heads: {query})" if query else ""
            raise StepArgumentError(
                f"segment {i}: num_shards={num_shards} neither divides its {count} KV heads nor is a multiple of them"
                f"{with_q}"
            )
        elif unit != 1:
            fused = "in a fused QKV: " if len(segments) > 1 else ""  # one segment: a projection of its own
            raise StepArgumentError(
                f"segment {i} holds {count} units of {unit} ({fused}{count} heads of head_dim {unit}); "
                f"{count} is not divisible by num_shards={num_shards}, so a head would be cut"
            )
        else:
            raise StepArgumentError(f"segment {i} of size {count} is not divisible by num_shards={num_shards}")
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


def _shape(in_shape: Shape, dtype: str, *args: Any) -> tuple[Shape, str]:
    d, runs = segment_runs(in_shape, *args)
    out = list(in_shape)
    out[d] = sum(length for _, length in runs[0])
    return (len(runs), *out), dtype


def _boxes(out_box: Box, in_shape: Shape, *args: Any) -> list[tuple[Box, Box]]:
    """The rule's arguments are shard_segments' own (dim, segments, kv, num_shards[, unit, pack])."""
    d, runs = segment_runs(in_shape, *args)
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


@register("shard_funcs.shard_segments", shape=_shape, boxes=_boxes)
def shard_segments(
    x: torch.Tensor,
    dim: int,
    segments: list[int],
    kv: list[int],
    num_shards: int,
    unit: int = 1,
    pack: int = 1,
) -> torch.Tensor:
    """Split fused ``dim`` (``segments`` in ``unit``s) so each rank gets its part of every segment, ``[N, ...]``.

    A ``kv``-flagged segment with fewer units than ranks is replicated (rank r: unit ``r // (N / count)``);
    ``pack`` logical elements share a stored element, and a rank's part must fall on their boundaries.
    """
    import torch

    d, runs = segment_runs(tuple(x.shape), dim, segments, kv, num_shards, unit, pack)
    return torch.stack([torch.cat([x.narrow(d, s, n) for s, n in rank], dim=d) for rank in runs])
