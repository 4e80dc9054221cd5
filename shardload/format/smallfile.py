"""Reading a small file an input names (shard_info, config.json, an index, a manifest): a regular file only,
opened without blocking and read to a size cap, so a FIFO, a device or ``/dev/zero`` under such a name is a
one-line error instead of a hang or an unbounded read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import ShardloadError
from . import input_log


def read_small(path: Path, limit: int, what: str, error: type[ShardloadError] = ShardloadError) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); ``error`` names the file and the reason."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise error(f"cannot read {what}: {err.strerror or err}", file=str(path)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} is not a regular file", file=str(path))
        if info.st_size > limit:
            raise error(f"{what} is {info.st_size} bytes, over the {limit} byte limit", file=str(path))
        parts: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
        data = b"".join(parts)
        if len(data) > limit:
            raise error(f"{what} grew past the {limit} byte limit while being read", file=str(path))
        input_log.note(path, data)
        return data
    except OSError as err:
        raise error(f"cannot read {what}: {err.strerror or err}", file=str(path)) from None
    finally:
        os.close(fd)
