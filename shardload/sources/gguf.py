"""GGUF files as a checkpoint source: headers parsed here, in one pass, once per file (the ``gguf`` package, an
optional extra, gives the GGML types' block sizes).

Tensors are presented in numpy/torch dim order (outermost first; GGUF lists dims innermost
first). A block-quantized tensor (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, ...) of logical shape
``[..., rows, cols]`` becomes a uint8 tensor ``[..., rows, cols / block, bytes per block]``: its
blocks run along the last logical dim, so a split by rows is any split of dim -3 and a split by
columns must fall on a block boundary (a split of dim -2, ``shard_funcs.shard_groups``). Plain
types (F32, F16, BF16, integers) keep their dtype and shape. Nothing is copied: each tensor is a
byte range of the file, read by the executor like a safetensors tensor. :func:`model_config`
reads the file's metadata in config.json's terms (head counts, sizes) for ``shardload plan``.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..format import input_log
from .checkpoint import Checkpoint, check_disjoint, resolve_inside
from .formats import SourceFormat, register_source
from .safetensors_header import MAX_HEADER_BYTES, MAX_SPAN, MAX_TENSORS
from .tensor_info import TensorInfo

GGUF_SUFFIX = ".gguf"

# GGUF plain types -> shardload dtype names (by the gguf package's type name, never a name from a file)
_PLAIN = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
}  # fmt: skip


REPACKED_TYPES = frozenset({31, 32, 33, 36, 37, 38})
"""GGML type ids of llama.cpp's repacked types (Q4_0_4_4, Q4_0_4_8, Q4_0_8_8, IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8),
refused by id: they interleave the blocks of several rows, so a row or column split of them is not one of the
tensor, and an older gguf package lists them with Q4_0's sizes. Every other type the installed gguf knows is
read as rows of whole blocks."""

# config.json key -> GGUF metadata key after the "{architecture}." prefix
_CONFIG_KEYS = {
    "hidden_size": "embedding_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_local_experts": "expert_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "vocab_size": "vocab_size",
}


# GGUF value types: fixed sizes by type id (uint8 .. float64, bool), 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 8
BAD = "not a readable GGUF file"
"""A GGUF tensor has at most this many dims (GGML itself has four)."""


@dataclass
class _Entry:
    """One tensor of a GGUF header: its name, dims (GGUF's order, innermost first), GGML type id and data offset."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


@dataclass(frozen=True)
class _Array:
    """A metadata array, skipped over: only its length is kept."""

    length: int


@dataclass
class _Header:
    """A GGUF file's header: its scalar metadata (arrays left out: a tokenizer's are most of a header), its tensors
    and where their data starts."""

    metadata: dict[str, Any]
    tensors: list[_Entry]
    data_start: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_header(path: Path) -> _Header:
    """Walk a GGUF file's header (counts, key/value pairs, tensor infos) in one pass, checking every count and
    length against the bytes left in the file: a forged count is a one-line error, never a huge allocation or a long
    loop. Arrays are skipped over, not decoded (a Llama 3 tokenizer's are a few MB of short strings)."""
    size = path.stat().st_size
    with open(path, "rb", buffering=1 << 20) as fh:
        pos = 0

        def skip(n: int, what: str, keep: bool = False) -> bytes:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise CheckpointError(f"{BAD}: {what} runs past the end of the file", file=str(path))
            if pos + n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{BAD}: header larger than {MAX_HEADER_BYTES} bytes", file=str(path))
            pos += n
            if keep:
                return fh.read(n)
            fh.seek(n, 1)
            return b""

        def number(n: int, what: str) -> int:
            return int.from_bytes(skip(n, what, keep=True), "little")

        def count(what: str, each: int) -> int:
            n = number(8, what)
            if n * each > size - pos:
                raise CheckpointError(
                    f"{BAD}: {what} {n} needs at least {n * each} bytes, more than the {size}-byte file holds",
                    file=str(path),
                )
            return n

        def text(what: str, strict: bool = True) -> str:
            raw = skip(count(f"{what} length", 1), what, keep=True)
            try:
                return raw.decode("utf-8", "strict" if strict else "replace")  # values are read only when used
            except UnicodeDecodeError:
                raise CheckpointError(f"{BAD}: {what} is not UTF-8", file=str(path)) from None

        def value(kind: int, what: str, nested: bool = False) -> Any:
            if kind in _FIXED:
                return struct.unpack(_SCALARS[kind], skip(_FIXED[kind], what, keep=True))[0]
            if kind == _STRING:
                return text(what, strict=False)
            if kind == _ARRAY and not nested:
                item = number(4, f"{what} item type")
                n = count(f"{what} length", _FIXED.get(item, 8))
                if item in _FIXED:
                    skip(n * _FIXED[item], what)
                elif item == _STRING:
                    for _ in range(n):
                        skip(count(f"{what} length", 1), what)
                else:
                    raise CheckpointError(f"{BAD}: {what} holds items of type {item}", file=str(path))
                return _Array(n)
            raise CheckpointError(f"{BAD}: {what} has unknown value type {kind}", file=str(path))

        if skip(4, "magic", keep=True) != b"GGUF":
            raise CheckpointError("not a GGUF file (no GGUF magic)", file=str(path))
        version = number(4, "version")
        if version not in (2, 3):
            other = " (a big-endian file?)" if version >= 1 << 16 else ""
            raise CheckpointError(f"{BAD}: GGUF version {version}{other}; shardload reads versions 2 and 3",
                                  file=str(path))  # fmt: skip
        tensors = count("tensor count", 8 + 4 + 4 + 8)
        if tensors > MAX_TENSORS:
            raise CheckpointError(f"{BAD}: {tensors} tensors; a file may declare at most {MAX_TENSORS}",
                                  file=str(path))  # fmt: skip
        kvs = count("metadata count", 8 + 4)
        metadata: dict[str, Any] = {}
        for _ in range(kvs):
            key = text("metadata key")
            if key in metadata:
                raise CheckpointError(f"{BAD}: metadata key {key!r} appears twice", file=str(path))
            kind = number(4, f"type of {key!r}")
            metadata[key] = value(kind, f"metadata {key!r}")
            align = metadata[key]
            if key == "general.alignment" and (kind != 4 or not 0 < align <= 1 << 20 or align & (align - 1)):
                raise CheckpointError(f"{BAD}: general.alignment must be a power of two up to 2**20", file=str(path))
        entries = []
        for _ in range(tensors):
            name = text("tensor name")
            dims = number(4, "tensor dims")
            if dims > MAX_DIMS:
                raise CheckpointError(f"{BAD}: a tensor with {dims} dims (at most {MAX_DIMS})", file=str(path))
            shape = tuple(number(8, "tensor dim") for _ in range(dims))
            entries.append(_Entry(name, shape, number(4, "tensor type"), number(8, "tensor offset")))
    align = metadata.get("general.alignment") or 32
    return _Header(metadata, entries, -(-pos // align) * align)


def _tensor_info(path: Path, size: int, data_start: int, t: _Entry) -> tuple[TensorInfo, dict[str, Any]]:
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        raise CheckpointError(
            "reading GGUF needs the gguf package: pip install 'shardload[gguf]'", file=str(path)
        ) from None

    where = {"file": str(path), "param": t.name}
    if t.kind in REPACKED_TYPES:
        raise CheckpointError(f"tensor type {t.kind} is not one shardload splits: its data is not whole rows of blocks "
                              "one after another (llama.cpp's repacked types store several rows interleaved); "
                              "requantize or convert the model to a plain type", **where)  # fmt: skip
    try:
        kind = GGMLQuantizationType(t.kind)
        block, type_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise CheckpointError(f"tensor type {t.kind} is not one the gguf package knows", **where) from None
    type_name = kind.name
    dims = tuple(reversed(t.dims))  # GGUF lists the innermost dim first
    if math.prod(max(d, 1) for d in dims) > MAX_SPAN:  # strides past int64, even for a tensor with no element
        too_large = f"shape {list(dims)} is too large (its nonzero dims multiply to more than 2**62)"
        raise CheckpointError(too_large, **where)
    if type_name in _PLAIN:
        dtype, shape = _PLAIN[type_name], dims
        nbytes = math.prod(dims) * type_bytes
    else:
        if not dims or dims[-1] % block:
            raise CheckpointError(f"{type_name} tensor of shape {list(dims)} is not whole blocks of {block}", **where)
        dtype, shape = "uint8", (*dims[:-1], dims[-1] // block, type_bytes)
        nbytes = math.prod(shape)
    start = data_start + t.offset
    if start + nbytes > size:
        raise CheckpointError(f"data runs past the end of the {size}-byte file", **where)
    info = {"type": type_name, "block_size": block, "type_size": type_bytes, "shape": list(dims)}
    return TensorInfo(t.name, dtype, shape, path, start, nbytes), info


def _read(files: list[Path]) -> tuple[dict[str, TensorInfo], dict[str, dict[str, Any]]]:
    tensors: dict[str, TensorInfo] = {}
    kinds: dict[str, dict[str, Any]] = {}
    parts: dict[Path, tuple[int, int, int | None]] = {}
    for f in files:
        st = f.stat()
        input_log.stamp(f, st)  # inside a load: this identity, checked again after the last read
        header = _header(f)
        split = _split_part(header.metadata, f)
        if split is not None:
            parts[f] = split
        for t in header.tensors:
            if t.name in tensors:
                first = tensors[t.name].file.name
                where = "twice in this file" if first == f.name else f"in two files: {first} and {f.name}"
                raise CheckpointError(f"tensor is stored {where}", file=str(f), param=t.name)
            tensors[t.name], kinds[t.name] = _tensor_info(f, st.st_size, header.data_start, t)
    if parts:
        _check_split(parts, files, len(tensors))
    check_disjoint(tensors.values())
    return tensors, kinds


def _split_part(metadata: dict[str, Any], path: Path) -> tuple[int, int, int | None] | None:
    """A split model's part: (its number from 0, the part count, the model's tensor count), from llama.cpp's
    ``split.no``, ``split.count`` and ``split.tensors.count``; None for a file that is not one of several parts."""
    values = {}
    for key in ("split.no", "split.count", "split.tensors.count"):
        if key in metadata:
            if type(metadata[key]) is not int:
                raise CheckpointError(f"{BAD}: metadata {key} is not an integer", file=str(path))
            values[key] = metadata[key]
    count = values.get("split.count", 1)
    if count <= 1:
        return None
    return values.get("split.no", -1), count, values.get("split.tensors.count")


def _check_split(parts: dict[Path, tuple[int, int, int | None]], files: list[Path], found: int) -> None:
    """Every part of one split model, each once, and no other GGUF file beside them; the model's tensor count."""
    first, (_, count, total) = next(iter(parts.items()))
    numbers = sorted(no for no, _, _ in parts.values())
    if any(c != count for _, c, _ in parts.values()) or len(files) != len(parts) or numbers != list(range(count)):
        have = ", ".join(f"{f.name} (part {no + 1} of {c})" for f, (no, c, _) in parts.items())
        others = [f.name for f in files if f not in parts]
        extra = f"; and not a part of it: {', '.join(others)}" if others else ""
        raise CheckpointError(
            f"a split GGUF model needs all its {count} parts, each once, and nothing else: here {have}{extra} (give "
            "the directory that holds every part)",
            file=str(first.parent if len(files) > 1 else first),
        )
    if total is not None and found != total:
        raise CheckpointError(f"the split model's {count} parts hold {found} tensors, their metadata says {total}",
                              file=str(first.parent))  # fmt: skip


def gguf_files(path: Path) -> list[Path]:
    """The GGUF files of ``path``: the file itself, or every ``*.gguf`` in a directory (split models)."""
    if path.is_file():
        return [path]
    found = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    return [resolve_inside(path, name, path) for name in found]  # a link out of the directory is refused


def open_gguf(path: Path) -> Checkpoint:
    """Open a ``.gguf`` file or a directory of them as a :class:`Checkpoint` (headers only)."""
    files = gguf_files(path)
    if not files:
        raise CheckpointError("no *.gguf file here", file=str(path))
    tensors, _ = _read(files)
    return Checkpoint(path, path if path.is_dir() else path.parent, "gguf", tensors, files)


def quantization_config(path: str | Path) -> dict[str, Any]:
    """A quantization_config for a GGUF source: ``{"quant_method": "gguf", "tensor_types": {name: {...}}}``.

    Each entry gives the GGML type name, ``block_size`` (elements per block), ``type_size`` (bytes
    per block) and the logical ``shape`` (numpy order); :mod:`shardload.models.stored_layouts` reads it.
    """
    _, kinds = _read(gguf_files(Path(path)))
    return {"quant_method": "gguf", "tensor_types": kinds}


def model_config(path: str | Path) -> dict[str, Any]:
    """The model's config from GGUF metadata, in config.json's terms, with its ``quantization_config``.

    ``model_type`` is the file's ``general.architecture`` (a family entry maps those that differ from
    transformers', :func:`shardload.models.families.gguf_model_type`); head counts and sizes come from the
    ``{architecture}.*`` keys (absent keys are left out).
    """
    files = gguf_files(Path(path))
    if not files:
        raise CheckpointError("no *.gguf file here", file=str(path))
    metadata = _header(files[0]).metadata
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError("GGUF metadata has no general.architecture", file=str(files[0]))
    config: dict[str, Any] = {"model_type": arch}
    for key, suffix in _CONFIG_KEYS.items():
        value = metadata.get(f"{arch}.{suffix}")
        if isinstance(value, _Array):  # one value per layer (as some architectures write head counts)
            raise CheckpointError(
                f"GGUF metadata {arch}.{suffix} holds one value per layer; shardload plans a model whose {key} is "
                "one number: write its shard_info.json",
                file=str(files[0]),
            )
        if value is not None:
            config[key] = value
    config["quantization_config"] = quantization_config(path)
    return config


def _header(path: Path) -> _Header:
    """``path``'s header, parsed once per file identity in this process (a load asks for it three times)."""
    st = path.stat()
    key: tuple[Any, ...] = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if input_log.file_system(st.st_dev) in input_log.UNTIMED_FILE_SYSTEMS:  # rewritten through a mapping, its
        log = input_log.current()  # times stay: kept for this load only, outside one not at all
        if log is None:
            return read_header(path)
        key += (log.serial,)
    with _HEADERS_LOCK:
        header = _HEADERS.pop(key, None)
    header = header or read_header(path)  # parsed outside the lock: another thread's file is not kept waiting
    with _HEADERS_LOCK:
        _HEADERS[key] = header  # the newest last
        while len(_HEADERS) > _HEADERS_KEPT:
            del _HEADERS[next(iter(_HEADERS))]
    return header


_HEADERS_LOCK = threading.Lock()
_HEADERS: dict[tuple[Any, ...], _Header] = {}
_HEADERS_KEPT = 64
"""Headers kept (a few kB each, arrays left out): a split model's parts, and a few models."""


register_source(
    SourceFormat(
        name="gguf",
        claims_file=lambda path: path.suffix == GGUF_SUFFIX,
        claims_dir=lambda path: bool(gguf_files(path)),
        open=open_gguf,
        config_file=lambda checkpoint: checkpoint.files[0],
        read_config=lambda checkpoint: model_config(checkpoint.path),
        gguf_model_type=True,
    )
)
