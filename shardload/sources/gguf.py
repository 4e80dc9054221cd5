"""GGUF files as a checkpoint source, read through the ``gguf`` package (an optional extra).

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

from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..format import input_log
from .checkpoint import Checkpoint, check_disjoint
from .formats import SourceFormat, register_source
from .safetensors_header import MAX_HEADER_BYTES
from .tensor_info import TensorInfo

GGUF_SUFFIX = ".gguf"

# GGUF plain types -> shardload dtype names (by the gguf package's type name, never a name from a file)
_PLAIN = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
}  # fmt: skip


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


def check_layout(path: Path) -> None:
    """Walk a GGUF file's header (counts, key/value pairs, tensor infos) checking every count and length against
    the bytes left in the file, before gguf's reader trusts them: a forged count is a one-line error, never a huge
    allocation or a long loop."""
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

        def value(kind: int, what: str, nested: bool = False) -> None:
            if kind in _FIXED:
                skip(_FIXED[kind], what)
            elif kind == _STRING:
                skip(count(f"{what} length", 1), what)
            elif kind == _ARRAY and not nested:
                item = number(4, f"{what} item type")
                n = count(f"{what} length", _FIXED.get(item, 8))
                if item in _FIXED:
                    skip(n * _FIXED[item], what)
                else:
                    for _ in range(n):
                        value(item, what, nested=True)
            else:
                raise CheckpointError(f"{BAD}: {what} has unknown value type {kind}", file=str(path))

        if skip(4, "magic", keep=True) != b"GGUF":
            raise CheckpointError("not a GGUF file (no GGUF magic)", file=str(path))
        number(4, "version")
        tensors = count("tensor count", 8 + 4 + 4 + 8)
        kvs = count("metadata count", 8 + 4)
        for _ in range(kvs):
            key = skip(count("metadata key length", 1), "metadata key", keep=True).decode("utf-8", "replace")
            value(number(4, f"type of {key!r}"), f"metadata {key!r}")
        for _ in range(tensors):
            skip(count("tensor name length", 1), "tensor name")
            dims = number(4, "tensor dims")
            if dims > MAX_DIMS:
                raise CheckpointError(f"{BAD}: a tensor with {dims} dims (at most {MAX_DIMS})", file=str(path))
            skip(8 * dims + 4 + 8, "tensor info")


def _reader(path: Path) -> Any:
    check_layout(path)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError(
            "reading GGUF needs the gguf package: pip install 'shardload[gguf]'", file=str(path)
        ) from None
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OSError, EOFError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{BAD}: {err}", file=str(path)) from None
    if reader.byte_order != "I":
        raise CheckpointError("GGUF file has the other byte order than this machine; not supported", file=str(path))
    return reader


def _tensor_info(path: Path, size: int, t: Any) -> tuple[TensorInfo, dict[str, Any]]:
    from gguf.constants import GGML_QUANT_SIZES

    type_name = t.tensor_type.name
    block, type_bytes = GGML_QUANT_SIZES[t.tensor_type]
    dims = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the innermost dim first
    where = {"file": str(path), "param": t.name}
    if type_name in _PLAIN:
        dtype, shape = _PLAIN[type_name], dims
    else:
        if not dims or dims[-1] % block:
            raise CheckpointError(f"{type_name} tensor of shape {list(dims)} is not whole blocks of {block}", **where)
        dtype, shape = "uint8", (*dims[:-1], dims[-1] // block, type_bytes)
    if t.data_offset + t.n_bytes > size:
        raise CheckpointError(f"data runs past the end of the {size}-byte file", **where)
    kind = {"type": type_name, "block_size": block, "type_size": type_bytes, "shape": list(dims)}
    return TensorInfo(t.name, dtype, shape, path, int(t.data_offset), int(t.n_bytes)), kind


def _read(files: list[Path]) -> tuple[dict[str, TensorInfo], dict[str, dict[str, Any]]]:
    tensors: dict[str, TensorInfo] = {}
    kinds: dict[str, dict[str, Any]] = {}
    parts: dict[Path, tuple[int, int, int | None]] = {}
    for f in files:
        st = f.stat()
        input_log.stamp(f, st)  # inside a load: this identity, checked again after the last read
        reader = _reader(f)
        size = st.st_size
        split = _split_part(reader, f)
        if split is not None:
            parts[f] = split
        for t in reader.tensors:
            if t.name in tensors:
                first = tensors[t.name].file.name
                raise CheckpointError(f"tensor is stored in two files: {first} and {f.name}", file=str(f), param=t.name)
            tensors[t.name], kinds[t.name] = _tensor_info(f, size, t)
    if parts:
        _check_split(parts, files, len(tensors))
    check_disjoint(tensors.values())
    return tensors, kinds


def _split_part(reader: Any, path: Path) -> tuple[int, int, int | None] | None:
    """A split model's part: (its number from 0, the part count, the model's tensor count), from llama.cpp's
    ``split.no``, ``split.count`` and ``split.tensors.count``; None for a file that is not one of several parts."""
    values = {}
    for key in ("split.no", "split.count", "split.tensors.count"):
        field = reader.fields.get(key)
        if field is not None:
            try:
                values[key] = int(field.parts[field.data[0]][0])
            except (IndexError, TypeError, ValueError):
                raise CheckpointError(f"{BAD}: metadata {key} is not an integer", file=str(path)) from None
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
    return sorted(p for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())


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
    reader = _reader(files[0])
    arch = _metadata(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError("GGUF metadata has no general.architecture", file=str(files[0]))
    config: dict[str, Any] = {"model_type": arch}
    for key, suffix in _CONFIG_KEYS.items():
        value = _metadata(reader, f"{arch}.{suffix}")
        if value is not None:
            config[key] = value
    config["quantization_config"] = quantization_config(path)
    return config


def _metadata(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


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
