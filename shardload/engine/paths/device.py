"""The device path: a rank's bytes reach a GPU as the page-aligned spans of the file that hold them, each read by
one ``preadv`` into a page-locked buffer and uploaded in one copy; the device then cuts each span into the rank's
tensors with strided copies, so the CPU never gathers a column slice row by row. Where a span's gaps are wide (a
rank's column slice) it is packed: the same ``preadv`` puts the pieces the load takes side by side and the gaps in
a sink, so the buffer and the upload carry only those; a load onto several GPUs packs each device's pieces
together, so each uploads its own bytes alone. A span whose part is a few contiguous stretches of tensors
(replicated and row-split tensors, a rank's packed column slice) is uploaded straight into them.

A parameter structure's spans and cuts are computed once (:func:`span_plan`, pure) and shared by every layer. The
same path runs with a CPU "device" in tests (``data_path_for(..., staged=True)``): the upload is then a host copy
into a scratch buffer and the cuts are CPU strided copies. :class:`DeviceTally` counts what moved.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...sources.reader import PAGE, Reader
from ..staging import ready_event
from .base import fill_padding
from .host import HostPath

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ...planning.plan import ParamPlan
    from ...planning.runs import Runs
    from ...sources.read_plan import IoModel
    from ..read_schedule import StructureKey
    from ..staging import StagingBuffers

STRAIGHT_CUTS = 4
"""A span whose cuts are all contiguous, and at most this many, is uploaded piece by piece straight into its tensors;
any other span is uploaded whole into a device scratch buffer and cut there."""
ALIGN = 16
"""A span's bytes sit in a device scratch buffer at the offset that keeps their alignment in the stored tensor
modulo this many bytes, so cuts move whole words whatever the tensor's offset in its file (a TVM cache's)."""
PACK_GAP = 512
"""A span whose bytes no rank of the load takes (onto several devices: no rank of that device) average at least this
many per piece it does take is packed: its one ``preadv`` still reads from its first to its last used byte, but the
pieces land side by side in the staging buffer (each kept at its alignment modulo :data:`ALIGN`; each device's
together) and the gaps in a per-thread sink as long as the longest gap, so the staging buffer and the upload carry
the load's bytes alone (a rank's column slice at N = 8: an eighth of the pages it lies on, and one stretch of its
tensor, uploaded straight). The kernel still copies every gap byte
(into the sink); the price is two iovecs a piece, which this 512 keeps small beside the gap's bytes (not measured
on a GPU host)."""
PACK_JOIN = 8
"""Consecutive packed reads joined into one span cover at most this many staging buffers' worth of the file: at
N = 8 a rank's column slice fills a buffer from eight, and a sparser layout still gives the reader threads several
spans to share (each span one thread's reads, back to back, before its upload)."""
SPAN_OVER_READ = 2.0
"""A single rank whose spans of a parameter would read more than this many times its bytes (a column slice at
N = 8 reads the whole tensor: gaps narrower than a span's cost are read through) copies them out of a mapping
instead, into the staging buffers with strided copies, one upload per buffer (:class:`HostPath`'s way; from cold
storage only the pages they lie on). On an H200 host, rank 0 of 8 of a 1 GiB model from the page cache took
0.062 s through spans alone against 0.037 s through the mapping alone (docs/benchmarks.md, session 27)."""
SPAN_S = 50e-6
"""What one more span costs besides its request to storage: a read call, an upload, its cuts, and the Python that
issues them (tens of microseconds each). A gap between a rank's pages is read through when reading it costs less
than a span and a request (the file system's measured :class:`~shardload.sources.read_plan.IoModel`)."""


@dataclass(frozen=True)
class Cuts:
    """Strided copies out of one span, as parallel int64 arrays: copy ``k`` moves ``count[k]`` blocks of
    ``length[k]`` bytes from byte ``src[k] + i * src_step[k]`` of the span to byte ``dst[k] + i * dst_step[k]`` of
    destination tensor ``tensor[k]``."""

    tensor: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    count: np.ndarray
    src_step: np.ndarray
    dst_step: np.ndarray

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True)
class Part:
    """What one device takes of a span: with ``straight``, its cuts (offsets in the span) copied from the staging
    buffer into its tensors; else bytes ``[lo, hi)`` of the span uploaded to byte ``at`` of a scratch buffer on the
    device (``at`` keeps the bytes' alignment in the stored tensor, modulo :data:`ALIGN`) and its cuts (offsets in
    the scratch buffer) copied there."""

    device: int
    """Which of the load's devices (in order of first appearance among the destinations)."""
    lo: int
    hi: int
    at: int
    cuts: Cuts
    straight: bool


@dataclass(frozen=True)
class Span:
    """One read: the pages ``[offset, offset + length)`` of the stored tensor (offsets relative to its first byte)
    read once into a staging buffer, and what each device takes of it."""

    offset: int
    length: int
    parts: tuple[Part, ...]
    read: Runs
    """The read as runs (offsets relative to :attr:`offset`) of one stretch of the file: into buffer 0, the staging
    buffer, and (a packed span) buffer 1, a sink of :attr:`sink` bytes for the gaps."""
    used: Runs
    """The bytes the cuts take (sorted, disjoint) and where the staging buffer holds them: all that a reader which
    does not read through gaps (a checking reader, object storage) reads of the span."""
    sink: int = 0
    """The longest gap a packed span reads into the sink (0: no gap read through)."""
    packed: bool = False
    """Whether the used bytes sit apart from their own offsets in the staging buffer (side by side, each device's
    together); else every byte of the read at its own offset."""


@dataclass(frozen=True)
class SpanPlan:
    """A parameter structure's spans for the ranks of a load (on one device or several), and the bytes they move."""

    spans: list[Span]
    used: int
    """Bytes the ranks' runs copy (each rank's bytes once per rank)."""
    moved: int
    """Bytes the spans read from the file (gaps read through included)."""


@dataclass
class DeviceTally:
    """What device-path loads moved inside :func:`count_device`: spans read (the bytes the reads moved, and those
    of them that reached the staging buffers), uploads, device cuts, and the bytes delivered into tensors."""

    spans: int = 0
    packed: int = 0
    """Spans read packed (gaps into the sink)."""
    read_bytes: int = 0
    staged_bytes: int = 0
    uploads: int = 0
    upload_bytes: int = 0
    cuts: int = 0
    delivered: int = 0

    def add(
        self,
        spans: int,
        read: int,
        staged: int,
        uploads: int,
        uploaded: int,
        cuts: int,
        delivered: int,
        packed: int = 0,
    ) -> None:
        """Record one span's work."""
        with _tally_lock:
            self.spans += spans
            self.packed += packed
            self.read_bytes += read
            self.staged_bytes += staged
            self.uploads += uploads
            self.upload_bytes += uploaded
            self.cuts += cuts
            self.delivered += delivered


_tally: DeviceTally | None = None
_tally_lock = threading.Lock()


@contextmanager
def count_device() -> Iterator[DeviceTally]:
    """Count what every device-path load inside this block moves (all threads)."""
    global _tally
    outer, _tally = _tally, DeviceTally()
    try:
        yield _tally
    finally:
        _tally = outer


def span_plan(
    runs: Runs,
    limit: int,
    model: IoModel | None,
    *,
    max_read: int,
    max_waste: float,
    skew: int,
    devices: Sequence[int] | None = None,
) -> SpanPlan:
    """The spans that read ``runs`` (offsets relative to a stored tensor of ``limit`` bytes starting ``skew`` bytes
    into a page) once for every device: the runs' pages merged across gaps cheaper to read than one more span
    (:data:`SPAN_S`) and one more request (``model``; None: no request cost) within ``max_waste`` of the page floor,
    cut at ``max_read`` bytes and at the tensor's edges. Per span and device (``devices[k]``: the device of runs
    into buffer ``k``; None: one device), the part of it the device takes, its runs folded into as few strided
    cuts as their layout allows."""
    import numpy as np

    from ...sources.read_plan import IoModel, plan_reads

    order = np.argsort(runs.src, kind="stable")
    src, length, buf, dst = runs.src[order], runs.length[order], runs.buf[order], runs.dst[order]
    model = IoModel(request_s=SPAN_S + (0.0 if model is None else model.request_s),
                    bandwidth=1e9 if model is None else model.bandwidth)  # fmt: skip
    reads = plan_reads(src + skew, src + length + skew, model, max_waste=max_waste, max_read=max_read,
                       limit=limit + skew).reads  # fmt: skip
    lo = np.maximum(np.array([r.offset for r in reads], dtype=np.int64) - skew, 0)  # no byte before the tensor
    hi = np.array([r.end for r in reads], dtype=np.int64) - skew
    # runs cut at the reads' edges (a long run spans several reads)
    first = np.searchsorted(lo, src, side="right") - 1
    last = np.searchsorted(lo, src + length - 1, side="right") - 1
    counts = last - first + 1
    owner = np.repeat(np.arange(len(src)), counts)
    which = np.repeat(first, counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    a = np.maximum(src[owner], lo[which])
    b = np.minimum(src[owner] + length[owner], hi[which])
    cut_len, cut_buf, cut_dst, cut_src = b - a, buf[owner], dst[owner] + (a - src[owner]), a - lo[which]
    order = np.lexsort((cut_src, cut_buf, which))  # per read, per tensor, by offset: how cuts fold
    which, cut_len, cut_buf, cut_dst, cut_src = (x[order] for x in (which, cut_len, cut_buf, cut_dst, cut_src))
    # one entry per destination: the last ranks may have no runs at all (a padded vocabulary's padding alone)
    device_of = np.zeros(max(int(buf.max()) + 1 if len(buf) else 1, len(devices or ())), dtype=np.int64)
    if devices is not None:
        device_of[: len(devices)] = devices
    cut_dev = device_of[cut_buf]
    bounds = np.searchsorted(which, np.arange(len(lo) + 1), side="left").tolist()
    spans = []
    for k0, k1, packing in _groups(lo, hi, bounds, cut_src, cut_len, cut_dev, max_read):
        s = slice(bounds[k0], bounds[k1 + 1])
        rel = cut_src[s] + (lo[which[s]] - lo[k0])  # offsets in the span
        order = np.lexsort((rel, cut_buf[s]))  # per tensor, by offset: how cuts fold
        rel, c_buf, c_dst, c_len, c_dev = (x[order] for x in (rel, cut_buf[s], cut_dst[s], cut_len[s], cut_dev[s]))
        used, read, sink, packed = _span_read(rel, c_len, packing)
        at_staged = rel
        if packed:  # each cut's bytes where the staging buffer holds them
            j = np.searchsorted(used.src, rel, side="right") - 1
            at_staged = used.dst[j] + (rel - used.src[j])
        parts = []
        for g in np.unique(c_dev).tolist():
            sel = np.flatnonzero(c_dev == g)
            b, c, d, n = c_buf[sel], at_staged[sel], c_dst[sel], c_len[sel]
            cuts = strided_cuts(*_joined(b, c, d, n))
            if len(cuts) <= STRAIGHT_CUTS and bool((cuts.count == 1).all()):
                parts.append(Part(g, 0, 0, 0, cuts, True))
                continue
            first = int(np.argmin(c))
            start, end = int(c[first]), int((c + n).max())
            at = (int(lo[k0]) + int(rel[sel][first])) % ALIGN  # its first byte's alignment in the stored tensor
            # offsets in the scratch buffer: folding does not depend on where the runs start, so shift the folds
            parts.append(Part(g, start, end, at, replace(cuts, src=cuts.src - start + at), False))
        spans.append(Span(int(lo[k0]), int(hi[k1] - lo[k0]), tuple(parts), read, used, sink, packed))
    return SpanPlan(spans, int(length.sum()), sum(int(span.read.length.sum()) for span in spans))


def _groups(
    lo: np.ndarray,
    hi: np.ndarray,
    bounds: list[int],
    src: np.ndarray,
    length: np.ndarray,
    dev: np.ndarray,
    max_read: int,
) -> Iterator[tuple[int, int, tuple[np.ndarray, np.ndarray, np.ndarray] | None]]:
    """The reads ``[k0, k1]`` each span reads, skipping reads of a gap alone: one read, or consecutive reads that
    each pack and go on where the last ended, as long as what they stage together fits one staging buffer and they
    cover at most :data:`PACK_JOIN` buffers' worth of the file (a packed span stages only its pieces: at N = 8 a
    column slice's span reads eight buffers' worth of the file); with each, its :func:`_packing` (offsets from its
    first read's start)."""
    import numpy as np

    def cuts(k0: int, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = slice(bounds[k0], bounds[k1 + 1])
        at = np.repeat(lo[k0 : k1 + 1] - lo[k0], np.diff(bounds[k0 : k1 + 2]))
        return src[s] + at, length[s], dev[s]

    alone: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray] | None] = {}

    def packing(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if k not in alone:
            alone[k] = _packing(*cuts(k, k), pack=None, limit=max_read)
        return alone[k]

    one = _one_device(dev)  # what joined reads stage adds up
    k, n = 0, len(lo)
    while k < n:
        if bounds[k] == bounds[k + 1]:
            k += 1
            continue  # a stretch of a gap read through (cut at max_read): nothing to read
        k1, packed = k, packing(k)
        if packed is not None:
            staged, last = _staged(packed), int(lo[k] + packed[1][-1])
            while k1 + 1 < n and lo[k1 + 1] == hi[k1] and bounds[k1 + 1] < bounds[k1 + 2]:
                nxt = packing(k1 + 1) if hi[k1 + 1] - lo[k] <= PACK_JOIN * max_read else None
                if nxt is None:
                    break
                if one:  # the next read's pieces after these, each at its alignment: no need to lay them out again
                    more = staged + (int(lo[k1 + 1] + nxt[0][0]) - last) % ALIGN + _staged(nxt)
                    if more > max_read:
                        break
                    k1, staged, last = k1 + 1, more, int(lo[k1 + 1] + nxt[1][-1])
                    continue
                joined = _packing(*cuts(k, k1 + 1), pack=True, limit=max_read)
                if joined is None:  # its pieces fill the buffer
                    break
                k1, packed = k1 + 1, joined
            if one and k1 > k:
                packed = _packing(*cuts(k, k1), pack=True, limit=max_read)
                if packed is None:  # not reached (what it stages was added up exactly): read alone, never past
                    k1, packed = k, packing(k)
        yield k, k1, packed
        alone.pop(k, None)
        k = k1 + 1


def _one_device(devices: np.ndarray) -> bool:
    """Whether every piece (of a read, of a span) goes to one device."""
    return len(devices) == 0 or bool((devices == devices[0]).all())


def _staged(packing: tuple[np.ndarray, np.ndarray, np.ndarray]) -> int:
    """Bytes a :func:`_packing` puts in the staging buffer (to the end of its last piece there)."""
    starts, ends, at = packing
    return int((at + ends - starts).max())


def _packed_at(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Where packed pieces ``[starts, ends)`` (sorted, disjoint) go in the staging buffer: each gap dropped but for
    its remainder modulo :data:`ALIGN`, so every piece keeps its alignment relative to the first (cuts then move
    whole words; pieces of whole words, a column slice's rows, end up side by side)."""
    import numpy as np

    dropped = np.zeros(len(starts), dtype=np.int64)
    dropped[1:] = (starts[1:] - ends[:-1]) // ALIGN * ALIGN
    return starts - starts[0] - np.cumsum(dropped)


def _pieces(src: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``[src, src + length)`` (any order, overlapping where ranks share bytes) as the sorted starts and
    ends of the disjoint pieces they cover."""
    import numpy as np

    from ...sources.read_plan import union

    order = np.argsort(src, kind="stable")
    return union(src[order], (src + length)[order])


def _packing(
    src: np.ndarray, length: np.ndarray, dev: np.ndarray, *, pack: bool | None, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """How a read of cuts ``[src, src + length)`` onto devices ``dev`` is packed: its pieces (sorted, disjoint
    starts and ends) and where each goes in the staging buffer; None where it is not packed. Each device's pieces
    are packed side by side (:func:`_packed_at`), one device's after another's, so each uploads only its own bytes
    (the ranks of a load onto several GPUs take a column slice's rows in turn); where devices share bytes, the
    pieces of all of them together. Packed (``pack``; None: where the gaps within each device's stretch of the
    file, its own pieces aside, average at least :data:`PACK_GAP` bytes a piece) if it fits ``limit`` bytes."""
    import numpy as np

    starts, ends, owner, foreign = _apart(src, length, dev)
    order = np.argsort(starts, kind="stable")
    if bool((starts[order][1:] >= ends[order][:-1]).all()):  # no byte shared by two devices
        if pack or (foreign > 0 and foreign >= PACK_GAP * len(starts)):
            at = np.empty(len(starts), dtype=np.int64)
            heads = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1]))).tolist()
            top, first = 0, int(starts.min())
            for h0, h1 in zip(heads, [*heads[1:], len(starts)], strict=True):  # a device's pieces, side by side
                top += (int(starts[h0]) - first - top) % ALIGN  # each at its alignment to the span's first piece
                at[h0:h1] = top + _packed_at(starts[h0:h1], ends[h0:h1])
                top = int(at[h1 - 1] + ends[h1 - 1] - starts[h1 - 1])
            if top <= limit:
                return starts[order], ends[order], at[order]
        if _one_device(owner):
            return None  # one device: the pieces below are these, weighed already
    starts, ends = _pieces(src, length)
    gaps = int((starts[1:] - ends[:-1]).sum())
    if len(starts) > 1 and (pack or gaps >= PACK_GAP * len(starts)):
        at = _packed_at(starts, ends)
        if int(at[-1] + ends[-1] - starts[-1]) <= limit:
            return starts, ends, at
    return None


def _apart(src: np.ndarray, length: np.ndarray, dev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Each device's pieces of cuts ``[src, src + length)`` (``dev``: each cut's device) by device, then offset: their
    starts, ends and devices, and the bytes between consecutive pieces of one device (what it would upload beside
    its own, were its stretch uploaded whole)."""
    import numpy as np

    from ...sources.read_plan import union

    if _one_device(dev):  # its pieces, the gaps between them
        starts, ends = _pieces(src, length)
        owner = np.full(len(starts), dev[0] if len(dev) else 0, dtype=np.int64)
        return starts, ends, owner, int((starts[1:] - ends[:-1]).sum())
    big = int((src + length).max()) + 1  # each device's offsets in a range of their own: one union for all
    key = src + dev * big
    order = np.argsort(key, kind="stable")
    starts, ends = union(key[order], (key + length)[order])
    owner = starts // big
    starts, ends = starts - owner * big, ends - owner * big
    same = owner[1:] == owner[:-1]
    return starts, ends, owner, int((starts[1:] - ends[:-1])[same].sum())


def _span_read(
    src: np.ndarray, length: np.ndarray, packing: tuple[np.ndarray, np.ndarray, np.ndarray] | None
) -> tuple[Runs, Runs, int, bool]:
    """A span's used bytes (its cuts' ``[src, src + length)`` as sorted disjoint runs, and where the staging buffer
    holds them), the runs of its one read, its sink's size and whether it is packed: with its ``packing``
    (:func:`_packing`), pieces where that puts them and gaps into the sink; else its first to last used byte, each
    at its own offset."""
    import numpy as np

    from ...planning.runs import Runs

    if packing is not None:
        starts, ends, at = packing
        gap = starts[1:] - ends[:-1]
        holes = np.flatnonzero(gap > 0)  # devices' pieces that touch read on with no gap between them
        n = len(starts) + len(holes)
        where = np.arange(len(starts)) + np.searchsorted(holes, np.arange(len(starts)), side="left")
        read = Runs(np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.ones(n, dtype=np.int64),
                    np.zeros(n, dtype=np.int64))  # fmt: skip
        read.src[where], read.length[where], read.buf[where], read.dst[where] = starts, ends - starts, 0, at
        gaps = where[holes] + 1
        read.src[gaps], read.length[gaps] = ends[holes], gap[holes]
        zero = np.zeros(len(starts), dtype=np.int64)
        return Runs(starts, ends - starts, zero, at), read, int(gap[holes].max()) if len(holes) else 0, True
    starts, ends = _pieces(src, length)
    zero = np.zeros(len(starts), dtype=np.int64)
    one = np.ones(1, dtype=np.int64)
    first, last = int(starts[0]), int(ends[-1])
    whole = Runs(first * one, (last - first) * one, 0 * one, first * one)
    return Runs(starts, ends - starts, zero, starts), whole, 0, False


def _joined(buf: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs (sorted by buffer, then source) with each run that goes on where the previous one ends, in source and
    destination alike, joined to it (a rank's pieces of a packed span are one run)."""
    import numpy as np

    if len(src) < 2:
        return buf, src, dst, length
    goes_on = (buf[1:] == buf[:-1]) & (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    if not bool(goes_on.any()):
        return buf, src, dst, length
    heads = np.flatnonzero(np.concatenate(([True], ~goes_on)))
    sizes = np.add.reduceat(length, heads)
    return buf[heads], src[heads], dst[heads], sizes


def strided_cuts(buf: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Cuts:
    """Runs (sorted by buffer, then source offset) folded into strided copies: each buffer's runs of one length, by
    source offset, with equal, positive steps in source and destination become one copy of ``count`` blocks (rows
    of unequal pieces, a fused dim's segments along the columns, fold one copy per length; runs of one length
    whose steps alternate, a GQA k and v slice in each row, still fold only as far as a step repeats)."""
    import numpy as np

    n = len(src)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return Cuts(z, z, z, z, z, z, z)
    if n > 1 and bool((length[1:] != length[:-1]).any()):
        order = np.lexsort((src, length, buf))  # each length's runs together: they fold apart from the others'
        buf, src, dst, length = buf[order], src[order], dst[order], length[order]
    ds, dd = np.diff(src), np.diff(dst)
    link = (buf[1:] == buf[:-1]) & (length[1:] == length[:-1]) & (ds >= length[:-1]) & (dd >= length[:-1])
    # a block from run p goes on while each next step links and repeats the first: ``go[j]``, step j+1 repeats j
    go = link[1:] & link[:-1] & (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
    stops = np.flatnonzero(~go)  # the steps after which a streak of repeats ends
    starts, ends = [], []
    p = 0
    links = link.tolist()
    while p < n:
        q = p
        if p < n - 1 and links[p]:
            k = int(np.searchsorted(stops, p, side="left"))
            q = (int(stops[k]) if k < len(stops) else n - 2) + 1
        starts.append(p)
        ends.append(q)
        p = q + 1
    at = np.array(starts, dtype=np.int64)
    count = np.array(ends, dtype=np.int64) - at + 1
    src_step = np.where(count > 1, np.append(ds, 0)[at], 0)
    dst_step = np.where(count > 1, np.append(dd, 0)[at], 0)
    return Cuts(buf[at], src[at], dst[at], length[at], count, src_step, dst_step)


class DevicePath(HostPath):
    """Spans read into page-locked buffers (packed where gaps are wide), uploaded, cut on the device, for every rank
    not on the CPU (``stand_in``: CPU ranks too, for tests). A forced ``ReadOptions.strategy`` of ``map`` or
    ``read``, a compute step, a tensor of more runs than are listed and a single rank's parameter whose spans would
    read over :data:`SPAN_OVER_READ` times its bytes take the host path's ways."""

    def __init__(self, *, one_rank: bool = False, stand_in: bool = False, apart: bool = False) -> None:
        super().__init__(one_rank=one_rank)
        self.stand_in = stand_in
        self.apart = apart
        """A stand-in's destinations each on a device of their own (a load onto several GPUs, the CPU as each)."""
        self.plans: dict[tuple[StructureKey, int], SpanPlan] = {}
        self.models: dict[Path, IoModel | None] = {}
        self.scratch: dict[Any, queue.SimpleQueue[torch.Tensor]] = {}
        self.sinks = threading.local()
        """Each reader thread's sink for the gaps of packed spans."""

    def direct(self, device: torch.device) -> bool:
        """Host memory is filled in place, except in a stand-in run, where every tensor takes the device's way."""
        return device.type == "cpu" and not self.stand_in

    @property
    def span_bytes(self) -> int:
        """Bytes per span at most: the staging buffer's size in whole pages."""
        return max(PAGE, self.ctx.stage_bytes // PAGE * PAGE)

    def param(
        self,
        plan: ParamPlan,
        ranks: Sequence[int],
        devices: Sequence[torch.device],
        key: StructureKey,
        out: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor] | None:
        """``plan``'s tensors for ``ranks`` filled from spans cut on their devices, or (a CPU rank, a forced
        strategy, a compute step) the host path's way."""
        import torch

        from ...sources.dtypes import to_torch

        if self.ctx.options.strategy in ("map", "read") or any(self.direct(d) for d in devices):
            return super().param(plan, ranks, devices, key, out)
        runs = self.ctx.runs.get(plan, ranks, key)
        if runs is None:
            return super().param(plan, ranks, devices, key, out)
        source = plan.source
        dests = list(out) if out is not None else [
            torch.empty(plan.shape, dtype=to_torch(plan.dtype), device=d) for d in devices]  # fmt: skip
        for r, t in zip(ranks, dests, strict=True):
            fill_padding(plan, r, t)
        if not len(runs):
            return dests
        skew = source.offset % PAGE
        devs = [t.device for t in dests]  # with their indices ("cuda" alone means the caller's current device)
        order = devs if self.apart else list(dict.fromkeys(devs))  # the load's devices: each span read once for all
        staging = self.staging(pin=any(d.type == "cuda" for d in devs), size=self.span_bytes)  # whole pages
        pkey = (key, skew)
        if pkey not in self.plans:
            # spans read through every gap cheaper than a span: bytes over the page floor are bounded by max_waste
            # only where the caller asked for planned cold reads
            waste = self.ctx.options.max_waste if self.ctx.options.strategy == "plan" else math.inf
            where = list(range(len(devs))) if self.apart else [order.index(d) for d in devs]
            self.plans[pkey] = span_plan(runs, source.nbytes, self._model(source.file), max_read=self.span_bytes,
                                         max_waste=waste, skew=skew, devices=where)  # fmt: skip
        spans = self.plans[pkey]
        if self.strategy is not None and len(ranks) == 1 and spans.moved > SPAN_OVER_READ * spans.used:
            got = super().param(plan, ranks, devices, key, dests)  # copied out of a mapping, where it can be
            if got is not None:
                return got
        afters = [ready_event(d) for d in order]
        for span in spans.spans:
            self.ctx.submit(partial(self._span, staging, source.file, source.offset, span, order, dests, afters))
        return dests

    def _model(self, path: Path) -> IoModel | None:
        """The I/O model spans are merged by: the caller's, else the file system's (measured once), else none."""
        if self.ctx.options.io_model is not None:
            return self.ctx.options.io_model
        if path not in self.models:
            model = None
            if self.ctx.reader.can_map:
                from ...sources.io_model import io_model

                model = io_model(path)
            self.models[path] = model
        return self.models[path]

    def _span(
        self,
        staging: StagingBuffers,
        path: Path,
        offset: int,
        span: Span,
        devices: list[torch.device],
        dests: list[Any],
        afters: list[Any],
    ) -> None:
        """Read one span into a page-locked buffer, then for each device its part: uploaded and cut there."""

        buf = staging.acquire()
        try:
            reader = self.ctx.reader
            if isinstance(reader, Reader) and span.sink:  # one preadv: pieces side by side, gaps into the sink
                runs, into, more = span.read, [buf, self._sink(span.sink)], {"sink": 1}
            elif span.sink or hasattr(reader, "plan_with"):
                # a checking reader (each byte checked), or a reader of ranged requests: the bytes the cuts take
                runs, into, more = span.used, [buf], {}
            else:  # first to last used byte in one read (packed with no gap: each device's pieces together)
                runs, into, more = span.read, [buf], {}
            base = offset + span.offset
            reader.read_runs(path, runs.src + base, runs.length, runs.buf, runs.dst, into, **more)
            for part in span.parts:
                device, cuts = devices[part.device], part.cuts
                if part.straight:
                    staging.on_device(buf, device, partial(_straight, buf, cuts, dests, staging.pin),
                                      afters[part.device])  # fmt: skip
                else:
                    scratch = self._scratch(device, staging.size + ALIGN)
                    try:
                        upload = partial(_upload_and_cut, buf, part, scratch, dests, staging.pin)
                        staging.on_device(buf, device, upload, afters[part.device])
                    finally:
                        self.scratch[device].put(scratch)  # stream order: its next upload waits for these cuts
                if _tally is not None:
                    uploads, uploaded, cut = ((len(cuts), int(cuts.length.sum()), 0) if part.straight
                                              else (1, part.hi - part.lo, len(cuts)))  # fmt: skip
                    _tally.add(0, 0, 0, uploads, uploaded, cut, int((cuts.length * cuts.count).sum()))
            if _tally is not None:
                moved = int(runs.length.sum())
                staged = int(span.used.length.sum()) if span.packed else moved
                _tally.add(1, moved, staged, 0, 0, 0, 0, packed=int(span.packed))
        finally:
            staging.release(buf)

    def _sink(self, size: int) -> torch.Tensor:
        """This reader thread's sink for the gaps of packed spans, at least ``size`` bytes (the longest gap: the
        gaps are written over one another, so it stays as small as the layout allows)."""
        import torch

        sink = getattr(self.sinks, "buf", None)
        if sink is None or sink.numel() < size:
            sink = self.sinks.buf = torch.empty(max(size, 64 << 10), dtype=torch.uint8)
        return sink

    def _scratch(self, device: torch.device, size: int) -> torch.Tensor:
        """A device buffer of ``size`` bytes for one span, from this load's pool (made on first use)."""
        import torch

        pool = self.scratch.setdefault(device, queue.SimpleQueue())
        try:
            return pool.get_nowait()
        except queue.Empty:
            return torch.empty(size, dtype=torch.uint8, device=device)


def _straight(buf: torch.Tensor, cuts: Cuts, dests: list[torch.Tensor], pinned: bool) -> None:
    """Copy each contiguous cut from the page-locked buffer straight into its tensor (an upload each)."""
    import torch

    for t, s, d, n in zip(cuts.tensor.tolist(), cuts.src.tolist(), cuts.dst.tolist(), cuts.length.tolist(),
                          strict=True):  # fmt: skip
        _copy(dests[t].reshape(-1).view(torch.uint8)[d : d + n], buf[s : s + n], pinned)


def _upload_and_cut(
    buf: torch.Tensor, part: Part, scratch: torch.Tensor, dests: list[torch.Tensor], pinned: bool
) -> None:
    """Upload a device's part of a span into ``scratch`` in one copy, then cut it into the tensors on the device."""
    cuts = part.cuts
    _copy(scratch[part.at : part.at + part.hi - part.lo], buf[part.lo : part.hi], pinned)
    rows = zip(*(x.tolist() for x in (cuts.tensor, cuts.src, cuts.dst, cuts.length, cuts.count, cuts.src_step,
                                      cuts.dst_step)), strict=True)  # fmt: skip
    for t, s, d, n_, c, ss, dst_step in rows:
        dest = dests[t]
        word = _word(dest, s, d, n_, ss, dst_step)
        w = word.itemsize
        to = _flat(dest, word)
        frm = scratch.view(word)
        _copy(
            to.as_strided((c, n_ // w), (dst_step // w, 1), to.storage_offset() + d // w),
            frm.as_strided((c, n_ // w), (ss // w, 1), frm.storage_offset() + s // w),
            pinned,
        )


def _copy(dst: torch.Tensor, src: torch.Tensor, pinned: bool) -> None:
    """``dst.copy_(src)``: on a GPU queued on the current stream; with the CPU as the device (tests, benchmarks'
    stand-in) by numpy, one thread with the GIL released, as a reader thread's copies are (``copy_jobs.copy_bytes``:
    torch would start an OpenMP team per copy, fighting the reader threads for the cores)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        import numpy as np

        np.copyto(dst.numpy(), src.numpy(), casting="no")
    else:
        dst.copy_(src, non_blocking=pinned)


def _flat(dest: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """``dest``'s bytes as a flat tensor of ``word``."""
    import torch

    return dest.reshape(-1).view(torch.uint8).view(word)


def _word(dest: torch.Tensor, *sizes: int) -> torch.dtype:
    """The widest integer type dividing every offset, length and step of a cut and ``dest``'s size and address:
    a strided copy moves words, not bytes."""
    import torch

    nbytes = dest.numel() * dest.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        w = word.itemsize
        if nbytes % w == 0 and dest.data_ptr() % w == 0 and all(x % w == 0 for x in sizes):
            return word
    return torch.uint8
