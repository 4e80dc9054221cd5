"""Checkpoint sources: headers and byte readers, never tensor math.

Holds: :mod:`.checkpoint` (``Checkpoint``/``TensorInfo``, safetensors single file, HF index, converted
directories, ``open_checkpoint``), :mod:`.formats` (the table other formats register in), :mod:`.gguf`
(GGUF files), :mod:`.tvm_cache` (TVM/MLC tensor caches), :mod:`.reader` (``preadv`` reads of byte runs,
mappings) and :mod:`.dtypes`.
May import: ``shardload.format`` and ``shardload.errors``.

Importing this package registers every built-in source format in :mod:`.formats`.
"""

from . import gguf as gguf  # registers the GGUF source format
from . import tvm_cache as tvm_cache  # registers TVM tensor caches
