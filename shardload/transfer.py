"""Moving tensor bytes from checkpoint files into per-rank tensors on their devices.

CPU tensors are read into directly: a parameter's byte runs are scattered by ``preadv`` into every
requested rank's tensor, in jobs of ``JOB_BYTES`` spread over a small thread pool, and bytes that
several ranks hold (replicated parts) are read once and copied. Device tensors are filled through a
few reusable staging buffers (page-locked for CUDA): a thread reads a chunk into a free buffer set,
queues non-blocking copies on a side stream per device, and the set is reused once the event
recorded behind those copies has completed, so reading overlaps copying.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dtypes import to_torch
from .reader import Reader

if TYPE_CHECKING:
    import torch

    from .checkpoint import TensorInfo
    from .plan import ParamPlan
    from .runs import Copies, Runs

JOB_BYTES = 8 << 20
"""Bytes per thread-pool read job."""
STAGE_SET_BYTES = 32 << 20
"""Bytes per staging set: one buffer per destination tensor, of ``STAGE_CHUNK_LIMITS`` bytes each."""
STAGE_CHUNK_LIMITS = (1 << 20, 16 << 20)
READ_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Reader threads: page-cache copies scale with cores until memory bandwidth is the bound."""


class Transfer:
    """Start reads of parameters into tensors; :meth:`wait` finishes them. One per load.

    ``threads=0`` reads synchronously in the calling thread. ``staged`` routes CPU destinations
    through the staging buffers too (tests compare that path against the direct one).
    """

    def __init__(self, reader: Reader, *, threads: int | None = None, staged: bool = False) -> None:
        self.reader = reader
        self.threads = READ_THREADS if threads is None else threads
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardload-read") if self.threads else None
        self.stage_cpu = staged
        self.futures: list[Future[None]] = []
        self.copies: list[tuple[Copies, list[torch.Tensor]]] = []
        self.staging: _Staging | None = None

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.pool is None:
            fn()
        else:
            self.futures.append(self.pool.submit(fn))

    def param(self, plan: ParamPlan, ranks: Sequence[int], devices: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """``plan``'s tensors for ``ranks`` (rank ``ranks[k]`` on ``devices[k]``, default CPU), being filled."""
        import torch

        from .runs import param_runs

        devs = [torch.device("cpu")] * len(ranks) if devices is None else [torch.device(d) for d in devices]
        runs = param_runs(plan, ranks)
        if runs is None:  # a compute step: read the tensor whole, run the steps, split
            from .execute import run_steps

            full = torch.empty(plan.source.shape, dtype=to_torch(plan.source.dtype))
            self.reader.read_tensor(plan.source.file, plan.source.offset, full)
            out = run_steps(plan, full)
            return [out[r].to(d, copy=True, memory_format=torch.contiguous_format) for r, d in zip(ranks, devs)]  # noqa: B905
        dests = [torch.empty(plan.shape, dtype=to_torch(plan.dtype), device=d) for d in devs]
        self.fill(plan.source.file, runs, dests)
        return dests

    def tensors(self, infos: Sequence[TensorInfo], device: Any) -> list[torch.Tensor]:
        """Whole stored tensors of one file on ``device``, being filled (neighbours share a ``preadv``)."""
        import numpy as np
        import torch

        from .runs import Runs

        dests = [torch.empty(t.shape, dtype=to_torch(t.dtype), device=device) for t in infos]
        keep = [k for k, t in enumerate(infos) if t.nbytes]
        if keep:
            runs = Runs(
                np.array([infos[k].offset for k in keep], dtype=np.int64),
                np.array([infos[k].nbytes for k in keep], dtype=np.int64),
                np.array(keep, dtype=np.int64),
                np.zeros(len(keep), dtype=np.int64),
            )
            self.fill(infos[keep[0]].file, runs.take(np.argsort(runs.src, kind="stable")), dests)
        return dests

    def fill(self, path: Path, runs: Runs, dests: list[torch.Tensor]) -> None:
        """Start copying ``runs`` (sorted by file offset) of ``path`` into ``dests``; CPU directly, others staged."""
        import numpy as np

        on_cpu = np.array([t.device.type == "cpu" and not self.stage_cpu for t in dests])
        direct = on_cpu[runs.buf] if len(runs) else np.zeros(0, dtype=bool)
        if direct.all():
            self._direct(path, runs, dests)
        elif not direct.any():
            self._staged(path, runs, dests)
        else:
            self._direct(path, runs.take(direct), dests)
            self._staged(path, runs.take(~direct), dests)

    def _direct(self, path: Path, runs: Runs, dests: list[torch.Tensor]) -> None:
        from .runs import dedupe, jobs, split

        reads, copies = dedupe(runs)
        reads = split(reads, JOB_BYTES)
        for part in jobs(reads, JOB_BYTES):
            r = reads.take(part)
            self._submit(lambda r=r: self.reader.read_runs(path, r.src, r.length, r.buf, r.dst, dests))
        if len(copies):
            self.copies.append((copies, dests))

    def _staged(self, path: Path, runs: Runs, dests: list[torch.Tensor]) -> None:
        from .runs import chunks

        if self.staging is None or self.staging.nbuf < len(dests):
            if self.staging is not None:
                self.wait()
            pin = any(t.device.type == "cuda" for t in dests)
            low, high = STAGE_CHUNK_LIMITS
            chunk = min(high, max(low, STAGE_SET_BYTES // len(dests)))
            self.staging = _Staging(len(dests), chunk, max(2, self.threads + 1), pin=pin)
        staging = self.staging
        chunk = staging.chunk
        sizes = [t.numel() * t.element_size() for t in dests]
        for k, part in chunks(runs, chunk):
            lo = k * chunk
            which = sorted(set(part.buf.tolist()))

            def job(part: Runs = part, lo: int = lo, which: list[int] = which) -> None:
                bufs = staging.acquire()
                try:
                    self.reader.read_runs(path, part.src, part.length, part.buf, part.dst, bufs)
                    for b in which:
                        staging.upload(bufs, b, dests[b], lo, min(lo + chunk, sizes[b]))
                finally:
                    staging.release(bufs)

            self._submit(job)

    def wait(self) -> None:
        """Finish every started read, copy and device upload (re-raising the first failure)."""
        futures, self.futures = self.futures, []
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()
            raise
        copies, self.copies = self.copies, []
        for c, dests in copies:
            _apply_copies(c, dests)
        if self.staging is not None:
            self.staging.sync()

    def close(self) -> None:
        """Stop the pool: jobs not started are cancelled, running ones finish."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.staging is not None:
            self.staging.sync()

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _apply_copies(copies: Copies, dests: list[torch.Tensor]) -> None:
    """Copy bytes one rank's tensor already holds into another's (replicated parts, read once)."""
    import torch

    flat = [t.reshape(-1).view(torch.uint8) for t in dests]
    rows = zip(
        copies.from_buf.tolist(), copies.from_dst.tolist(), copies.buf.tolist(), copies.dst.tolist(),
        copies.length.tolist(), strict=True,
    )  # fmt: skip
    for a, a_off, b, b_off, n in rows:
        flat[b][b_off : b_off + n].copy_(flat[a][a_off : a_off + n])


class _Staging:
    """Sets of host buffers (``nbuf`` buffers of ``chunk`` bytes each) cycled between reads and uploads."""

    def __init__(self, nbuf: int, chunk: int, depth: int, *, pin: bool) -> None:
        import torch

        self.nbuf, self.chunk, self.pin = nbuf, chunk, pin
        self.free: queue.SimpleQueue[list[torch.Tensor]] = queue.SimpleQueue()
        self.events: dict[int, list[Any]] = {}
        self.streams: dict[Any, Any] = {}
        self.lock = threading.Lock()
        for _ in range(depth):
            self.free.put([torch.empty(chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(nbuf)])

    def acquire(self) -> list[torch.Tensor]:
        """A free buffer set whose earlier uploads have completed."""
        bufs = self.free.get()
        with self.lock:
            events = self.events.pop(id(bufs), [])
        for event in events:
            event.synchronize()
        return bufs

    def release(self, bufs: list[torch.Tensor]) -> None:
        """Hand a buffer set back (its uploads may still be in flight: their events guard reuse)."""
        self.free.put(bufs)

    def _stream(self, device: Any) -> Any:
        import torch

        with self.lock:
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
            return stream

    def upload(self, bufs: list[torch.Tensor], k: int, dest: torch.Tensor, lo: int, hi: int) -> None:
        """Copy bytes ``[0, hi - lo)`` of ``bufs[k]`` to bytes ``[lo, hi)`` of ``dest``."""
        import torch

        dst = dest.reshape(-1).view(torch.uint8)[lo:hi]
        src = bufs[k][: hi - lo]
        if dst.device.type == "cuda" and self.pin:
            stream = self._stream(dst.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            with self.lock:
                self.events.setdefault(id(bufs), []).append(event)
        else:
            dst.copy_(src)

    def sync(self) -> None:
        """Wait for every upload issued so far."""
        for stream in self.streams.values():
            stream.synchronize()
