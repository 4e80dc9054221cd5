"""A kernel that lacks one madvise advice must not switch off the others (sources/reader.py)."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from shardload.sources import reader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through libc: Linux only")


class _Kernel:
    """Stands in for libc's madvise: refuses MADV_POPULATE_WRITE (a kernel before 5.14), records every call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append(advice)
        return -1 if advice == reader.MADV_POPULATE_WRITE else 0


def test_a_refused_populate_leaves_random_and_dontneed_on(monkeypatch, tmp_path):
    kernel = _Kernel()
    monkeypatch.setattr(reader, "_MADVISE", kernel)
    monkeypatch.setattr(reader, "_POPULATE", True, raising=False)
    buf = np.zeros(4 * mmap.PAGESIZE, dtype=np.uint8)
    reader.populate(buf.ctypes.data, buf.nbytes)
    reader.populate(buf.ctypes.data, buf.nbytes)
    assert kernel.calls.count(reader.MADV_POPULATE_WRITE) == 1  # refused once, then not asked again

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(8 * mmap.PAGESIZE))
    maps = reader.FileMaps()
    maps.no_readahead(path, 0, 4 * mmap.PAGESIZE)
    maps.bytes(path)
    maps.release()
    assert reader.MADV_RANDOM in kernel.calls
    assert reader.MADV_DONTNEED in kernel.calls
