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
from .checkpoint import Checkpoint, TensorInfo
from .formats import SourceFormat, register_source

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
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # GGUF architecture -> transformers model_type


def _reader(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError(
            "reading GGUF needs the gguf package: pip install 'shardload[gguf]'", file=str(path)
        ) from None
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OSError, EOFError, UnicodeDecodeError) as err:
        raise CheckpointError(f"not a readable GGUF file: {err}", file=str(path)) from None
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
    for f in files:
        reader = _reader(f)
        size = f.stat().st_size
        for t in reader.tensors:
            if t.name in tensors:
                first = tensors[t.name].file.name
                raise CheckpointError(f"tensor is stored in two files: {first} and {f.name}", file=str(f), param=t.name)
            tensors[t.name], kinds[t.name] = _tensor_info(f, size, t)
    return tensors, kinds


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
    per block) and the logical ``shape`` (numpy order); :mod:`shardload.quant_plan` reads it.
    """
    _, kinds = _read(gguf_files(Path(path)))
    return {"quant_method": "gguf", "tensor_types": kinds}


def model_config(path: str | Path) -> dict[str, Any]:
    """The model's config from GGUF metadata, in config.json's terms, with its ``quantization_config``.

    ``model_type`` is the file's ``general.architecture``; head counts and sizes come from the
    ``{architecture}.*`` keys (absent keys are left out).
    """
    files = gguf_files(Path(path))
    if not files:
        raise CheckpointError("no *.gguf file here", file=str(path))
    reader = _reader(files[0])
    arch = _metadata(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError("GGUF metadata has no general.architecture", file=str(files[0]))
    config: dict[str, Any] = {"model_type": _MODEL_TYPES.get(arch, arch)}
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
    )
)
