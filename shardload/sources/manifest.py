"""A converted directory's names and manifest: rank file names, the manifest's format, version and conversion id,
and ``check_manifest``, the check of its contents (the files themselves: :mod:`shardload.engine.verify`)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, printable, short_repr
from ..format.hash_record import RECORD_NAME
from ..format.shard_info import MAX_RANKS
from .dtypes import FROM_SAFETENSORS
from .tensor_info import TensorInfo

MANIFEST_NAME = "shard_manifest.json"
MANIFEST_FORMAT = "shardload.converted"
MANIFEST_VERSION = 1
"""The version of a manifest that lists every file with the sha256 of its bytes (what every shardload reads)."""
LEAVES_MANIFEST_VERSION = 2
"""The version of a manifest that lists a rank file by ``leaves_sha256`` instead (the sha256 of its leaf hashes in
the directory's integrity record, which the manifest lists with its sha256): ``convert``'s, unless asked for
sha256. A shardload that reads only version 1 refuses it by its version."""
MANIFEST_VERSIONS = (MANIFEST_VERSION, LEAVES_MANIFEST_VERSION)
LEAVES_KEY = "leaves_sha256"
CONVERSION_KEY = "conversion"
"""The manifest key (and ``shardload.conversion`` in each rank file's metadata) naming one convert run: a rank file
copied in from another conversion is refused by it."""
CONVERSION_RE = re.compile(r"[0-9a-f]{32}")
VLLM_MANIFEST_FORMAT = "shardload.vllm-sharded-state"
"""The manifest format of a directory in vLLM's ``sharded_state`` layout (``convert --layout vllm``)."""
RANK_FILE_RE = re.compile(r"(?:pp-([0-9]{5,9})-of-([0-9]{5,9})-)?rank-([0-9]{5,9})-of-([0-9]{5,9})\.safetensors")
"""A converted rank file; groups: pipeline stage and stage count (absent for one stage), rank, N."""
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
SEAL_KEY = "shardload.seal"
"""The metadata key of a rank file's seal: :func:`seal` of its manifest's plan and its own tensor table."""
SEALED = "sealed"
"""The manifest key saying every rank file carries a seal (one without is refused), of version :data:`SEAL_VERSION`
(``true``: version 1, without the file's place)."""
SEAL_VERSION = 2
"""The seal written now: it covers the file's place (rank, N, stage, stages as its metadata says them) beside its
tensor table, so a file swapped for another rank's with its rank field edited is refused."""
PLACE_KEYS = (("shardload.rank", ""), ("shardload.num_shards", ""), ("shardload.pp", "0"), ("shardload.num_pp", "1"))
"""A rank file's metadata that a version-2 seal covers, with the value meant when a key is absent."""
SEALED_KEYS = ("format", "num_shards", "mesh", CONVERSION_KEY, SEALED, "shard_info", "source_plan", "plan",
               "expert_parallel")  # fmt: skip
"""The manifest keys that say where each byte of a rank file goes, which its seal covers (not the list of files,
their digests and the record, which are checked by their sizes and hashes; nor which shardload wrote it)."""


def rank_file_name(rank: int, num_shards: int, stage: int = 0, stages: int = 1) -> str:
    """A rank's file in a converted directory: ``rank-00003-of-00008.safetensors``, or with
    pipeline stages ``pp-00001-of-00002-rank-00003-of-00004.safetensors``."""
    name = f"rank-{rank:05d}-of-{num_shards:05d}.safetensors"
    return name if stages == 1 else f"pp-{stage:05d}-of-{stages:05d}-{name}"


def manifest_stages(manifest: dict[str, Any]) -> int:
    """Number of pipeline stages a converted directory was written for (1 without a mesh)."""
    mesh = manifest.get("mesh")
    return mesh["pp"] if isinstance(mesh, dict) else 1


def manifest_ranks(manifest: dict[str, Any], bad: Any) -> tuple[int, list[Any]]:
    """A manifest's ``num_shards`` (an int within the rank cap) and ``files`` list, and its conversion id checked;
    ``bad(reason)`` makes the error raised (every layout's manifest has these)."""
    n, files = manifest.get("num_shards"), manifest.get("files")
    if type(n) is not int or n < 1 or not isinstance(files, list):
        raise bad("needs an integer 'num_shards' >= 1 and a 'files' list")
    if n > MAX_RANKS:
        raise bad(f"num_shards={n} is over the limit of {MAX_RANKS}")
    check_conversion(manifest, bad)
    return n, files


def check_manifest(manifest: Any, where: Path) -> None:
    """Check a converted directory's manifest for consistency (not the files: see :func:`shardload.verify_dir`)."""

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"inconsistent manifest: {reason}", file=str(where))

    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if isinstance(manifest, dict) and manifest.get("format") == VLLM_MANIFEST_FORMAT:
        raise CheckpointError(
            "is in vLLM's sharded_state layout (convert --layout vllm): serve it with vLLM's "
            "load_format='sharded_state'; `shardload verify` checks its files",
            file=str(where.parent),
        )
    if manifest.get("format") != MANIFEST_FORMAT:
        raise bad(f"'format' is {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}")
    version = manifest.get("version")
    if type(version) is not int or version not in MANIFEST_VERSIONS:
        reads = " and ".join(str(v) for v in MANIFEST_VERSIONS)
        raise bad(f"unsupported version {short_repr(version)} (this shardload reads {reads})")
    n, files = manifest_ranks(manifest, bad)
    info = manifest.get("shard_info")
    if not isinstance(info, dict) or info.get("num_shards") != n:
        raise bad(f"'shard_info' must be an object for num_shards={n}")
    mesh = manifest.get("mesh")
    if mesh is not None:
        pp, layers = (mesh.get("pp"), mesh.get("pp_layers")) if isinstance(mesh, dict) else (None, None)
        ok = type(pp) is int and pp >= 1 and mesh.get("tp") == n and isinstance(layers, list) and len(layers) == pp
        if type(pp) is int and pp * n > MAX_RANKS:
            raise bad(f"'mesh' of pp={pp} x tp={n} has {pp * n} ranks, over the limit of {MAX_RANKS}")
        if not ok or not all(type(c) is int and c >= 0 for c in layers):
            raise bad("'mesh' must hold pp >= 1, tp equal to num_shards and pp_layers, one count per stage")
    stages = manifest_stages(manifest)
    seen: set[str] = set()
    ranks: set[tuple[int, int]] = set()
    for entry in files:
        path = manifest_file_entry(entry, seen, where)
        rank_match = RANK_FILE_RE.fullmatch(path)
        if LEAVES_KEY in entry and (version < LEAVES_MANIFEST_VERSION or not rank_match):
            raise bad(f"lists {path} by its {LEAVES_KEY}, which only a version-{LEAVES_MANIFEST_VERSION} manifest's "
                      "rank files are")  # fmt: skip
        if rank_match:
            s, s_of = int(rank_match[1] or 0), int(rank_match[2] or 1)
            r, of = int(rank_match[3]), int(rank_match[4])
            if of != n or r >= n or s_of != stages or s >= stages:
                raise bad(f"lists {path}, which is not a rank file of num_shards={n} with {stages} stage(s)")
            if path != rank_file_name(r, n, s, stages):
                raise bad(f"lists {path}, where convert names that rank file {rank_file_name(r, n, s, stages)}")
            ranks.add((s, r))
    check_leaves_record(manifest, files, bad)
    missing = [(s, r) for s in range(stages) for r in range(n) if (s, r) not in ranks]
    if missing:
        total = n * stages
        name = rank_file_name(missing[0][1], n, missing[0][0], stages)
        raise bad(f"lists no file {name} ({len(missing)} of {total} rank files unlisted)")


def check_leaves_record(manifest: dict[str, Any], files: list[Any], bad: Any) -> None:
    """A manifest (either layout) that lists rank files by their ``leaves_sha256`` must list the record holding the
    leaves too, its sha256 the ``integrity`` root."""
    if any(isinstance(e, dict) and LEAVES_KEY in e for e in files):
        integrity = manifest.get("integrity")
        record = next((e for e in files if e["path"] == RECORD_NAME), None)
        if not isinstance(integrity, dict) or integrity.get("record") != RECORD_NAME or record is None \
                or "sha256" not in record or integrity.get("root") != record["sha256"]:  # fmt: skip
            raise bad(f"lists rank files by their {LEAVES_KEY} but not the record {RECORD_NAME!r} that holds the "
                      "leaves (in 'files', its sha256 the 'integrity' root)")  # fmt: skip


def check_conversion(manifest: dict[str, Any], bad: Any) -> None:
    """A manifest's conversion id, when it has one, must be 32 hex digits (older manifests have none)."""
    conversion = manifest.get(CONVERSION_KEY)
    if conversion is not None and not (isinstance(conversion, str) and CONVERSION_RE.fullmatch(conversion)):
        raise bad(f"'{CONVERSION_KEY}' must be 32 hex digits, got {short_repr(conversion)}")


def manifest_file_entry(entry: Any, seen: set[str], where: Path) -> str:
    """Check one ``files`` entry of a manifest (either layout): path, size and one hex digest present (``sha256``,
    or ``leaves_sha256``: :data:`LEAVES_MANIFEST_VERSION`), a plain file name, listed once (``seen`` collects the
    names); return its path."""
    ok = isinstance(entry, dict) and isinstance(entry.get("path"), str) and type(entry.get("size")) is int
    digests = [entry.get(k) for k in ("sha256", LEAVES_KEY) if k in entry] if ok else []
    if not ok or entry["size"] < 0 or len(digests) != 1 or not _SHA256_RE.fullmatch(str(digests[0])):
        raise CheckpointError(
            f"inconsistent manifest: bad 'files' entry {short_repr(entry)} (needs path, size >= 0 and a hex sha256)",
            file=str(where),
        )
    path = entry["path"]
    if path in seen:
        raise CheckpointError(f"inconsistent manifest: file {printable(path)!r} is listed twice", file=str(where))
    if not path or "/" in path or "\\" in path or path in (".", "..") or "\0" in path:
        raise CheckpointError(
            f"inconsistent manifest: file {printable(path)!r} is not a plain file name in the directory",
            file=str(where),
        )
    seen.add(path)
    return path


_digests: dict[int, tuple[dict[str, Any], str]] = {}
"""The digests of the last few manifests read (by identity, each held so its id is not reused)."""
_digests_lock = threading.Lock()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's :data:`SEALED_KEYS` in one canonical JSON form (a manifest as parsed from JSON)."""
    with _digests_lock:
        kept = _digests.get(id(manifest))
    if kept is not None and kept[0] is manifest:
        return kept[1]
    part = {k: manifest[k] for k in SEALED_KEYS if k in manifest}
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), allow_nan=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    with _digests_lock:
        while len(_digests) >= 8:
            _digests.pop(next(iter(_digests)))
        _digests[id(manifest)] = (manifest, digest)
    return digest


def digest_to_write(manifest: dict[str, Any]) -> str:
    """Mark a manifest about to be written :data:`SEALED` and return its :func:`manifest_digest`, taken from its JSON
    as a reader will parse it."""
    manifest[SEALED] = SEAL_VERSION
    return manifest_digest(json.loads(json.dumps(manifest)))


def add_seal(header: dict[str, Any], digest: str) -> None:
    """Put the seal of a rank file's ``header`` (a safetensors header about to be written: ``__metadata__`` and
    tensor entries) in its metadata, for the manifest whose :func:`manifest_digest` is ``digest``."""
    table = []
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            table.append(TensorInfo(name, FROM_SAFETENSORS[entry["dtype"]], tuple(entry["shape"]), Path(), begin,
                                    end - begin))  # fmt: skip
    header["__metadata__"][SEAL_KEY] = seal(digest, table, seal_place(header["__metadata__"]))


def seal_place(metadata: Mapping[str, str]) -> list[str]:
    """The place a rank file's ``metadata`` says it holds, as a version-2 seal covers it."""
    return [str(metadata.get(key, absent)) for key, absent in PLACE_KEYS]


def seal(digest: str, tensors: Iterable[TensorInfo], place: list[str] | None = None) -> str:
    """A rank file's seal: the sha256 of its manifest's ``digest``, its ``place`` (:func:`seal_place`; None: a
    version-1 seal, without it) and its tensors' names, dtypes and shapes in the order of their bytes (which, with
    the bytes tiling the data, fix every offset)."""
    ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes, t.name))
    table = [[t.name, t.dtype, list(t.shape)] for t in ordered]
    text = json.dumps([digest, table] if place is None else [digest, place, table], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
