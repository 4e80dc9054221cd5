"""Integrity records checked: ``verifier`` and ``converted_verifier`` load a record (pinned by its root hash or not)
and ``verified_reader`` wraps a reader so a load checks every byte it returns against it; the small files that say
where tensors are, checked whole (see docs/integrity.md). The records are made by :mod:`.hashing`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ShardloadError
from ..format import input_log
from ..format.hash_record import (
    HASH_BYTES,
    RECORD_NAME,
    FileHashes,
    HashRecord,
    RecordError,
    hasher,
    is_root_hash,
    parse_record,
    root_of,
)
from ..format.smallfile import read_small
from ..sources.checkpoint import Checkpoint
from ..sources.objects import ObjectPath
from ..sources.reader import RunReader
from ..sources.tensor_info import TensorInfo
from ..sources.verified import IntegrityError, VerifiedFile, VerifiedReader, region_bases
from .hashing import file_name, file_size, metadata_names, record_path, tensors_by_file_of, unpinned_ok


def check_metadata(checkpoint: Checkpoint, record: HashRecord, *, source: bool = True) -> None:
    """Check the small files that say where tensors are or how they split against the record: each one present now
    is listed (an input the record does not pin is refused), each one listed is present, and the bytes this load
    parsed (else the file, read whole now) have the recorded size and leaves. ``source`` False (a converted
    directory's rank files, whose record lists only them): files the record does not list are not looked at."""
    hash_fn = hasher(record.hash)
    listed = {f.name: f for f in record.files}
    optional = unpinned_ok(checkpoint)
    for name in metadata_names(checkpoint):
        entry = listed.get(name)
        path = checkpoint.root / name
        present = path.is_file()
        if entry is None:
            if present and source and name not in optional:
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


RECORD_SLACK = 64 << 20
"""Bytes of integrity record allowed beyond what the checkpoint's size and tensors account for."""
RECORD_BYTES_PER_TENSOR = 128
"""Bytes of integrity record allowed per stored tensor: its leaf and region, however few bytes it holds."""


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
    tensors = RECORD_BYTES_PER_TENSOR * len(checkpoint.tensors)  # a leaf each, however small (~53 bytes)
    limit = RECORD_SLACK + sum(file_size(f) for f in checkpoint.files) // 512 + tensors
    if isinstance(path, ObjectPath):
        try:
            data = path.read_whole(limit, "integrity record")
        except ShardloadError as err:
            raise RecordError(err.reason, file=str(path)) from None
    else:
        data = read_small(path, limit, "integrity record", RecordError)
    if isinstance(verify, str):
        pin = verify.strip().lower()
        if not is_root_hash(pin):
            raise RecordError(f"verify={verify!r} is neither True nor a 64-digit root hash from `shardload hash`")
        if root_of(data) != pin:
            raise RecordError(f"record's root {root_of(data)} is not the pinned root {pin} (tampered or another "
                              "checkpoint's record)", file=str(path))  # fmt: skip
    return parse_record(data, str(path))


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


def manifest_root(checkpoint: Checkpoint) -> str:
    """The root of a converted directory's own integrity record, as its manifest names it: what ``verify=True``
    checks bytes a group's peers send against (a pinned root is given by the caller instead)."""
    integrity = (checkpoint.manifest or {}).get("integrity")
    root = integrity.get("root") if isinstance(integrity, dict) else None
    if not isinstance(root, str) or not is_root_hash(root):
        raise RecordError("this converted directory's manifest names no integrity record (converted by an older "
                          "shardload), against which group= would check what peers send: convert again, or load "
                          "it without group=", file=str(checkpoint.root / "shard_manifest.json"))  # fmt: skip
    return root


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
