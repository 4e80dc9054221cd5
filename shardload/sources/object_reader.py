"""Reading byte runs from object storage: :class:`ObjectReader`, the :class:`~shardload.sources.reader.Reader`
protocol over ranged GETs, and :func:`reader_for`, which picks the reader for a checkpoint file.

Runs are grouped into requests by :func:`plan_requests` under the limits in :mod:`shardload.sources.objects`
(``REQUEST_BYTES``, ``MERGE_GAP``, ``MAX_WASTE``, ``CONCURRENCY``; read when a load runs, so they can be tuned).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from . import objects
from . import reader as local
from .objects import ObjectPath

if TYPE_CHECKING:
    import numpy as np


def reader_for(path: Any) -> Any:
    """The reader of a checkpoint file: an :class:`ObjectReader` for an object, else the local ``Reader``."""
    return ObjectReader() if isinstance(path, ObjectPath) else local.Reader()


class ObjectReader(local.RunReader):
    """The :class:`~shardload.sources.reader.Reader` protocol over an object store: ranged GETs, concurrently.

    It cannot map files (``can_map`` is False), so the transfer reads every run; ``threads`` is how many read
    jobs the transfer should keep going at once.
    """

    threads = 8

    def __init__(self, concurrency: int | None = None) -> None:
        self.concurrency = concurrency or objects.CONCURRENCY
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="shardload-get")
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

        Runs must be sorted by ``src``. They are grouped into ranged requests (:func:`plan_requests`), fetched
        concurrently; each response is written straight into the destination bytes.
        """
        if not isinstance(path, ObjectPath):
            raise CheckpointError("an object-store reader was given a local file", file=str(path))
        n = len(src)
        if n == 0:
            return
        local.check_destinations(length, buf, dst, buffers)
        views = [local.buffer_view(t) for t in buffers]
        src_l, len_l, buf_l, dst_l = src.tolist(), length.tolist(), buf.tolist(), dst.tolist()
        requests = plan_requests(src_l, len_l)

        def fetch(request: tuple[int, int, int, int]) -> None:
            first, last, start, end = request
            parts: list[memoryview] = []
            scratch: memoryview | None = None  # one buffer all this request's gaps are read into, then dropped
            at = start
            for i in range(first, last):
                a, k = src_l[i], len_l[i]
                lo, hi = max(a, at), min(a + k, end)
                if lo > at:
                    if scratch is None or len(scratch) < lo - at:
                        scratch = memoryview(bytearray(max(lo - at, 64 << 10)))
                    parts.append(scratch[: lo - at])
                if hi > lo:
                    off = dst_l[i] + (lo - a)
                    parts.append(views[buf_l[i]][off : off + hi - lo])
                    at = hi
            path.store.read_into(path.key, start, parts)

        if len(requests) == 1:
            fetch(requests[0])
        else:
            list(self._executor().map(fetch, requests))
        if local._count is not None:
            local._count.add(path, sum(len_l), len(requests))

    def close(self) -> None:
        """Stop the request pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def plan_requests(src: Sequence[int], length: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Group sorted byte runs into ranged requests: ``(first run, end run, start byte, end byte)`` each.

    A run longer than ``objects.REQUEST_BYTES`` is split over several requests; neighbours join a request
    while it stays within ``REQUEST_BYTES``, the gap before them is at most ``MERGE_GAP``, and the gap bytes
    of the request stay within ``MAX_WASTE`` of its run bytes. Overlapping runs share their bytes.
    """
    request_bytes, merge_gap, max_waste = objects.REQUEST_BYTES, objects.MERGE_GAP, objects.MAX_WASTE
    out: list[tuple[int, int, int, int]] = []
    n = len(src)
    i = 0
    while i < n:
        a, k = src[i], length[i]
        if k > request_bytes:  # split a long run: whole requests, the tail may join what follows
            for lo in range(a, a + k - request_bytes + 1, request_bytes):
                if lo + request_bytes <= a + k:
                    out.append((i, i + 1, lo, lo + request_bytes))
            done = (k // request_bytes) * request_bytes
            if done == k:
                i += 1
                continue
            start, end, wanted, waste = a + done, a + k, k - done, 0
        else:
            start, end, wanted, waste = a, a + k, k, 0
        j = i + 1
        while j < n:
            b, m = src[j], length[j]
            gap = max(0, b - end)
            new_end = max(end, b + m)
            if new_end - start > request_bytes or gap > merge_gap or waste + gap > max_waste * (wanted + m):
                break
            waste += gap
            wanted += m
            end = new_end
            j += 1
        out.append((i, j, start, end))
        i = j
    return out
