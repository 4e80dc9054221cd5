"""The executor that moves tensor bytes from checkpoint files into per-rank tensors on their devices.

:class:`Transfer` allocates each parameter's (or stored tensor's) destinations and runs, in a small thread pool,
the jobs of one load: read schedules of ``preadv`` jobs straight into tensors and batches through staging buffers
(:mod:`.read_schedule`), and whatever the load's data path (:mod:`.paths`, chosen once per load by
:func:`~shardload.engine.paths.data_path_for`) submits for the parameters it takes its own way: copies out of a
mapping, planned cold reads, views. Bytes several ranks hold (replicated parts) are read once and copied. A
parameter structure's runs and schedule are computed once and reused for every layer.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..format import input_log
from ..sources.dtypes import to_torch
from ..sources.object_reader import reader_for
from ..sources.reader import RunReader
from .paths import DataPath, HostPath, LoadContext, fill_padding
from .read_schedule import ReadSchedule, StructureKey, StructureRuns, build_schedule
from .read_strategy import ReadOptions
from .staging import ready_event

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ParamPlan
    from ..planning.runs import Copies, Runs
    from ..sources.tensor_info import TensorInfo

JOB_BYTES = 8 << 20
"""Bytes per thread-pool job (``preadv`` jobs into CPU tensors, and strided copies out of a mapping)."""
STAGE_BYTES = 4 << 20
"""Bytes per staging buffer; ``threads + 1`` of them cycle between reads and uploads. Page-locking them is most of a
fresh process's first GPU load: on an H100 host, rank 3 of 8 of 1 GiB (page cache warm) took 0.19 s median with
16 MiB buffers, 0.10 s with 4 MiB and 0.13 s with 1 MiB (three interleaved rounds; the second load in the process
0.08, 0.05 and 0.10 s); docs/benchmarks.md, session 15."""


@dataclass(frozen=True)
class ReplicaCopies:
    """Copies to make once the reads are done: bytes one destination already holds, for another."""

    copies: Copies
    dests: list[torch.Tensor]


class Transfer:
    """Start reads of parameters into tensors; :meth:`wait` finishes them. One per load.

    ``path`` (a :class:`~shardload.engine.paths.DataPath`, from :func:`~shardload.engine.paths.data_path_for`;
    default: host memory, no single-rank strategy) decides how each parameter's bytes reach its tensors.
    ``read_options`` (:class:`~shardload.engine.read_strategy.ReadOptions`) sets the reader threads (0: read
    synchronously in the calling thread) and a single rank's read strategy. ``defer`` holds every read until
    :meth:`wait`, which hands them to the reader threads and works through them itself as well: setting up
    parameters while reader threads run makes each wait for the interpreter lock, so a load sets up first, then
    reads at full speed. Planned reads of cold storage are not held: they wait on the device, not the lock, and
    holding them left it idle. ``progress(done, total)`` is called as the read jobs of :meth:`wait` finish.
    """

    def __init__(
        self,
        reader: RunReader,
        *,
        path: DataPath | None = None,
        read_options: ReadOptions | None = None,
        defer: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        options = ReadOptions() if read_options is None else read_options
        self.reader = reader
        self.progress = progress
        self._told = False  # progress was called
        self.runs = StructureRuns()
        self.threads = options.threads_for(reader)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardload-read") if self.threads else None
        self.options = options
        self.deep = False
        """Whether read jobs go to the pool of planned reads: a verifying reader's jobs plan their own cold reads."""
        if hasattr(reader, "plan_with"):  # a verifying reader plans its cold tile reads with the same settings
            reader.plan_with(options.io_model, options.max_waste)
            self.deep = bool(reader.can_plan)
        self.io_pool: ThreadPoolExecutor | None = None
        self.futures: list[Future[None]] = []
        self.copies: list[ReplicaCopies] = []
        self.schedules: dict[StructureKey, ReadSchedule | None] = {}
        self.held: list[tuple[Callable[[], None], bool]] | None = [] if defer else None
        self.broken: BaseException | None = None
        """The failure of a ``wait``: the transfer's tensors are incomplete from then on."""
        self.log = input_log.current()
        self.sources: set[Any] = set()
        """The files read: each checked after the last read against its identity when its header was parsed."""
        self.path = HostPath() if path is None else path
        self.path.bind(LoadContext(reader, options, self.runs, self._submit, self.threads, JOB_BYTES, STAGE_BYTES))

    def _source(self, path: Any) -> None:
        """Note a file this load reads: its identity, if no header parse took it, is taken before its first read."""
        if path not in self.sources:
            self.sources.add(path)
            input_log.stamp(path)

    def _submit(self, fn: Callable[[], None], *, io: bool = False) -> None:
        """Run ``fn`` in the pool (``io``: in the pool of planned cold reads), or now without one."""
        if self.held is not None and not io:  # a cold read starts at once (see the class docstring)
            self.held.append((fn, io))
        elif self.pool is None:
            fn()
        else:
            if io and self.io_pool is None and self.options.io_depth:
                depth = self.options.io_depth
                if self.deep and self.options.threads is not None:  # verifying jobs hash: threads caps their CPU
                    depth = min(depth, self.options.threads)
                self.io_pool = ThreadPoolExecutor(depth, thread_name_prefix="shardload-io")
            pool = self.io_pool if io and self.io_pool is not None else self.pool
            self.futures.append(pool.submit(fn))

    def param(
        self,
        plan: ParamPlan,
        ranks: Sequence[int],
        devices: Sequence[Any] | None = None,
        *,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """``plan``'s tensors for ``ranks`` (rank ``ranks[k]`` on ``devices[k]``, default CPU), being filled.

        ``out`` (one per rank: contiguous, of the plan's per-rank shape and dtype) receives the bytes in place of
        fresh tensors, e.g. a server's own parameter memory; the devices are then the tensors' own.
        """
        import torch

        from ..planning.runs import structure, zero_spans

        self._source(plan.source.file)
        if out is not None:
            want = (tuple(plan.shape), to_torch(plan.dtype))
            if len(out) != len(ranks) or any((tuple(t.shape), t.dtype) != want or not t.is_contiguous() for t in out):
                raise ValueError(f"{plan.name}: out must be {len(ranks)} contiguous {want[1]} tensor(s) of {want[0]}")
            devices = [t.device for t in out]
        devs = [torch.device("cpu")] * len(ranks) if devices is None else [torch.device(d) for d in devices]
        key: StructureKey = (structure(plan, ranks), tuple(devs))
        got = self.path.param(plan, ranks, devs, key, out)
        if got is not None:
            return got
        if key in self.schedules:
            schedule = self.schedules[key]
        else:
            rel = self.runs.get(plan, ranks, key)
            sizes = [plan.rank_nbytes] * len(ranks)
            holes = [zero_spans(plan, r) for r in ranks] if plan.pads else None
            schedule = self.schedules[key] = None if rel is None else self._schedule(rel, sizes, devs, holes)
        if schedule is None:  # a compute step: read the tensor whole, run the steps, split
            from .steps import run_steps

            full = torch.empty(plan.source.shape, dtype=to_torch(plan.source.dtype))
            self.reader.read_tensor(plan.source.file, plan.source.offset, full)
            computed = run_steps(plan, full)
            if out is not None:
                for r, t in zip(ranks, out, strict=True):
                    t.copy_(computed[r])
                return list(out)
            return [computed[r].to(d, copy=True, memory_format=torch.contiguous_format) for r, d in zip(ranks, devs)]  # noqa: B905
        if out is not None:
            dests = list(out)
        else:
            dests = [torch.empty(plan.shape, dtype=to_torch(plan.dtype), device=d) for d in devs]
        for r, t in zip(ranks, dests, strict=True):
            fill_padding(plan, r, t)
        self._start(plan.source.file, plan.source.offset, schedule, dests)
        return dests

    def tensors(self, infos: Sequence[TensorInfo], device: Any) -> list[torch.Tensor]:
        """Whole stored tensors of one file on ``device``, being filled (neighbours share a ``preadv``), or what the
        data path gives without reading (views of a mapping)."""
        for t in infos:
            self._source(t.file)
        given = self.path.tensors(infos, device)
        if given is None:
            return self._read_tensors(infos, device)
        rest = [k for k, v in enumerate(given) if v is None]
        if rest:
            for k, t in zip(rest, self._read_tensors([infos[k] for k in rest], device), strict=True):
                given[k] = t
        return [v for v in given if v is not None]

    def _read_tensors(self, infos: Sequence[TensorInfo], device: Any) -> list[torch.Tensor]:
        """Fresh tensors of ``infos`` on ``device``, being filled by one schedule over their file."""
        import numpy as np
        import torch

        from ..planning.runs import Runs

        dests = [torch.empty(t.shape, dtype=to_torch(t.dtype), device=device) for t in infos]
        keep = [k for k, t in enumerate(infos) if t.nbytes]
        if keep:
            runs = Runs(
                np.array([infos[k].offset for k in keep], dtype=np.int64),
                np.array([infos[k].nbytes for k in keep], dtype=np.int64),
                np.array(keep, dtype=np.int64),
                np.zeros(len(keep), dtype=np.int64),
            )
            runs = runs.take(np.argsort(runs.src, kind="stable"))
            schedule = self._schedule(runs, [t.nbytes for t in infos], [d.device for d in dests])
            self._start(infos[keep[0]].file, 0, schedule, dests)
        return dests

    def _schedule(
        self, runs: Runs, sizes: list[int], devices: Sequence[Any], holes: Sequence[tuple[Any, Any]] | None = None
    ) -> ReadSchedule:
        """The read schedule of ``runs`` into tensors of ``sizes`` bytes on ``devices`` (in place where the data
        path fills them directly, else through its staging buffers)."""
        direct = [self.path.direct(d) for d in devices]
        return build_schedule(runs, sizes, direct, job_bytes=JOB_BYTES, stage_bytes=STAGE_BYTES, holes=holes)

    def _start(self, path: Path, offset: int, schedule: ReadSchedule, dests: list[torch.Tensor]) -> None:
        """Submit ``schedule``'s reads of the tensor at ``offset`` of ``path`` into ``dests``."""
        # a verifying reader's jobs of a cached file only copy and hash: the reader pool (one thread a core) runs
        # them, since a deep queue of them only switches between threads on the same cores
        deep = self.deep and not self.reader.warm(path)  # type: ignore[attr-defined]
        for job in schedule.jobs:
            self._submit(
                lambda r=job: self.reader.read_runs(path, r.src + offset, r.length, r.buf, r.dst, dests, populate=True),
                io=deep,
            )
        if schedule.batches:
            data_path = self.path
            staging = data_path.staging(pin=any(t.device.type == "cuda" for t in dests))
            ready = {d: ready_event(d) for d in {t.device for t in dests}}  # behind the caller's stream
            afters = [ready[t.device] for t in dests]
            for batch in schedule.batches:
                self._submit(lambda b=batch: data_path.read_staged(staging, path, offset, b, dests, afters))
        for copies in schedule.copies:
            self.copies.append(ReplicaCopies(copies, dests))

    def wait(self) -> None:
        """Finish every started read, device upload and copy (re-raising the first failure). After a failure the
        transfer is broken: its tensors are incomplete, and every later ``wait`` raises again."""
        if self.broken is not None:
            raise self.broken
        try:
            self._finish()
        except BaseException as err:
            self.broken, self.copies = err, []  # nothing may be copied from, or returned for, an incomplete read
            raise

    def _finish(self) -> None:
        self.path.flush()
        if self.held:
            held, self.held = self.held, None  # None while they are handed out: _submit must not hold them again
            try:
                if self.pool is None:  # threads=0: this thread runs them, reporting each
                    for done, (fn, _) in enumerate(held, 1):
                        fn()
                        if self.progress is not None:
                            self.progress(done, len(held))
                            self._told = True
                elif self.progress is None:
                    self._run_all([fn for fn, _ in held])
                else:
                    for fn, io in held:
                        self._submit(fn, io=io)
            finally:
                self.held = []
        futures, self.futures = self.futures, []
        try:
            if self.progress is not None and futures:
                for done, f in enumerate(as_completed(futures), 1):
                    f.result()
                    self.progress(done, len(futures))
                    self._told = True
            for f in futures:
                f.result()
        except BaseException:
            self.reader.abandon()  # requests in flight end now: the running jobs waited for below end with them
            _settle(futures)
            raise
        self.path.sync()
        copies, self.copies = self.copies, []
        for c in copies:
            _apply_copies(c.copies, c.dests)
        input_log.check_unchanged(self.sources, self.log)
        if self.progress is not None and not self._told:  # nothing to read (views of the files): the end, told once
            self._told = True
            self.progress(0, 0)

    def _run_all(self, jobs: list[Callable[[], None]]) -> None:
        """Run ``jobs`` on the reader threads and this one, each taking the next job none has taken: one hand-off
        per thread instead of one future per job (a thread woken for each job waits for the interpreter lock while
        the caller hands out the rest), and the caller works instead of waiting."""
        assert self.pool is not None
        taken = itertools.count()
        lock = threading.Lock()  # next() on a shared count is atomic only under the interpreter lock
        failed: list[bool] = []  # a job raised: the other threads take no more

        def worker() -> None:
            while not failed:
                with lock:
                    k = next(taken)
                if k >= len(jobs):
                    return
                try:
                    jobs[k]()
                except BaseException:
                    failed.append(True)
                    raise

        try:
            for _ in range(min(self.threads, len(jobs)) - 1):
                self.futures.append(self.pool.submit(worker))
            worker()
        except BaseException:
            failed.append(True)
            self.reader.abandon()
            futures, self.futures = self.futures, []
            _settle(futures)
            raise

    def close(self) -> None:
        """Stop the pool (jobs not started are cancelled, running ones finish), then let the data path release what
        it holds (uploads waited for, mapped files unmapped in the background)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.io_pool is not None:
            self.io_pool.shutdown(wait=True, cancel_futures=True)
            self.io_pool = None
        self.path.close()

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        left = bool(self.held or self.futures or self.copies or self.path.pending()) or self.broken is not None
        if exc_type is not None:  # the load stops: what its jobs wait for ends now
            self.reader.abandon()
        self.close()
        if exc_type is None and left:  # tensors whose reads never ran (or failed) must not reach the caller
            raise RuntimeError("shardload: read jobs were left unfinished or failed at the end of a load (a bug); "
                               "nothing was returned")  # fmt: skip


def reader_for_plan(params: Iterable[ParamPlan], options: ReadOptions | None = None) -> RunReader:
    """The reader of the files ``params`` are read from: an object store's (its requests planned by
    ``options.object_cost``), or the local one."""
    return reader_for(next((p.source.file for p in params), None), options and options.object_cost)


def _settle(futures: Sequence[Future[None]]) -> None:
    """After a failure: cancel the jobs not started and wait for the running ones (their errors are dropped)."""
    for f in futures:
        f.cancel()
    for f in futures:
        if not f.cancelled():
            f.exception()


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
