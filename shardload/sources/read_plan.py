"""Cold reads planned as I/O: a rank's byte runs in one file turned into a few large page-aligned reads, merged
across the gaps that are cheaper to read through than to skip under the source's :class:`IoModel`, within a byte
budget over the page floor. Pure: runs in, a :class:`ReadPlan` of :class:`Read` out; the executor does the I/O
(docs/reading.md, "Cold reads planned as I/O")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .reader import PAGE

if TYPE_CHECKING:
    import numpy as np

MAX_READ = 2 << 20
"""Bytes per planned read at most: a long stretch is cut into reads of this size (page-aligned), so a deep queue
of them keeps the device busy and each thread's share of a tensor arrives in parallel."""
MAX_WASTE = 0.05
"""Default byte budget for merging gaps: bytes moved at most this fraction over the page floor."""


@dataclass(frozen=True)
class IoModel:
    """What one more read request and one more byte cost on a source, measured (``sources/io_model.py``) or given
    through ``ReadOptions(io_model=...)``."""

    request_s: float
    """Seconds one more request costs at the queue depth the reader keeps (latency over the requests in flight)."""
    bandwidth: float
    """Bytes per second the source delivers to a long sequential read from cold storage."""

    def __post_init__(self) -> None:
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                      for x in (self.request_s, self.bandwidth))  # fmt: skip
        if not (numbers and self.request_s >= 0 and self.bandwidth > 0):
            raise ValueError(f"an I/O model needs finite numbers request_s >= 0 and bandwidth > 0, got {self}")

    @property
    def break_even(self) -> int:
        """The gap in bytes that takes as long to read through as one more request costs: shorter gaps are read."""
        return int(self.request_s * self.bandwidth)


@dataclass(frozen=True)
class Read:
    """One planned read: ``length`` bytes at file offset ``offset`` (the offset a multiple of the page size, the
    end too, except where the limit cuts it)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        """The offset just past the read."""
        return self.offset + self.length


@dataclass(frozen=True)
class ReadPlan:
    """The reads that fetch a set of byte runs, and the byte counts that keep a reader honest."""

    reads: list[Read]
    """Sorted, disjoint, page-aligned."""
    used: int
    """Bytes the runs need (each byte once)."""
    page_floor: int
    """Bytes of the whole pages that hold them: the least a cold read fetches from storage."""

    @property
    def moved(self) -> int:
        """Bytes the reads move from storage."""
        return sum(r.length for r in self.reads)


def plan_reads(
    starts: np.ndarray,
    ends: np.ndarray,
    model: IoModel,
    *,
    page: int = PAGE,
    max_waste: float = MAX_WASTE,
    max_read: int | None = None,
    limit: int | None = None,
) -> ReadPlan:
    """The reads fetching runs ``[starts[i], ends[i])`` (sorted by start, non-empty): their pages, merged across
    gaps shorter than ``model.break_even`` (shortest first) while the bytes merged stay within ``max_waste`` times
    the page floor, then cut into reads of at most ``max_read`` bytes (None: :data:`MAX_READ`); no read reaches
    past ``limit`` (the end of the bytes that may be read: the file's, or the stored tensor's)."""
    import numpy as np

    max_read = MAX_READ if max_read is None else max_read
    if max_read < page or max_read % page:
        raise ValueError(f"max_read must be a positive multiple of the page size ({page}), got {max_read}")
    if max_waste < 0:
        raise ValueError(f"max_waste must be >= 0, got {max_waste}")
    if not len(starts):
        return ReadPlan([], 0, 0)
    lo, hi = union(np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))
    used = int((hi - lo).sum())
    plo, phi = union(lo // page * page, -(-hi // page) * page)
    if limit is not None:
        if int(hi[-1]) > limit:
            raise ValueError(f"a run ends at {int(hi[-1])}, past the limit {limit}")
        phi = np.minimum(phi, limit)
    floor = int((phi - plo).sum())
    gaps = plo[1:] - phi[:-1]
    merge = np.zeros(len(gaps), dtype=bool)
    cheap = np.flatnonzero(gaps <= model.break_even)
    if len(cheap):
        order = cheap[np.argsort(gaps[cheap], kind="stable")]
        within = np.cumsum(gaps[order]) <= max_waste * floor
        merge[order[within]] = True
    heads = np.concatenate(([0], np.flatnonzero(~merge) + 1))
    tails = np.concatenate((heads[1:] - 1, [len(plo) - 1]))
    reads: list[Read] = []
    for a, b in zip(plo[heads].tolist(), phi[tails].tolist(), strict=True):
        reads += [Read(x, min(max_read, b - x)) for x in range(a, b, max_read)]
    return ReadPlan(reads, used, floor)


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges ``[starts[i], ends[i])`` (sorted by start) with overlapping and touching ones joined."""
    import numpy as np

    top = np.maximum.accumulate(ends)
    new = np.concatenate(([True], starts[1:] > top[:-1]))
    heads = np.flatnonzero(new)
    tails = np.concatenate((heads[1:] - 1, [len(starts) - 1]))
    return starts[heads], top[tails]


@dataclass(frozen=True)
class FilledRuns:
    """Byte runs that read each planned read whole: the original runs, cut where they cross a read's edge, and
    filler runs that send the bytes no run wants into a sink buffer. Arrays as in ``Reader.read_runs``."""

    src: np.ndarray
    length: np.ndarray
    buf: np.ndarray
    dst: np.ndarray
    read: np.ndarray
    """Which planned read each run belongs to (runs sorted by ``src``)."""
    sink: int
    """The bytes the sink buffer must hold (its longest filler run)."""


def fill_reads(
    plan: ReadPlan, src: np.ndarray, length: np.ndarray, buf: np.ndarray, dst: np.ndarray, sink: int
) -> FilledRuns:
    """Runs (sorted by ``src``, disjoint, each inside the plan's reads) cut at the reads' edges, with fillers into
    buffer ``sink`` (offset 0) for every byte of a read that no run covers: each read becomes one stretch of
    consecutive runs, one ``preadv`` per up to ``IOV_MAX`` of them."""
    import numpy as np

    r_lo = np.array([r.offset for r in plan.reads], dtype=np.int64)
    r_hi = np.array([r.end for r in plan.reads], dtype=np.int64)
    src, length, buf, dst = (np.asarray(x, dtype=np.int64) for x in (src, length, buf, dst))
    # cut runs at read edges: a run may span several reads (a long run cut into MAX_READ pieces)
    first = np.searchsorted(r_lo, src, side="right") - 1
    last = np.searchsorted(r_lo, src + length - 1, side="right") - 1
    if bool((first < 0).any()) or bool((src + length > r_hi[np.maximum(last, 0)]).any()):
        raise ValueError("a byte run lies outside the planned reads")
    counts = last - first + 1
    owner = np.repeat(np.arange(len(src)), counts)
    which = np.repeat(first, counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    a = np.maximum(src[owner], r_lo[which])
    b = np.minimum(src[owner] + length[owner], r_hi[which])
    cut_dst = dst[owner] + (a - src[owner])
    # fillers: per read, its start and each piece's end paired with each piece's start and its end, in order
    ends_at = np.concatenate((r_lo, b))
    starts_at = np.concatenate((a, r_hi))
    read_of_end = np.concatenate((np.arange(len(r_lo)), which))
    read_of_start = np.concatenate((which, np.arange(len(r_lo))))
    e_order = np.lexsort((ends_at, read_of_end))
    s_order = np.lexsort((starts_at, read_of_start))
    hole_a, hole_b = ends_at[e_order], starts_at[s_order]
    hole_read = read_of_end[e_order]
    holes = hole_b > hole_a
    f_src, f_len, f_read = hole_a[holes], (hole_b - hole_a)[holes], hole_read[holes]
    all_src = np.concatenate((a, f_src))
    all_len = np.concatenate((b - a, f_len))
    all_buf = np.concatenate((buf[owner], np.full(len(f_src), sink, dtype=np.int64)))
    all_dst = np.concatenate((cut_dst, np.zeros(len(f_src), dtype=np.int64)))
    all_read = np.concatenate((which, f_read))
    o = np.argsort(all_src, kind="stable")
    return FilledRuns(all_src[o], all_len[o], all_buf[o], all_dst[o], all_read[o], int(f_len.max(initial=0)))
