"""Safetensors headers: the 8-byte length and the JSON header of a local file or an object, read with a cap and
checked against the file (dtypes, shapes, byte ranges tiling the data section exactly)."""

from __future__ import annotations

import os
import struct
from math import prod
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, short_repr
from ..format import input_log, strictjson
from .dtypes import DTYPES, FROM_SAFETENSORS
from .objects import ObjectPath
from .tensor_info import TensorInfo

MAX_HEADER_BYTES = 100 << 20
"""Cap on a safetensors header and on index/manifest JSON files (real headers are a few MB at most)."""
MAX_TENSORS = 1 << 20
"""Most tensors one file may declare (the largest checkpoints hold about 100,000 in all): each costs a few KiB
once planned, so a compact header of millions would take gigabytes."""


MAX_SPAN = 2**62
"""Most elements a stored shape may span, zero dims counted as one: torch (and numpy) compute strides in int64, so
a tensor with no element but dims of 2**62 still cannot be made."""


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header: dtypes, shapes, byte ranges tiling the data exactly."""
    return read_header_and_metadata(path)[0]


def header_tensors(path: Path, header: bytes) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file about to be written at ``path``, from its whole header (the 8-byte length
    included), parsed and checked as :func:`read_header` would parse the finished file."""
    import json

    raw = header[8:]
    ends = [e["data_offsets"][1] for k, e in json.loads(raw).items() if k != "__metadata__"]
    return _parse_header(path, raw, len(raw), len(header) + max(ends, default=0))[0]


def read_header_and_metadata(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Like :func:`read_header`, also returning the header's ``__metadata__`` strings."""
    name = str(path)
    if isinstance(path, ObjectPath):
        raw, header_len, size = _object_header(path)
    else:
        raw, header_len, size = _file_header(path)
    if len(raw) != header_len:
        raise CheckpointError("file shrank while its header was read", file=name)
    return _parse_header(path, raw, header_len, size)


def _object_header(path: ObjectPath) -> tuple[bytes, int, int]:
    """A safetensors object's header by two range requests: its 8-byte length, then the header itself."""
    name = str(path)
    size = path.size()
    if size is None:
        raise CheckpointError("no such object", file=name)
    _check_size(size, name)
    first = path.store.read(path.key, 0, 8)
    header_len = _header_length(first, size, name)
    raw = path.store.read(path.key, 8, 8 + header_len)
    input_log.note(path, first + raw)
    return raw, header_len, size


def _check_size(size: int, name: str) -> None:
    if size < 8:
        raise CheckpointError(f"file of {size} bytes is too short for a safetensors header", file=name)


def _header_length(first: bytes, size: int, name: str) -> int:
    """The header length the first 8 bytes of a safetensors file give, checked against the cap and the file size."""
    if len(first) != 8:  # the size was read first: a writer cut the file since
        raise CheckpointError(f"file shrank while its header was read ({len(first)} of its first 8 bytes)", file=name)
    (header_len,) = struct.unpack("<Q", first)
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} byte cap", file=name)
    if 8 + header_len > size:
        raise CheckpointError(
            f"header length {header_len} runs past the end of the {size}-byte file (truncated?)", file=name
        )
    return header_len


def exact_reads(fd: int) -> None:
    """Read just the pages asked for through ``fd`` (no readahead; best effort). A header read with readahead leaves
    the kernel's readahead mark on a page past it, and whichever read touches that page later, even through
    another descriptor with readahead off, pulls in a whole readahead window of tensor bytes no rank asked for."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass


def _file_header(path: Path) -> tuple[bytes, int, int]:
    """A local safetensors file's raw header, its length and the file's size."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            exact_reads(fh.fileno())
            st = os.fstat(fh.fileno())  # before the lease test: a writer opening after it changes the file's times
            input_log.no_writer(path, fh.fileno())
            size = st.st_size
            _check_size(size, name)
            first = fh.read(8)
            header_len = _header_length(first, size, name)
            raw = fh.read(header_len)
            input_log.note(path, first + raw, st)
    except OSError as err:
        raise CheckpointError(f"cannot read: {err.strerror or err}", file=name) from None
    return raw, header_len, size


def _parse_header(path: Any, raw: bytes, header_len: int, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Check a raw safetensors header against the file's size: dtypes, shapes, byte ranges tiling the data."""
    name = str(path)
    objects = raw.count(b"{")  # one per tensor: counted before parsing, which builds every object at once
    if objects > 2 * MAX_TENSORS:
        raise CheckpointError(f"safetensors header holds {objects} JSON objects; a file may declare at most "
                              f"{MAX_TENSORS} tensors", file=name)  # fmt: skip
    try:
        header = strictjson.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"safetensors header is not UTF-8 text (byte {8 + err.start})", file=name) from None
    except strictjson.DuplicateKeyError as dup:
        if dup.key == "__metadata__":
            raise CheckpointError("'__metadata__' is given twice in the safetensors header", file=name) from None
        raise CheckpointError("tensor is listed twice in the safetensors header", file=name, param=dup.key) from None
    except (ValueError, RecursionError):
        raise CheckpointError("safetensors header is not valid JSON", file=name) from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object", file=name)
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError("safetensors '__metadata__' must be an object of strings", file=name)
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        tensors[key] = _tensor_entry(path, key, entry, data_start, data_size)
    _check_tiling(name, tensors, data_start, data_size)
    return tensors, metadata


def _check_tiling(name: str, tensors: dict[str, TensorInfo], data_start: int, data_size: int) -> None:
    """Tensor byte ranges must tile the data section exactly: no overlap, no gap, no trailing bytes."""
    end, last = 0, None
    for begin, stop, key in sorted((t.offset - data_start, t.offset - data_start + t.nbytes, t.name)
                                   for t in tensors.values() if t.nbytes):  # fmt: skip
        if begin < end:
            raise CheckpointError(f"data overlaps tensor {last!r}", file=name, param=key)
        if begin > end:
            raise CheckpointError(
                f"bytes {end}..{begin} of the data section belong to no tensor (gap before this tensor)",
                file=name, param=key,
            )  # fmt: skip
        end, last = stop, key
    if end != data_size:
        raise CheckpointError(
            f"{data_size - end} trailing bytes after the last tensor's data (file longer than its header says)",
            file=name,
        )


def _tensor_entry(path: Path, key: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    def bad(reason: str) -> CheckpointError:
        return CheckpointError(reason, file=str(path), param=key)

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in FROM_SAFETENSORS:
        raise bad(f"unknown dtype {short_repr(code)}")
    if not isinstance(shape, list) or len(shape) > 64 or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"bad shape {short_repr(shape)}")
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
    if not ok or offsets[0] > offsets[1]:
        raise bad(f"bad data_offsets {short_repr(offsets)}")
    if offsets[1] > data_size:
        raise bad(f"data_offsets {offsets} run past the end of the data ({data_size} bytes; truncated file?)")
    if prod(max(d, 1) for d in shape) > MAX_SPAN:  # strides past int64, even for a tensor with no element
        raise bad(f"shape {short_repr(shape)} is too large (its nonzero dims multiply to more than 2**62)")
    dtype = FROM_SAFETENSORS[code]
    nbytes = prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != nbytes:
        raise bad(
            f"shape {short_repr(shape)} of {dtype} needs {nbytes} bytes, "
            f"but data_offsets span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(key, dtype, tuple(shape), path, data_start + offsets[0], nbytes)
