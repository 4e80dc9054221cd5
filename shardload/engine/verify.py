"""Integrity of converted directories: each file's size and checksum against ``shard_manifest.json``: the sha256
of its bytes, or (a version-2 manifest's rank files) every leaf of the directory's integrity record, which the
manifest pins by its sha256.

``rank_file`` is the per-rank check ``load_rank`` runs before it reads a rank file; ``check_entry`` checks one
listed file. :mod:`shardload.engine.verify_dir` checks a whole directory with them (``shardload verify OUT``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ShardloadError
from ..format.hash_record import RECORD_NAME, HashRecord, parse_record, root_of
from ..format.smallfile import read_small
from ..sources.checkpoint import Checkpoint, resolve_inside
from ..sources.manifest import (
    CONVERSION_KEY,
    LEAVES_KEY,
    MANIFEST_NAME,
    RANK_FILE_RE,
    SEAL_KEY,
    SEAL_VERSION,
    SEALED,
    manifest_digest,
    manifest_stages,
    rank_file_name,
    seal,
    seal_place,
)
from ..sources.objects import ObjectPath
from ..sources.safetensors_header import read_header, read_header_and_metadata
from .integrity import RECORD_SLACK

if TYPE_CHECKING:
    from ..planning.mesh import Mesh

__all__ = ["OutputRecord", "VerifyReport", "check_entry", "rank_file", "sha256_file"]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    if isinstance(path, ObjectPath):  # in object storage: streamed in ranged reads
        size = path.size() or 0
        for start in range(0, size, 8 << 20):
            h.update(path.store.read(path.key, start, min(size, start + (8 << 20))))
        return h.hexdigest()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass
class VerifyReport:
    """What :func:`shardload.verify_dir` checked, and every problem it found (empty when the directory is intact)."""

    path: Path
    num_shards: int
    files: int = 0
    nbytes: int = 0
    problems: list[CheckpointError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class OutputRecord:
    """A converted directory's integrity record, read once when a file listed by its leaves is checked: the bytes
    must have the manifest's root (the record's sha256), or every such check fails with why."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = root
        self.manifest = manifest
        self.loaded: HashRecord | CheckpointError | None = None

    def get(self) -> HashRecord | CheckpointError:
        if self.loaded is None:
            self.loaded = self._load()
        return self.loaded

    def _load(self) -> HashRecord | CheckpointError:
        path = self.root / RECORD_NAME
        pinned = (self.manifest.get("integrity") or {}).get("root")
        files = self.manifest.get("files", [])
        own = [e.get("size") for e in files if e.get("path") == RECORD_NAME]
        if own and type(own[0]) is int and own[0] >= 0:  # its own entry: nothing past the size written is read
            limit = own[0]
        else:
            limit = RECORD_SLACK + sum(e["size"] for e in files) // 512
        try:
            if isinstance(path, ObjectPath):
                data = path.read_whole(limit, "integrity record")
            else:
                data = read_small(path, limit, "integrity record", CheckpointError)
            if root_of(data) != pinned:
                raise CheckpointError("does not match its sha256 in the manifest (the root of the directory's "
                                      "integrity record), so no rank file listed by its leaves can be checked",
                                      file=str(path))  # fmt: skip
            return parse_record(data, str(path))
        except ShardloadError as err:
            if not path.is_file():
                return CheckpointError("is missing (listed in the manifest; it holds the rank files' leaves)",
                                       file=str(path))  # fmt: skip
            return CheckpointError(err.reason, file=str(path))


def _check_leaves(full: Any, entry: dict[str, Any], record: OutputRecord) -> CheckpointError | None:
    """A rank file listed by the sha256 of its leaves: its entry in the record must be those leaves, and the file,
    re-hashed with the record's regions (one pass, stretches in parallel), must give every one of them."""
    import hashlib

    from .verify_source import hash_tables, leaf_problem

    loaded = record.get()
    if isinstance(loaded, CheckpointError):
        return CheckpointError(f"cannot be checked: {RECORD_NAME} {loaded.reason}", file=str(full))
    hashes = loaded.file(entry["path"])
    if hashes is None or hashes.size != entry["size"] or hashlib.sha256(hashes.leaves).hexdigest() != entry[LEAVES_KEY]:
        return CheckpointError(f"its entry in {RECORD_NAME} is not the one the manifest names (its {LEAVES_KEY} "
                               "differs)", file=str(full))  # fmt: skip
    try:
        (table,) = hash_tables([(hashes, full)], loaded)
    except ShardloadError as err:
        return CheckpointError(err.reason, file=str(full))
    if table == hashes.leaves:
        return None
    from .integrity import names_in

    try:
        names = names_in(list(read_header(full).values()))
    except ShardloadError as err:  # its header changed too: the tensors cannot be named, the file still is
        return CheckpointError(f"does not match its leaves in {RECORD_NAME} ({err.reason})", file=str(full))
    problem = leaf_problem(hashes, full, table, names)
    return CheckpointError(f"does not match its leaves in {RECORD_NAME}: {problem.reason}", file=str(full))


def check_entry(
    root: Path,
    entry: dict[str, Any],
    checksum: bool,
    manifest: dict[str, Any] | None = None,
    rank: int | None = None,
    record: OutputRecord | None = None,
) -> tuple[Path, CheckpointError | None]:
    """Check one manifest entry's file: present, inside the directory, right size, a rank file's header
    written for its rank (``rank``: the rank of a server's layout's file) by the conversion ``manifest`` names, and
    when ``checksum`` its sha256, or its leaves against the directory's record (``record``: that record, read once
    for several entries)."""
    manifest = manifest or {}
    conversion = manifest.get(CONVERSION_KEY)
    name = entry["path"]
    full = root / name
    try:
        full = resolve_inside(root, name, root / MANIFEST_NAME)
        size = full.size() if isinstance(full, ObjectPath) else full.stat().st_size
    except (CheckpointError, OSError):
        if not full.exists() and not full.is_symlink():
            return full, CheckpointError("is missing (listed in the manifest)", file=str(full))
        return full, CheckpointError("is not a regular file inside the directory", file=str(full))
    if size != entry["size"]:
        return full, CheckpointError(f"is {size} bytes, the manifest says {entry['size']}", file=str(full))
    match = RANK_FILE_RE.fullmatch(name)
    try:
        if match:
            _check_rank_header(full, manifest, int(match[3]), int(match[4]), int(match[1] or 0), int(match[2] or 1))
        elif rank is not None and conversion is not None:  # a server's-layout file this shardload wrote
            _check_rank_header(full, manifest, rank, manifest["num_shards"])
    except CheckpointError as err:
        return full, err
    if checksum and LEAVES_KEY in entry:
        return full, _check_leaves(full, entry, record or OutputRecord(root, manifest))
    if checksum:
        digest = sha256_file(full)
        if digest != entry["sha256"]:
            return full, CheckpointError(
                f"does not match its sha256 in the manifest "
                f"(file {digest[:16]}..., manifest {entry['sha256'][:16]}...)",
                file=str(full),
            )
    return full, None


def _check_rank_header(
    path: Path, manifest: dict[str, Any], rank: int, num_shards: int, stage: int = 0, stages: int = 1
) -> None:
    """A rank file must be a valid safetensors file written for this rank and N (catches renamed, copied and swapped
    files) by the conversion ``manifest`` names (catches a file of another convert copied in), and where it carries
    a seal, sealed with this manifest's plan and its own tensor table (catches an edit of either)."""
    conversion = manifest.get(CONVERSION_KEY)
    tensors, metadata = read_header_and_metadata(path)
    said = (metadata.get("shardload.rank"), metadata.get("shardload.num_shards"))
    if said != (str(rank), str(num_shards)):
        raise CheckpointError(
            f"its header says rank {said[0]} of {said[1]}, not rank {rank} of {num_shards}", file=str(path)
        )
    said_stage = (metadata.get("shardload.pp", "0"), metadata.get("shardload.num_pp", "1"))
    if said_stage != (str(stage), str(stages)):
        raise CheckpointError(
            f"its header says pipeline stage {said_stage[0]} of {said_stage[1]}, not {stage} of {stages}",
            file=str(path),
        )
    if conversion is not None and metadata.get("shardload.conversion") != conversion:
        raise CheckpointError(
            "was written by another conversion than this directory's manifest names (a rank file copied in from "
            "another convert): convert again, or restore the file",
            file=str(path),
        )
    sealed, version = metadata.get(SEAL_KEY), manifest.get(SEALED)
    if version not in (None, False, True, SEAL_VERSION):
        raise CheckpointError(
            f"its {MANIFEST_NAME} says its rank files carry seals of version {version!r}, which this shardload "
            f"does not know (it writes version {SEAL_VERSION}): load it with the shardload that wrote it, or convert "
            "again",
            file=str(path),
        )
    if sealed is None and version:
        raise CheckpointError(
            f"carries no seal, and {MANIFEST_NAME} says every rank file of this directory does (its header was "
            "rewritten): convert again, or restore the file",
            file=str(path),
        )
    place = seal_place(metadata) if version == SEAL_VERSION else None
    if sealed is not None and sealed != seal(manifest_digest(manifest), tensors.values(), place):
        raise CheckpointError(
            f"its header or the plan in {MANIFEST_NAME} was changed after convert wrote them (its seal does not match "
            "them): convert again, or restore both",
            file=str(path),
        )


def rank_file(checkpoint: Checkpoint, rank: int, layout: Mesh, *, stage: int = 0, checksum: bool = False) -> Path:
    """Check and return the file of tensor rank ``rank`` in pipeline ``stage`` of a converted directory.

    The directory must have been written for ``layout``'s tp (= num_shards) and pp; its size is
    always checked, its sha256 when ``checksum``.
    """
    manifest = checkpoint.manifest or {}
    where = str(checkpoint.root / MANIFEST_NAME)
    num_shards = layout.tp
    if manifest["num_shards"] != num_shards:
        raise CheckpointError(
            f"directory was converted for num_shards={manifest['num_shards']}, not {num_shards}; "
            "convert the source checkpoint again or load it directly",
            file=where,
        )
    stages = manifest_stages(manifest)
    stored_layers = (manifest.get("mesh") or {}).get("pp_layers")
    if stages != layout.pp or (layout.pp_layers is not None and list(layout.pp_layers) != stored_layers):
        raise CheckpointError(
            f"directory was converted for pp={stages} (layers per stage {stored_layers}), not for {layout}",
            file=where,
        )
    if type(rank) is not int or not 0 <= rank < num_shards:
        raise CheckpointError(f"rank {rank} is out of range for num_shards={num_shards}", file=where)
    name = rank_file_name(rank, num_shards, stage, stages)
    entry = next(f for f in manifest["files"] if f["path"] == name)  # check_manifest: every rank is listed
    path, problem = check_entry(checkpoint.root, entry, checksum, manifest)
    if problem is not None:
        raise problem
    return path
