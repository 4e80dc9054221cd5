"""Step functions for quantized layouts, registered as ``shard_funcs.<name>``.

A quantized tensor stores several logical elements per stored element along some dims: int4
values packed 8 per int32 word, one scale per group of 128 inputs, one FP8 scale per 128x128
block, one GGUF block of 32 or 256 values. A split of the logical weight must then fall on
pack, group or block boundaries, and a few companions hold values that change per rank
(``weight_shape``, act-order ``g_idx``). Fused segments and GQA on a packed or grouped dim are
``shard_segments`` with its ``pack`` factor (:mod:`shard_funcs.segments`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shard_funcs import _check_n, _norm_dim, _shard_dim_boxes, shard_dim
from shard_funcs.segments import segment_runs
from shardload.errors import StepArgumentError
from shardload.planning.registry import Box, Shape, register

if TYPE_CHECKING:
    import torch

__all__ = ["shard_group_index", "shard_groups", "shard_packed", "shard_shape"]

_INT_DTYPES = ("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8")


def _split(in_shape: Shape, d: int, n: int) -> Shape:
    out = list(in_shape)
    out[d] //= n
    return (n, *out)


# --- shard_packed ----------------------------------------------------------------------


def _packed_shape(
    in_shape: Shape, dtype: str, dim: int, pack: int, num_shards: int, size: int = 0
) -> tuple[Shape, str]:
    _check_n(num_shards)
    d = _norm_dim(dim, len(in_shape))
    if pack < 1:
        raise StepArgumentError(f"pack must be >= 1, got {pack}")
    words = in_shape[d]
    if size:
        if -(-size // pack) != words:
            raise StepArgumentError(f"dim {d} holds {words} packs, but {size} values {pack} to a pack need "
                                    f"{-(-size // pack)}")  # fmt: skip
        if num_shards > 1 and size % pack:
            raise StepArgumentError(
                f"{size} values along dim {d} fill {words} packs of {pack}, the last one partly filled: no split "
                f"across {num_shards} ranks falls on pack boundaries"
            )
    if words % num_shards:
        raise StepArgumentError(
            f"{words} packs along dim {d} cannot be split across {num_shards} ranks "
            f"({pack} values per {dtype}; a split must fall on a pack boundary)"
        )
    return _split(in_shape, d, num_shards), dtype


def _packed_boxes(
    out_box: Box, in_shape: Shape, dim: int, pack: int, num_shards: int, size: int = 0
) -> list[tuple[Box, Box]]:
    return _shard_dim_boxes(out_box, in_shape, dim, num_shards)


@register("shard_funcs.shard_packed", shape=_packed_shape, boxes=_packed_boxes)
def shard_packed(x: torch.Tensor, dim: int, pack: int, num_shards: int, size: int = 0) -> torch.Tensor:
    """Split a dim that packs ``pack`` values per element (int4 in int32: 8) into N parts on pack boundaries.

    Moves the same elements as ``shard_dim``; it exists so a bad N is reported in packs. ``size`` is the number of
    values packed (default: packs x pack); where the last pack is partly filled, N > 1 is refused.
    """
    return shard_dim(x, dim, num_shards)


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
    return shard_dim(x, dim, num_shards)


# --- shard_shape (compute: compressed-tensors weight_shape) ----------------------------------


def _shape_shape(
    in_shape: Shape,
    dtype: str,
    dim: int,
    num_shards: int,
    segments: Sequence[int] = (),
    kv: Sequence[int] = (),
    unit: int = 1,
    size: int = 0,
) -> tuple[Shape, str]:
    _check_n(num_shards)
    if len(in_shape) != 1 or dtype not in _INT_DTYPES:
        raise StepArgumentError(f"expects a 1-d integer shape vector, got {list(in_shape)} {dtype}")
    _norm_dim(dim, in_shape[0])
    if segments:
        segment_runs((sum(segments) * unit,), 0, segments, kv or [0] * len(segments), num_shards, unit, 1)
    return (num_shards, in_shape[0]), dtype


@register("shard_funcs.shard_shape", shape=_shape_shape)
def shard_shape(
    x: torch.Tensor,
    dim: int,
    num_shards: int,
    segments: Sequence[int] = (),
    kv: Sequence[int] = (),
    unit: int = 1,
    size: int = 0,
) -> torch.Tensor:
    """Rewrite a stored logical-shape vector (compressed-tensors ``weight_shape``) to each rank's shape.

    Entry ``dim`` becomes its N-th part, or with ``segments`` and ``kv`` flags (GQA) the rank's sum
    over segments as ``shard_segments`` splits them. ``size`` is what the packed tensors hold along that dim (packs x
    values per pack): an entry short of it (a partly filled last pack) cannot be split. A compute step.
    """
    d = dim % x.shape[0]
    stored, size = size, int(x[d])
    if stored and num_shards > 1 and size != stored:
        raise StepArgumentError(
            f"shape entry {d} is {size}, but the packed tensors hold {stored} values along it: their last pack is "
            f"partly filled, so no split across {num_shards} ranks falls on pack boundaries"
        )
    if segments:
        if sum(segments) * unit != size:
            raise StepArgumentError(
                f"shape entry {d} is {size}, but segments {list(segments)} x unit {unit} "
                f"add up to {sum(segments) * unit}"
            )
        _, runs = segment_runs((size,), 0, segments, kv or [0] * len(segments), num_shards, unit, 1)
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
    if num_groups < 1 or (num_groups > 1 and num_groups % num_shards):  # one group: every rank keeps it
        raise StepArgumentError(f"{num_groups} groups cannot be split across {num_shards} ranks")
    return _split(in_shape, 0, num_shards), dtype


def _group_index_inverse(out: torch.Tensor, num_groups: int, num_shards: int) -> torch.Tensor:
    """The global g_idx back from every rank's local one: rank r's values plus r x groups per rank."""
    import torch

    per_rank = 0 if num_groups == 1 else num_groups // num_shards
    return (out + (torch.arange(num_shards, dtype=out.dtype) * per_rank).unsqueeze(1)).reshape(-1)


@register("shard_funcs.shard_group_index", shape=_group_index_shape, inverse=_group_index_inverse)
def shard_group_index(x: torch.Tensor, num_groups: int, num_shards: int) -> torch.Tensor:
    """Split a per-input group index (``g_idx``) and make it local: rank r's values minus r x groups per rank.

    For checkpoints whose groups follow input order (no act-order), so each rank's scales are its own
    slice; a value outside the rank's groups is an error (act-order needs replicated scales). One group (GPTQ's
    group_size -1) is every rank's: its index stays 0.
    """
    shared = num_groups == 1
    per_rank = 1 if shared else num_groups // num_shards
    parts = shard_dim(x, 0, num_shards)
    import torch

    offsets = (torch.arange(num_shards, dtype=x.dtype) * (0 if shared else per_rank)).unsqueeze(1)
    local = parts - offsets
    bad = (local < 0) | (local >= per_rank)
    if bool(bad.any()):
        r = int(bad.any(dim=1).nonzero()[0])
        raise StepArgumentError(
            f"rank {r}'s inputs use groups outside its own {r * per_rank}..{(r + 1) * per_rank}: "
            "act-order (desc_act) indices need the scales replicated"
        )
    return local
