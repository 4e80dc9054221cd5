"""Writing the rank files of a converted directory, streamed through small per-thread buffers.

Each rank's safetensors header is known from the plan and written first. The ranks are split into
groups, one per worker thread, and each worker streams its ranks' bytes in chunks: scatter-read from
the checkpoint (``preadv``, reading through small holes), write and feed the tiles of each file's integrity
record (:class:`~shardload.engine.leaf_stream.LeafStream`) while the chunk is still in cache; the manifest
names each rank file by the sha256 of its leaves (a sha256 of its bytes only where asked for: ``sha256=True``).
Workers never wait for each other, so hashing (the bulk of the work) spreads over the cores. Durable files (see
:func:`shardload.convert`'s ``fsync``) have their writeback started as data is written (``sync_file_range``
where the platform has it) and are fsynced at the end. Memory stays at a few MiB per worker, whatever the size
of the model (compute-step parameters are held whole, once, while written).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import PlanError
from ..format.hash_record import RECORD_NAME, FileHashes, root_of
from ..sources.dtypes import DTYPES, itemsize, to_torch
from ..sources.manifest import add_seal
from ..sources.reader import RunReader, buffer_view, libc_function
from ..sources.safetensors_header import MAX_HEADER_BYTES
from .host_group import host_cores
from .integrity import wrapped
from .leaf_stream import LeafStream, streamed_record
from .transfer import reader_for_plan

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ModelPlan, ParamPlan

STAGE_SET_BYTES = 2 << 20
"""Bytes of one worker's buffers: one per rank of its group, of ``STAGE_CHUNK_LIMITS`` bytes each."""
STAGE_CHUNK_LIMITS = (128 << 10, 1 << 20)
READ_THROUGH_BYTES = 256 << 10
"""Holes up to this size between a worker's runs are read through (into a scratch buffer)."""
WRITE_THREADS: int | None = None
"""Writer threads, each with its own group of ranks (hashing is the bulk of the work); None: one per core this
process may run on (:func:`~shardload.engine.host_group.host_cores`), at most 8."""
WRITEBACK_BYTES = 16 << 20
"""Start writeback of a file each time this many more bytes have been written to it."""
SYNC_FILE_RANGE_WRITE = 2


@dataclass(frozen=True)
class WrittenFile:
    """A finished output file, as the manifest records it: name in the directory, size, and the sha256 of its bytes
    or (a rank file written with its leaves and no sha256) the sha256 of its leaf hashes in the output's record."""

    path: str
    size: int
    sha256: str | None
    leaves: FileHashes | None = field(default=None, compare=False, repr=False)
    """Its entry in the output's integrity record, hashed as it was written (a :class:`FileWriter` made with
    ``leaves=True``); not part of :meth:`entry`."""
    leaves_sha256: str | None = None
    """The sha256 of its leaf hashes (``leaves.leaves``): listed in place of ``sha256`` when there is none."""

    def entry(self) -> dict[str, Any]:
        """The file as a manifest (or ``--json``) lists it: path, size, and sha256 (else leaves_sha256)."""
        if self.sha256 is None:
            return {"path": self.path, "size": self.size, "leaves_sha256": self.leaves_sha256}
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @property
    def checksum(self) -> str:
        """What the manifest checks the file by: its sha256, else its leaves' (``convert``'s table shows it)."""
        return self.sha256 or self.leaves_sha256 or ""


def file_order(plan: ModelPlan) -> list[ParamPlan]:
    """The order of a rank file's tensors: widest element first (stable), so with the header padded to 8 bytes
    every tensor starts at a multiple of its element size and can be mapped as a view."""
    return sorted(plan.params.values(), key=lambda p: -itemsize(p.dtype))


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (names created or renamed in it) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every regular file directly in ``path`` to stable storage, then ``path`` itself."""
    for entry in sorted(path.iterdir()):
        if entry.is_file() and not entry.is_symlink():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


def save_safetensors(save: Callable[[], None], path: Path) -> None:
    """Run ``save`` (a safetensors ``save_file`` of ``path``): its failure as an OSError (safetensors raises its own
    SafetensorError, naming the OS error's number in its text), and the file given the mode a plain ``open`` gives
    (safetensors creates it 0600, unreadable to a server running as another user)."""
    import re

    from safetensors import SafetensorError

    try:
        save()
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        code = int(found.group(1)) if found else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None
    try:
        os.chmod(path, 0o666 & ~_umask())
    except OSError as err:  # a file system without modes (vfat, exfat) refuses it: the file is written all the same
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise


def _umask() -> int:
    """This process's umask (from /proc, which reads it without setting it; 0o022 where that cannot be read)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def new_conversion() -> str:
    """A fresh id for one convert run, written in its manifest and in every rank file's metadata."""
    import secrets

    return secrets.token_hex(16)


def rank_header(
    plan: ModelPlan,
    rank: int,
    stage: int = 0,
    stages: int = 1,
    conversion: str | None = None,
    digest: str | None = None,
) -> bytes:
    """The safetensors header of ``rank``'s file (length prefix included, padded to 8 bytes).

    Its metadata names the rank and N (and the pipeline stage when there are several), so a renamed file is caught,
    and with ``digest`` (:func:`~shardload.sources.manifest.manifest_digest` of its manifest) carries its seal.
    """
    meta = {"format": "pt", "shardload.rank": str(rank), "shardload.num_shards": str(plan.num_shards)}
    if stages > 1:
        meta.update({"shardload.pp": str(stage), "shardload.num_pp": str(stages)})
    if conversion is not None:
        meta["shardload.conversion"] = conversion
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for p in file_order(plan):
        header[p.name] = {
            "dtype": DTYPES[p.dtype][0],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.rank_nbytes],
        }
        offset += p.rank_nbytes
    if digest is not None:
        add_seal(header, digest)
    encoded = encode_header(header)
    if len(encoded) - 8 > MAX_HEADER_BYTES:  # a file the loader would refuse is never written
        raise PlanError(
            f"rank {rank}'s file would have a {len(encoded) - 8}-byte header, over the {MAX_HEADER_BYTES} bytes a load "
            "accepts"
        )
    return encoded


def encode_header(header: dict[str, Any]) -> bytes:
    """A safetensors header as its file begins: the 8-byte length, then the compact JSON padded with spaces to a
    multiple of 8 (so the data, and every tensor laid out by element size, starts aligned)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


_SYNC_FILE_RANGE = libc_function(
    lambda libc: libc.sync_file_range, [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
)


def create_file(path: Path) -> BinaryIO:
    """Open a new output file for unbuffered writing (every output byte of convert and quantize goes through here)."""
    return open(path, "xb", buffering=0)


def write_all(fh: BinaryIO, data: bytes | memoryview, path: Path) -> None:
    """Write every byte of ``data`` to ``fh`` (an unbuffered file may take part of a write); an error names ``path``."""
    view = memoryview(data).cast("B")
    try:
        while len(view):
            view = view[fh.write(view) or 0 :]
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None


class FileWriter:
    """One output file: appended to by one task at a time, hashed as written; ``durable`` ones are fsynced on
    finish. With ``leaves``, a safetensors file whose header :meth:`write_header` writes first: its integrity
    record's leaves are hashed as its bytes pass too (:class:`LeafStream`), so it is never read back; such a file's
    sha256 is hashed only with ``sha256`` (the leaves check every byte already, at a quarter of the cost)."""

    def __init__(self, path: Path, *, durable: bool = True, leaves: bool = False, sha256: bool = True) -> None:
        if not (leaves or sha256):
            raise ValueError("a FileWriter hashes its file one way at least (leaves or sha256)")
        self.path = path
        self.durable = durable
        self.leaves = leaves
        self.stream: LeafStream | None = None
        self.hash = hashlib.sha256() if sha256 else None
        self.size = 0
        self.flushed = 0
        try:
            self.fh: BinaryIO | None = create_file(path)
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from None

    def write_header(self, header: bytes) -> None:
        """Write a safetensors file's header (its first bytes), from which the file's tiles are known."""
        assert self.fh is not None and self.size == 0
        if self.leaves:
            self.stream = LeafStream(self.path, header)
        self.write(header)

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the file and add it to the hash (and to its tiles' leaves)."""
        assert self.fh is not None
        if self.leaves and self.stream is None:
            raise RuntimeError("a FileWriter made with leaves=True is written its header first (write_header)")
        write_all(self.fh, data, self.path)
        if self.hash is not None:
            self.hash.update(data)
        if self.stream is not None:
            self.stream.update(data)
        self.size += memoryview(data).nbytes
        if self.durable and _SYNC_FILE_RANGE is not None and self.size - self.flushed >= WRITEBACK_BYTES:
            _SYNC_FILE_RANGE(self.fh.fileno(), self.flushed, self.size - self.flushed, SYNC_FILE_RANGE_WRITE)
            self.flushed = self.size

    def finish(self) -> WrittenFile:
        """Close the file (flushed to stable storage first when ``durable``)."""
        assert self.fh is not None
        try:
            self.fh.flush()
            if self.durable:
                os.fsync(self.fh.fileno())
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.path)) from None
        self.close()
        leaves = self.stream.hashes() if self.stream is not None else None
        digest = self.hash.hexdigest() if self.hash is not None else None
        of_leaves = hashlib.sha256(leaves.leaves).hexdigest() if leaves is not None else None
        return WrittenFile(self.path.name, self.size, digest, leaves, of_leaves)

    def close(self) -> None:
        """Close without raising (after an error the file is removed with its directory)."""
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass
            self.fh = None


class _Shared:
    """Results of compute-step parameters, computed once and handed to every worker that needs them."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.lock = threading.Lock()
        self.entries: dict[str, list[Any]] = {}  # name -> [lock, shards or None, workers left]

    def get(self, param: ParamPlan, reader: RunReader) -> list[torch.Tensor]:
        """The parameter's per-rank shards (contiguous CPU tensors)."""
        import torch

        from .steps import run_steps

        with self.lock:
            entry = self.entries.setdefault(param.name, [threading.Lock(), None, self.workers])
        with entry[0]:
            if entry[1] is None:
                full = torch.empty(param.source.shape, dtype=to_torch(param.source.dtype))
                reader.read_tensor(param.source.file, param.source.offset, full)
                out = run_steps(param, full)
                entry[1] = [out[r].contiguous() for r in range(param.num_shards)]
            return entry[1]

    def done(self, param: ParamPlan) -> None:
        """One worker is finished with the parameter; the last one frees it."""
        with self.lock:
            entry = self.entries[param.name]
            entry[2] -= 1
            if entry[2] == 0:
                del self.entries[param.name]


def write_rank_files(
    plan: ModelPlan,
    names: list[Path],
    progress: Callable[[int, str], None] | None = None,
    *,
    threads: int | None = None,
    stage: int = 0,
    stages: int = 1,
    durable: bool = True,
    wrap: Callable[[Any], Any] | None = None,
    conversion: str | None = None,
    digest: str | None = None,
    sha256: bool = False,
) -> list[WrittenFile]:
    """Write rank r's safetensors file to ``names[r]`` for every rank of ``plan``; new files only.

    The ranks are split into one group per worker thread; each worker streams its ranks' bytes through
    its own small buffers: read (through small holes, so a column slice costs one call per chunk, not
    per row), write, hash. ``progress(source_bytes_done, param_name)`` is called after each parameter.
    ``durable`` fsyncs every file before returning; ``wrap`` wraps the reader (a verifying one). Each file's
    leaves are hashed for the output's record; its sha256 too only with ``sha256``.
    """
    n = plan.num_shards
    workers = max(1, min(threads or WRITE_THREADS or min(8, host_cores()), n))
    groups = [list(range(n))[w * n // workers : (w + 1) * n // workers] for w in range(workers)]
    files: list[FileWriter] = []
    results: list[WrittenFile | None] = [None] * n
    events: queue.SimpleQueue[tuple[int, int | BaseException | None]] = queue.SimpleQueue()
    stop = threading.Event()
    params = file_order(plan)
    try:
        for path in names:
            files.append(FileWriter(path, durable=durable, leaves=True, sha256=sha256))
        for r, f in enumerate(files):
            f.write_header(rank_header(plan, r, stage, stages, conversion, digest))
        with wrapped(reader_for_plan(params), wrap) as reader:
            shared = _Shared(workers)

            def work(w: int) -> None:
                try:
                    _write_group(params, groups[w], files, results, reader, shared, stop, lambda i: events.put((w, i)))
                    events.put((w, None))
                except BaseException as err:
                    stop.set()
                    events.put((w, err))

            pool = [threading.Thread(target=work, args=(w,), name=f"shardload-write-{w}") for w in range(workers)]
            for t in pool:
                t.start()
            try:
                _follow(events, workers, params, progress)
            except BaseException:
                stop.set()
                reader.abandon()  # the workers' requests in flight end now: they are joined below
                raise
            finally:
                for t in pool:
                    t.join()
        return [r for r in results if r is not None]
    finally:
        for f in files:
            f.close()


def _follow(
    events: queue.SimpleQueue[tuple[int, int | BaseException | None]],
    workers: int,
    params: list[ParamPlan],
    progress: Callable[[int, str], None] | None,
) -> None:
    """Wait for the workers, reporting each parameter once every worker is past it; re-raise a failure."""
    at = [-1] * workers
    reported, running, source_done = -1, workers, 0
    while running:
        w, event = events.get()
        if isinstance(event, BaseException):
            raise event
        if event is None:
            running -= 1
            at[w] = len(params) - 1
        else:
            at[w] = event
        while reported < min(at):
            reported += 1
            source_done += params[reported].source.nbytes
            if progress is not None:
                progress(source_done, params[reported].name)


def _padding_by_chunk(param: ParamPlan, ranks: list[int], chunk: int) -> dict[int, list[tuple[int, int, int]]]:
    """The padding of each rank's tensor (byte spans that are zeros) cut by write chunk: chunk k -> (buffer,
    start, stop) within the chunk."""
    from ..planning.runs import zero_spans

    out: dict[int, list[tuple[int, int, int]]] = {}
    for j, rank in enumerate(ranks):
        starts, lengths = zero_spans(param, rank)
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            at, end = start, start + length
            while at < end:
                k = at // chunk
                stop = min(end, (k + 1) * chunk)
                out.setdefault(k, []).append((j, at - k * chunk, stop - k * chunk))
                at = stop
    return out


def _write_group(
    params: list[ParamPlan],
    ranks: list[int],
    files: list[FileWriter],
    results: list[WrittenFile | None],
    reader: RunReader,
    shared: _Shared,
    stop: threading.Event,
    passed: Callable[[int], None],
) -> None:
    """One worker: every parameter's bytes for ``ranks``, chunk by chunk, read, written and hashed in order."""
    import torch

    from ..planning.runs import Runs, chunks, fill_gaps, param_runs, shifted, structure

    low, high = STAGE_CHUNK_LIMITS
    chunk = min(high, max(low, STAGE_SET_BYTES // len(ranks)))
    bufs = [torch.empty(chunk, dtype=torch.uint8) for _ in ranks]
    bufs.append(torch.empty(READ_THROUGH_BYTES, dtype=torch.uint8))  # holes land here
    views = [buffer_view(t) for t in bufs]
    scratch = len(ranks)
    # per structure, offsets relative to the tensor: (chunk k, its reads, its padding as (buffer, start, stop))
    schedules: dict[Any, list[tuple[int, Runs | None, list[tuple[int, int, int]]]] | None] = {}
    for i, param in enumerate(params):
        if stop.is_set():
            return
        key = structure(param, ranks)
        if key not in schedules:
            runs = param_runs(param, ranks)
            schedules[key] = None
            if runs is not None:
                rel = shifted(runs, -param.source.offset)
                parts = {k: fill_gaps(part, READ_THROUGH_BYTES, scratch) for k, part in chunks(rel, chunk)}
                pads = _padding_by_chunk(param, ranks, chunk) if param.pads else {}
                count = -(-param.rank_nbytes // chunk)
                schedules[key] = [(k, parts.get(k), pads.get(k, [])) for k in range(count) if k in parts or k in pads]
        schedule = schedules[key]
        if schedule is None:  # a compute step: the whole tensor, computed once for all workers
            shards = shared.get(param, reader)
            for r in ranks:
                if shards[r].numel():
                    files[r].write(buffer_view(shards[r]))
            shared.done(param)
        else:
            offset = param.source.offset
            for k, part, zeros in schedule:
                if stop.is_set():
                    return
                for j, lo, hi in zeros:  # padding: zeros, not read (the buffers hold the last chunk's bytes)
                    bufs[j][lo:hi].zero_()
                if part is not None:
                    reader.read_runs(param.source.file, part.src + offset, part.length, part.buf, part.dst, bufs)
                size = min(chunk, param.rank_nbytes - k * chunk)
                for j, r in enumerate(ranks):
                    files[r].write(views[j][:size])
        passed(i)
    for r in ranks:
        results[r] = files[r].finish()


def written_record(files: list[WrittenFile]) -> bytes:
    """The integrity record (its bytes) of output files whose leaves were hashed as they were written: the same
    bytes :func:`shardload.engine.hashing.output_record` gives by reading them back."""
    entries = [f.leaves for f in files]
    if any(e is None for e in entries):
        raise RuntimeError("an output file was written without its leaves (FileWriter(leaves=True))")
    from ..format.hash_record import default_hash

    return streamed_record([e for e in entries if e is not None], default_hash())


def write_output_record(directory: Path, data: bytes, durable: bool) -> WrittenFile:
    """Write an output's integrity record; returned as the manifest lists it (its sha256 is its root)."""
    out = FileWriter(directory / RECORD_NAME, durable=durable)
    try:
        out.write(data)
        out.finish()
    finally:
        out.close()
    return WrittenFile(RECORD_NAME, len(data), root_of(data))
