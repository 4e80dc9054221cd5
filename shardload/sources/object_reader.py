"""Reading byte runs from object storage: :class:`ObjectReader`, the :class:`~shardload.sources.reader.Reader`
protocol over ranged GETs, and :func:`reader_for`, which picks the reader for a checkpoint file.

Runs are grouped into requests by :func:`plan_requests`, a pure function of the runs and an
:class:`~shardload.sources.objects.ObjectCost`: the caller's (``ReadOptions(object_cost=...)``), the one
``SHARDLOAD_S3_COST`` names, or the default; ``"measure"`` times a few requests to the store once instead.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import CheckpointError, ShardloadError
from ..format import input_log
from . import reader as local
from .deadlines import DEADLINES
from .objects import ObjectCost, ObjectPath, cost_from_environment

if TYPE_CHECKING:
    import numpy as np


CostChoice = ObjectCost | Literal["measure"] | None
"""A load's say in request costs: a model, ``"measure"`` (timed once per store), or None (the environment's, else
the default :class:`ObjectCost`)."""


def reader_for(path: Any, cost: CostChoice = None) -> Any:
    """The reader of a checkpoint file: an :class:`ObjectReader` (planning by ``cost``) for an object, else the
    local ``Reader``."""
    return ObjectReader(cost) if isinstance(path, ObjectPath) else local.Reader()


class ObjectReader(local.RunReader):
    """The :class:`~shardload.sources.reader.Reader` protocol over an object store: ranged GETs, concurrently.

    It cannot map files (``can_map`` is False), so the transfer reads every run; ``threads`` is how many read
    jobs the transfer should keep going at once. ``cost`` plans the requests (:data:`CostChoice`; None:
    ``SHARDLOAD_S3_COST``, read here, else the default).
    """

    threads = 8

    def __init__(self, cost: CostChoice = None) -> None:
        if not (cost is None or cost == "measure" or isinstance(cost, ObjectCost)):
            raise ShardloadError(f'object_cost must be an ObjectCost, "measure" or None, got {cost!r}')
        choice = cost_from_environment() if cost is None else cost
        self._cost: ObjectCost | None = ObjectCost() if choice is None else None if choice == "measure" else choice
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()  # set when the load stops (abandon)
        self._lock = threading.Lock()
        self.log = input_log.current()
        """The load this reader serves (made on its thread): its worker threads check each answer's version there."""

    def cost(self, path: ObjectPath) -> ObjectCost:
        """The request cost this reader plans by (a measured one: the store's, measured on its first object read)."""
        cost = self._cost
        return cost if cost is not None else path.store.measured_cost(path.key)

    def _executor(self, concurrency: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="shardload-get")
            return self._pool

    def no_readahead(self, path: Any) -> None:
        """Nothing to do: every request fetches exactly its range."""

    def prefetch(self, path: Any, starts: Sequence[int], ends: Sequence[int]) -> None:
        """Nothing to do: reads are issued concurrently when they are asked for."""

    def read_runs(
        self,
        path: Any,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        buffers: Sequence[Any],
        *,
        populate: bool = False,
    ) -> None:
        """Copy run i: ``length[i]`` bytes at object offset ``src[i]`` to byte ``dst[i]`` of ``buffers[buf[i]]``.

        Any set of runs is read right: unsorted, overlapping or repeated sources (the same bytes for several
        ranks), destinations interleaved between buffers. Runs are grouped into ranged requests
        (:func:`plan_requests`), fetched concurrently; a response whose bytes each go to one place is written
        straight into the destinations, one whose bytes several runs share is fetched once and copied out.
        """
        if not isinstance(path, ObjectPath):
            raise CheckpointError("an object-store reader was given a local file", file=str(path))
        n = len(src)
        if n == 0:
            return
        local.check_destinations(length, buf, dst, buffers)
        views = [local.buffer_view(t) for t in buffers]
        src_l, len_l, buf_l, dst_l = src.tolist(), length.tolist(), buf.tolist(), dst.tolist()
        cost = self.cost(path)
        requests = plan_requests(src_l, len_l, cost)

        def fetch(request: Request) -> None:
            # every answer must be the version whose header the load parsed; the load may stop meanwhile
            with input_log.using(self.log), DEADLINES.serving(self._stop):
                _fetch(request)

        def _fetch(request: Request) -> None:
            lo, hi = request.start, request.end
            pieces = [
                Piece(max(src_l[i], lo), min(src_l[i] + len_l[i], hi), buf_l[i], dst_l[i] - src_l[i])
                for i in request.runs
            ]
            if all(b.lo >= a.hi for a, b in itertools.pairwise(pieces)):
                _stream(path, request, pieces, views)
            else:  # some bytes go to several places: fetch the range once, then copy each run's part out
                whole = memoryview(bytearray(request.end - request.start))
                path.store.read_into(path.key, request.start, [whole])
                for p in pieces:
                    at = p.lo + p.shift
                    views[p.buf][at : at + p.hi - p.lo] = whole[p.lo - request.start : p.hi - request.start]

        if len(requests) == 1:
            fetch(requests[0])
        else:
            list(self._executor(cost.concurrency).map(fetch, requests))
        if local._count is not None:
            local._count.add(path, sum(len_l), len(requests), sum(r.end - r.start for r in requests))

    def abandon(self) -> None:
        """The load stops: every request in flight is cut off and none is retried or started."""
        DEADLINES.stop(self._stop)

    def close(self) -> None:
        """Stop the request pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class Request:
    """One ranged GET: object bytes ``[start, end)``, and the runs (indices, by source offset) it carries bytes of."""

    start: int
    end: int
    runs: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """The part of one run a request carries: object bytes ``[lo, hi)``, which land at byte ``lo + shift`` of
    destination buffer ``buf``."""

    lo: int
    hi: int
    buf: int
    shift: int


def _stream(path: ObjectPath, request: Request, pieces: list[Piece], views: list[memoryview]) -> None:
    """Read ``request`` straight into its pieces' destinations (pieces disjoint and in source order); the gap
    bytes between them go to one scratch buffer and are dropped."""
    parts: list[memoryview] = []
    scratch: memoryview | None = None
    at = request.start
    for p in pieces:
        if p.lo > at:
            if scratch is None or len(scratch) < p.lo - at:
                scratch = memoryview(bytearray(max(p.lo - at, 64 << 10)))
            parts.append(scratch[: p.lo - at])
        parts.append(views[p.buf][p.lo + p.shift : p.hi + p.shift])
        at = p.hi
    path.store.read_into(path.key, request.start, parts)


def plan_requests(src: Sequence[int], length: Sequence[int], cost: ObjectCost) -> list[Request]:
    """Group byte runs (in any order, overlapping or not) into ranged requests that carry every run's bytes.

    The bytes the runs cover are cut into requests: a stretch longer than ``cost.request_bytes`` is split over
    several, and the next stretch joins a request when the gap before it is one ``cost`` says to fetch
    (:meth:`ObjectCost.fetches`) and the request stays within ``request_bytes``. Each request then lists every
    run it carries bytes of, so bytes several runs share are fetched once and a run that spans several requests
    gets its part from each.
    """
    request_bytes = cost.request_bytes
    order = sorted(range(len(src)), key=src.__getitem__)
    spans: list[list[int]] = []  # the union of the runs' bytes, as sorted, separated [start, end) stretches
    for i in order:
        a, e = src[i], src[i] + length[i]
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], e)
        elif e > a:
            spans.append([a, e])
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(spans):
        a, e = spans[i]
        full = (e - a) // request_bytes * request_bytes if e - a > request_bytes else 0
        ranges.extend((lo, lo + request_bytes) for lo in range(a, a + full, request_bytes))
        if a + full == e:  # split into whole requests; nothing left over
            i += 1
            continue
        start, end = a + full, e
        j = i + 1
        while j < len(spans):
            b, f = spans[j]
            if f - start > request_bytes or not cost.fetches(b - end):
                break
            end = f
            j += 1
        ranges.append((start, end))
        i = j
    starts = [lo for lo, _ in ranges]
    members: list[list[int]] = [[] for _ in ranges]
    for i in order:
        a, e = src[i], src[i] + length[i]
        k = max(0, bisect.bisect_right(starts, a) - 1)
        while k < len(ranges) and ranges[k][0] < e:
            if ranges[k][1] > a:
                members[k].append(i)
            k += 1
    return [Request(lo, hi, tuple(m)) for (lo, hi), m in zip(ranges, members, strict=True)]
