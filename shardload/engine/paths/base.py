"""The data-path seam: :class:`DataPath`, how one load's bytes reach its destination tensors, and
:class:`LoadContext`, what a path may use of the executor that runs its jobs (:mod:`shardload.engine.transfer`).

The executor sets every parameter up through its path, then runs the jobs the path submitted. By default a
parameter's bytes follow its read schedule (:mod:`..read_schedule`): ``preadv`` jobs straight into the tensors
the path fills directly (:meth:`DataPath.direct`), batches through the host staging buffers for the rest
(:mod:`..staging`: page-locked for CUDA, each uploaded on a side stream). A path takes a parameter another way by
returning its tensors from :meth:`DataPath.param` (a view of a mapping, copies out of one, planned cold reads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..staging import StagingBuffers, shared_staging

if TYPE_CHECKING:
    import torch

    from ...planning.plan import ParamPlan
    from ...sources.reader import RunReader
    from ...sources.tensor_info import TensorInfo
    from ..read_schedule import StagedBatch, StructureKey, StructureRuns
    from ..read_strategy import ReadOptions


@dataclass(frozen=True)
class LoadContext:
    """What a data path uses of its load's executor: the reader, the read options, the shared runs of each
    parameter structure, the job queue, and the executor's job and staging sizes."""

    reader: RunReader
    options: ReadOptions
    runs: StructureRuns
    submit: Callable[..., None]
    """``submit(fn, io=False)``: run ``fn`` on the reader threads (``io``: among the planned cold reads)."""
    threads: int
    job_bytes: int
    """Bytes per job (``preadv`` jobs into CPU tensors, strided copies out of a mapping)."""
    stage_bytes: int
    """Bytes per staging buffer."""


class DataPath:
    """How one load's bytes reach their destination tensors; one object per load, chosen by
    :func:`~shardload.engine.paths.data_path_for` and bound to the executor when it starts.

    A subclass decides :meth:`direct` (which tensors ``preadv`` fills in place, the rest going through the staging
    buffers) and may take whole parameters its own way in :meth:`param` and stored tensors in :meth:`tensors`;
    whatever it returns None for follows the read schedule. Jobs go to ``self.ctx.submit``; work a path holds back
    (batches) goes out in :meth:`flush`.
    """

    ctx: LoadContext

    def __init__(self) -> None:
        self.staging_pools: dict[tuple[int, bool], StagingBuffers] = {}
        """The staging pools this load took, by buffer size and page-locking (the host path's batches, the device
        path's spans)."""

    def bind(self, ctx: LoadContext) -> None:
        """Attach the path to its load's executor (once: a path serves one load)."""
        if getattr(self, "ctx", None) is not None:
            raise RuntimeError("a data path serves one load; choose a new one (data_path_for) for the next")
        self.ctx = ctx

    def direct(self, device: torch.device) -> bool:
        """Whether a tensor on ``device`` is filled in place (else through the staging buffers): host memory is."""
        return device.type == "cpu"

    def param(
        self,
        plan: ParamPlan,
        ranks: Sequence[int],
        devices: Sequence[torch.device],
        key: StructureKey,
        out: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor] | None:
        """``plan``'s tensors for ``ranks``, being filled this path's own way, or None to follow the read
        schedule (``key``: the plan's structure; ``out``: the caller's tensors, on ``devices``)."""
        return None

    def tensors(self, infos: Sequence[TensorInfo], device: Any) -> list[torch.Tensor | None] | None:
        """Whole stored tensors on ``device`` this path gives without reading them (None where it does not), or
        None for none of them."""
        return None

    def staging(self, *, pin: bool, size: int | None = None) -> StagingBuffers:
        """The staging buffers of ``size`` bytes (None: the executor's staging size): this process's pool
        (:func:`~shardload.engine.staging.shared_staging`, page-locked with ``pin``), taken on first use."""
        size = self.ctx.stage_bytes if size is None else size
        pool = self.staging_pools.get((size, pin))
        if pool is None:
            pool = self.staging_pools[size, pin] = shared_staging(size, max(2, self.ctx.threads + 1), pin=pin)
        return pool

    def read_staged(
        self,
        staging: StagingBuffers,
        path: Path,
        offset: int,
        batch: StagedBatch,
        dests: list[torch.Tensor],
        afters: Sequence[Any],
    ) -> None:
        """One staged batch: read its runs into a free buffer, then upload the buffer's parts to ``dests`` (each
        behind its ``afters`` event, :func:`~..staging.ready_event`)."""
        buf = staging.acquire()
        try:
            part = batch.runs
            self.ctx.reader.read_runs(path, part.src + offset, part.length, part.buf, part.dst, [buf])
            for up in batch.uploads:
                staging.upload(buf, up.at, dests[up.tensor], up.start, up.stop, afters[up.tensor])
        finally:
            staging.release(buf)

    def flush(self) -> None:
        """Submit the work the path holds back (batches of small tensors), before the executor runs its jobs."""

    def pending(self) -> bool:
        """Whether work the path holds back was never submitted."""
        return False

    def sync(self) -> None:
        """Wait for every upload issued so far."""
        for pool in self.staging_pools.values():
            pool.sync()

    def close(self) -> None:
        """Release what the path holds once its load's jobs have stopped."""
        self.sync()


def fill_padding(plan: ParamPlan, rank: int, dest: torch.Tensor) -> None:
    """Write zeros into the padding of ``rank``'s tensor (:meth:`ParamPlan.zeros`): no byte of it is read, and no
    run writes it, so this runs before or beside the reads (on a GPU, on the default stream the uploads wait for)."""
    for box in plan.zeros(rank):
        dest[tuple(slice(a, b) for a, b in box)].zero_()
