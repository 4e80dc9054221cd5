"""Integrity records made by reading files: ``hash_checkpoint`` writes a source checkpoint's (every file streamed
once, files and stretches of files hashed in parallel), ``output_record`` hashes a converted output's rank files
again by reading them back; each file's regions (see docs/integrity.md): a source file's with two tilings
(``regions_for``), a rank file's with one (``output_regions``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ShardloadError
from ..format import input_log
from ..format.hash_record import (
    HASH_BYTES,
    LEAF_BYTES,
    MAGIC,
    RECORD_NAME,
    FileHashes,
    HashRecord,
    Region,
    default_hash,
    hasher,
    linear_region,
    root_of,
    tensor_region,
)
from ..sources.checkpoint import CONFIG_NAME, INDEX_NAME, SHARD_INFO_NAME, Checkpoint, as_path, open_checkpoint
from ..sources.deadlines import DEADLINES
from ..sources.dtypes import itemsize as itemsize_of
from ..sources.location import is_uri, object_path
from ..sources.objects import ObjectPath
from ..sources.source_types import open_source
from ..sources.tensor_info import TensorInfo
from ..sources.tvm_cache import B16_NAME, CACHE_NAMES, MLC_CONFIG
from ..sources.verified import IntegrityError
from .host_group import host_cores

WORK_BYTES = 32 << 20
"""Bytes one hashing job covers (a stretch of one file, whole row blocks)."""


READ_BYTES = 8 << 20
"""Bytes read per call while hashing."""


@dataclass
class HashResult:
    """What :func:`hash_checkpoint` wrote: the record's path, its root hash and size, and the bytes hashed."""

    path: Path | ObjectPath
    root: str
    record_bytes: int
    checkpoint_bytes: int


def record_path(checkpoint: Checkpoint) -> Any:
    """Where a checkpoint's record lives: ``shardload.hashes`` in its directory (or prefix), or ``FILE.hashes``
    beside a single file given by path."""
    path = checkpoint.path
    if path.is_file() and path.suffix != ".json":
        return path.parent / (path.name + ".hashes")
    return checkpoint.root / RECORD_NAME


def file_name(root: Any, path: Any) -> str:
    """A checkpoint file's name in the record: its path relative to the checkpoint's directory (or prefix)."""
    if isinstance(path, ObjectPath):
        return path.key[len(root.key) :].lstrip("/")
    return Path(path).relative_to(Path(root)).as_posix()


def regions_for(size: int, tensors: Sequence[TensorInfo], leaf: int = LEAF_BYTES) -> list[Region]:
    """A file's regions: each tensor with a row shape tiled, everything else (header, gaps, tensors stored in
    blocks) hashed linearly, together covering ``[0, size)`` in order."""
    regions: list[Region] = []
    cursor = 0
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset < cursor or t.nbytes == 0 or t.offset + t.nbytes > size:
            continue
        if t.offset > cursor:
            regions.append(linear_region(cursor, t.offset - cursor, leaf))
        try:
            size_of = itemsize_of(t.dtype)
        except KeyError:  # a block-quantized GGUF type: no row shape in bytes
            size_of = 0
        rows = 1
        for d in t.shape[:-1]:
            rows *= d
        last = t.shape[-1] if t.shape else 1
        if size_of and len(t.shape) >= 2 and rows * last * size_of == t.nbytes:
            regions.append(tensor_region(t.offset, rows, last * size_of, size_of, leaf))
        else:
            regions.append(linear_region(t.offset, t.nbytes, leaf))
        cursor = t.offset + t.nbytes
    if cursor < size:
        regions.append(linear_region(cursor, size - cursor, leaf))
    return regions


def output_regions(size: int, tensors: Sequence[TensorInfo], leaf: int = LEAF_BYTES) -> list[Region]:
    """A converted output's rank file's regions: :func:`regions_for`'s, each tensor with its row-block tiling only.
    Every load of a rank file reads each of its tensors whole (at the N it was written for; another N is read with
    ``verify=True``, each file checked whole), so the column bands would never be asked for: one tiling covers
    every byte once, and the file is hashed once instead of twice."""
    return [Region(r.offset, r.length, r.row_bytes, r.tilings[:1]) for r in regions_for(size, tensors, leaf)]


@dataclass
class _Job:
    """A stretch of one region to hash: rows ``[first, last)`` (bytes, for a one-row region), every tiling's tiles
    in them; ``leaf0`` is the region's first leaf in the file's table."""

    file: int
    region: Region
    leaf0: int
    first: int
    last: int


def _jobs(index: int, regions: Sequence[Region]) -> list[_Job]:
    jobs = []
    base = 0
    for region in regions:
        if region.rows == 1:
            step = region.tilings[0][1]
            per = max(1, WORK_BYTES // step) * step
            jobs += [_Job(index, region, base, a, min(region.length, a + per)) for a in range(0, region.length, per)]
        else:
            unit = max(t for t, _ in region.tilings)
            per = max(1, WORK_BYTES // (unit * region.row_bytes)) * unit
            jobs += [_Job(index, region, base, a, min(region.rows, a + per)) for a in range(0, region.rows, per)]
        base += region.leaves
    return jobs


def _hash_job(fd: int, job: _Job, hash_fn: Any, out: bytearray, done: Callable[[int], None]) -> None:
    """Hash every tile of one stretch of a region, reading its bytes in order once."""
    import numpy as np

    r = job.region
    if r.rows == 1:  # a one-row region: consecutive leaves are consecutive bytes
        step = r.tilings[0][1]
        for at in range(job.first, job.last, READ_BYTES // step * step or step):
            data = _pread(fd, r.offset + at, min(READ_BYTES // step * step or step, job.last - at))
            for k in range(0, len(data), step):
                pos = (job.leaf0 + (at + k) // step) * HASH_BYTES
                out[pos : pos + HASH_BYTES] = hash_fn(data[k : k + step]).digest()
            done(len(data))
        return
    B = r.row_bytes
    unit = max(t for t, _ in r.tilings)
    per = max(unit, READ_BYTES // (unit * B) * unit)
    for a in range(job.first, job.last, per):
        b = min(job.last, a + per)
        data = np.frombuffer(_pread(fd, r.offset + a * B, (b - a) * B), dtype=np.uint8).reshape(b - a, B)
        base = job.leaf0
        for k in range(len(r.tilings)):
            t = r.tiling(k)
            for blk in range(a // t.tile_rows, -(-b // t.tile_rows)):
                rows = data[blk * t.tile_rows - a : min(b, (blk + 1) * t.tile_rows) - a]
                for band in range(t.bands):
                    c0 = band * t.tile_bytes
                    tile = rows if t.bands == 1 else np.ascontiguousarray(rows[:, c0 : c0 + t.tile_bytes])
                    pos = (base + blk * t.bands + band) * HASH_BYTES
                    out[pos : pos + HASH_BYTES] = hash_fn(tile.reshape(-1)).digest()
            base += t.leaves
        done((b - a) * B)


def _pread(fd: Any, offset: int, n: int) -> memoryview:
    """Exactly ``n`` bytes at ``offset`` of a local file (an fd) or an object (a file that shrinks while hashed is
    an error)."""
    buf = bytearray(n)
    view = memoryview(buf)
    if isinstance(fd, ObjectPath):
        fd.store.read_into(fd.key, offset, [view])
        return view
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise IntegrityError(f"file ended at byte {offset + got} while being hashed")
        got += k
    return view


def hash_checkpoint(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
) -> Path | ObjectPath:
    """Write ``model``'s integrity record (beside it, or to ``out``) and return its path; see :func:`hash_model`."""
    return hash_model(model, out, threads=threads, progress=progress).path


@input_log.records_inputs
def hash_model(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
) -> HashResult:
    """Hash every file of ``model`` once (in parallel) into an integrity record, written atomically; the same
    checkpoint always gives the same record and root."""
    if threads is not None and (type(threads) is not int or threads < 1):
        raise ShardloadError(f"threads must be None or an int >= 1, got {threads!r}", file=str(model))
    if not (isinstance(progress, bool) or callable(progress)):
        raise ShardloadError(f"progress must be True, False or a callable (done, total), got {progress!r}",
                             file=str(model))  # fmt: skip
    source = open_source(open_checkpoint(model), where=str(model))
    if source.derived:
        raise ShardloadError(f"{source.what} carries its record already (convert writes it); hash the source "
                             "checkpoint", file=str(model))  # fmt: skip
    checkpoint = source.checkpoint
    if out is None:
        target = record_path(checkpoint)
    elif is_uri(out):  # a prefix (ending in /) gets the record inside it, as a directory does
        uri = str(out)
        target = object_path(uri + RECORD_NAME if uri.endswith("/") else uri)
    else:
        target = as_path(out, "out")  # "" is no path (Path would read it as the current directory)
        if target.is_dir():
            target = target / RECORD_NAME
        elif os.fspath(out).endswith(("/", os.sep)):  # Path() drops the slash that means a folder
            raise ShardloadError("no such directory (a path ending in / names one)", file=os.fspath(out))
    _record_or_nothing(target)  # before hashing: a weight file given as -o is refused at once
    tensors_by_file = tensors_by_file_of(checkpoint)
    files = sorted(set(tensors_by_file) | set(checkpoint.files) | set(metadata_files(checkpoint)), key=str)
    record = hash_files(checkpoint.root, files, tensors_by_file, threads=threads, progress=progress)
    data = record.to_bytes()
    if isinstance(target, ObjectPath):
        write_object_record(target, data)
        return HashResult(target, root_of(data), len(data), sum(f.size for f in record.files))
    write_record(target, data)
    return HashResult(target, root_of(data), len(data), sum(f.size for f in record.files))


def _record_or_nothing(target: Path | ObjectPath) -> None:
    """Refuse a record's destination that holds something other than a record (a weight file, a config) or is no
    regular file (a FIFO, a device, ``/dev/stdout``): writing there would replace it, or wait forever."""
    if isinstance(target, ObjectPath):
        size = target.size()
        first = target.store.read(target.key, 0, min(size, len(MAGIC))) if size else None
    elif target.exists() or target.is_symlink():
        if not target.is_file():
            raise ShardloadError("is not a regular file: the record is written to a new path, or over a record",
                                 file=str(target))  # fmt: skip
        try:
            with open(target, "rb") as f:
                first = f.read(len(MAGIC))
        except OSError:
            first = None  # unreadable: writing it says why
    else:
        first = None
    if first and first != MAGIC:  # an empty file (mktemp's) is no loss
        raise ShardloadError("exists and is not an integrity record (writing the record there would replace it): "
                             "give a new path, or the path of a record to replace", file=str(target))  # fmt: skip


def write_object_record(target: ObjectPath, data: bytes) -> None:
    """Put a record's bytes beside the objects (nothing is rewritten when it holds them already); a store that
    refuses the write is one line pointing to ``-o FILE``."""
    try:
        if target.size() == len(data) and target.read_small(len(data), "integrity record") == data:
            return
        target.write_bytes(data)
    except ShardloadError as err:
        raise ShardloadError(f"cannot write the record beside the objects ({err.reason}); give -o FILE and upload "
                             f"it as {target}", file=str(target)) from None  # fmt: skip


def write_record(target: Path, data: bytes) -> None:
    """Write a record's bytes to ``target`` atomically (nothing is rewritten when it already holds them)."""
    if target.is_file() and target.stat().st_size == len(data) and target.read_bytes() == data:
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ShardloadError(f"cannot write the record: {err.strerror or err}", file=str(target)) from None


METADATA_NAMES = (INDEX_NAME, *CACHE_NAMES, B16_NAME, MLC_CONFIG, CONFIG_NAME, SHARD_INFO_NAME)
"""Small files beside the weights that say where tensors are or how they are split: hashed into the record too, and
checked whole at every verified load (a tampered TVM table or shard_info could point a rank at other bytes). TVM's
writer puts a bf16 table beside the main one when it encodes float32 as bf16: one record covers both. MLC-LLM's
config says whether ``NAME_shard-I`` records are one parameter's parts."""


def unpinned_ok(checkpoint: Checkpoint) -> frozenset[str]:
    """Metadata names a record may lack without failing a verified load of ``checkpoint`` (records written before
    shardload hashed them lack them): the bf16 table of a TVM cache unless the load reads through it, MLC-LLM's
    config unless it makes ``NAME_shard-I`` records one parameter's parts."""
    names = set() if checkpoint.path.name == B16_NAME else {B16_NAME}
    if not checkpoint.mlc_preshard:
        names.add(MLC_CONFIG)
    return frozenset(names)


def metadata_files(checkpoint: Checkpoint) -> list[Any]:
    """The checkpoint's :data:`METADATA_NAMES` files that exist (for a directory or prefix model); one there that is
    no regular file (a FIFO, a device) is refused: a record without it would pass ``verify``."""
    root = checkpoint.root
    found = []
    for name in metadata_names(checkpoint):
        path = root / name
        if path.is_file():
            found.append(path)
        elif not isinstance(path, ObjectPath) and (path.is_symlink() or path.exists()):
            raise CheckpointError("is not a regular file (a FIFO, a device, a dangling link?): the integrity record "
                                  "must hold it", file=str(path))  # fmt: skip
    return found


def metadata_names(checkpoint: Checkpoint) -> tuple[str, ...]:
    """:data:`METADATA_NAMES`, and the table the model was opened by when it has another name (an ``*.index.json``
    or a TVM cache table given by path): it says where every tensor is."""
    name = checkpoint.path.name
    if name.endswith(".json") and name not in METADATA_NAMES and checkpoint.path.parent == checkpoint.root:
        return (*METADATA_NAMES, name)
    return METADATA_NAMES


def tensors_by_file_of(checkpoint: Checkpoint) -> dict[Any, list[TensorInfo]]:
    """The checkpoint's stored tensors by file (a pre-sharded one's parts too): their shapes choose the tilings."""
    out: dict[Any, list[TensorInfo]] = {}
    for t in checkpoint.tensors.values():
        out.setdefault(t.file, []).append(t)
    for parts in checkpoint.shards.values():
        for t in parts:
            out.setdefault(t.file, []).append(t)
    return out


def hash_files(
    root: Any,
    files: Sequence[Path],
    tensors_by_file: dict[Path, list[TensorInfo]],
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
    regions_of: Callable[[int, Sequence[TensorInfo]], list[Region]] = regions_for,
) -> HashRecord:
    """The integrity record of ``files`` (named relative to ``root``), each streamed once, stretches of files
    hashed in parallel; ``tensors_by_file`` gives each file's tensors (their shapes choose the tilings, by
    ``regions_of``: a source checkpoint's two, a converted output's one)."""
    names = [file_name(root, f) for f in files]
    sizes: list[int] = []
    fds: list[Any] = []
    opened: list[int] = []
    try:
        for f in files:
            if isinstance(f, ObjectPath):
                fds.append(f)
                sizes.append(file_size(f))
                continue
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            opened.append(fd)
            fds.append(fd)
            sizes.append(os.fstat(fd).st_size)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        regions = [regions_of(size, tensors_by_file.get(f, [])) for f, size in zip(files, sizes, strict=True)]
        hash_name = default_hash()
        tables = leaf_tables(fds, files, regions, sizes, hash_name, threads=threads, progress=progress)
    except OSError as err:
        raise ShardloadError(f"cannot hash: {err.strerror or err}", file=str(root)) from None
    finally:
        for fd in opened:
            os.close(fd)
    return HashRecord(hash_name, LEAF_BYTES, [
        FileHashes(n, s, regs, bytes(t)) for n, s, regs, t in zip(names, sizes, regions, tables, strict=True)
    ])  # fmt: skip


def leaf_tables(
    fds: Sequence[Any],
    files: Sequence[Any],
    regions: Sequence[Sequence[Region]],
    sizes: Sequence[int],
    hash_name: str,
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
) -> list[bytearray]:
    """Each file's leaf table for ``regions``, hashed with ``hash_name`` in parallel stretches (``fds``: open file
    descriptors, or object paths, of ``files``); what ``shardload hash`` writes and ``shardload verify MODEL``
    compares."""
    tables = [bytearray(sum(r.leaves for r in regs) * HASH_BYTES) for regs in regions]
    jobs = [job for i, regs in enumerate(regions) for job in _jobs(i, regs)]
    hash_fn = hasher(hash_name)
    total = sum(sizes)
    report = _progress(progress, total)
    lock = threading.Lock()
    seen = [0]

    def done(n: int) -> None:
        if report is not None:
            with lock:
                seen[0] += n
                report(seen[0], total)

    count = threads or min(len(jobs), max(2, host_cores())) or 1  # two at least: one hashes while one waits
    with input_log.recording() as log:
        for fd, file in zip(fds, files, strict=True):
            if isinstance(fd, int):
                input_log.stamp(file, os.fstat(fd))  # the file hashed is the one named, and no one writes to it
        stop = threading.Event()  # set when hashing stops: object requests in flight are cut off, none retried
        with ThreadPoolExecutor(count, thread_name_prefix="shardload-hash") as pool:
            futures = [pool.submit(_logged, log, stop, fds[j.file], j, hash_fn, tables[j.file], done) for j in jobs]
            try:
                for job, future in zip(jobs, futures, strict=True):
                    try:
                        future.result()
                    except IntegrityError as err:
                        raise IntegrityError(err.reason, file=str(files[job.file])) from None
            except BaseException:  # a job's failure, or Ctrl-C: the running jobs end now, the rest never start
                DEADLINES.stop(stop)
                for future in futures:
                    future.cancel()
                raise
        input_log.check_unchanged(files, log)  # a file changed meanwhile would give leaves of neither version
    return tables


def _logged(log: input_log.InputLog, stop: threading.Event, *args: Any) -> None:
    """One hash job on a pool thread, its object reads held to the versions the caller's log saw first (and cut off
    once ``stop`` is set)."""
    with input_log.using(log), DEADLINES.serving(stop):
        _hash_job(*args)


def _progress(progress: Any, total: int) -> Callable[[int, int], None] | None:
    if callable(progress):
        return progress
    if progress is not True:
        return None
    import sys

    if not sys.stderr.isatty():
        return None
    last = [-1]

    def draw(done: int, total: int) -> None:
        pct = 100 * done // max(1, total)
        if pct != last[0]:
            last[0] = pct
            sys.stderr.write(f"\rhashing: {done >> 20}/{total >> 20} MiB ({pct}%)")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return draw


def file_size(path: Any) -> int:
    """A local file's or an object's size (0 when it cannot be had)."""
    if isinstance(path, ObjectPath):
        return path.size() or 0
    try:
        return os.stat(path).st_size
    except (OSError, TypeError):
        return 0


def output_record(directory: Path, names: Sequence[str]) -> bytes:
    """The integrity record of a converted output's rank files ``names`` in ``directory`` (its bytes), hashed by
    reading them back: what ``convert``'s record, hashed as the files were written (:class:`LeafStream`), must
    equal byte for byte."""
    from ..sources.safetensors_header import read_header

    files = [directory / name for name in names]
    tensors = {f: list(read_header(f).values()) for f in files}
    return hash_files(directory, files, tensors, regions_of=output_regions).to_bytes()
