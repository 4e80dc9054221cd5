"""Integrity records of source checkpoints: ``hash_checkpoint`` writes one (every file streamed once, files and
stretches of files hashed in parallel), ``verified_reader`` wraps a reader so a load checks every byte it returns
against it (see docs/integrity.md)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError
from ..format import input_log
from ..format.hash_record import (
    HASH_BYTES,
    LEAF_BYTES,
    RECORD_NAME,
    FileHashes,
    HashRecord,
    RecordError,
    Region,
    Tiling,
    default_hash,
    hasher,
    linear_region,
    parse_record,
    root_of,
    tensor_region,
)
from ..format.smallfile import read_small
from ..sources.checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    SHARD_INFO_NAME,
    Checkpoint,
    TensorInfo,
    header_tensors,
    open_checkpoint,
)
from ..sources.dtypes import itemsize as itemsize_of
from ..sources.objects import ObjectPath
from ..sources.reader import RunReader
from ..sources.source_types import open_source
from ..sources.tvm_cache import CACHE_NAMES
from ..sources.verified import IntegrityError, VerifiedFile, VerifiedReader, region_bases

if TYPE_CHECKING:
    pass

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


class LeafStream:
    """The leaves of one file's integrity record, hashed from its bytes as they are written (in order, in pieces of
    any size) so the finished file is never read back: the regions :func:`regions_for` gives the file its
    ``header`` describes, and the same leaves :func:`hash_files` would hash from it. A tile one piece holds whole is
    hashed in one call; one that pieces split is fed to a hasher kept open for it, a column band gathering its
    rows' slices as they pass. At most one row block's tiles per tiling are open at a time, and nothing is kept
    but their hasher states (the gather of a band copies only the piece at hand)."""

    def __init__(self, path: Path, header: bytes, hash_name: str | None = None) -> None:
        tensors = list(header_tensors(path, header).values())
        self.name = path.name
        self.size = len(header) + sum(t.nbytes for t in tensors)
        self.regions = regions_for(self.size, tensors)
        self.hash_name = hash_name or default_hash()
        self.hash_fn = hasher(self.hash_name)
        self.table = bytearray(sum(r.leaves for r in self.regions) * HASH_BYTES)
        self.region = 0
        self.at = 0
        """Bytes of the current region fed so far."""
        self.base = 0
        """The current region's first leaf in the file's table."""
        self.open: dict[int, Any] = {}
        """Leaf index -> the hasher of a tile some of whose bytes have passed (none between regions)."""

    def update(self, data: Any) -> None:
        """Hash the file's next bytes into the tiles they belong to."""
        view = memoryview(data).cast("B")
        while len(view):
            if self.region == len(self.regions):
                raise ShardloadError(f"more than the {self.size} bytes its header describes were written",
                                     file=self.name)  # fmt: skip
            r = self.regions[self.region]
            n = min(len(view), r.length - self.at)
            base = self.base
            for k in range(len(r.tilings)):
                t = r.tiling(k)
                self._tiling(t, base, self.at, view[:n])
                base += t.leaves
            view = view[n:]
            self.at += n
            if self.at == r.length:
                self.base += r.leaves
                self.region += 1
                self.at = 0

    def hashes(self) -> FileHashes:
        """The file's entry in the record, once every byte its header describes has passed."""
        if self.region != len(self.regions) or self.open:
            raise ShardloadError(f"was cut short: its header describes {self.size} bytes", file=self.name)
        return FileHashes(self.name, self.size, self.regions, bytes(self.table))

    def _tiling(self, t: Tiling, base: int, at: int, piece: memoryview) -> None:
        """Bytes ``[at, at + len(piece))`` of a region into the tiles of tiling ``t`` (its first leaf ``base``): a
        row's end, whole rows, a row's start."""
        import numpy as np

        B = t.row_bytes
        pos, end = at, at + len(piece)
        if pos % B:
            stop = min(end, (pos // B + 1) * B)
            self._row_part(t, base, pos // B, pos % B, piece[: stop - at])
            pos = stop
        ra, rb = pos // B, end // B
        if rb > ra:
            rows = np.frombuffer(piece[pos - at : rb * B - at], dtype=np.uint8).reshape(rb - ra, B)
            self._rows(t, base, ra, rows)
            pos = rb * B
        if pos < end:
            self._row_part(t, base, pos // B, 0, piece[pos - at :])

    def _row_part(self, t: Tiling, base: int, row: int, col: int, data: memoryview) -> None:
        """Bytes ``[col, col + len(data))`` of one row, into each band they reach."""
        blk = row // t.tile_rows
        last = min(t.rows, (blk + 1) * t.tile_rows) - 1
        end = col + len(data)
        for band in range(col // t.tile_bytes, -(-end // t.tile_bytes)):
            c0 = band * t.tile_bytes
            c1 = min(t.row_bytes, c0 + t.tile_bytes)
            a, b = max(col, c0), min(end, c1)
            self._put(base + blk * t.bands + band, data[a - col : b - col], row == last and b == c1)

    def _rows(self, t: Tiling, base: int, first: int, rows: Any) -> None:
        """Whole rows ``first, first + 1, ...`` (a 2-D array), block by block: each band's slice gathered once."""
        import numpy as np

        tr, w = t.tile_rows, t.tile_bytes
        stop = first + len(rows)
        for blk in range(first // tr, -(-stop // tr)):
            x, y = max(first, blk * tr), min(stop, (blk + 1) * tr)
            done = y == min(t.rows, (blk + 1) * tr)
            part = rows[x - first : y - first]
            if t.bands == 1:
                self._put(base + blk, part.reshape(-1), done)
                continue
            for band in range(t.bands):
                self._put(base + blk * t.bands + band, np.ascontiguousarray(part[:, band * w : (band + 1) * w]), done)

    def _put(self, leaf: int, data: Any, complete: bool) -> None:
        """Bytes of tile ``leaf`` in order; ``complete`` when they end the tile (then its leaf is written)."""
        h = self.open.pop(leaf, None)
        if h is None:
            if not complete:  # the tile's first bytes: keep a hasher open for the rest
                self.open[leaf] = self.hash_fn(data)
                return
            digest = self.hash_fn(data).digest()  # the whole tile at once
        else:
            h.update(data)
            if not complete:
                self.open[leaf] = h
                return
            digest = h.digest()
        self.table[leaf * HASH_BYTES : (leaf + 1) * HASH_BYTES] = digest


def streamed_record(files: Sequence[FileHashes], hash_name: str) -> bytes:
    """The integrity record (its bytes) of files whose leaves :class:`LeafStream` hashed as they were written."""
    return HashRecord(hash_name, LEAF_BYTES, list(files)).to_bytes()


def hash_checkpoint(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
) -> Path | ObjectPath:
    """Write ``model``'s integrity record (beside it, or to ``out``) and return its path; see :func:`hash_model`."""
    return hash_model(model, out, threads=threads, progress=progress).path


def hash_model(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
) -> HashResult:
    """Hash every file of ``model`` once (in parallel) into an integrity record, written atomically; the same
    checkpoint always gives the same record and root."""
    source = open_source(open_checkpoint(model), where=str(model))
    if source.derived:
        raise ShardloadError(f"{source.what} carries its record already (convert writes it); hash the source "
                             "checkpoint", file=str(model))  # fmt: skip
    checkpoint = source.checkpoint
    tensors_by_file = tensors_by_file_of(checkpoint)
    files = sorted(set(tensors_by_file) | set(checkpoint.files) | set(metadata_files(checkpoint)), key=str)
    record = hash_files(checkpoint.root, files, tensors_by_file, threads=threads, progress=progress)
    data = record.to_bytes()
    target = Path(out) if out is not None else record_path(checkpoint)
    if isinstance(target, ObjectPath):
        write_object_record(target, data)
        return HashResult(target, root_of(data), len(data), sum(f.size for f in record.files))
    if target.is_dir():
        target = target / RECORD_NAME
    write_record(target, data)
    return HashResult(target, root_of(data), len(data), sum(f.size for f in record.files))


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


METADATA_NAMES = (INDEX_NAME, *CACHE_NAMES, CONFIG_NAME, SHARD_INFO_NAME)
"""Small files beside the weights that say where tensors are or how they are split: hashed into the record too, and
checked whole at every verified load (a tampered TVM table or shard_info could point a rank at other bytes)."""


def metadata_files(checkpoint: Checkpoint) -> list[Any]:
    """The checkpoint's :data:`METADATA_NAMES` files that exist (for a directory or prefix model)."""
    root = checkpoint.root
    return [root / name for name in metadata_names(checkpoint) if (root / name).is_file()]


def metadata_names(checkpoint: Checkpoint) -> tuple[str, ...]:
    """:data:`METADATA_NAMES`, and the table the model was opened by when it has another name (an ``*.index.json``
    or a TVM cache table given by path): it says where every tensor is."""
    name = checkpoint.path.name
    if name.endswith(".json") and name not in METADATA_NAMES and checkpoint.path.parent == checkpoint.root:
        return (*METADATA_NAMES, name)
    return METADATA_NAMES


def check_metadata(checkpoint: Checkpoint, record: HashRecord, *, source: bool = True) -> None:
    """Check the small files that say where tensors are or how they split against the record: each one present now
    is listed (an input the record does not pin is refused), each one listed is present, and the bytes this load
    parsed (else the file, read whole now) have the recorded size and leaves. ``source`` False (a converted
    directory's rank files, whose record lists only them): files the record does not list are not looked at."""
    hash_fn = hasher(record.hash)
    listed = {f.name: f for f in record.files}
    for name in metadata_names(checkpoint):
        entry = listed.get(name)
        path = checkpoint.root / name
        present = path.is_file()
        if entry is None:
            if present and source:
                raise IntegrityError(
                    "exists but is not in the integrity record (added after `shardload hash`?): a verified load uses "
                    "no input its record does not cover; hash the checkpoint again if it belongs",
                    file=str(path),
                )
            continue
        if not present:
            raise IntegrityError("is listed in the integrity record but missing", file=str(path))
        data = input_log.parsed(path)
        if data is None:
            try:
                data = (
                    path.read_small(entry.size + 1, name)
                    if isinstance(path, ObjectPath)
                    else read_small(path, entry.size + 1, name, IntegrityError)
                )
            except ShardloadError as err:
                raise IntegrityError(err.reason, file=str(path)) from None
        if not _same_leaves(data, entry, hash_fn):
            raise IntegrityError("differs from the integrity record (changed or replaced)", file=str(path))


def _same_leaves(data: bytes, entry: FileHashes, hash_fn: Any) -> bool:
    """Whether ``data`` is exactly the first region of ``entry``, hashed linearly (a whole small file, or a safetensors
    header): same length, same leaves."""
    if not entry.regions:
        return entry.size == 0 and not data
    r = entry.regions[0]
    if r.rows != 1 or r.length != len(data):
        return False
    step = r.tilings[0][1]
    got = b"".join(hash_fn(data[k : k + step]).digest() for k in range(0, len(data), step))
    return got == entry.leaves[: r.leaves * HASH_BYTES]


def check_complete(checkpoint: Checkpoint, record: HashRecord) -> None:
    """Every weight file the record lists is part of the model now: one deleted or moved away is an error naming it,
    never a smaller model."""
    now = {file_name(checkpoint.root, f) for f in checkpoint.files}
    now |= {file_name(checkpoint.root, f) for f in tensors_by_file_of(checkpoint)}
    now |= set(metadata_names(checkpoint))  # checked by check_metadata
    for entry in record.files:
        if entry.name not in now:
            raise IntegrityError("is listed in the integrity record but missing from the model (deleted, "
                                 "moved or renamed)", file=str(checkpoint.root / entry.name))  # fmt: skip


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
) -> HashRecord:
    """The integrity record of ``files`` (named relative to ``root``), each streamed once, stretches of files
    hashed in parallel; ``tensors_by_file`` gives each file's tensors (their shapes choose the tilings)."""
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
        regions = [regions_for(size, tensors_by_file.get(f, [])) for f, size in zip(files, sizes, strict=True)]
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

    count = threads or min(len(jobs), max(2, os.cpu_count() or 2)) or 1
    with ThreadPoolExecutor(count, thread_name_prefix="shardload-hash") as pool:
        futures = [pool.submit(_hash_job, fds[j.file], j, hash_fn, tables[j.file], done) for j in jobs]
        for job, future in zip(jobs, futures, strict=True):
            try:
                future.result()
            except IntegrityError as err:
                raise IntegrityError(err.reason, file=str(files[job.file])) from None
    return tables


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


def load_record(
    checkpoint: Checkpoint, verify: bool | str, record: str | os.PathLike[str] | ObjectPath | None = None
) -> HashRecord:
    """The checkpoint's integrity record, checked against the pinned root when ``verify`` is a root hash."""
    path = record_path(checkpoint) if record is None else record if isinstance(record, ObjectPath) else Path(record)
    if not path.is_file():
        if isinstance(path, ObjectPath):
            raise RecordError(
                f"verify needs an integrity record and there is none at {path}; make one with `shardload hash "
                f"{checkpoint.path}` (or with -o FILE, then upload it there)",
                file=str(checkpoint.path),
            )
        raise RecordError(
            f"verify needs an integrity record and there is none at {path}; make one with `shardload hash "
            f"{checkpoint.path}` (or shardload.hash_checkpoint)",
            file=str(checkpoint.path),
        )
    limit = (64 << 20) + sum(file_size(f) for f in checkpoint.files) // 512
    if isinstance(path, ObjectPath):
        try:
            data = path.read_whole(limit, "integrity record")
        except ShardloadError as err:
            raise RecordError(err.reason, file=str(path)) from None
    else:
        data = read_small(path, limit, "integrity record", RecordError)
    if isinstance(verify, str):
        pin = verify.strip().lower()
        if len(pin) != 64 or any(c not in "0123456789abcdef" for c in pin):
            raise RecordError(f"verify={verify!r} is neither True nor a 64-digit root hash from `shardload hash`")
        if root_of(data) != pin:
            raise RecordError(f"record's root {root_of(data)} is not the pinned root {pin} (tampered or another "
                              "checkpoint's record)", file=str(path))  # fmt: skip
    return parse_record(data, str(path))


def file_size(path: Any) -> int:
    """A local file's or an object's size (0 when it cannot be had)."""
    if isinstance(path, ObjectPath):
        return path.size() or 0
    try:
        return os.stat(path).st_size
    except (OSError, TypeError):
        return 0


def names_in(tensors: Sequence[TensorInfo]) -> Callable[[int, int], list[str]]:
    """Names of the tensors overlapping a byte range of one file (``header`` for bytes before the first)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    first = spans[0][0] if spans else None

    def names(lo: int, hi: int) -> list[str]:
        out = [name for a, b, name in spans if a < hi and b > lo]
        if first is not None and lo < first:
            out.insert(0, "the header")
        return out

    return names


def verified_files(checkpoint: Checkpoint, record: HashRecord) -> dict[Any, VerifiedFile]:
    """Each checkpoint file with its record entry; a file missing from the record, or of another size, is an error."""
    import numpy as np

    by_file = tensors_by_file_of(checkpoint)
    out: dict[Any, VerifiedFile] = {}
    for f in checkpoint.files:
        name = file_name(checkpoint.root, f)
        entry = record.file(name)
        if entry is None:
            raise IntegrityError(f"not in the integrity record (which lists {len(record.files)} other files: "
                                 "a record for another checkpoint?)", file=str(f))  # fmt: skip
        size = file_size(f)
        if size != entry.size:
            what = "truncated" if size < entry.size else "extended"
            raise IntegrityError(f"is {size} bytes, the integrity record says {entry.size} ({what} or replaced)",
                                 file=str(f))  # fmt: skip
        starts = np.array([r.offset for r in entry.regions], dtype=np.int64)
        out[f] = VerifiedFile(entry, starts, region_bases(entry), names_in(by_file.get(f, [])))
    return out


def verified_reader(
    inner: RunReader, checkpoint: Checkpoint, record: HashRecord, *, source: bool = True
) -> VerifiedReader:
    """``inner`` wrapped so every byte it returns is checked against ``record``, and every file's header
    (the bytes before its first tensor) checked now."""
    import numpy as np
    import torch

    reader = VerifiedReader(inner, verified_files(checkpoint, record), record.hash)
    check_metadata(checkpoint, record, source=source)
    for f, entry in reader.files.items():
        first = entry.hashes.regions[0] if entry.hashes.regions else None
        n = first.length if first is not None and first.rows == 1 else 0
        parsed = input_log.parsed(f)
        if parsed is not None:  # the header this load parsed: checked from those very bytes, not read again
            if not _same_leaves(parsed, entry.hashes, reader.hash):
                raise IntegrityError(
                    "its header as read for this load differs from the integrity record (changed, or a store that "
                    "answered differently)",
                    file=str(f),
                )
            continue
        if n:
            out = torch.empty(n, dtype=torch.uint8)
            z = np.zeros(1, dtype=np.int64)
            reader.read_runs(f, z, np.array([n], dtype=np.int64), z, z, [out])
    return reader


def wrapped(reader: RunReader, wrap: Callable[[RunReader], RunReader] | None) -> RunReader:
    """``reader``, wrapped by ``wrap`` when given (closing ``reader`` if wrapping fails)."""
    if wrap is None:
        return reader
    try:
        return wrap(reader)
    except BaseException:
        reader.close()
        raise


def verifier(checkpoint: Checkpoint, verify: bool | str, where: str) -> Callable[[RunReader], RunReader] | None:
    """For a source checkpoint: None without ``verify``, else a wrapper checking every byte read against its
    integrity record (``verify`` True, or the pinned root hash). Loads and checks the record now."""
    if verify is False or verify is None:
        return None
    if verify is not True and not isinstance(verify, str):
        raise ShardloadError(f"verify must be True, False or a root hash string, got {verify!r}", file=where)
    record = load_record(checkpoint, verify)
    check_complete(checkpoint, record)
    check_metadata(checkpoint, record)  # now, before a plan is made from them; again from the bytes the plan parsed
    return lambda reader: verified_reader(reader, checkpoint, record)


def output_record(directory: Path, names: Sequence[str]) -> bytes:
    """The integrity record of a converted output's rank files ``names`` in ``directory`` (its bytes), hashed by
    reading them back: what ``convert``'s record, hashed as the files were written (:class:`LeafStream`), must
    equal byte for byte."""
    from ..sources.checkpoint import read_header

    files = [directory / name for name in names]
    tensors = {f: list(read_header(f).values()) for f in files}
    return hash_files(directory, files, tensors).to_bytes()


def converted_verifier(checkpoint: Checkpoint, verify: bool | str) -> Callable[..., RunReader] | None:
    """For a converted directory loaded with a pinned root: a wrapper ``(reader, {rank file: its tensors})``
    checking every byte read from those files against the output's record. None for ``verify`` False or True
    (True checks the rank file's sha256 from the manifest: a rank reads its whole file, the same check)."""
    if not isinstance(verify, str):
        return None
    integrity = (checkpoint.manifest or {}).get("integrity")
    where = str(checkpoint.root / "shard_manifest.json")
    if integrity is None:
        raise RecordError("this converted directory's manifest names no integrity record (converted by an older "
                          "shardload): convert again to pin it, or load with verify=True", file=where)  # fmt: skip
    if not isinstance(integrity, dict) or integrity.get("record") != RECORD_NAME:
        raise RecordError(f"manifest's 'integrity' must name the record {RECORD_NAME!r}", file=where)
    record = load_record(checkpoint, verify, checkpoint.root / RECORD_NAME)

    def wrap(reader: RunReader, files: Mapping[Path, Sequence[TensorInfo]]) -> RunReader:
        tensors = {f"{path.name}/{t.name}": t for path, infos in files.items() for t in infos}  # names repeat per file
        view = Checkpoint(checkpoint.path, checkpoint.root, "safetensors", tensors, list(files))
        return verified_reader(reader, view, record, source=False)

    return wrap
