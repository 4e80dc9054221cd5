"""Planned reads of cold storage for a single rank's CPU tensors (``sources/read_plan``): a parameter's pages merged
across cheap gaps into large reads, all requested up front, then :attr:`ReadOptions.io_depth` of them at once, each
one ``preadv`` into the tensor (the gap bytes into a small per-thread sink). The host path
(:class:`~shardload.engine.paths.host.HostPath`) takes a parameter this way where its read strategy says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...sources.dtypes import to_torch
from ...sources.reader import PAGE, count_requested
from .base import LoadContext, fill_padding

if TYPE_CHECKING:
    import torch

    from ...planning.plan import ParamPlan
    from ...sources.read_plan import FilledRuns, IoModel
    from ...sources.reader import FileMaps
    from ..read_schedule import StructureKey


@dataclass(frozen=True)
class PlannedReads:
    """A structure's planned cold reads (offsets relative to the page holding its tensor's first byte): the filled
    runs, where each read's runs start in them, and the byte counts of the plan."""

    runs: FilledRuns
    bounds: list[int]
    """Where each job's runs start in :attr:`runs` (a job: consecutive reads of about ``job_bytes``)."""
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


class ColdReads:
    """A single rank's planned cold reads, each structure's plan made once per page skew; :attr:`io` tallies them."""

    def __init__(self, ctx: LoadContext, filemaps: FileMaps | None) -> None:
        self.ctx = ctx
        self.filemaps = filemaps
        self.planned: dict[tuple[StructureKey, int], PlannedReads | None] = {}
        self.io = IoTally()
        self.sinks = threading.local()

    def param(
        self,
        plan: ParamPlan,
        rank: int,
        key: StructureKey,
        device: torch.device,
        out: torch.Tensor | None,
        copy_out: Callable[[], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """The rank's CPU tensor, being filled by the planned cold reads of its bytes, or for short runs by
        ``copy_out`` (strided copies out of the mapping) once their pages are requested. None where the runs
        overlap (read exactly)."""
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
        reader = self.ctx.reader
        reader.no_readahead(source.file)  # type: ignore[attr-defined]
        lo, hi = (x + base for x in planned.ranges)
        reader.prefetch(source.file, lo, hi)  # the whole queue, up front
        if planned.short and self.filemaps is not None:
            # runs shorter than half a page (a column slice): copied out of the mapping as the requested pages
            # arrive, since a preadv would copy the other ranks' bytes of every page into the sink as well
            self.filemaps.no_readahead(source.file, int(lo[0]), int(hi[-1]))
            copied = copy_out()
            if copied is not None:
                count_requested(source.file, planned.moved - planned.used)  # the copies count the bytes used
                return copied
        dest = torch.empty(plan.shape, dtype=to_torch(plan.dtype), device=device) if out is None else out
        fill_padding(plan, rank, dest)
        for a, b in zip(planned.bounds[:-1], planned.bounds[1:], strict=True):
            self.ctx.submit(lambda a=a, b=b: self._read(source.file, base, planned.runs, a, b, dest), io=True)
        return dest

    def _plan_reads(self, plan: ParamPlan, rank: int, key: StructureKey, skew: int) -> PlannedReads | None:
        """A structure's planned reads for a tensor ``skew`` bytes into its first page (None: overlapping runs)."""
        import numpy as np

        from ...sources.read_plan import fill_reads, plan_reads

        rel = self.ctx.runs.get(plan, [rank], key)
        if rel is None or not len(rel):
            return None
        order = np.argsort(rel.src, kind="stable")
        src, length, buf, dst = rel.src[order] + skew, rel.length[order], rel.buf[order], rel.dst[order]
        if len(src) > 1 and bool((src[1:] < src[:-1] + length[:-1]).any()):
            return None
        model = self.io_model(plan.source.file)
        max_waste = self.ctx.options.max_waste
        reads = plan_reads(src, src + length, model, max_waste=max_waste, limit=skew + plan.source.nbytes)
        filled = fill_reads(reads, src, length, buf, dst, sink=1)
        lo = np.array([r.offset for r in reads.reads], dtype=np.int64)
        hi = np.array([r.end for r in reads.reads], dtype=np.int64)
        first = np.flatnonzero(np.diff(filled.read, prepend=-1))  # each read's first run
        # jobs of whole reads, about job_bytes each: one read_runs call, one preadv per read
        job = (np.cumsum(hi - lo) - (hi - lo)) // self.ctx.job_bytes
        starts = np.flatnonzero(np.diff(job, prepend=-1))
        bounds = [*first[starts].tolist(), len(filled.src)]
        short = int(length.sum()) < len(length) * (PAGE // 2)
        return PlannedReads(filled, bounds, (lo, hi), len(lo), short, reads.used, reads.moved, reads.page_floor)

    def io_model(self, path: Path) -> IoModel:
        """The I/O model cold reads of ``path`` are planned with: the caller's, else the file system's, measured."""
        if self.ctx.options.io_model is not None:
            return self.ctx.options.io_model
        from ...sources.io_model import io_model

        return io_model(path)

    def _read(self, path: Path, base: int, runs: FilledRuns, a: int, b: int, dest: torch.Tensor) -> None:
        """One planned read: runs ``[a, b)`` of ``runs`` (one stretch of the file) into ``dest`` and the sink."""
        import torch

        sink = getattr(self.sinks, "buf", None)
        if sink is None or sink.numel() < max(1, runs.sink):
            sink = self.sinks.buf = torch.empty(max(runs.sink, 64 << 10), dtype=torch.uint8)
        self.ctx.reader.read_runs(  # type: ignore[call-arg]
            path, runs.src[a:b] + base, runs.length[a:b], runs.buf[a:b], runs.dst[a:b], [dest, sink],
            populate=True, sink=1,
        )  # fmt: skip
