"""Moving tensor bytes from checkpoint files into per-rank tensors on their devices.

CPU tensors are read into directly: a parameter's byte runs are scattered by ``preadv`` into every
requested rank's tensor, in jobs of ``JOB_BYTES`` spread over a small thread pool, and bytes that
several ranks hold (replicated parts) are read once and copied. Device tensors are filled through a
few reusable staging buffers (page-locked for CUDA): a thread reads a chunk into a free buffer,
queues non-blocking copies on a side stream per device, and the buffer is reused once the event
recorded behind those copies has completed, so reading overlaps copying. The schedule of a
parameter (its jobs, staging batches and copies) is computed once per parameter structure and
reused for every layer.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..sources.dtypes import to_torch
from ..sources.object_reader import reader_for
from ..sources.reader import PAGE, FileMaps, Mappings, RunReader, count_mapped, populate, probes

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ParamPlan, Piece
    from ..planning.runs import Copies, Runs
    from ..sources.checkpoint import TensorInfo

JOB_BYTES = 8 << 20
"""Bytes per thread-pool read job."""
STAGE_BYTES = 16 << 20
"""Bytes per staging buffer; ``threads + 1`` of them cycle between reads and uploads."""
STAGE_MIN_SLICE = 64 << 10
"""Rank tensors share a staging buffer in slices of at least this many bytes each."""
READ_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
"""Reader threads: page-cache copies scale with cores until memory bandwidth is the bound (the cores this process
may run on: a container or ``taskset`` may allow fewer than the machine has)."""
READ_STRATEGY = "auto"
"""How a single rank's pieces are read: ``"auto"`` (below), ``"map"`` (always copy out of a mapping) or
``"read"`` (always ``preadv`` the exact runs)."""
RESIDENT_ENOUGH = 0.9
"""``auto`` treats a parameter's bytes as cached when at least this fraction of the pages holding them is (sampled
with ``mincore``); otherwise it fetches exactly those pages from storage."""
SMALL_RUN = PAGE // 2
"""On cold storage, ``auto`` copies runs averaging under this many bytes (a column slice) out of a mapping, their pages
requested up front: ``preadv`` would pay one call per run, and the kernel reads whole pages either way."""

STAGED_MAP_RUN = 256 << 10
"""A GPU rank copies out of a mapping (when cached) only if its runs average under this many bytes; longer runs
are read with ``preadv`` into the pinned buffers (measured on an H100 host: whole tensors 0.053 s by ``preadv``
against 0.079 s through the mapping, column slices 0.050 s against 0.305 s)."""


@dataclass
class _Schedule:
    """How one parameter's runs are read: direct jobs into CPU tensors, staged batches for the others, and the
    copies that replace re-reads. File offsets are relative to the stored tensor, so parameters of the same
    structure (every layer of a model) share one schedule."""

    jobs: list[Runs] = field(default_factory=list)
    batches: list[tuple[Runs, list[tuple[int, int, int, int]]]] = field(default_factory=list)
    copies: list[Copies] = field(default_factory=list)


class Transfer:
    """Start reads of parameters into tensors; :meth:`wait` finishes them. One per load.

    ``threads=0`` reads synchronously in the calling thread. ``staged`` routes CPU destinations
    through the staging buffers too (tests compare that path against the direct one). ``defer`` holds
    every read until :meth:`wait`: allocating destinations while other threads fault pages in slows
    both, so a whole-model load allocates first, then reads at full speed. ``mapped`` returns a single
    rank's CPU tensor that is one contiguous stretch of its file as a view of a private file mapping
    instead of reading it (see :class:`~shardload.sources.reader.Mappings`). ``copy_out`` lets a single
    rank copy its pieces out of a read-only mapping with strided copies where that is faster than reading
    them (:data:`READ_STRATEGY`). Neither maps anything when the reader says its files cannot be mapped
    (``reader.can_map`` False: an object store); every byte is then read with ``read_runs``.
    ``progress(done, total)`` is called as the read jobs of :meth:`wait` finish.
    """

    def __init__(
        self,
        reader: RunReader,
        *,
        threads: int | None = None,
        staged: bool = False,
        defer: bool = False,
        mapped: bool = False,
        copy_out: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.reader = reader
        self.progress = progress
        self.mappings = Mappings() if mapped and reader.can_map else None  # an object store has no file to map
        self.filemaps = FileMaps() if copy_out and reader.can_map else None
        self.spans: dict[Any, tuple[Any, ...] | None] = {}
        self.whole: dict[Any, int | None] = {}
        self.threads = (reader.threads or READ_THREADS) if threads is None else threads
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardload-read") if self.threads else None
        self.stage_cpu = staged
        self.futures: list[Future[None]] = []
        self.copies: list[tuple[Copies, list[torch.Tensor]]] = []
        self.staging: _Staging | None = None
        self.schedules: dict[Any, _Schedule | None] = {}
        self.rel_runs: dict[Any, Runs | None] = {}
        self.programs: dict[Any, list[tuple[tuple[slice, ...], tuple[slice, ...], tuple[slice, ...]]]] = {}
        self.held: list[Callable[[], None]] | None = [] if defer else None

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.held is not None:
            self.held.append(fn)
        elif self.pool is None:
            fn()
        else:
            self.futures.append(self.pool.submit(fn))

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

        if out is not None:
            want = (tuple(plan.shape), to_torch(plan.dtype))
            if len(out) != len(ranks) or any((tuple(t.shape), t.dtype) != want or not t.is_contiguous() for t in out):
                raise ValueError(f"{plan.name}: out must be {len(ranks)} contiguous {want[1]} tensor(s) of {want[0]}")
            devices = [t.device for t in out]
        devs = [torch.device("cpu")] * len(ranks) if devices is None else [torch.device(d) for d in devices]
        key = (structure(plan, ranks), tuple(devs))
        if out is None and self.mappings is not None and len(ranks) == 1 and devs[0].type == "cpu":
            view = self._view(plan, ranks, key)
            if view is not None:
                return [view]
        if self.filemaps is not None and len(ranks) == 1:
            copied = self._copy_out(plan, ranks[0], key, devs[0], None if out is None else out[0])
            if copied is not None:
                return [copied]
        if key in self.schedules:
            schedule = self.schedules[key]
        else:
            rel = self._runs(plan, ranks, key)
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

    def _runs(self, plan: ParamPlan, ranks: Sequence[int], key: Any) -> Runs | None:
        """``plan``'s runs for ``ranks`` with file offsets relative to the stored tensor (None: read it whole), built
        once per structure ``key`` and shared by every parameter of that structure."""
        from ..planning.runs import param_runs, shifted

        if key not in self.rel_runs:
            runs = param_runs(plan, ranks)
            self.rel_runs[key] = None if runs is None else shifted(runs, -plan.source.offset)
        return self.rel_runs[key]

    def _copy_out(
        self, plan: ParamPlan, rank: int, key: Any, device: torch.device, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The rank's tensor, being filled by strided copies out of a read-only mapping of its file, when the
        strategy says so (None: read it with ``preadv`` instead). On a GPU (or with ``staged``) the copies gather
        the rank's bytes into the pinned staging buffers, each upload one contiguous block.

        ``auto`` copies when the pages holding the rank's bytes are in the page cache (``mincore``), whatever the
        length of its runs on a CPU rank (user-space copies out of a mapping beat the kernel's copy out of the page
        cache, page faults included: 0.056 s against 0.059 s for ``load_rank(mmap=True)``, rank 3 of 8, medians of 10
        in ``benchmarks/run.py``'s setting), or when its runs are smaller than half a page (then faults read just
        their pages: no readahead); otherwise, on cold storage, ``preadv`` of the exact runs reads no byte the rank
        does not need.
        """
        import torch

        from ..planning.runs import MANY_RUNS, run_count

        if not plan.remap or plan.rank_nbytes == 0 or plan.source.dtype != plan.dtype:
            return None
        if key not in self.spans and run_count(plan, [rank]) > MANY_RUNS:
            self.spans[key] = ()  # too many runs to list: always copied out of the mapping
        if READ_STRATEGY == "read" and self.spans.get(key) != ():
            return None
        if key not in self.spans:
            runs = self._runs(plan, [rank], key)
            if runs is None or not len(runs):
                self.spans[key] = None
            else:
                starts, ends = runs.src, runs.src + runs.length
                self.spans[key] = (starts, ends, float(runs.length.mean()), probes(starts, ends), int(ends.max()))
        span = self.spans[key]
        assert self.filemaps is not None
        if span is None:
            return None
        direct = device.type == "cpu" and not self.stage_cpu
        if READ_STRATEGY == "auto" and span:
            at = plan.source.offset
            mean_run = span[2]
            if self.filemaps.warm(plan.source.file):  # the whole file is cached: no probe per parameter
                resident: float | None = 1.0
            else:
                resident = self.filemaps.cached(plan.source.file, [at + x for x in span[3]], at + span[4])
            if not direct and mean_run >= STAGED_MAP_RUN:
                # long runs reach the pinned buffers faster by preadv than through a mapping
                if resident is not None and resident < RESIDENT_ENOUGH:
                    self.reader.no_readahead(plan.source.file)  # cold: exactly the runs, their pages requested now
                    self.reader.prefetch(plan.source.file, (at + span[0]).tolist(), (at + span[1]).tolist())
                return None
            if resident is None:
                return None
            if resident < RESIDENT_ENOUGH:  # cold: fetch the pages holding the rank's bytes, and nothing else
                starts, ends = at + span[0], at + span[1]
                if mean_run >= SMALL_RUN:  # few long runs: read exactly them, their pages requested up front
                    self.reader.no_readahead(plan.source.file)
                    self.reader.prefetch(plan.source.file, starts.tolist(), ends.tolist())
                    return None
                # many short runs: request the pages they touch (merged into ranges), copy as the pages arrive
                self.filemaps.no_readahead(plan.source.file, int(starts.min()), int(ends.max()))
                self.reader.prefetch(plan.source.file, *_page_ranges(starts, ends))
        data = self.filemaps.bytes(plan.source.file)
        if data is None:
            return None
        end = plan.source.offset + plan.source.nbytes
        if end > len(data):
            raise CheckpointError(
                "file is shorter than its header says (changed while loading?)", file=str(plan.source.file)
            )
        dtype = to_torch(plan.dtype)
        if plan.source.offset % dtype.itemsize:
            return None  # packed at an odd offset (a TVM cache can be): preadv has no alignment needs
        pieces = plan.pieces(rank) or []
        for piece in pieces:  # a GPU rank stages whole rows (or elements): each must fit a staging buffer
            lead = piece.dst[0][1] - piece.dst[0][0] if piece.dst else 1
            if not direct and lead and math.prod(b - a for a, b in piece.dst) * dtype.itemsize // lead > STAGE_BYTES:
                return None
        dest = torch.empty(plan.shape, dtype=dtype, device=device) if out is None else out
        fill_padding(plan, rank, dest)
        if direct:
            self._copy_direct(plan, pieces, key, dest)
            return dest
        file = plan.source.file
        src = data[plan.source.offset : end].view(dtype).view(plan.source.shape)
        if self.staging is None:
            self.staging = _Staging(STAGE_BYTES, max(2, self.threads + 1), pin=device.type == "cuda")
        staging = self.staging
        for piece in pieces:
            d = dest[tuple(slice(a, b) for a, b in piece.dst)]
            s = src[tuple(slice(a, b) for a, b in piece.src)].reshape(d.shape)
            rows = d.shape[0] if d.dim() else 1
            nbytes = d.numel() * d.element_size()
            step = max(1, rows * STAGE_BYTES // max(1, nbytes)) if d.dim() else 1
            for a in range(0, rows, step):
                part = (slice(a, a + step),) if d.dim() else ()

                def job(d: Any = d[part], s: Any = s[part]) -> None:
                    n = d.numel() * d.element_size()
                    buf = staging.acquire()
                    try:
                        host = buf[:n].view(d.dtype).view(d.shape)
                        copy_bytes(host, s)
                        staging.copy(buf, host, d)
                    finally:
                        staging.release(buf)
                    count_mapped(file, n)

                self._submit(job)
        return dest

    def _copy_direct(self, plan: ParamPlan, pieces: Sequence[Piece], key: Any, dest: torch.Tensor) -> None:
        """Submit the strided copies of ``pieces`` out of the file's mapping into the CPU tensor ``dest``, in jobs
        of about ``JOB_BYTES``. The calling thread only hands over numpy views; each job slices them itself."""
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = _copy_program(pieces, dest.element_size(), JOB_BYTES)
        data = self.filemaps.array(plan.source.file) if self.filemaps is not None else None
        assert data is not None  # mapped by the caller
        torch_word, np_word = _words(dest.element_size())
        at = plan.source.offset
        src = data[at : at + plan.source.nbytes].view(np_word).reshape(plan.source.shape)
        out = dest.view(torch_word).numpy()
        file = plan.source.file
        for src_box, dst_box, part in program:
            self._submit(lambda s=src_box, d=dst_box, p=part: _copy_piece(src, out, s, d, p, file))

    def _view(self, plan: ParamPlan, ranks: Sequence[int], key: Any) -> torch.Tensor | None:
        """The rank's tensor as a view of the file mapping, where it is one contiguous stretch of the file."""
        if key not in self.whole:
            runs = self._runs(plan, ranks, key)
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
    ) -> _Schedule:
        """Split ``runs`` (sorted by file offset) between direct reads into CPU tensors and staged ones.

        ``holes`` (per tensor: byte starts and lengths) are padding no run writes: staged uploads leave them out.
        """
        import numpy as np

        direct_buf = np.array([d.type == "cpu" and not self.stage_cpu for d in devices], dtype=bool)
        direct = direct_buf[runs.buf] if len(runs) else np.zeros(0, dtype=bool)
        schedule = _Schedule()
        if direct.any():
            self._plan_direct(runs.take(direct) if not direct.all() else runs, schedule)
        if not direct.all():
            self._plan_staged(runs.take(~direct) if direct.any() else runs, sizes, schedule)
            if holes is not None:
                schedule.batches = [(part, _skip_holes(ups, holes)) for part, ups in schedule.batches]
        return schedule

    def _plan_direct(self, runs: Runs, schedule: _Schedule) -> None:
        from ..planning.runs import dedupe, jobs, split

        reads, copies = dedupe(runs)
        reads = split(reads, JOB_BYTES)
        schedule.jobs += [reads.take(part) for part in jobs(reads, JOB_BYTES)]
        if len(copies):
            schedule.copies.append(copies)

    def _plan_staged(self, runs: Runs, sizes: list[int], schedule: _Schedule) -> None:
        import numpy as np

        from ..planning.runs import Runs, chunks, dedupe

        size = STAGE_BYTES
        reads, copies = dedupe(runs)
        if len(copies):
            schedule.copies.append(copies)
        if len(set(sizes)) == 1 and size // len(sizes) >= STAGE_MIN_SLICE:
            # rank tensors: batch k holds bytes [k c, (k+1) c) of every tensor, tensor b at b c, so the
            # row parts of a column slice arrive in one pass over the file
            c = size // len(sizes)
            for k, part in chunks(reads, c):
                lo = k * c
                ups = [(b * c, b, lo, min(lo + c, sizes[b])) for b in sorted(set(part.buf.tolist()))]
                schedule.batches.append((Runs(part.src, part.length, part.buf * 0, part.buf * c + part.dst), ups))
            return
        base = np.concatenate(([0], np.cumsum(sizes)))  # tensors of any sizes, laid end to end
        starts = base.tolist()
        flat = Runs(reads.src, reads.length, reads.buf * 0, base[reads.buf] + reads.dst)
        for k, part in chunks(flat, size):
            lo, hi = k * size, (k + 1) * size
            ups = []
            last = min(len(sizes), int(np.searchsorted(base, hi, "left")))
            for b in range(int(np.searchsorted(base, lo, "right")) - 1, last):
                a, z = max(lo, starts[b]), min(hi, starts[b + 1])
                if z > a:
                    ups.append((a - lo, b, a - starts[b], z - starts[b]))
            schedule.batches.append((part, ups))

    def _start(self, path: Path, offset: int, schedule: _Schedule, dests: list[torch.Tensor]) -> None:
        """Submit ``schedule``'s reads of the tensor at ``offset`` of ``path`` into ``dests``."""
        for job in schedule.jobs:
            self._submit(
                lambda r=job: self.reader.read_runs(path, r.src + offset, r.length, r.buf, r.dst, dests, populate=True)
            )
        if schedule.batches:
            if self.staging is None:
                pin = any(t.device.type == "cuda" for t in dests)
                self.staging = _Staging(STAGE_BYTES, max(2, self.threads + 1), pin=pin)
            staging = self.staging
            for part, ups in schedule.batches:

                def batch(part: Runs = part, ups: list[tuple[int, int, int, int]] = ups) -> None:
                    buf = staging.acquire()
                    try:
                        self.reader.read_runs(path, part.src + offset, part.length, part.buf, part.dst, [buf])
                        for at, b, lo, hi in ups:
                            staging.upload(buf, at, dests[b], lo, hi)
                    finally:
                        staging.release(buf)

                self._submit(batch)
        for copies in schedule.copies:
            self.copies.append((copies, dests))

    def wait(self) -> None:
        """Finish every started read, device upload and copy (re-raising the first failure)."""
        if self.held:
            held, self.held = self.held, None
            for fn in held:
                self._submit(fn)
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
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()
            raise
        if self.staging is not None:
            self.staging.sync()
        copies, self.copies = self.copies, []
        for c, dests in copies:
            _apply_copies(c, dests)

    def close(self) -> None:
        """Stop the pool (jobs not started are cancelled, running ones finish), then unmap the files copied from in
        the background: their page-table entries take tens of milliseconds to tear down."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.staging is not None:
            self.staging.sync()
        if self.filemaps is not None:
            filemaps, self.filemaps = self.filemaps, None
            # not a daemon: interpreter exit waits for it (a daemon thread stopped inside the C call would abort)
            threading.Thread(target=filemaps.release, name="shardload-unmap").start()

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plan_reader(params: Iterable[ParamPlan]) -> RunReader:
    """The reader of the files ``params`` are read from: an object store's, or the local one."""
    return reader_for(next((p.source.file for p in params), None))


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of one dtype, by numpy where it can view them as bytes: single-threaded, the GIL
    released. From a reader thread, torch would start an OpenMP team of its own for each large copy (one per
    reader thread, each as wide as the machine), and those teams fight the reader threads for the cores."""
    import numpy as np
    import torch

    if dst.dim() and dst.stride(-1) == 1 and src.stride(-1) == 1 and dst.device.type == src.device.type == "cpu":
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy(), casting="no")
    else:
        dst.copy_(src)


_WORDS: dict[int, tuple[Any, Any]] = {}


def _words(itemsize: int) -> tuple[Any, Any]:
    """The integer types of ``itemsize`` bytes (every dtype shardload knows has 1, 2, 4 or 8), torch's and numpy's:
    strided copies move words, whatever the dtype. Built on first use: importing this module imports neither."""
    if not _WORDS:
        import numpy as np
        import torch

        _WORDS.update({1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
                       8: (torch.int64, np.int64)})  # fmt: skip
    return _WORDS[itemsize]


def _copy_program(
    pieces: Sequence[Piece], itemsize: int, block: int
) -> list[tuple[tuple[slice, ...], tuple[slice, ...], tuple[slice, ...]]]:
    """Per job: the source box, the destination box and the rows of that box it copies (about ``block`` bytes),
    computed once per parameter structure."""
    program = []
    for piece in pieces:
        src_box = tuple(slice(a, b) for a, b in piece.src)
        dst_box = tuple(slice(a, b) for a, b in piece.dst)
        if not piece.dst:
            program.append((src_box, dst_box, ()))
            continue
        rows = piece.dst[0][1] - piece.dst[0][0]
        nbytes = math.prod(b - a for a, b in piece.dst) * itemsize
        step = max(1, rows * block // max(1, nbytes))
        program += [(src_box, dst_box, (slice(a, a + step),)) for a in range(0, rows, step)]
    return program


def _copy_piece(
    src: Any, out: Any, src_box: tuple[slice, ...], dst_box: tuple[slice, ...], part: tuple[slice, ...], file: Path
) -> None:
    """One job: copy rows ``part`` of source box ``src_box`` of ``src`` (a mapping's words) into ``dst_box`` of
    ``out``, with the GIL released during the copy; the fresh destination pages are faulted in in one call first."""
    import numpy as np

    d = out[dst_box or ...]  # a 0-d box: ``[()]`` would give a scalar, not a view
    s = src[src_box or ...]
    if part and s.shape[:1] == d.shape[:1]:  # rows line up: reshape only this job's rows (never a copy of the box)
        d = d[part]
        s = s[part].reshape(d.shape)
    else:
        s = s.reshape(d.shape)
        if part:
            d, s = d[part], s[part]
    if d.flags.c_contiguous and d.nbytes:
        populate(d.ctypes.data, d.nbytes)
    np.copyto(d, s, casting="no")
    count_mapped(file, d.nbytes)


def fill_padding(plan: ParamPlan, rank: int, dest: torch.Tensor) -> None:
    """Write zeros into the padding of ``rank``'s tensor (:meth:`ParamPlan.zeros`): no byte of it is read, and no
    run writes it, so this runs before or beside the reads (on a GPU, on the default stream the uploads wait for)."""
    for box in plan.zeros(rank):
        dest[tuple(slice(a, b) for a, b in box)].zero_()


def _skip_holes(
    ups: list[tuple[int, int, int, int]], holes: Sequence[tuple[Any, Any]]
) -> list[tuple[int, int, int, int]]:
    """Staged uploads ``(buffer offset, tensor, start, stop)`` cut so none covers a hole (padding, zeros already
    written into the tensor, that the staging buffer holds no bytes for)."""
    import numpy as np

    out = []
    for at, b, lo, hi in ups:
        starts, lengths = holes[b]  # sorted, disjoint
        ends = starts + lengths
        first, last = int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(starts, hi, "left"))
        cut = lo
        for start, end in zip(starts[first:last].tolist(), ends[first:last].tolist(), strict=True):
            if start > cut:
                out.append((at + cut - lo, b, cut, start))
            cut = max(cut, end)
        if cut < hi:
            out.append((at + cut - lo, b, cut, hi))
    return out


def _page_ranges(starts: Any, ends: Any) -> tuple[list[int], list[int]]:
    """The byte ranges of whole pages that runs ``[starts[i], ends[i])`` (sorted) touch, adjacent pages merged."""
    first = (starts // PAGE).tolist()
    last = ((ends - 1) // PAGE).tolist()
    lo: list[int] = []
    hi: list[int] = []
    for a, b in zip(first, last, strict=True):
        if hi and a <= hi[-1]:
            hi[-1] = max(hi[-1], b + 1)
        else:
            lo.append(a)
            hi.append(b + 1)
    return [x * PAGE for x in lo], [x * PAGE for x in hi]


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
    """A few host buffers of ``size`` bytes (page-locked with ``pin``) cycled between reads and uploads."""

    def __init__(self, size: int, depth: int, *, pin: bool) -> None:
        import torch

        self.pin = pin
        self.free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.events: dict[int, list[Any]] = {}
        self.streams: dict[Any, Any] = {}
        self.lock = threading.Lock()
        for _ in range(depth):
            self.free.put(torch.empty(size, dtype=torch.uint8, pin_memory=pin))

    def acquire(self) -> torch.Tensor:
        """A free buffer whose earlier uploads have completed."""
        buf = self.free.get()
        with self.lock:
            events = self.events.pop(buf.data_ptr(), [])
        for event in events:
            event.synchronize()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Hand a buffer back (its uploads may still be in flight: their events guard its reuse)."""
        self.free.put(buf)

    def _stream(self, device: Any) -> Any:
        import torch

        with self.lock:
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
            return stream

    def upload(self, buf: torch.Tensor, offset: int, dest: torch.Tensor, lo: int, hi: int) -> None:
        """Copy ``hi - lo`` bytes at ``offset`` of ``buf`` to bytes ``[lo, hi)`` of ``dest``."""
        import torch

        self.copy(buf, buf[offset : offset + hi - lo], dest.reshape(-1).view(torch.uint8)[lo:hi])

    def copy(self, buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` (a view of ``buf``) into ``dst``: on a CUDA device a non-blocking copy on a side stream,
        with an event that keeps ``buf`` from reuse until it completes."""
        import torch

        if dst.device.type == "cuda" and self.pin:
            stream = self._stream(dst.device)
            # ``dest`` was allocated on the default stream, whose queued work may still use its memory's last owner
            stream.wait_stream(torch.cuda.default_stream(dst.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            with self.lock:
                self.events.setdefault(buf.data_ptr(), []).append(event)
        else:
            dst.copy_(src)

    def sync(self) -> None:
        """Wait for every upload issued so far."""
        for stream in self.streams.values():
            stream.synchronize()
