"""Read schedules: a parameter's byte runs cut into thread-pool jobs that ``preadv`` straight into CPU tensors,
batches that fill one staging buffer each for the other devices, and the copies that replace re-reads of bytes
several ranks hold. A schedule's file offsets are relative to the stored tensor, so every parameter of one
structure (every layer of a model) shares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planning.plan import ParamPlan
    from ..planning.runs import Copies, Runs

STAGE_MIN_SLICE = 64 << 10
"""Rank tensors share a staging buffer in slices of at least this many bytes each."""

StructureKey = tuple[Any, ...]
"""A parameter's structure (:func:`~shardload.planning.runs.structure`) and its destinations' devices: what
parameters that share runs, read schedules and copy programs have in common."""


@dataclass(frozen=True)
class Upload:
    """Bytes ``[start, stop)`` of destination tensor ``tensor``, held at offset ``at`` of a staging buffer."""

    at: int
    tensor: int
    start: int
    stop: int


@dataclass(frozen=True)
class StagedBatch:
    """What one staging buffer carries: the runs read into it (their destinations are buffer offsets) and the
    uploads that take its bytes on to the destination tensors."""

    runs: Runs
    uploads: list[Upload]


@dataclass
class ReadSchedule:
    """How one parameter's runs are read: direct jobs into CPU tensors, staged batches for the others, and the
    copies that replace re-reads."""

    jobs: list[Runs] = field(default_factory=list)
    batches: list[StagedBatch] = field(default_factory=list)
    copies: list[Copies] = field(default_factory=list)


class StructureRuns:
    """Each parameter structure's runs, file offsets relative to the stored tensor, built once and shared by every
    parameter of that structure."""

    def __init__(self) -> None:
        self.relative: dict[StructureKey, Runs | None] = {}

    def get(self, plan: ParamPlan, ranks: Sequence[int], key: StructureKey) -> Runs | None:
        """``plan``'s runs for ``ranks`` (None: the tensor is read whole), ``key`` naming its structure."""
        from ..planning.runs import param_runs, shifted

        if key not in self.relative:
            runs = param_runs(plan, ranks)
            self.relative[key] = None if runs is None else shifted(runs, -plan.source.offset)
        return self.relative[key]


def build_schedule(
    runs: Runs,
    sizes: list[int],
    direct: Sequence[bool],
    *,
    job_bytes: int,
    stage_bytes: int,
    holes: Sequence[tuple[Any, Any]] | None = None,
) -> ReadSchedule:
    """Split ``runs`` (sorted by file offset) between jobs reading straight into the tensors ``direct`` marks (jobs
    of about ``job_bytes``) and batches of ``stage_bytes`` through staging buffers for the others.

    ``sizes`` are the tensors' byte sizes; ``holes`` (per tensor: byte starts and lengths) are padding no run
    writes: staged uploads leave them out.
    """
    import numpy as np

    direct_buf = np.array(direct, dtype=bool)
    into = direct_buf[runs.buf] if len(runs) else np.zeros(0, dtype=bool)
    schedule = ReadSchedule()
    if into.any():
        _plan_direct(runs.take(into) if not into.all() else runs, schedule, job_bytes)
    if not into.all():
        _plan_staged(runs.take(~into) if into.any() else runs, sizes, schedule, stage_bytes)
        if holes is not None:
            schedule.batches = [StagedBatch(b.runs, _skip_holes(b.uploads, holes)) for b in schedule.batches]
    return schedule


def _plan_direct(runs: Runs, schedule: ReadSchedule, job_bytes: int) -> None:
    """Jobs of about ``job_bytes`` reading ``runs`` into their tensors, each stored byte read once."""
    from ..planning.runs import dedupe, jobs, split

    reads, copies = dedupe(runs)
    reads = split(reads, job_bytes)
    schedule.jobs += [reads.take(part) for part in jobs(reads, job_bytes)]
    if len(copies):
        schedule.copies.append(copies)


def _plan_staged(runs: Runs, sizes: list[int], schedule: ReadSchedule, size: int) -> None:
    """Batches of ``size`` bytes (one staging buffer each) carrying ``runs`` to their tensors."""
    import numpy as np

    from ..planning.runs import Runs, chunks, dedupe

    reads, copies = dedupe(runs)
    if len(copies):
        schedule.copies.append(copies)
    if len(set(sizes)) == 1 and size // len(sizes) >= STAGE_MIN_SLICE:
        # rank tensors: batch k holds bytes [k c, (k+1) c) of every tensor, tensor b at b c, so the
        # row parts of a column slice arrive in one pass over the file
        c = size // len(sizes)
        for k, part in chunks(reads, c):
            lo = k * c
            ups = [Upload(b * c, b, lo, min(lo + c, sizes[b])) for b in sorted(set(part.buf.tolist()))]
            schedule.batches.append(
                StagedBatch(Runs(part.src, part.length, part.buf * 0, part.buf * c + part.dst), ups)
            )
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
                ups.append(Upload(a - lo, b, a - starts[b], z - starts[b]))
        schedule.batches.append(StagedBatch(part, ups))


def _skip_holes(uploads: list[Upload], holes: Sequence[tuple[Any, Any]]) -> list[Upload]:
    """``uploads`` cut so none covers a hole (padding, zeros already written into the tensor, that the staging
    buffer holds no bytes for)."""
    import numpy as np

    out = []
    for up in uploads:
        starts, lengths = holes[up.tensor]  # sorted, disjoint
        ends = starts + lengths
        first = int(np.searchsorted(ends, up.start, "right"))
        last = int(np.searchsorted(starts, up.stop, "left"))
        cut = up.start
        for start, end in zip(starts[first:last].tolist(), ends[first:last].tolist(), strict=True):
            if start > cut:
                out.append(Upload(up.at + cut - up.start, up.tensor, cut, start))
            cut = max(cut, end)
        if cut < up.stop:
            out.append(Upload(up.at + cut - up.start, up.tensor, cut, up.stop))
    return out
