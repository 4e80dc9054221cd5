"""TVM tensor caches (what MLC-LLM ships) as a checkpoint source: ``tensor-cache.json`` beside raw-shard files.

A cache is a JSON table (named ``ndarray-cache.json`` before TVM 0.22) of data files, each holding
records packed end to end::

    {"records": [{"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": N,
                  "records": [{"name", "shape", "dtype", "format": "raw" | "f32-to-bf16",
                               "nbytes", "byteOffset"}, ...]}, ...]}

Every record becomes a :class:`~shardload.sources.tensor_info.TensorInfo`, a byte range of its data
file read like any safetensors tensor. An ``f32-to-bf16`` record of a float32 tensor stores the upper
16 bits of each value (bfloat16); as TVM's reader does, it is decoded to float32, so planning and the
ranks see float32 (such a tensor is read whole, then decoded and split). A pre-sharded cache names its
records ``NAME_shard-K-of-N`` (K from 1, TVM's Disco loader) or ``NAME_shard-I`` (I from 0, MLC-LLM's
``--preshard``, beside its ``mlc-chat-config.json``): rank K-1 (rank I) reads that record of every such
parameter and nothing else; at another N the records are the whole parameter's pieces (a shard_info says how it
splits).
"""

from __future__ import annotations

import re
from dataclasses import replace
from math import prod
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, short_repr
from ..format import input_log
from .checkpoint import Checkpoint, check_disjoint, read_json, resolve_inside
from .dtypes import DTYPES, itemsize
from .formats import SourceFormat, register_source
from .safetensors_header import MAX_SPAN
from .tensor_info import TensorInfo

CACHE_NAMES = ("tensor-cache.json", "ndarray-cache.json")
"""The table's name since TVM 0.22, and before it; a directory is read through the first one present."""
B16_NAME = "tensor-cache-b16.json"
"""The table TVM writes beside the first when it encoded float32 as bfloat16 (bfloat16 records); read when named."""
_SHARD_RE = re.compile(r"(.+)_shard-([0-9]{1,9})-of-([0-9]{1,9})")
"""A pre-sharded record's name as TVM's Disco loader looks it up (``NAME_shard-K-of-N``, K from 1); its numbers
are written without leading zeros, and TVM looks records up by that exact name, so one written otherwise
(``_shard-01-of-2``) is refused."""
_WORKER_RE = re.compile(r"(.+)_shard-([0-9]{1,9})")
"""MLC-LLM's ``--preshard`` name for worker I's record (``NAME_shard-I``, I from 0: its ``support/preshard.py``,
looked up so by its runtime's presharded loader). Read so only beside an :data:`MLC_CONFIG` whose
``tensor_parallel_shards`` (N) is at least 2: MLC-LLM's runtime picks that loader by an environment variable, not by
anything in the cache, and a name alone could be any tensor's."""
MLC_CONFIG = "mlc-chat-config.json"
_MAX_SHARDS = 1 << 16


_TVM_DTYPES = {"e4m3_float8": "float8_e4m3fn", "e5m2_float8": "float8_e5m2"}
"""Older TVM's names of the float8 types (ml_dtypes' float8_e4m3fn and float8_e5m2), as its caches record them."""


def is_cache_table(path: Path) -> bool:
    """True for a file named like a TVM tensor-cache table."""
    return path.name in (*CACHE_NAMES, B16_NAME)


def cache_table(path: Path) -> Path | None:
    """The cache table of a directory, or None."""
    return next((path / n for n in CACHE_NAMES if (path / n).is_file()), None)


def open_tensor_cache(path: Path) -> Checkpoint:
    """Open a TVM tensor cache (its directory or its table) as a :class:`Checkpoint`, headers only."""
    table = path if path.is_file() else cache_table(path)
    if table is None:
        raise CheckpointError(f"no {' or '.join(CACHE_NAMES)} here", file=str(path))
    if table != path:  # a directory's table that links out of it is refused, as its data files are
        resolve_inside(path, table.name, path)
    root = table.parent
    doc = read_json(table, "tensor cache")
    shards = _field(doc, "records", list, table, "the top level")
    tensors: dict[str, TensorInfo] = {}
    files: list[Path] = []
    for i, shard in enumerate(shards):
        where = f"records[{i}]"
        if not isinstance(shard, dict):
            raise CheckpointError(f"{where} is not an object", file=str(table))
        data_path = _field(shard, "dataPath", str, table, where)
        if shard.get("format") != "raw-shard":
            raise CheckpointError(
                f"{where} ({data_path}): format {shard.get('format')!r} is not 'raw-shard', the one TVM writes",
                file=str(table),
            )
        nbytes = _count(shard, "nbytes", table, where)
        file = resolve_inside(root, data_path, table)
        st = file.stat()
        input_log.stamp(file, st)  # inside a load: this identity, checked again after the last read
        size = st.st_size
        if size != nbytes:
            raise CheckpointError(f"{data_path} is {size} bytes but the cache table says {nbytes}", file=str(table))
        files.append(file)
        for j, record in enumerate(_field(shard, "records", list, table, where)):
            info = _record(record, file, nbytes, table, f"{where}.records[{j}]")
            if info.name in tensors:
                raise CheckpointError("stored twice in the cache", file=str(table), param=info.name)
            tensors[info.name] = info
    check_disjoint(tensors.values(), str(table))
    ckpt = Checkpoint(path, root, "tvm-cache", tensors, files)
    _split_presharded(ckpt, table)
    return ckpt


def _field(obj: Any, key: str, kind: type, table: Path, where: str) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get(key), kind):
        raise CheckpointError(f"{where} needs {key!r} ({kind.__name__})", file=str(table))
    return obj[key]


def _count(obj: dict[str, Any], key: str, table: Path, where: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{where}: {key!r} must be a non-negative integer, got {value!r}", file=str(table))
    return value


def _record(record: Any, file: Path, file_nbytes: int, table: Path, where: str) -> TensorInfo:
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        raise CheckpointError(f"{where} needs a 'name' (str)", file=str(table))
    name = record["name"]

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(reason, file=str(table), param=name)

    shape = record.get("shape")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape) or len(shape) > 64:
        raise bad(f"shape must be a list of non-negative integers, got {shape!r}")
    if prod(max(d, 1) for d in shape) > MAX_SPAN:  # strides past int64, even for a record of no element
        raise bad(f"shape {short_repr(shape)} is too large (its nonzero dims multiply to more than 2**62)")
    dtype = record.get("dtype")
    dtype = _TVM_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"dtype {short_repr(dtype)} is not one shardload reads ({', '.join(DTYPES)})")
    encoding = record.get("format")
    if encoding not in ("raw", "f32-to-bf16"):
        raise bad(f"format {encoding!r} is neither 'raw' nor 'f32-to-bf16'")
    offset = _count(record, "byteOffset", table, f"{where} ({name})")
    nbytes = _count(record, "nbytes", table, f"{where} ({name})")
    # TVM decodes f32-to-bf16 only for float32 tensors; any other dtype is stored as is.
    decode = encoding == "f32-to-bf16" and dtype == "float32"
    stored = "bfloat16" if decode else dtype
    expected = prod(shape) * itemsize(stored)
    if nbytes != expected:
        raise bad(f"nbytes is {nbytes} but shape {shape} of {stored} needs {expected}")
    if offset + nbytes > file_nbytes:
        raise bad(f"bytes {offset}..{offset + nbytes} run past the end of {file.name} ({file_nbytes} bytes)")
    return TensorInfo(name, stored, tuple(shape), file, offset, nbytes, "float32" if decode else None)


def _split_presharded(ckpt: Checkpoint, table: Path) -> None:
    """Group ``NAME_shard-K-of-N`` (or MLC-LLM's ``NAME_shard-I``) records by parameter; check every parameter has
    K = 1..N, alike, one N."""
    groups: dict[str, dict[int, TensorInfo]] = {}
    count: int | None = None
    workers = _worker_records(ckpt, table)
    for info in ckpt.tensors.values():
        match = _SHARD_RE.fullmatch(info.name)
        if match is None:
            continue
        if workers:
            raise CheckpointError("records named both MLC-LLM's way (NAME_shard-I) and TVM's (NAME_shard-K-of-N)",
                                  file=str(table), param=info.name)  # fmt: skip
        base, k, n = match.group(1), int(match.group(2)), int(match.group(3))
        if match.group(2) != str(k) or match.group(3) != str(n):
            raise CheckpointError(f"a shard record named with a leading zero (TVM writes {base}_shard-{k}-of-{n}, "
                                  "the name TVM looks up)", file=str(table), param=info.name)  # fmt: skip
        if count is not None and n != count:
            raise CheckpointError(
                f"pre-sharded for num_shards={n}, but other records are for num_shards={count}",
                file=str(table),
                param=info.name,
            )
        if not 1 <= k <= n or n > _MAX_SHARDS:
            raise CheckpointError(f"shard {k} of {n} is out of range", file=str(table), param=info.name)
        count = n
        groups.setdefault(base, {})[k] = info  # one name per K: the spelling is checked above, names are unique
    if workers:
        groups, count = workers, len(next(iter(workers.values())))
    if count is None:
        return
    for base, parts in groups.items():
        if base in ckpt.tensors:
            raise CheckpointError(
                "stored both whole and pre-sharded (as NAME_shard-K-of-N)", file=str(table), param=base
            )
        missing = [k for k in range(1, count + 1) if k not in parts]
        if missing:
            raise CheckpointError(
                f"pre-sharded for num_shards={count} but shard {missing[0]} of {count} is missing",
                file=str(table),
                param=base,
            )
        first = parts[1]
        for k, part in parts.items():
            if (part.shape, part.dtype, part.decode) != (first.shape, first.dtype, first.decode):
                raise CheckpointError(
                    f"shard {k} is {list(part.shape)} {part.logical_dtype} but shard 1 is "
                    f"{list(first.shape)} {first.logical_dtype}",
                    file=str(table),
                    param=base,
                )
        ckpt.shards[base] = [replace(parts[k], name=base) for k in range(1, count + 1)]
    for base, parts in groups.items():
        for part in parts.values():
            del ckpt.tensors[part.name]
        ckpt.tensors[base] = ckpt.shards[base][0]  # the plan of a pre-sharded cache: every rank holds a part this size
    ckpt.split_for = count


def _worker_records(ckpt: Checkpoint, table: Path) -> dict[str, dict[int, TensorInfo]]:
    """MLC-LLM's pre-sharded records (``NAME_shard-I``) by parameter, each under K = I + 1 (TVM's numbering), when
    an :data:`MLC_CONFIG` beside them says how many ranks (else none: the names are the tensors' own)."""
    names = [n for n in ckpt.tensors if _WORKER_RE.fullmatch(n) and not _SHARD_RE.fullmatch(n)]
    config = ckpt.root / MLC_CONFIG
    if not names or not config.is_file():
        return {}
    doc = read_json(config, "MLC-LLM config")
    tp = doc.get("tensor_parallel_shards") if isinstance(doc, dict) else None
    if type(tp) is not int or tp < 2:
        return {}
    ckpt.mlc_preshard = True
    groups: dict[str, dict[int, TensorInfo]] = {}
    for name in names:
        info, match = ckpt.tensors[name], _WORKER_RE.fullmatch(name)
        assert match is not None  # matched above
        base, i = match.group(1), int(match.group(2))
        if match.group(2) != str(i):
            raise CheckpointError(f"a shard record named with a leading zero (MLC-LLM writes {base}_shard-{i}, the "
                                  "name its loader looks up)", file=str(table), param=info.name)  # fmt: skip
        if i >= tp:
            raise CheckpointError(f"is worker {i}'s record, but {MLC_CONFIG} says tensor_parallel_shards={tp}",
                                  file=str(table), param=info.name)  # fmt: skip
        groups.setdefault(base, {})[i + 1] = info
    for base, parts in groups.items():
        missing = next((k for k in range(1, tp + 1) if k not in parts), None)
        if missing is not None:
            raise CheckpointError(f"pre-sharded for tensor_parallel_shards={tp} ({MLC_CONFIG}) but its record "
                                  f"{base}_shard-{missing - 1} is missing", file=str(table), param=base)  # fmt: skip
    return groups


register_source(
    SourceFormat(
        name="tvm-cache",
        claims_file=is_cache_table,
        claims_dir=lambda path: cache_table(path) is not None,
        open=open_tensor_cache,
    )
)
