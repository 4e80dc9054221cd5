"""Strided copies out of a read-only file mapping: the jobs in which a single rank's pieces are copied into its
tensor, straight into a CPU tensor (numpy, the GIL released, fresh destination pages populated in one call) or
gathered into staging buffers for a device. Each job is a callable for the executor's reader threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..sources.reader import count_mapped, populate

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..planning.plan import Piece
    from ..sources.tensor_info import TensorInfo
    from .staging import StagingBuffers

Job = Callable[[], None]


@dataclass(frozen=True)
class CopyJob:
    """One strided copy of a rank's piece: rows ``rows`` (None: all of it) of the source box ``src`` into the
    destination box ``dst``. Boxes are slices per dimension (empty for a 0-d tensor)."""

    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    rows: slice | None


def copy_program(pieces: Sequence[Piece], itemsize: int, block: int) -> list[CopyJob]:
    """The jobs that copy ``pieces`` of ``itemsize``-byte elements, about ``block`` bytes each (whole rows),
    computed once per parameter structure."""
    program = []
    for piece in pieces:
        src_box = tuple(slice(a, b) for a, b in piece.src)
        dst_box = tuple(slice(a, b) for a, b in piece.dst)
        if not piece.dst:
            program.append(CopyJob(src_box, dst_box, None))
            continue
        rows = piece.dst[0][1] - piece.dst[0][0]
        nbytes = math.prod(b - a for a, b in piece.dst) * itemsize
        step = max(1, rows * block // max(1, nbytes))
        program += [CopyJob(src_box, dst_box, slice(a, a + step)) for a in range(0, rows, step)]
    return program


def mapped_copy_jobs(program: list[CopyJob], mapping: np.ndarray, source: TensorInfo, dest: torch.Tensor) -> list[Job]:
    """The jobs of ``program`` copying the stored tensor ``source`` out of ``mapping`` (its file's bytes) into the
    CPU tensor ``dest``. Only numpy views are made here; each job slices out its own rows."""
    torch_word, np_word = _words(dest.element_size())
    src = mapping[source.offset : source.offset + source.nbytes].view(np_word).reshape(source.shape)
    out = dest.view(torch_word).numpy()
    return [partial(_run_copy, job, src, out, source.file) for job in program]


def staged_copy_jobs(
    mapping: torch.Tensor,
    source: TensorInfo,
    pieces: Sequence[Piece],
    dest: torch.Tensor,
    staging: StagingBuffers,
    after: Any,
) -> list[Job]:
    """The jobs gathering ``pieces`` of the stored tensor ``source`` out of ``mapping`` (its file's bytes) into
    staging buffers, each then uploaded to ``dest`` as one contiguous block (whole rows per buffer: see
    :func:`rows_fit`) behind ``after`` (:func:`~.staging.ready_event`)."""
    src = mapping[source.offset : source.offset + source.nbytes].view(dest.dtype).view(source.shape)
    jobs: list[Job] = []
    for piece in pieces:
        d = dest[tuple(slice(a, b) for a, b in piece.dst)]
        s = src[tuple(slice(a, b) for a, b in piece.src)].reshape(d.shape)
        if not d.dim():
            jobs.append(partial(_stage_copy, d, s, staging, source.file, after))
            continue
        rows = d.shape[0]
        step = max(1, rows * staging.size // max(1, d.numel() * d.element_size()))
        jobs += [partial(_stage_copy, d[a : a + step], s[a : a + step], staging, source.file, after)
                 for a in range(0, rows, step)]  # fmt: skip
    return jobs


def rows_fit(pieces: Sequence[Piece], itemsize: int, limit: int) -> bool:
    """Whether each piece's rows (or elements) fit a staging buffer of ``limit`` bytes: staged copies move whole
    rows."""
    for piece in pieces:
        lead = piece.dst[0][1] - piece.dst[0][0] if piece.dst else 1
        if lead and math.prod(b - a for a, b in piece.dst) * itemsize // lead > limit:
            return False
    return True


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


def _run_copy(job: CopyJob, src: Any, out: Any, file: Path) -> None:
    """Copy ``job``'s rows of ``src`` (a mapping's words) into ``out``, with the GIL released during the copy; the
    fresh destination pages are faulted in in one call first."""
    import numpy as np

    d = out[job.dst or ...]  # a 0-d box: ``[()]`` would give a scalar, not a view
    s = src[job.src or ...]
    if job.rows is not None and s.shape[:1] == d.shape[:1]:  # rows line up: reshape only this job's rows
        d = d[job.rows]
        s = s[job.rows].reshape(d.shape)
    else:
        s = s.reshape(d.shape)
        if job.rows is not None:
            d, s = d[job.rows], s[job.rows]
    if d.flags.c_contiguous and d.nbytes:
        populate(d.ctypes.data, d.nbytes)
    np.copyto(d, s, casting="no")
    count_mapped(file, d.nbytes)


def _stage_copy(d: torch.Tensor, s: torch.Tensor, staging: StagingBuffers, file: Path, after: Any) -> None:
    """Gather ``s`` (a view of a mapping) into a staging buffer, then copy that on to ``d`` (behind ``after``)."""
    n = d.numel() * d.element_size()
    buf = staging.acquire()
    try:
        host = buf[:n].view(d.dtype).view(d.shape)
        copy_bytes(host, s)
        staging.copy(buf, host, d, after)
    finally:
        staging.release(buf)
    count_mapped(file, n)


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
