"""How a test's worker processes find each other: a FileStore at a path the test gives them (no TCP port, which
another group could take between the test picking it and rank 0 binding it), or torch's ``env://`` where a
launcher (torchrun) set that up."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

STORE_ENV = "SHARDLOAD_TEST_STORE"
"""The FileStore path a test gives its workers (with ``RANK`` and ``WORLD_SIZE``)."""


def new_store() -> str:
    """A fresh FileStore path: its directory made, the file not there yet."""
    return str(Path(tempfile.mkdtemp(prefix="shardload-store-")) / "store")


def store() -> dict[str, Any]:
    """``init_process_group``'s keyword arguments for this worker: the test's FileStore, or none (``env://``)."""
    path = os.environ.get(STORE_ENV)
    if not path:
        return {}
    return {
        "init_method": f"file://{path}",
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
