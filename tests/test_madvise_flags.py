"""madvise through libc (sources/reader.py): a kernel that lacks one advice must not switch off the others, and
destination memory is populated in one call only where it is not faulted in already."""

from __future__ import annotations

import ctypes
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
    fresh = mmap.mmap(-1, 4 * mmap.PAGESIZE)  # anonymous, never touched: not resident
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    reader.populate(address, len(fresh))
    reader.populate(address, len(fresh))
    assert kernel.calls.count(reader.MADV_POPULATE_WRITE) == 1  # refused once, then not asked again

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(8 * mmap.PAGESIZE))
    maps = reader.FileMaps()
    maps.no_readahead(path, 0, 4 * mmap.PAGESIZE)
    maps.bytes(path)
    maps.release()
    assert reader.MADV_RANDOM in kernel.calls
    assert reader.MADV_DONTNEED in kernel.calls


class _Recorder:
    """Stands in for libc's madvise: accepts every advice and records (address, length, advice)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append((address, length, advice))
        return 0


@pytest.mark.skipif(reader._MINCORE is None, reason="mincore through libc")
def test_populate_asks_only_for_memory_not_faulted_in(monkeypatch):
    kernel = _Recorder()
    monkeypatch.setattr(reader, "_MADVISE", kernel)
    monkeypatch.setattr(reader, "_POPULATE", True, raising=False)
    page = mmap.PAGESIZE
    fresh = mmap.mmap(-1, 64 * page)
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    reader.populate(address, len(fresh))
    assert kernel.calls == [(address, 64 * page, reader.MADV_POPULATE_WRITE)]  # fresh: populated in one call

    fresh[::page] = b"\x01" * 64  # every page written: faulted in (a model loaded a second time)
    kernel.calls.clear()
    reader.populate(address, len(fresh))
    ptrs = np.array([address], dtype=np.uint64)
    reader.populate_runs(ptrs, np.array([0]), np.array([0]), np.array([len(fresh)]))
    assert kernel.calls == []

    half = mmap.mmap(-1, 64 * page)  # only the first half written: the rest still asks
    half[: 32 * page] = b"\x02" * (32 * page)
    at = ctypes.addressof(ctypes.c_char.from_buffer(half))
    if reader._resident_pages([at + 40 * page]) != 0:  # a write faulted in its neighbours (multi-size THP)
        pytest.skip("this kernel faults anonymous memory in blocks larger than a page")
    reader.populate_runs(np.array([at], dtype=np.uint64), np.array([0]), np.array([0]), np.array([len(half)]))
    assert kernel.calls == [(at, 64 * page, reader.MADV_POPULATE_WRITE)]

    kernel.calls.clear()
    hole = mmap.mmap(-1, 64 * page)  # every page written but a stretch in the middle: still asks
    for k in range(64):
        if not 24 <= k < 40:
            hole[k * page] = 3
    at = ctypes.addressof(ctypes.c_char.from_buffer(hole))
    reader.populate(at, len(hole))
    assert kernel.calls == [(at, 64 * page, reader.MADV_POPULATE_WRITE)]

    kernel.calls.clear()
    one = mmap.mmap(-1, 2 * page)  # one whole page inside an unaligned range: asked about alone
    at = ctypes.addressof(ctypes.c_char.from_buffer(one))
    reader.populate(at + 100, 2 * page - 100)  # covers page 1 whole only
    assert kernel.calls == [(at + page, page, reader.MADV_POPULATE_WRITE)]
    one[page] = 4
    kernel.calls.clear()
    reader.populate(at + 100, 2 * page - 100)
    reader.populate(at + 100, page)  # no whole page inside: nothing to ask
    assert kernel.calls == []
