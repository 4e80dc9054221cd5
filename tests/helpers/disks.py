"""A disk that fills up: output files that fail with ENOSPC after a byte budget (monkeypatched in as
``shardload.engine.writer.create_file``, through which every output file of convert and quantize is made)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any


class DiskFull:
    """Output files that fail with ENOSPC once ``budget`` bytes have been written in total."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.written = 0

    def __call__(self, path: Path) -> Any:
        real, disk = open(path, "xb"), self

        class Out:
            def write(self, data: Any) -> int:
                size = memoryview(data).nbytes
                if disk.written + size > disk.budget:
                    real.write(bytes(memoryview(data)[: max(disk.budget - disk.written, 0)]))
                    disk.written = disk.budget
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.written += size
                return real.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        return Out()
