"""Byte runs: a remap plan's read boxes flattened into contiguous copies from the file into rank buffers.

Run i copies ``length[i]`` bytes from file offset ``src[i]`` to byte ``dst[i]`` of buffer ``buf[i]``
(buffer k holds the k-th requested rank's tensor). :func:`param_runs` builds them from a plan, checked
against the stored tensor and the rank tensors (a faulty box rule cannot read or write out of bounds,
nor leave a byte unwritten: a byte no run writes must be padding the plan declares, which
:func:`zero_spans` lists for the executor to fill with zeros) and sorted by file offset;
:func:`dedupe` turns runs whose bytes an earlier run already reads into memory copies, so each stored
byte is read once; :func:`split`, :func:`jobs` and :func:`chunks` cut runs into thread-pool jobs and
bounded staging chunks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..sources.dtypes import itemsize

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .plan import ParamPlan
    from .registry import Box, Shape


@dataclass(frozen=True)
class Runs:
    """Parallel int64 arrays, one entry per run: file offset, byte count, buffer index, buffer offset."""

    src: np.ndarray
    length: np.ndarray
    buf: np.ndarray
    dst: np.ndarray

    def __len__(self) -> int:
        return len(self.src)

    @property
    def nbytes(self) -> int:
        """Bytes the runs copy in total."""
        return int(self.length.sum())

    def take(self, index: np.ndarray | slice) -> Runs:
        """The runs selected by ``index`` (a slice or an index array), in that order."""
        return Runs(self.src[index], self.length[index], self.buf[index], self.dst[index])


@dataclass(frozen=True)
class Copies:
    """Memory copies that replace reads: ``length`` bytes from ``(from_buf, from_dst)`` to ``(buf, dst)``."""

    from_buf: np.ndarray
    from_dst: np.ndarray
    buf: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.buf)


def _empty() -> Runs:
    z = np.zeros(0, dtype=np.int64)
    return Runs(z, z, z, z)


def contiguous_run(shape: Shape, box: Box) -> int:
    """Elements per contiguous run of ``box`` inside a row-major array of ``shape``."""
    run = 1
    for (a, b), n in zip(reversed(box), reversed(shape), strict=True):
        run *= b - a
        if b - a != n:
            break
    return run


def _strides(shape: Shape) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _run_offsets(shape: Shape, box: Box, dims: list[int], outer: list[int]) -> np.ndarray:
    """Element offsets of every run start of ``box``: a grid over its first ``outer`` non-unit dims."""
    strides = _strides(shape)
    base = sum(a * s for (a, _), s in zip(box, strides, strict=True))
    offsets = np.array([base], dtype=np.int64)
    for d, n in zip(dims, outer, strict=False):
        step = np.arange(n, dtype=np.int64) * strides[d]
        offsets = (offsets[:, None] + step[None, :]).reshape(-1)
    return offsets


def box_runs(src_shape: Shape, src_box: Box, dst_shape: Shape, dst_box: Box) -> tuple[np.ndarray, np.ndarray, int]:
    """Element offsets (source, destination) of the contiguous runs copying ``src_box`` to ``dst_box``, and the
    run length in elements. The boxes hold the same elements in the same row-major order."""
    src_dims = [d for d, (a, b) in enumerate(src_box) if b - a != 1]
    dst_dims = [d for d, (a, b) in enumerate(dst_box) if b - a != 1]
    extents = [src_box[d][1] - src_box[d][0] for d in src_dims]
    run = min(contiguous_run(src_shape, src_box), contiguous_run(dst_shape, dst_box))
    outer, acc = [], prod(extents)
    for e in extents:  # the leading extents whose product is the number of runs
        if acc == run:
            break
        outer.append(e)
        acc //= e
    return _run_offsets(src_shape, src_box, src_dims, outer), _run_offsets(dst_shape, dst_box, dst_dims, outer), run


def _check_piece(plan: ParamPlan, rank: int, src: Box, dst: Box) -> None:
    def inside(box: Box, shape: Shape) -> bool:
        return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape, strict=True))

    ok = inside(src, plan.source.shape) and inside(dst, plan.shape)
    if ok:
        ok = [b - a for a, b in src if b - a != 1] == [b - a for a, b in dst if b - a != 1]
    if not ok:
        raise PlanError(
            f"box rule gave rank {rank} the piece {list(src)} -> {list(dst)}, which does not fit "
            f"the stored shape {list(plan.source.shape)} and the rank shape {list(plan.shape)}",
            param=plan.name,
        )


def structure(plan: ParamPlan, ranks: Sequence[int]) -> tuple[object, ...]:
    """A key shared by parameters whose runs differ only by the stored tensor's file offset."""
    steps = tuple((s.func, repr(s.args)) for s in plan.steps)
    return (plan.source.shape, plan.source.dtype, plan.source.decode, plan.shape, plan.dtype, steps, tuple(ranks))


def shifted(runs: Runs, delta: int) -> Runs:
    """The same runs with file offsets moved by ``delta``."""
    return Runs(runs.src + delta, runs.length, runs.buf, runs.dst)


MANY_RUNS = 1 << 20
"""Above this many runs (a column slice of a tall, narrow tensor: millions of rows of a few bytes) no run table is
built: its arrays would take far more memory and time than the bytes themselves. The tensor is then copied out
of a mapping with strided copies (one rank) or read whole and split (several), in time linear in its bytes."""


def run_count(plan: ParamPlan, ranks: Sequence[int]) -> int:
    """How many contiguous runs ``plan``'s pieces for ``ranks`` make, counted from the boxes without building them."""
    total = 0
    for rank in ranks:
        pieces = [p for p in plan.pieces(rank) or [] if prod(b - a for a, b in p.src)]
        for piece in pieces:
            _check_piece(plan, rank, piece.src, piece.dst)
            run = min(contiguous_run(plan.source.shape, piece.src), contiguous_run(plan.shape, piece.dst))
            total += prod(b - a for a, b in piece.src) // max(1, run)
        if not _tiles([p.dst for p in pieces] + plan.zeros(rank), plan.shape):
            raise PlanError(
                f"box rule pieces do not cover rank {rank}'s {list(plan.shape)} tensor exactly once", param=plan.name
            )
    return total


def _tiles(boxes: list[Box], shape: Shape) -> bool:
    """Whether ``boxes`` (each inside ``shape``) cover it exactly once: sorted intervals when they differ along one
    dim only (every box rule here), else a coverage count over the elements (bounded by the rank's size)."""
    if sum(prod(b - a for a, b in box) for box in boxes) != prod(shape):
        return False
    if len(boxes) <= 1:
        return True
    varying = [d for d in range(len(shape)) if len({box[d] for box in boxes}) > 1]
    if len(varying) == 1:
        d = varying[0]
        spans = sorted(box[d] for box in boxes)
        return all(spans[k][1] <= spans[k + 1][0] for k in range(len(spans) - 1))  # no overlap; sizes add up
    count = np.zeros(shape, dtype=np.uint8)
    for box in boxes:
        count[tuple(slice(a, b) for a, b in box)] += 1
    return bool((count == 1).all())


def param_runs(plan: ParamPlan, ranks: Sequence[int]) -> Runs | None:
    """The runs that build ``plan``'s tensors for ``ranks`` (buffer k = ``ranks[k]``), sorted by file offset.

    None when the plan has a compute step (or a remap that changes the dtype), or when the runs would be more than
    :data:`MANY_RUNS`: then the tensor is read whole.
    """
    if not plan.remap or plan.source.dtype != plan.dtype or run_count(plan, ranks) > MANY_RUNS:
        return None
    size = itemsize(plan.dtype)
    per_rank: list[Runs] = []
    for k, rank in enumerate(ranks):
        src_parts, dst_parts, len_parts = [], [], []
        for piece in plan.pieces(rank) or ():
            _check_piece(plan, rank, piece.src, piece.dst)
            src, dst, run = box_runs(plan.source.shape, piece.src, plan.shape, piece.dst)
            src_parts.append(src)
            dst_parts.append(dst)
            len_parts.append(np.full(len(src), run * size, dtype=np.int64))
        if not src_parts:
            src_parts = dst_parts = len_parts = [np.zeros(0, dtype=np.int64)]
        src, dst, length = (np.concatenate(x) for x in (src_parts, dst_parts, len_parts))
        runs = Runs(src * size + plan.source.offset, length, np.full(len(src), k, dtype=np.int64), dst * size)
        runs = runs.take(runs.length > 0)  # an empty tensor's pieces copy nothing
        _check_coverage(plan, rank, runs)
        per_rank.append(runs)
    if not per_rank:
        return _empty()
    runs = Runs(
        np.concatenate([r.src for r in per_rank]),
        np.concatenate([r.length for r in per_rank]),
        np.concatenate([r.buf for r in per_rank]),
        np.concatenate([r.dst for r in per_rank]),
    )
    return coalesce(runs.take(_src_order(runs)))


def _src_order(runs: Runs) -> np.ndarray | slice:
    """The order that sorts runs by file offset, the longest first among runs starting at the same byte."""
    src = runs.src
    if len(src) < 2 or bool(np.all(src[1:] > src[:-1])):
        return slice(None)
    order = np.argsort(src, kind="stable")
    s = src[order]
    if bool(np.any(s[1:] == s[:-1])):
        order = np.lexsort((-runs.length, src))
    return order


def zero_spans(plan: ParamPlan, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets and lengths, in ``rank``'s tensor, of its padding (:meth:`ParamPlan.zeros`), merged where
    they touch: what the executor fills with zeros instead of reading. Empty for a plan that does not pad."""
    starts, lengths = [], []
    size = itemsize(plan.dtype)
    for box in plan.zeros(rank):
        dst, _, run = box_runs(plan.shape, box, plan.shape, box)
        starts.append(dst * size)
        lengths.append(np.full(len(dst), run * size, dtype=np.int64))
    if not starts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    start, length = np.concatenate(starts), np.concatenate(lengths)
    order = np.argsort(start, kind="stable")
    start, length = start[order], length[order]
    joins = start[1:] == (start + length)[:-1]
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return start[heads], np.add.reduceat(length, heads)


def _check_coverage(plan: ParamPlan, rank: int, runs: Runs) -> None:
    """The runs of one rank and its padding must write its tensor exactly once, byte for byte (no gap, no
    overlap)."""
    dst, length = runs.dst, runs.length
    if plan.pads:
        zero_dst, zero_length = zero_spans(plan, rank)
        dst, length = np.concatenate((dst, zero_dst)), np.concatenate((length, zero_length))
    if len(dst) > 1 and not bool(np.all(dst[1:] > dst[:-1])):
        order = np.argsort(dst, kind="stable")
        dst, length = dst[order], length[order]
    end = dst + length
    want = plan.rank_nbytes
    if len(dst) == 0:
        ok = want == 0
    else:
        ok = int(dst[0]) == 0 and int(end[-1]) == want and bool(np.all(dst[1:] == end[:-1]))
    if not ok:
        raise PlanError(
            f"box rule pieces do not cover rank {rank}'s {list(plan.shape)} tensor exactly once", param=plan.name
        )


def coalesce(runs: Runs) -> Runs:
    """Merge neighbours that continue each other in the file and in the same buffer (fewer iovecs)."""
    if len(runs) < 2:
        return runs
    end = runs.src + runs.length
    dst_end = runs.dst + runs.length
    joins = (runs.src[1:] == end[:-1]) & (runs.buf[1:] == runs.buf[:-1]) & (runs.dst[1:] == dst_end[:-1])
    if not joins.any():
        return runs
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return Runs(runs.src[heads], np.add.reduceat(runs.length, heads), runs.buf[heads], runs.dst[heads])


def dedupe(runs: Runs) -> tuple[Runs, Copies]:
    """Split runs (sorted by ``src``, longest first on ties) into reads and copies of bytes read by an earlier run.

    A run lying wholly inside an earlier read run becomes a memory copy from that run's destination;
    partial overlaps stay reads.
    """
    n = len(runs)
    if n < 2:
        return runs, Copies(*(np.zeros(0, dtype=np.int64),) * 5)
    end = runs.src + runs.length
    reach = np.maximum.accumulate(end)
    prev_reach = np.concatenate(([-1], reach[:-1]))
    new = end > prev_reach
    owner = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    inside = ~new
    if not inside.any():
        return runs, Copies(*(np.zeros(0, dtype=np.int64),) * 5)
    o = owner[inside]
    copies = Copies(
        runs.buf[o],
        runs.dst[o] + (runs.src[inside] - runs.src[o]),
        runs.buf[inside],
        runs.dst[inside],
        runs.length[inside],
    )
    return runs.take(new), copies


def fill_gaps(runs: Runs, max_gap: int, scratch: int) -> Runs:
    """Read through holes of at most ``max_gap`` bytes between consecutive runs (sorted by ``src``): each
    becomes a run into byte 0 of buffer ``scratch``, so a few more bytes are read in far fewer calls."""
    if len(runs) < 2:
        return runs
    end = runs.src + runs.length
    gap = runs.src[1:] - end[:-1]
    fill = (gap > 0) & (gap <= max_gap)
    if not fill.any():
        return runs
    at = np.flatnonzero(fill) + 1
    return Runs(
        np.insert(runs.src, at, end[at - 1]),
        np.insert(runs.length, at, gap[at - 1]),
        np.insert(runs.buf, at, scratch),
        np.insert(runs.dst, at, 0),
    )


def split(runs: Runs, max_bytes: int) -> Runs:
    """Cut every run longer than ``max_bytes`` into consecutive runs of at most that size."""
    if len(runs) == 0 or int(runs.length.max()) <= max_bytes:
        return runs
    count = -(-runs.length // max_bytes)
    idx = np.repeat(np.arange(len(runs)), count)
    first = np.repeat(np.cumsum(count) - count, count)
    shift = (np.arange(len(idx)) - first) * max_bytes
    length = np.minimum(runs.length[idx] - shift, max_bytes)
    return Runs(runs.src[idx] + shift, length, runs.buf[idx], runs.dst[idx] + shift)


def jobs(runs: Runs, target: int) -> list[slice]:
    """Consecutive slices of ``runs`` holding about ``target`` bytes each (for a thread pool)."""
    if len(runs) == 0:
        return []
    cum = np.cumsum(runs.length)
    cuts = np.searchsorted(cum, np.arange(target, int(cum[-1]), target), side="left") + 1
    bounds = [0, *sorted(set(cuts.tolist()) - {0, len(runs)}), len(runs)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def chunks(runs: Runs, chunk_bytes: int) -> list[tuple[int, Runs]]:
    """Group runs by destination chunk ``[k * chunk_bytes, (k + 1) * chunk_bytes)`` of every buffer.

    Returns ``(k, runs)`` pairs in order of ``k``; runs crossing a chunk boundary are cut, their
    ``dst`` is made relative to the chunk start, and each group is sorted by file offset.
    """
    if len(runs) == 0:
        return []
    first = runs.dst // chunk_bytes
    last = (runs.dst + runs.length - 1) // chunk_bytes
    count = last - first + 1
    idx = np.repeat(np.arange(len(runs)), count)
    k = np.repeat(first, count) + (np.arange(len(idx)) - np.repeat(np.cumsum(count) - count, count))
    lo = np.maximum(runs.dst[idx], k * chunk_bytes)
    hi = np.minimum(runs.dst[idx] + runs.length[idx], (k + 1) * chunk_bytes)
    cut = Runs(runs.src[idx] + (lo - runs.dst[idx]), hi - lo, runs.buf[idx], lo - k * chunk_bytes)
    order = np.lexsort((cut.src, k))
    cut, k = cut.take(order), k[order]
    heads = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    bounds = [*heads.tolist(), len(k)]
    return [(int(k[a]), coalesce(cut.take(slice(a, b)))) for a, b in itertools.pairwise(bounds)]
