"""Auditing a source checkpoint against its integrity record (``shardload verify MODEL``): every file the record
lists is re-hashed with the regions the record lists (each file read once, stretches hashed in parallel) and its leaf
table compared with the record's; a missing file, a weight file the record does not list, a size or a leaf that
differs is one problem each (see docs/integrity.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ShardloadError
from ..format import input_log
from ..format.hash_record import HASH_BYTES, FileHashes, HashRecord, RecordError, root_of
from ..sources.manifest import MANIFEST_NAME
from ..sources.objects import ObjectPath
from ..sources.source_types import SavedBoxes, open_source
from ..sources.verified import IntegrityError
from .hashing import file_name, file_size, leaf_tables, metadata_files, record_path, tensors_by_file_of, unpinned_ok
from .integrity import load_record, names_in

__all__ = ["SourceReport", "verify_source"]


@dataclass
class SourceReport:
    """What :func:`verify_source` checked: the record (its path and root), the files and bytes re-hashed, and every
    problem found (empty when the checkpoint matches its record)."""

    model: Any
    record: Any
    root: str
    files: int = 0
    nbytes: int = 0
    problems: list[ShardloadError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@input_log.records_inputs
def verify_source(
    model: str | os.PathLike[str],
    root: str | None = None,
    *,
    threads: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
) -> SourceReport:
    """Check every file of source checkpoint ``model`` against its integrity record (``shardload hash``): each listed
    file present with its recorded size and every leaf equal, and no weight file the record does not list (the
    model's own, and any ``*.safetensors`` in its directory). ``root``
    (hex) pins the record's root hash. A missing record, or one that is not the pinned one, raises a one-line error.

    Example::

        report = verify_source("llama-dir", root="9f2c...")
        for problem in report.problems:
            print(problem)
    """
    source = open_source(model, where=str(model))  # a split format (vLLM's save) is told apart, not read as files
    if isinstance(source, SavedBoxes):
        raise _vllm_save_refusal(model)
    if source.derived:
        raise ShardloadError(f"is {source.what}: `shardload verify` checks it against its shard_manifest.json",
                             file=str(model))  # fmt: skip
    checkpoint = source.checkpoint
    path = record_path(checkpoint)
    if not path.is_file():
        raise RecordError(
            f"a source checkpoint without an integrity record ({path}): make one with `shardload hash {model}`, "
            f"then `shardload verify {model}` checks every file against it (a converted directory has a "
            "shard_manifest.json)",
            file=str(model),
        )
    record = load_record(checkpoint, root if root is not None else True)
    report = SourceReport(checkpoint.path, path, root_of(_read(path)))
    listed = {entry.name for entry in record.files}
    tensors = tensors_by_file_of(checkpoint)
    stray = sorted(Path(checkpoint.root).glob("*.safetensors")) if isinstance(checkpoint.path, Path) else []
    stray = stray if checkpoint.path.is_dir() else []  # a directory's weight files, whether its model uses them or not
    files = (*checkpoint.files, *tensors, *metadata_files(checkpoint), *stray)
    present = {file_name(checkpoint.root, f): f for f in files}
    to_hash: list[tuple[FileHashes, Any]] = []
    for entry in record.files:
        full = checkpoint.root / entry.name
        if not full.is_file():
            report.problems.append(IntegrityError("is listed in the integrity record but missing", file=str(full)))
            continue
        size = file_size(full)
        if size != entry.size:
            report.problems.append(
                IntegrityError(f"is {size} bytes, the integrity record says {entry.size}", file=str(full))
            )
            continue
        to_hash.append((entry, full))
    for name in sorted(set(present) - listed - unpinned_ok(checkpoint)):
        report.problems.append(IntegrityError(
            "is not in the integrity record (added after `shardload hash`?); hash the checkpoint again if it belongs",
            file=str(present[name]),
        ))  # fmt: skip
    tables = hash_tables(to_hash, record, threads, progress)
    for (entry, full), table in zip(to_hash, tables, strict=True):
        report.files += 1
        report.nbytes += entry.size
        if table != entry.leaves:
            names = names_in(tensors.get(present.get(entry.name), []))
            report.problems.append(leaf_problem(entry, full, table, names))
    order = {entry.name: i for i, entry in enumerate(record.files)}
    report.problems.sort(key=lambda p: order.get(_relative(checkpoint.root, p.file), len(order)))
    return report


def refuse_vllm_save(model: Any) -> None:
    """Raise one line when ``model`` is a directory vLLM's ``save_model`` wrote (rank files, no manifest): it holds
    no record of its bytes, and as a checkpoint its tensors would look stored twice."""
    path = Path(model) if isinstance(model, (str, os.PathLike)) else None
    if path is None or not path.is_dir() or (path / MANIFEST_NAME).exists():
        return
    try:
        saved = isinstance(open_source(path), SavedBoxes)
    except ShardloadError:  # not one that reads: the checks that follow say what it is
        return
    if saved:
        raise _vllm_save_refusal(model)


def _vllm_save_refusal(model: Any) -> ShardloadError:
    return ShardloadError(f"is vLLM's own sharded_state (save_model wrote it, with no {MANIFEST_NAME}): it holds no "
                          "record of its bytes to verify; `shardload convert` reads it, and its --layout vllm output "
                          "can be verified", file=str(model))  # fmt: skip


def _read(path: Any) -> bytes:
    return path.read_whole(1 << 40, "integrity record") if isinstance(path, ObjectPath) else Path(path).read_bytes()


def _relative(root: Any, file: str | None) -> str:
    prefix = str(root).rstrip("/") + "/"
    return file[len(prefix) :] if file and file.startswith(prefix) else file or ""


def hash_tables(
    files: list[tuple[FileHashes, Any]], record: HashRecord, threads: int | None = None, progress: Any = False
) -> list[bytearray]:
    """Each file's leaf table, hashed with the record's hash function and the regions the record lists."""
    fds: list[Any] = []
    opened: list[int] = []
    try:
        for _, full in files:
            if isinstance(full, ObjectPath):
                fds.append(full)
                continue
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            opened.append(fd)
            fds.append(fd)
        regions = [entry.regions for entry, _ in files]
        sizes = [entry.size for entry, _ in files]
        return leaf_tables(fds, [full for _, full in files], regions, sizes, record.hash, threads=threads,
                           progress=progress)  # fmt: skip
    except OSError as err:
        raise ShardloadError(f"cannot read: {err.strerror or err}", file=str(files[len(opened)][1])) from None
    finally:
        for fd in opened:
            os.close(fd)


def leaf_problem(entry: FileHashes, full: Any, table: bytes, names: Callable[[int, int], list[str]]) -> IntegrityError:
    """The first leaf (in file order) that differs, as its byte range and the tensors it covers."""
    differ = [
        k for k in range(len(table) // HASH_BYTES) if entry.leaf(k) != table[k * HASH_BYTES : (k + 1) * HASH_BYTES]
    ]
    leaf = differ[0]
    base = 0
    for region in entry.regions:
        if leaf < base + region.leaves:
            break
        base += region.leaves
    index = leaf - base
    for k in range(len(region.tilings)):
        tiling = region.tiling(k)
        if index < tiling.leaves:
            break
        index -= tiling.leaves
    r0, rows, c0, width = tiling.tile(index)
    lo = region.offset + r0 * region.row_bytes + c0
    hi = region.offset + (r0 + rows - 1) * region.row_bytes + c0 + width
    what = ", ".join(names(lo, hi)) or "no tensor"
    band = f", a column band of {rows} rows" if k and tiling.bands > 1 else ""
    others = f" ({len(differ)} leaf hashes differ in all)" if len(differ) > 1 else ""
    return IntegrityError(f"bytes {lo}..{hi} ({what}{band}) differ from the integrity record{others}", file=str(full))
