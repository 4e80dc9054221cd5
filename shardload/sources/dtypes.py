"""The element types shardload knows, by their shard_info name, with safetensors codes and sizes."""

from __future__ import annotations

# name used in shard_info.json -> (safetensors dtype code, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint64": ("U64", 8),
    "uint32": ("U32", 4),
    "uint16": ("U16", 2),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}

FROM_SAFETENSORS: dict[str, str] = {code: name for name, (code, _) in DTYPES.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of a known dtype name."""
    return DTYPES[dtype][1]


def to_torch(dtype: str):
    """The torch dtype for a known dtype name (looked up in a fixed table, never by a name from a file)."""
    import torch

    table = {
        "float64": torch.float64,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "int64": torch.int64,
        "int32": torch.int32,
        "int16": torch.int16,
        "int8": torch.int8,
        "uint64": torch.uint64,
        "uint32": torch.uint32,
        "uint16": torch.uint16,
        "uint8": torch.uint8,
        "bool": torch.bool,
    }
    return table[dtype]
