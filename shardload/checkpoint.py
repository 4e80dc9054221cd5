"""Checkpoint reading: safetensors headers (single file, HF indexed multi-file, converted output).

Opening a checkpoint reads headers only; tensor bytes are read by the executor, run by run,
through :class:`shardload.reader.Reader`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from itertools import pairwise
from math import prod
from pathlib import Path
from typing import Any

from .dtypes import DTYPES, FROM_SAFETENSORS
from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAME = "shard_manifest.json"
SHARD_INFO_NAME = "shard_info.json"
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives: file, absolute byte offset, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


@dataclass
class Checkpoint:
    """The header-level view of a model: every tensor's location, no data read.

    ``kind`` is ``"safetensors"`` for a source checkpoint and ``"converted"`` for a directory
    written by ``convert`` (then ``manifest`` holds its manifest and ``tensors`` is empty:
    each rank's file is opened with :func:`read_header` when needed).
    """

    path: Path
    root: Path
    kind: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    manifest: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(t.nbytes for t in self.tensors.values())

    def default_shard_info(self) -> Path:
        """Where a shard_info.json is looked for when none is given: beside the weights."""
        return self.root / SHARD_INFO_NAME


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a model directory, a ``.safetensors`` file, or a converted directory (headers only)."""
    path = Path(path)
    if path.is_file():
        if path.name == MANIFEST_NAME:
            return _open_converted(path.parent)
        if path.name.endswith(".json") and path.name.endswith(".index.json"):
            return _open_index(path.parent, path)
        return _open_files(path, path.parent, [path])
    if not path.is_dir():
        raise CheckpointError("no such file or directory", file=str(path))
    if (path / MANIFEST_NAME).is_file():
        return _open_converted(path)
    if (path / INDEX_NAME).is_file():
        return _open_index(path, path / INDEX_NAME)
    if (path / SINGLE_NAME).is_file():
        return _open_files(path, path, [path / SINGLE_NAME])
    found = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not found:
        raise CheckpointError(
            f"no {SINGLE_NAME}, {INDEX_NAME}, {MANIFEST_NAME} or *.safetensors file here", file=str(path)
        )
    return _open_files(path, path, found)


def _open_files(path: Path, root: Path, files: list[Path]) -> Checkpoint:
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor is stored in two files: {tensors[name].file.name} and {f.name}", file=str(f), param=name
                )
            tensors[name] = info
    return Checkpoint(path, root, "safetensors", tensors, list(files))


def _open_index(root: Path, index: Path) -> Checkpoint:
    doc = _read_json(index, "index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("'weight_map' must be an object of tensor name -> file name", file=str(index))
    files: dict[str, Path] = {}
    for file_name in dict.fromkeys(weight_map.values()):
        files[file_name] = _inside(root, file_name, index)
    ckpt = _open_files(index, root, list(files.values()))
    for name, file_name in weight_map.items():
        info = ckpt.tensors.get(name)
        if info is None:
            raise CheckpointError(f"listed in the index but not stored in {file_name}", file=str(index), param=name)
        if info.file != files[file_name]:
            raise CheckpointError(
                f"the index says {file_name}, but it is stored in {info.file.name}", file=str(index), param=name
            )
    return ckpt


def _inside(root: Path, file_name: str, referrer: Path) -> Path:
    """Resolve a file name from an index or manifest, refusing anything outside ``root``."""
    candidate = Path(file_name)
    if candidate.is_absolute() or ".." in candidate.parts or not file_name:
        raise CheckpointError(f"file name {file_name!r} points outside the model directory", file=str(referrer))
    full = root / candidate
    try:
        real = full.resolve(strict=True)
    except (OSError, RuntimeError):
        raise CheckpointError(f"references missing file {file_name!r}", file=str(referrer)) from None
    if not real.is_relative_to(root.resolve()):
        raise CheckpointError(
            f"file {file_name!r} resolves outside the model directory (symlink to {real})", file=str(referrer)
        )
    if not real.is_file():
        raise CheckpointError(f"{file_name!r} is not a regular file", file=str(referrer))
    return full


def _open_converted(root: Path) -> Checkpoint:
    manifest_path = root / MANIFEST_NAME
    manifest = _read_json(manifest_path, "manifest")
    n = manifest.get("num_shards") if isinstance(manifest, dict) else None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if type(n) is not int or n < 1 or not isinstance(files, list):
        raise CheckpointError("manifest needs an integer 'num_shards' and a 'files' list", file=str(manifest_path))
    for entry in files:
        ok = isinstance(entry, dict) and isinstance(entry.get("path"), str) and type(entry.get("size")) is int
        if not ok:
            raise CheckpointError(f"bad 'files' entry {entry!r}", file=str(manifest_path))
    return Checkpoint(root, root, "converted", {}, [], manifest)


def _read_json(path: Path, what: str) -> Any:
    try:
        if path.stat().st_size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{what} file is larger than {MAX_HEADER_BYTES} bytes", file=str(path))
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise CheckpointError(f"cannot read {what}: {err.strerror or err}", file=str(path)) from None
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{what} is not valid JSON: {err}", file=str(path)) from None


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header: dtypes, shapes, byte ranges in bounds."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"file of {size} bytes is too short for a safetensors header", file=name)
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} byte cap", file=name
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"header length {header_len} runs past the end of the {size}-byte file", file=name
                )
            raw = fh.read(header_len)
    except OSError as err:
        raise CheckpointError(f"cannot read: {err.strerror or err}", file=name) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError("safetensors header is not valid JSON", file=name) from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object", file=name)
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        tensors[key] = _tensor_entry(path, key, entry, data_start, data_size)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(f"data overlaps tensor {name_a!r}", file=name, param=name_b)
    return tensors


def _tensor_entry(path: Path, key: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    def bad(reason: str) -> CheckpointError:
        return CheckpointError(reason, file=str(path), param=key)

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in FROM_SAFETENSORS:
        raise bad(f"unknown dtype {code!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"bad shape {shape!r}")
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
    if not ok or offsets[0] > offsets[1]:
        raise bad(f"bad data_offsets {offsets!r}")
    if offsets[1] > data_size:
        raise bad(f"data_offsets {offsets} run past the end of the data ({data_size} bytes)")
    dtype = FROM_SAFETENSORS[code]
    nbytes = prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"shape {shape} of {dtype} needs {nbytes} bytes, but data_offsets span {offsets[1] - offsets[0]}")
    return TensorInfo(key, dtype, tuple(shape), path, data_start + offsets[0], nbytes)
