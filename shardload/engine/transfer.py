"""The executor that moves tensor bytes from checkpoint files into per-rank tensors on their devices.

:class:`Transfer` allocates each parameter's (or stored tensor's) destinations and runs, in a small thread pool,
the work the modules beside it plan: a single rank's way per parameter (:mod:`.read_strategy`), read schedules
of ``preadv`` jobs straight into CPU tensors and batches through staging buffers (:mod:`.read_schedule`),
strided copies out of a file mapping (:mod:`.copy_jobs`), and the host staging buffers that carry bytes to
devices (:mod:`.staging`). Bytes several ranks hold (replicated parts) are read once and copied. A parameter
structure's runs, schedule and copy program are computed once and reused for every layer.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format import input_log
from ..sources.dtypes import to_torch
from ..sources.object_reader import reader_for
from ..sources.reader import PAGE, FileMaps, Mappings, RunReader, count_mapped, count_requested
from .copy_jobs import CopyJob, copy_program, mapped_copy_jobs, rows_fit, staged_copy_jobs
from .read_schedule import ReadSchedule, StagedBatch, StructureKey, StructureRuns, build_schedule
from .read_strategy import ReadOptions, ReadStrategy, Way
from .staging import StagingBuffers

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ParamPlan
    from ..planning.runs import Copies, Runs
    from ..sources.checkpoint import TensorInfo
    from ..sources.read_plan import FilledRuns, IoModel

JOB_BYTES = 8 << 20
"""Bytes per thread-pool job (``preadv`` jobs into CPU tensors, and strided copies out of a mapping)."""
SMALL_BYTES = 64 << 10
"""A whole tensor up to this size copied out of a mapping joins a batch of its file's small tensors, one job per
:data:`SMALL_BATCH` of them (or :data:`JOB_BYTES`), instead of a job of its own: a file of 200,000 norms and scales
then costs a few dozen jobs, not 200,000 closures and futures."""
SMALL_BATCH = 4096
STAGE_BYTES = 4 << 20
"""Bytes per staging buffer; ``threads + 1`` of them cycle between reads and uploads. Page-locking them is most of a
fresh process's first GPU load: on an H100 host, rank 3 of 8 of 1 GiB (page cache warm) took 0.19 s median with
16 MiB buffers, 0.10 s with 4 MiB and 0.13 s with 1 MiB (three interleaved rounds; the second load in the process
0.08, 0.05 and 0.10 s); docs/benchmarks.md, session 15."""


@dataclass(frozen=True)
class PlannedReads:
    """A structure's planned cold reads (offsets relative to the page holding its tensor's first byte): the filled
    runs, where each read's runs start in them, and the byte counts of the plan."""

    runs: FilledRuns
    bounds: list[int]
    """Where each job's runs start in :attr:`runs` (a job: consecutive reads of about ``JOB_BYTES``)."""
    ranges: tuple[Any, Any]
    """The reads' starts and ends, as numpy arrays (shifted by the tensor's page to request them)."""
    reads: int
    short: bool
    """Whether the runs average under half a page (copied out of the mapping once their pages are requested)."""
    used: int
    moved: int
    page_floor: int


@dataclass
class IoTally:
    """What a single rank's planned cold reads used and moved, and the page floor of them (reported, not asserted
    by the executor)."""

    used: int = 0
    moved: int = 0
    page_floor: int = 0
    reads: int = 0


@dataclass(frozen=True)
class ReplicaCopies:
    """Copies to make once the reads are done: bytes one destination already holds, for another."""

    copies: Copies
    dests: list[torch.Tensor]


class Transfer:
    """Start reads of parameters into tensors; :meth:`wait` finishes them. One per load.

    ``read_options`` (:class:`~shardload.engine.read_strategy.ReadOptions`) sets the reader threads (0: read
    synchronously in the calling thread) and a single rank's read strategy. ``staged`` routes CPU destinations
    through the staging buffers too (tests compare that path against the direct one). ``defer`` holds every read
    until :meth:`wait`, which hands them to the reader threads and works through them itself as well: setting up
    parameters while reader threads run makes each wait for the interpreter lock, so a load sets up first, then
    reads at full speed. Planned reads of cold storage are not held: they wait on the device, not the lock, and
    holding them left it idle. ``mapped`` returns a single rank's CPU tensor that is one contiguous stretch of its
    file as a view of a private file mapping instead of reading it (see :class:`~shardload.sources.reader.Mappings`).
    ``copy_out`` lets a single rank copy its pieces out of a read-only mapping with strided copies where its read
    strategy says that is faster than reading them. Neither maps anything when the reader says its files cannot be
    mapped (``reader.can_map`` False: an object store); every byte is then read with ``read_runs``.
    ``progress(done, total)`` is called as the read jobs of :meth:`wait` finish.
    """

    def __init__(
        self,
        reader: RunReader,
        *,
        read_options: ReadOptions | None = None,
        staged: bool = False,
        defer: bool = False,
        mapped: bool = False,
        copy_out: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        options = ReadOptions() if read_options is None else read_options
        self.reader = reader
        self.progress = progress
        self.mappings = Mappings() if mapped and reader.can_map else None  # an object store has no file to map
        self.filemaps = FileMaps() if copy_out and reader.can_map else None
        self.runs = StructureRuns()
        self.strategy = None if self.filemaps is None else ReadStrategy(options, reader, self.filemaps, self.runs)
        self.threads = options.threads_for(reader)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardload-read") if self.threads else None
        self.options = options
        self.deep = False
        """Whether read jobs go to the pool of planned reads: a verifying reader's jobs plan their own cold reads."""
        if hasattr(reader, "plan_with"):  # a verifying reader plans its cold tile reads with the same settings
            reader.plan_with(options.io_model, options.max_waste)
            self.deep = bool(reader.can_plan)
        self.io_pool: ThreadPoolExecutor | None = None
        self.planned: dict[tuple[StructureKey, int], PlannedReads | None] = {}
        self.io = IoTally()
        self.sinks = threading.local()
        self.stage_cpu = staged
        self.futures: list[Future[None]] = []
        self.copies: list[ReplicaCopies] = []
        self.staging: StagingBuffers | None = None
        self.whole: dict[StructureKey, int | None] = {}
        self.schedules: dict[StructureKey, ReadSchedule | None] = {}
        self.programs: dict[StructureKey, list[CopyJob]] = {}
        self.held: list[tuple[Callable[[], None], bool]] | None = [] if defer else None
        self.broken: BaseException | None = None
        """The failure of a ``wait``: the transfer's tensors are incomplete from then on."""
        self.small: dict[Any, list[tuple[int, int, torch.Tensor]]] = {}
        """Per file, small whole tensors waiting to be copied out of its mapping as one job (:data:`SMALL_BYTES`)."""
        self.log = input_log.current()
        self.sources: set[Any] = set()
        """The files read: each checked after the last read against its identity when its header was parsed."""

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

    def _direct(self, device: torch.device) -> bool:
        """Whether a tensor on ``device`` is filled directly (else through the staging buffers)."""
        return device.type == "cpu" and not self.stage_cpu

    def _staging(self, *, pin: bool) -> StagingBuffers:
        """The staging buffers, made on first use (page-locked with ``pin``)."""
        if self.staging is None:
            self.staging = StagingBuffers(STAGE_BYTES, max(2, self.threads + 1), pin=pin)
        return self.staging

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

        self.sources.add(plan.source.file)
        if out is not None:
            want = (tuple(plan.shape), to_torch(plan.dtype))
            if len(out) != len(ranks) or any((tuple(t.shape), t.dtype) != want or not t.is_contiguous() for t in out):
                raise ValueError(f"{plan.name}: out must be {len(ranks)} contiguous {want[1]} tensor(s) of {want[0]}")
            devices = [t.device for t in out]
        devs = [torch.device("cpu")] * len(ranks) if devices is None else [torch.device(d) for d in devices]
        key: StructureKey = (structure(plan, ranks), tuple(devs))
        if out is None and self.mappings is not None and len(ranks) == 1 and devs[0].type == "cpu":
            view = self._view(plan, ranks, key)
            if view is not None:
                return [view]
        if self.strategy is not None and len(ranks) == 1:
            way = self.strategy.way(plan, ranks[0], key, direct=self._direct(devs[0]))
            got = None
            if way is Way.MAP:
                got = self._copy_out(plan, ranks[0], key, devs[0], None if out is None else out[0])
            elif way is Way.PLAN:
                got = self._planned(plan, ranks[0], key, devs[0], None if out is None else out[0])
            if got is not None:
                return [got]
        if _small(plan) and self.strategy is None and len(ranks) == 1 and devs[0].type == "cpu":
            # a reader that cannot map (verifying, object storage): small whole tensors read as one batch of runs
            dest = torch.empty(plan.shape, dtype=to_torch(plan.dtype)) if out is None else out[0]
            self._copy_small(plan.source.file, plan.source.offset, plan.source.nbytes, dest)
            return [dest]
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

    def _copy_out(
        self, plan: ParamPlan, rank: int, key: StructureKey, device: torch.device, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The rank's tensor, being filled by strided copies out of a read-only mapping of its file, when the read
        strategy says so (None: read it with ``preadv`` instead). On a GPU (or with ``staged``) the copies gather
        the rank's bytes into the staging buffers, each upload one contiguous block."""
        import torch

        assert self.strategy is not None and self.filemaps is not None
        direct = self._direct(device)
        source = plan.source
        data = self.filemaps.bytes(source.file)
        if data is None:
            return None
        if source.offset + source.nbytes > data.numel():
            raise CheckpointError(
                "file is shorter than its header says (changed while loading?)", file=str(source.file)
            )
        dtype = to_torch(plan.dtype)
        if source.offset % dtype.itemsize:
            return None  # packed at an odd offset (a TVM cache can be): preadv has no alignment needs
        pieces = plan.pieces(rank) or []
        if not direct and not rows_fit(pieces, dtype.itemsize, STAGE_BYTES):
            return None  # a GPU rank stages whole rows (or elements): each must fit a staging buffer
        dest = torch.empty(plan.shape, dtype=dtype, device=device) if out is None else out
        if direct and _small(plan):
            self._copy_small(source.file, source.offset, source.nbytes, dest)
            return dest
        fill_padding(plan, rank, dest)
        if direct:
            program = self.programs.get(key)
            if program is None:
                program = self.programs[key] = copy_program(pieces, dest.element_size(), JOB_BYTES)
            mapping = self.filemaps.array(source.file)
            assert mapping is not None  # mapped above
            jobs = [partial(_intact_then, self.filemaps, source.file, source.offset + source.nbytes, job)
                    for job in mapped_copy_jobs(program, mapping, source, dest)]  # fmt: skip
        else:
            jobs = staged_copy_jobs(data, source, pieces, dest, self._staging(pin=device.type == "cuda"))
        for job in jobs:
            self._submit(job)
        return dest

    def _copy_small(self, path: Any, offset: int, nbytes: int, dest: torch.Tensor) -> None:
        """Queue a small whole tensor's copy out of ``path``'s mapping; a full batch becomes one job."""
        batch = self.small.setdefault(path, [])
        batch.append((offset, nbytes, dest))
        if len(batch) >= SMALL_BATCH:
            self._submit(self._small_job(path, self.small.pop(path)))

    def _small_job(self, path: Any, batch: list[tuple[int, int, torch.Tensor]]) -> Callable[[], None]:
        if self.filemaps is not None:
            return partial(_copy_batch, self.filemaps, path, batch)
        return partial(_read_batch, self.reader, path, batch)

    def _flush_small(self) -> None:
        small, self.small = self.small, {}
        for path, batch in small.items():
            self._submit(self._small_job(path, batch))

    def _planned(
        self, plan: ParamPlan, rank: int, key: StructureKey, device: torch.device, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The rank's CPU tensor, being filled by the planned cold reads of its bytes (``sources/read_plan``): its
        pages merged across cheap gaps into large reads, all requested up front, then :attr:`ReadOptions.io_depth`
        of them at once, each one ``preadv`` into the tensor (the gap bytes into a small sink), or for short runs
        strided copies out of the mapping. None where the runs overlap (read exactly)."""
        import torch

        source = plan.source
        skew = source.offset % PAGE
        pkey = (key, skew)
        if pkey not in self.planned:
            self.planned[pkey] = self._plan_reads(plan, rank, key, skew)
        planned = self.planned[pkey]
        if planned is None:
            return None
        io = self.io
        io.used, io.moved = io.used + planned.used, io.moved + planned.moved
        io.page_floor, io.reads = io.page_floor + planned.page_floor, io.reads + planned.reads
        base = source.offset - skew
        self.reader.no_readahead(source.file)  # type: ignore[attr-defined]
        lo, hi = (x + base for x in planned.ranges)
        self.reader.prefetch(source.file, lo, hi)  # the whole queue, up front
        if planned.short and self.filemaps is not None:
            # runs shorter than half a page (a column slice): copied out of the mapping as the requested pages
            # arrive, since a preadv would copy the other ranks' bytes of every page into the sink as well
            self.filemaps.no_readahead(source.file, int(lo[0]), int(hi[-1]))
            copied = self._copy_out(plan, rank, key, device, out)
            if copied is not None:
                count_requested(source.file, planned.moved - planned.used)  # the copies count the bytes used
                return copied
        dest = torch.empty(plan.shape, dtype=to_torch(plan.dtype), device=device) if out is None else out
        fill_padding(plan, rank, dest)
        for a, b in zip(planned.bounds[:-1], planned.bounds[1:], strict=True):
            self._submit(lambda a=a, b=b: self._read_planned(source.file, base, planned.runs, a, b, dest), io=True)
        return dest

    def _plan_reads(self, plan: ParamPlan, rank: int, key: StructureKey, skew: int) -> PlannedReads | None:
        """A structure's planned reads for a tensor ``skew`` bytes into its first page (None: overlapping runs)."""
        import numpy as np

        from ..sources.read_plan import fill_reads, plan_reads

        rel = self.runs.get(plan, [rank], key)
        if rel is None or not len(rel):
            return None
        order = np.argsort(rel.src, kind="stable")
        src, length, buf, dst = rel.src[order] + skew, rel.length[order], rel.buf[order], rel.dst[order]
        if len(src) > 1 and bool((src[1:] < src[:-1] + length[:-1]).any()):
            return None
        model = self.io_model(plan.source.file)
        reads = plan_reads(src, src + length, model, max_waste=self.options.max_waste, limit=skew + plan.source.nbytes)
        filled = fill_reads(reads, src, length, buf, dst, sink=1)
        lo = np.array([r.offset for r in reads.reads], dtype=np.int64)
        hi = np.array([r.end for r in reads.reads], dtype=np.int64)
        first = np.flatnonzero(np.diff(filled.read, prepend=-1))  # each read's first run
        # jobs of whole reads, about JOB_BYTES each: one read_runs call, one preadv per read
        job = (np.cumsum(hi - lo) - (hi - lo)) // JOB_BYTES
        starts = np.flatnonzero(np.diff(job, prepend=-1))
        bounds = [*first[starts].tolist(), len(filled.src)]
        short = int(length.sum()) < len(length) * (PAGE // 2)
        return PlannedReads(filled, bounds, (lo, hi), len(lo), short, reads.used, reads.moved, reads.page_floor)

    def io_model(self, path: Path) -> IoModel:
        """The I/O model cold reads of ``path`` are planned with: the caller's, else the file system's, measured."""
        if self.options.io_model is not None:
            return self.options.io_model
        from ..sources.io_model import io_model

        return io_model(path)

    def _read_planned(self, path: Path, base: int, runs: FilledRuns, a: int, b: int, dest: torch.Tensor) -> None:
        """One planned read: runs ``[a, b)`` of ``runs`` (one stretch of the file) into ``dest`` and the sink."""
        import torch

        sink = getattr(self.sinks, "buf", None)
        if sink is None or sink.numel() < max(1, runs.sink):
            sink = self.sinks.buf = torch.empty(max(runs.sink, 64 << 10), dtype=torch.uint8)
        self.reader.read_runs(  # type: ignore[call-arg]
            path, runs.src[a:b] + base, runs.length[a:b], runs.buf[a:b], runs.dst[a:b], [dest, sink],
            populate=True, sink=1,
        )  # fmt: skip

    def _view(self, plan: ParamPlan, ranks: Sequence[int], key: StructureKey) -> torch.Tensor | None:
        """The rank's tensor as a view of the file mapping, where it is one contiguous stretch of the file."""
        if key not in self.whole:
            runs = self.runs.get(plan, ranks, key)
            whole = runs is not None and len(runs) == 1 and int(runs.length[0]) == plan.rank_nbytes
            self.whole[key] = int(runs.src[0]) if whole and runs is not None else None
        at = self.whole[key]
        if at is None or self.mappings is None:
            return None
        return self.mappings.tensor(plan.source.file, plan.source.offset + at, plan.shape, to_torch(plan.dtype))

    def tensors(self, infos: Sequence[TensorInfo], device: Any) -> list[torch.Tensor]:
        """Whole stored tensors of one file on ``device``, being filled (neighbours share a ``preadv``), or views of
        its mapping where ``mapped`` allows."""
        import torch

        self.sources.update(t.file for t in infos)
        if self.mappings is not None and torch.device(device).type == "cpu":
            views = [self.mappings.tensor(t.file, t.offset, t.shape, to_torch(t.dtype)) for t in infos]
            rest = [k for k, v in enumerate(views) if v is None]
            if not rest:
                return [v for v in views if v is not None]
            for k, t in zip(rest, self._read_tensors([infos[k] for k in rest], device), strict=True):
                views[k] = t
            return [v for v in views if v is not None]
        return self._read_tensors(infos, device)

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
        """The read schedule of ``runs`` into tensors of ``sizes`` bytes on ``devices``."""
        direct = [self._direct(d) for d in devices]
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
            staging = self._staging(pin=any(t.device.type == "cuda" for t in dests))
            for batch in schedule.batches:
                self._submit(lambda b=batch: self._read_staged(staging, path, offset, b, dests))
        for copies in schedule.copies:
            self.copies.append(ReplicaCopies(copies, dests))

    def _read_staged(
        self, staging: StagingBuffers, path: Path, offset: int, batch: StagedBatch, dests: list[torch.Tensor]
    ) -> None:
        """One staged batch: read its runs into a free buffer, then upload the buffer's parts to ``dests``."""
        buf = staging.acquire()
        try:
            part = batch.runs
            self.reader.read_runs(path, part.src + offset, part.length, part.buf, part.dst, [buf])
            for up in batch.uploads:
                staging.upload(buf, up.at, dests[up.tensor], up.start, up.stop)
        finally:
            staging.release(buf)

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
        if self.small:
            self._flush_small()
        if self.held:
            held, self.held = self.held, None  # None while they are handed out: _submit must not hold them again
            try:
                if self.pool is not None and self.progress is None:
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
            for f in futures:
                f.result()
        except BaseException:
            _settle(futures)
            raise
        if self.staging is not None:
            self.staging.sync()
        copies, self.copies = self.copies, []
        for c in copies:
            _apply_copies(c.copies, c.dests)
        input_log.check_unchanged(self.sources, self.log)

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
            futures, self.futures = self.futures, []
            _settle(futures)
            raise

    def close(self) -> None:
        """Stop the pool (jobs not started are cancelled, running ones finish), then unmap the files copied from in
        the background: their page-table entries take tens of milliseconds to tear down."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.io_pool is not None:
            self.io_pool.shutdown(wait=True, cancel_futures=True)
            self.io_pool = None
        if self.staging is not None:
            self.staging.sync()
        if self.filemaps is not None:
            filemaps, self.filemaps = self.filemaps, None
            # not a daemon: interpreter exit waits for it (a daemon thread stopped inside the C call would abort)
            threading.Thread(target=filemaps.release, name="shardload-unmap").start()

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        left = bool(self.held or self.futures or self.copies or self.small) or self.broken is not None
        self.close()
        if exc_type is None and left:  # tensors whose reads never ran (or failed) must not reach the caller
            raise RuntimeError("shardload: read jobs were left unfinished or failed at the end of a load (a bug); "
                               "nothing was returned")  # fmt: skip


def reader_for_plan(params: Iterable[ParamPlan], options: ReadOptions | None = None) -> RunReader:
    """The reader of the files ``params`` are read from: an object store's (its requests planned by
    ``options.object_cost``), or the local one."""
    return reader_for(next((p.source.file for p in params), None), options and options.object_cost)


def fill_padding(plan: ParamPlan, rank: int, dest: torch.Tensor) -> None:
    """Write zeros into the padding of ``rank``'s tensor (:meth:`ParamPlan.zeros`): no byte of it is read, and no
    run writes it, so this runs before or beside the reads (on a GPU, on the default stream the uploads wait for)."""
    for box in plan.zeros(rank):
        dest[tuple(slice(a, b) for a, b in box)].zero_()


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


def _intact_then(filemaps: FileMaps, path: Path, end: int, job: Callable[[], None]) -> None:
    """Run a copy job out of ``path``'s mapping once the file still holds its ``end`` bytes."""
    filemaps.intact(path, end)
    job()
    filemaps.intact(path, end)  # cut during the job: it read zeros past the cut (fault_guard), never returned


def _copy_batch(filemaps: FileMaps, path: Path, batch: list[tuple[int, int, torch.Tensor]]) -> None:
    """Copy small whole tensors ``(offset, nbytes, dest)`` out of ``path``'s mapping (checked intact around it)."""
    import numpy as np
    import torch

    mapping = filemaps.array(path)
    assert mapping is not None  # mapped when the batch was queued
    end = max(o + n for o, n, _ in batch)
    filemaps.intact(path, end)
    for offset, nbytes, dest in batch:
        if nbytes:
            np.copyto(dest.reshape(-1).view(torch.uint8).numpy(), mapping[offset : offset + nbytes], casting="no")
    filemaps.intact(path, end)
    count_mapped(path, sum(n for _, n, _ in batch))


def _read_batch(reader: RunReader, path: Path, batch: list[tuple[int, int, torch.Tensor]]) -> None:
    """Read small whole tensors ``(offset, nbytes, dest)`` of ``path`` with one ``read_runs`` call (sorted runs)."""
    import numpy as np

    batch = sorted((b for b in batch if b[1]), key=lambda b: b[0])
    if not batch:
        return
    src = np.array([o for o, _, _ in batch], dtype=np.int64)
    length = np.array([n for _, n, _ in batch], dtype=np.int64)
    buf = np.arange(len(batch), dtype=np.int64)
    reader.read_runs(path, src, length, buf, np.zeros(len(batch), dtype=np.int64), [d for _, _, d in batch])


def _small(plan: ParamPlan) -> bool:
    """Whether ``plan`` is a small tensor every rank reads whole, as stored: one of a batch (:data:`SMALL_BYTES`)."""
    return plan.replicated and plan.source.nbytes <= SMALL_BYTES and plan.source.decode is None
