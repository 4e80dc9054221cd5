"""``TensorInfo``: where one stored tensor lives (file, byte offset, dtype, shape), whichever format the header
that placed it was (safetensors, GGUF, a TVM cache, a converted rank file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives: file, absolute byte offset, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int
    decode: str | None = None
    """The dtype the stored values decode to when it is not ``dtype`` (a TVM ``f32-to-bf16`` record: stored
    as bfloat16, read as float32); planning and the ranks see the decoded dtype."""

    @property
    def logical_dtype(self) -> str:
        """The dtype of the tensor a step function sees: the decoded one, else the stored one."""
        return self.decode or self.dtype
