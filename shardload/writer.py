"""Writing the rank files of a converted directory, streamed through bounded staging buffers.

Each rank's safetensors header is known from the plan and written first. Tensor bytes then move
in chunks: the main thread scatters one chunk of every rank's bytes from the checkpoint into a
staging set (``preadv``), while worker threads write the previous chunk (``pwrite``) and feed it
to each file's sha256, so reading, writing and hashing overlap. Writeback is started as data is
written (``sync_file_range`` where the platform has it), and each file is fsynced at the end.
Memory stays at two staging sets, whatever the size of the model.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dtypes import DTYPES
from .reader import Reader, buffer_view
from .transfer import READ_THREADS

if TYPE_CHECKING:
    import torch

    from .plan import ModelPlan

STAGE_SET_BYTES = 16 << 20
"""Bytes of one staging set: one buffer per rank, of ``STAGE_CHUNK_LIMITS`` bytes each; two sets are in use."""
STAGE_CHUNK_LIMITS = (256 << 10, 4 << 20)
WRITEBACK_BYTES = 16 << 20
"""Start writeback of a file each time this many more bytes have been written to it."""
SYNC_FILE_RANGE_WRITE = 2


@dataclass(frozen=True)
class WrittenFile:
    """A finished rank file: its name, size and sha256."""

    name: str
    size: int
    sha256: str


def rank_header(plan: ModelPlan, rank: int) -> bytes:
    """The safetensors header of ``rank``'s file (length prefix included, padded to 8 bytes)."""
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "shardload.rank": str(rank), "shardload.num_shards": str(plan.num_shards)}
    }
    offset = 0
    for p in plan.params.values():
        header[p.name] = {
            "dtype": DTYPES[p.dtype][0],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.rank_nbytes],
        }
        offset += p.rank_nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


class _RankFile:
    """One output file: appended to by one task at a time, hashed as written, fsynced on finish."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.hash = hashlib.sha256()
        self.size = 0
        self.flushed = 0

    def write(self, data: memoryview) -> None:
        """Append ``data``: write it at the end of the file and add it to the hash."""
        offset, view = self.size, data
        try:
            while len(view):
                done = os.pwrite(self.fd, view, offset)
                view, offset = view[done:], offset + done
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.path)) from None
        self.hash.update(data)
        self.size = offset
        if _SYNC_FILE_RANGE is not None and self.size - self.flushed >= WRITEBACK_BYTES:
            _SYNC_FILE_RANGE(self.fd, self.flushed, self.size - self.flushed, SYNC_FILE_RANGE_WRITE)
            self.flushed = self.size

    def finish(self) -> WrittenFile:
        """Flush the file to stable storage and close it."""
        try:
            os.fsync(self.fd)
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.path)) from None
        self.close()
        return WrittenFile(self.path.name, self.size, self.hash.hexdigest())

    def close(self) -> None:
        """Close without flushing (after an error the file is removed with its directory)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_rank_files(
    plan: ModelPlan,
    names: list[Path],
    progress: Callable[[int, str], None] | None = None,
    *,
    threads: int | None = None,
) -> list[WrittenFile]:
    """Write rank r's safetensors file to ``names[r]`` for every rank of ``plan``; new files only.

    ``progress(source_bytes_done, param_name)`` is called after each parameter is read.
    """
    import torch

    from .execute import run_steps
    from .runs import chunks, param_runs

    n = plan.num_shards
    files: list[_RankFile] = []
    pending: list[Future[None]] = []

    def settle() -> None:
        nonlocal pending
        done, pending = pending, []
        for f in done:
            f.result()

    try:
        for path in names:
            files.append(_RankFile(path))
        for r, f in enumerate(files):
            f.write(memoryview(rank_header(plan, r)))
        low, high = STAGE_CHUNK_LIMITS
        chunk = min(high, max(low, STAGE_SET_BYTES // n))
        sets = [[torch.empty(chunk, dtype=torch.uint8) for _ in range(n)] for _ in range(2)]
        views = [[buffer_view(t) for t in s] for s in sets]
        turn = 0
        source_done = 0
        with Reader() as reader, ThreadPoolExecutor(threads or READ_THREADS) as pool:
            try:
                for param in plan.params.values():
                    runs = param_runs(param, range(n))
                    if runs is None:  # a compute step: the whole tensor, then each rank's slice
                        full = torch.empty(param.source.shape, dtype=_torch_dtype(param.source.dtype))
                        reader.read_tensor(param.source.file, param.source.offset, full)
                        out = run_steps(param, full)
                        shards = [out[r].contiguous() for r in range(n)]
                        settle()
                        pending = [pool.submit(_write_tensor, f, t) for f, t in zip(files, shards, strict=True)]
                    else:
                        for k, part in chunks(runs, chunk):
                            bufs, mvs = sets[turn], views[turn]
                            turn ^= 1
                            reader.read_runs(param.source.file, part.src, part.length, part.buf, part.dst, bufs)
                            size = min(chunk, param.rank_nbytes - k * chunk)
                            settle()
                            pending = [pool.submit(f.write, mvs[r][:size]) for r, f in enumerate(files)]
                    source_done += param.source.nbytes
                    if progress is not None:
                        progress(source_done, param.name)
                settle()
                return list(pool.map(_RankFile.finish, files))
            finally:
                for f in pending:
                    f.cancel()
                for f in pending:
                    if not f.cancelled():
                        f.exception()
    finally:
        for f in files:
            f.close()


def _write_tensor(file: _RankFile, t: torch.Tensor) -> None:
    if t.numel():
        file.write(buffer_view(t))


def _torch_dtype(name: str) -> Any:
    from .dtypes import to_torch

    return to_torch(name)
