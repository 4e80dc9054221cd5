"""The host-memory path: CPU tensors filled in place by ``preadv`` (and any other device's through the staging
buffers). A single rank's load (``one_rank``) lets its read strategy (:mod:`..read_strategy`) pick per parameter
between strided copies out of a read-only mapping (:mod:`..copy_jobs`), ``preadv`` of its exact runs, and planned
reads of cold storage (:mod:`.planned`); a single rank's small whole tensors go in batches, one job per
:data:`SMALL_BATCH` of them. Nothing is mapped when the reader's files cannot be (``reader.can_map`` False: an
object store); every byte is then read with ``read_runs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ...sources.dtypes import to_torch
from ...sources.reader import FileMaps, RunReader, count_mapped
from ..copy_jobs import CopyJob, copy_program, mapped_copy_jobs, rows_fit, staged_copy_jobs
from ..read_strategy import ReadStrategy, Way
from ..staging import ready_event
from .base import DataPath, LoadContext, fill_padding
from .planned import ColdReads, IoTally

if TYPE_CHECKING:
    import torch

    from ...planning.plan import ParamPlan
    from ..read_schedule import StructureKey

SMALL_BYTES = 64 << 10
"""A whole tensor up to this size copied out of a mapping joins a batch of its file's small tensors, one job per
:data:`SMALL_BATCH` of them (or ``job_bytes``), instead of a job of its own: a file of 200,000 norms and scales
then costs a few dozen jobs, not 200,000 closures and futures."""
SMALL_BATCH = 4096

Batch = list[tuple[int, int, "torch.Tensor"]]
"""Small whole tensors of one file: ``(offset, nbytes, dest)``."""


class HostPath(DataPath):
    """Host memory: CPU tensors read in place; with ``one_rank``, a single rank's read strategy per parameter."""

    def __init__(self, *, one_rank: bool = False) -> None:
        super().__init__()
        self.one_rank = one_rank
        self.filemaps: FileMaps | None = None
        self.strategy: ReadStrategy | None = None
        self.cold: ColdReads | None = None
        self.programs: dict[StructureKey, list[CopyJob]] = {}
        self.small: dict[Any, Batch] = {}
        """Per file, small whole tensors waiting to be read (or copied out of its mapping) as one job."""

    def bind(self, ctx: LoadContext) -> None:
        """Attach to the executor; a single rank's load maps its files (where the reader can) for its strategy."""
        super().bind(ctx)
        if self.one_rank and ctx.reader.can_map:  # an object store has no file to map
            self.filemaps = FileMaps()
            self.strategy = ReadStrategy(ctx.options, ctx.reader, self.filemaps, ctx.runs)
        self.cold = ColdReads(ctx, self.filemaps)

    @property
    def io(self) -> IoTally:
        """What the planned cold reads used and moved, and their page floor."""
        assert self.cold is not None
        return self.cold.io

    def param(
        self,
        plan: ParamPlan,
        ranks: Sequence[int],
        devices: Sequence[torch.device],
        key: StructureKey,
        out: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor] | None:
        """A single rank's tensor the way its read strategy says (copies out of a mapping, planned cold reads), or
        a single CPU rank's small whole tensor as one of a batch; None: the read schedule."""
        import torch

        if len(ranks) != 1:
            return None
        rank, device, dest = ranks[0], devices[0], None if out is None else out[0]
        if self.strategy is not None:
            way = self.strategy.way(plan, rank, key, direct=self.direct(device))
            got = None
            if way is Way.MAP:
                got = self._copy_out(plan, rank, key, device, dest)
            elif way is Way.PLAN:
                assert self.cold is not None
                copy = partial(self._copy_out, plan, rank, key, device, dest)
                got = self.cold.param(plan, rank, key, device, dest, copy)
            return None if got is None else [got]
        if _small(plan) and device.type == "cpu":
            # a reader that cannot map (verifying, object storage): small whole tensors read as one batch of runs
            dest = torch.empty(plan.shape, dtype=to_torch(plan.dtype)) if dest is None else dest
            self._copy_small(plan.source.file, plan.source.offset, plan.source.nbytes, dest)
            return [dest]
        return None

    def _copy_out(
        self, plan: ParamPlan, rank: int, key: StructureKey, device: torch.device, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The rank's tensor, being filled by strided copies out of a read-only mapping of its file (None: read it
        with ``preadv`` instead). Where the path does not fill it in place (a GPU, or the staged path) the copies
        gather the rank's bytes into the staging buffers, each upload one contiguous block."""
        import torch

        assert self.filemaps is not None
        ctx, direct, source = self.ctx, self.direct(device), plan.source
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
        if not direct and not rows_fit(pieces, dtype.itemsize, ctx.stage_bytes):
            return None  # a GPU rank stages whole rows (or elements): each must fit a staging buffer
        dest = torch.empty(plan.shape, dtype=dtype, device=device) if out is None else out
        if direct and _small(plan):
            self._copy_small(source.file, source.offset, source.nbytes, dest)
            return dest
        fill_padding(plan, rank, dest)
        if direct:
            program = self.programs.get(key)
            if program is None:
                program = self.programs[key] = copy_program(pieces, dest.element_size(), ctx.job_bytes)
            mapping = self.filemaps.array(source.file)
            assert mapping is not None  # mapped above
            jobs = [partial(_intact_then, self.filemaps, source.file, source.offset + source.nbytes, job)
                    for job in mapped_copy_jobs(program, mapping, source, dest)]  # fmt: skip
        else:
            staged = staged_copy_jobs(data, source, pieces, dest, self.staging(pin=device.type == "cuda"),
                                      ready_event(device))  # fmt: skip
            end = source.offset + source.nbytes  # a file cut meanwhile read zeros (fault_guard): never returned
            jobs = [partial(_intact_then, self.filemaps, source.file, end, job) for job in staged]
        for job in jobs:
            ctx.submit(job)
        return dest

    def _copy_small(self, path: Any, offset: int, nbytes: int, dest: torch.Tensor) -> None:
        """Queue a small whole tensor's copy out of ``path``'s mapping (or read); a full batch becomes one job."""
        batch = self.small.setdefault(path, [])
        batch.append((offset, nbytes, dest))
        if len(batch) >= SMALL_BATCH:
            self.ctx.submit(self._small_job(path, self.small.pop(path)))

    def _small_job(self, path: Any, batch: Batch) -> Callable[[], None]:
        if self.filemaps is not None:
            return partial(_copy_batch, self.filemaps, path, batch)
        return partial(_read_batch, self.ctx.reader, path, batch)

    def flush(self) -> None:
        """Submit the batches of small tensors not yet full."""
        small, self.small = self.small, {}
        for path, batch in small.items():
            self.ctx.submit(self._small_job(path, batch))

    def pending(self) -> bool:
        """Whether a batch of small tensors was never submitted."""
        return bool(self.small)

    def close(self) -> None:
        """Wait for the uploads, then unmap the files copied from in the background: their page-table entries take
        tens of milliseconds to tear down."""
        super().close()
        if self.filemaps is not None:
            filemaps, self.filemaps = self.filemaps, None
            # not a daemon: interpreter exit waits for it (a daemon thread stopped inside the C call would abort)
            threading.Thread(target=filemaps.release, name="shardload-unmap").start()


def _intact_then(filemaps: FileMaps, path: Path, end: int, job: Callable[[], None]) -> None:
    """Run a copy job out of ``path``'s mapping once the file still holds its ``end`` bytes."""
    filemaps.intact(path, end)
    job()
    filemaps.intact(path, end)  # cut during the job: it read zeros past the cut (fault_guard), never returned


def _copy_batch(filemaps: FileMaps, path: Path, batch: Batch) -> None:
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


def _read_batch(reader: RunReader, path: Path, batch: Batch) -> None:
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
