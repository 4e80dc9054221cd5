"""Reading checkpoint bytes: each file opened once, byte runs read with ``pread``/``preadv`` straight
into destination buffers, and an opt-in count of every byte read (for benchmarks and tests).

The fast path calls the C library's ``preadv`` through ctypes with a vectorised iovec table, so
thousands of small runs (a column slice is one run per row) cost one system call per 1024 runs
and no Python object per run; the GIL is released while the kernel copies. Where that is not
available, ``os.preadv`` (or ``readinto``) over memoryviews does the same reads.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format import input_log
from . import fault_guard

if TYPE_CHECKING:
    import numpy as np
    import torch
    from typing_extensions import Self

    from .tensor_info import TensorInfo

IOV_MAX = 1024  # POSIX minimum is 16; Linux and the BSDs allow 1024


@dataclass
class ReadCount:
    """Bytes and read calls seen inside :func:`count_reads`, in total and per file: ``bytes`` the readers delivered
    to destinations (what the ranks use), ``moved`` what they read from the files, bytes read through and thrown
    away included (the gaps of planned cold reads); ``checked`` the bytes a verifying load hashed, in ``tiles``
    pieces (``verify=True``); ``warmed`` the bytes a rank read only to bring them into the page cache for the
    ranks loading beside it on its host (its stripe of the files, not counted in ``moved``)."""

    bytes: int = 0
    calls: int = 0
    moved: int = 0
    checked: int = 0
    tiles: int = 0
    warmed: int = 0
    by_file: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, path: Path, nbytes: int, calls: int, moved: int | None = None) -> None:
        """Record ``calls`` read system calls that delivered ``nbytes`` bytes of ``path`` and read ``moved`` (None:
        the same bytes)."""
        with self._lock:
            self.bytes += nbytes
            self.calls += calls
            self.moved += nbytes if moved is None else moved
            key = str(path)
            self.by_file[key] = self.by_file.get(key, 0) + nbytes

    def add_checked(self, nbytes: int, tiles: int = 1) -> None:
        """Record ``tiles`` tiles of ``nbytes`` in all hashed by a verifying reader."""
        with self._lock:
            self.checked += nbytes
            self.tiles += tiles

    def add_warmed(self, nbytes: int) -> None:
        """Record ``nbytes`` read into the page cache for the host's other ranks."""
        with self._lock:
            self.warmed += nbytes


@dataclass(frozen=True)
class _Counting:
    """Every :func:`count_reads` block open now, in any thread: each read is told to all of them."""

    blocks: tuple[ReadCount, ...]

    def add(self, path: Path, nbytes: int, calls: int, moved: int | None = None) -> None:
        for block in self.blocks:
            block.add(path, nbytes, calls, moved)

    def add_checked(self, nbytes: int, tiles: int = 1) -> None:
        for block in self.blocks:
            block.add_checked(nbytes, tiles)

    def add_warmed(self, nbytes: int) -> None:
        for block in self.blocks:
            block.add_warmed(nbytes)


_count: _Counting | None = None
"""The blocks open now (None: none, and reads count nothing)."""
_count_lock = threading.Lock()


@contextmanager
def count_reads() -> Iterator[ReadCount]:
    """Count every tensor byte any :class:`Reader` reads while this block is open (all threads; blocks may nest and
    overlap, each counting what is read while it is open).

    Example::

        with count_reads() as seen:
            shardload.load_rank("llama-dir", 0, 8)
        print(seen.bytes)
    """
    global _count
    mine = ReadCount()
    with _count_lock:
        _count = _Counting((*(_count.blocks if _count else ()), mine))
    try:
        yield mine
    finally:
        with _count_lock:
            assert _count is not None
            left = tuple(block for block in _count.blocks if block is not mine)
            _count = _Counting(left) if left else None


def libc_function(pick: Callable[[Any], Any], argtypes: list[Any], restype: Any, *, keep_gil: bool = False) -> Any:
    """The C library function ``pick`` takes from libc (``lambda libc: libc.preadv``), typed; None where absent.

    ``keep_gil`` calls it without releasing the GIL: for a call that never blocks, where releasing and retaking
    the GIL costs more than the call (and makes the caller queue behind busy threads to get it back).
    """
    try:
        fn = pick((ctypes.PyDLL if keep_gil else ctypes.CDLL)(None, use_errno=True))
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_PREADV = libc_function(
    lambda libc: libc.preadv, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64], ctypes.c_ssize_t
)
_MADVISE = (
    libc_function(lambda libc: libc.madvise, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
    if sys.platform.startswith("linux")
    else None
)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, in one call
# Whether the kernel takes MADV_POPULATE_WRITE: cleared by the first refusal (an older kernel), after which copies
# fault pages in themselves. Kept apart from _MADVISE, so MADV_RANDOM and MADV_DONTNEED go on being asked.
_POPULATE = _MADVISE is not None
MADV_RANDOM = 1  # no readahead on faults: a fault reads just its page
MADV_DONTNEED = 4  # drop a range's page-table entries (a shared file mapping's pages stay in the page cache)
_MINCORE = (
    libc_function(
        lambda libc: libc.mincore, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int, keep_gil=True
    )  # one page per call: page tables and the page cache, never I/O
    if sys.platform.startswith("linux")
    else None
)
PAGE = mmap.PAGESIZE
PROBES = 16
"""Pages :func:`probes` picks for ``mincore`` to ask about, at most, per parameter."""
FILE_PROBES = 64
"""Pages spread over a whole file that :meth:`FileMaps.warm` asks about, once per file."""
WARM_FILE = 0.95
"""The fraction of :data:`FILE_PROBES` found cached from which a file counts as warm as a whole."""
_HAVE_PREADV = hasattr(os, "preadv")


def buffer_view(t: Any) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor (its storage, not a copy)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def check_destinations(length: np.ndarray, buf: np.ndarray, dst: np.ndarray, buffers: Sequence[Any]) -> None:
    """Refuse, before anything is read, runs that are empty or reach outside their destination buffers."""
    import numpy as np

    sizes = np.array([t.numel() * t.element_size() for t in buffers], dtype=np.int64)
    if not (bool(np.all(dst >= 0)) and bool(np.all(length > 0)) and bool(np.all(dst + length <= sizes[buf]))):
        raise ValueError("a byte run lies outside its destination buffer")


class RunReader:
    """What every byte reader shares: whole tensors read through :meth:`read_runs`, and closing on exit.

    Subclasses give ``read_runs(path, src, length, buf, dst, buffers)``, ``no_readahead``, ``prefetch`` and
    ``close``: :class:`Reader` for local files, ``ObjectReader`` for object storage."""

    can_map = False
    """Whether the loader may map this reader's files and ask the page cache about them (``mmap``, ``mincore``).
    A reader of remote objects says False: it then gets only :meth:`read_runs`, :meth:`no_readahead` and
    :meth:`prefetch` calls."""
    threads: int | None = None
    """How many read jobs a transfer should keep going at once with this reader (None: the transfer's default)."""

    def read_runs(self, path: Any, src: Any, length: Any, buf: Any, dst: Any, buffers: Sequence[Any]) -> None:
        """Copy run i: ``length[i]`` bytes at ``src[i]`` of ``path`` to byte ``dst[i]`` of ``buffers[buf[i]]``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reader holds (files, connections)."""

    def abandon(self) -> None:
        """The load stops (an error, a signal): requests in flight are cut off and none starts, so that the threads
        waited for end at once (an object store's; a wrapper tells the reader it wraps; local reads need nothing)."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, RunReader):
            inner.abandon()

    def read_tensor(self, path: Any, offset: int, out: Any) -> None:
        """Fill the contiguous CPU tensor ``out`` with its bytes at ``offset`` of ``path``."""
        import numpy as np

        nbytes = out.numel() * out.element_size()
        if nbytes:
            z = np.zeros(1, dtype=np.int64)
            one = np.array([nbytes], dtype=np.int64)
            self.read_runs(path, np.array([offset], dtype=np.int64), one, z, z, [out])

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The whole stored tensor ``info``, read into a fresh CPU tensor."""
        import torch

        from .dtypes import to_torch

        out = torch.empty(info.shape, dtype=to_torch(info.dtype))
        self.read_tensor(info.file, info.offset, out)
        return out

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Reader(RunReader):
    """Open checkpoint files once and read byte runs from them into tensors, thread-safely."""

    can_map = True

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._log = input_log.current()  # the load's: a file opened here must be the one whose header it parsed

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                        input_log.check_opened(path, os.fstat(fd), self._log)
                    except OSError as err:
                        if fd is not None:
                            os.close(fd)
                        raise CheckpointError(f"cannot open: {err.strerror or err}", file=str(path)) from None
                    except CheckpointError:
                        os.close(fd)
                        raise
                    self._fds[path] = fd
        return fd

    def no_readahead(self, path: Path) -> None:
        """Read just the bytes asked for from ``path`` from now on (no readahead; best effort): for one rank's
        exact runs of a file that is not in the page cache."""
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd(path), 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:
                pass

    def prefetch(self, path: Path, starts: Sequence[int], ends: Sequence[int]) -> None:
        """Start reading byte ranges ``[starts[i], ends[i])`` of ``path`` into the page cache in the background
        (best effort), so the reads that follow find their pages arriving."""
        if not hasattr(os, "posix_fadvise"):
            return
        fd = self._fd(path)
        for a, b in zip(starts, ends, strict=True):
            try:
                os.posix_fadvise(fd, int(a), int(b) - int(a), os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def read_runs(
        self,
        path: Path,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        buffers: Sequence[Any],
        *,
        populate: bool = False,
        sink: int | None = None,
    ) -> None:
        """Copy run i: ``length[i]`` bytes at file offset ``src[i]`` to byte ``dst[i]`` of ``buffers[buf[i]]``.

        Runs must be sorted by ``src``; consecutive file ranges are read with one ``preadv``.
        ``buffers`` are contiguous CPU tensors; a run outside its buffer is refused before anything is read.
        ``populate`` first maps the fresh destination pages in one call per buffer instead of one
        page fault per 4 KiB page during the copy. Runs into buffer ``sink`` are bytes read through and thrown
        away: :func:`count_reads` counts them as moved, not delivered.
        """
        import numpy as np

        n = len(src)
        if n == 0:
            return
        check_destinations(length, buf, dst, buffers)
        ends = src + length
        starts = np.flatnonzero(src[1:] != ends[:-1]) + 1
        bounds = np.concatenate(([0], starts, [n])).tolist()
        if _PREADV is not None:
            ptrs = np.array([t.data_ptr() for t in buffers], dtype=np.uint64)
            iov = np.empty((n, 2), dtype=np.uint64)
            iov[:, 0] = ptrs[buf] + dst.astype(np.uint64)
            iov[:, 1] = length
            if populate:
                populate_runs(ptrs, buf, dst, length)
            self._preadv_fast(path, iov, src, bounds, length, buf, sink)
        else:
            views = [buffer_view(t) for t in buffers]
            self._preadv_portable(path, src, length, buf, dst, views, bounds, sink)

    def _preadv_fast(
        self, path: Path, iov: np.ndarray, src: np.ndarray, bounds: list[int], length: Any, buf: Any, sink: int | None
    ) -> None:
        fd = self._fd(path)
        base = iov.ctypes.data
        lens = iov[:, 1].tolist()
        offsets = src.tolist()
        total, calls = 0, 0
        for g in range(len(bounds) - 1):
            i, end = bounds[g], bounds[g + 1]
            while i < end:
                k = min(end - i, IOV_MAX)
                want = sum(lens[i : i + k])
                got = _PREADV(fd, base + 16 * i, k, offsets[i])
                calls += 1
                if got != want:  # interrupted, short or failed: finish this batch run by run
                    calls += self._finish_short(path, fd, iov, offsets, lens, i, k, got)
                total += want
                i += k
        if _count is not None:
            thrown = 0 if sink is None else int(length[buf == sink].sum())
            _count.add(path, total - thrown, calls, total)

    def _finish_short(
        self, path: Path, fd: int, iov: np.ndarray, offsets: list[int], lens: list[int], i: int, k: int, got: int
    ) -> int:
        """Complete a batch whose ``preadv`` came back short (or failed), run by run; return the calls made."""
        if got < 0:
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise CheckpointError(f"cannot read: {os.strerror(err)}", file=str(path))
            got = 0
        done, calls = 0, 0
        for j in range(i, i + k):
            n = lens[j]
            skip = min(max(got - done, 0), n)
            done += n
            if skip < n:
                view = (ctypes.c_char * (n - skip)).from_address(int(iov[j, 0]) + skip)
                calls += _pread_fully(path, fd, memoryview(view).cast("B"), offsets[j] + skip)
        return calls

    def _preadv_portable(
        self,
        path: Path,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        views: list[memoryview],
        bounds: list[int],
        sink: int | None = None,
    ) -> None:
        fd = self._fd(path)
        src_l, len_l, buf_l, dst_l = src.tolist(), length.tolist(), buf.tolist(), dst.tolist()
        total, calls = 0, 0
        for g in range(len(bounds) - 1):
            for i in range(bounds[g], bounds[g + 1], IOV_MAX):
                j = min(bounds[g + 1], i + IOV_MAX)
                parts = [views[buf_l[r]][dst_l[r] : dst_l[r] + len_l[r]] for r in range(i, j)]
                got = 0
                if _HAVE_PREADV:
                    try:
                        got = os.preadv(fd, parts, src_l[i])
                    except InterruptedError:
                        got = 0
                    except OSError as err:
                        raise CheckpointError(f"cannot read: {err.strerror or err}", file=str(path)) from None
                    calls += 1
                done = 0
                for r, part in zip(range(i, j), parts, strict=True):
                    skip = min(max(got - done, 0), len_l[r])
                    done += len_l[r]
                    if skip < len_l[r]:
                        calls += _pread_fully(path, fd, part[skip:], src_l[r] + skip)
                total += sum(len_l[i:j])
        if _count is not None:
            thrown = 0 if sink is None else int(length[buf == sink].sum())
            _count.add(path, total - thrown, calls, total)

    def close(self) -> None:
        """Close every file this reader opened."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class FileMaps:
    """Read-only shared mappings of checkpoint files, one per file, to copy strided pieces out of.

    Copying a column slice out of a mapping costs one strided memory copy where ``preadv`` costs one iovec
    per row, so it is the faster way when the bytes are already in the page cache (:meth:`resident`).
    Copies are counted by :func:`count_reads` like reads. Each file's size is checked against the bytes
    asked for before any page is touched, so a file cut short is an error, never SIGBUS.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[mmap.mmap, torch.Tensor, np.ndarray] | None] = {}
        self._guards: dict[Path, int] = {}
        """Each mapping's key in :mod:`.fault_guard` (0: not guarded)."""
        self._warm: dict[Path, bool] = {}
        self._lock = threading.Lock()
        self._log = input_log.current()  # the load's: a file mapped here must be the one whose header it parsed

    def _entry(self, path: Path) -> tuple[mmap.mmap, torch.Tensor, np.ndarray] | None:
        import warnings

        import numpy as np
        import torch

        entry = self._maps.get(path, False)
        if entry is not False:
            return entry
        with self._lock:
            if path not in self._maps:
                try:
                    with open(path, "rb") as fh:
                        input_log.check_opened(path, os.fstat(fh.fileno()), self._log)
                        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                    with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is, on purpose
                        warnings.simplefilter("ignore", UserWarning)
                        self._maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8), np.frombuffer(mm, np.uint8))
                    self._guards[path] = fault_guard.guard(mm, self._maps[path][2].ctypes.data, len(mm), str(path))
                except (OSError, ValueError):  # empty, or not mappable: the caller reads instead
                    self._maps[path] = None
            return self._maps[path]

    def bytes(self, path: Path) -> torch.Tensor | None:
        """The file's bytes as a uint8 tensor over its read-only mapping (None where it cannot be mapped).

        Never write to it: the pages are the page cache's own, mapped read-only (a write would fault).
        """
        entry = self._entry(path)
        return None if entry is None else entry[1]

    def intact(self, path: Path, end: int) -> None:
        """Refuse to copy out of ``path``'s mapping when the file was found cut under it (:mod:`.fault_guard`), or,
        where no guard is installed, when it is now shorter than ``end`` bytes: asked around each copy job, so a
        file truncated while a load reads it is one error, never a SIGBUS or a returned tensor of zeros."""
        if fault_guard.cut(self._guards.get(path, 0)):
            raise input_log.changed(path, "truncated under its mapping")
        entry = self._maps.get(path)
        if entry is None or fault_guard.installed():
            return
        try:
            size = entry[0].size()
        except (OSError, ValueError):
            return
        if size < end:
            raise input_log.changed(path, f"truncated to {size} bytes")

    def array(self, path: Path) -> np.ndarray | None:
        """The same bytes as a read-only numpy uint8 array (slicing one costs a fraction of a torch view's time)."""
        entry = self._entry(path)
        return None if entry is None else entry[2]

    def warm(self, path: Path) -> bool:
        """Whether ``path`` as a whole looks cached: at least :data:`WARM_FILE` of :data:`FILE_PROBES` pages spread
        over it are in the page cache (asked once per file). Then no parameter of it needs probing of its own; any
        other answer leaves the choice to each parameter's probes (:meth:`cached`)."""
        verdict = self._warm.get(path)
        if verdict is None:
            data = self.bytes(path)
            size = 0 if data is None else len(data)
            offsets = [k * size // FILE_PROBES for k in range(FILE_PROBES)] if size else []
            resident = self.cached(path, offsets, size)
            verdict = self._warm[path] = resident is not None and resident >= WARM_FILE
        return verdict

    def resident(self, path: Path, starts: np.ndarray, ends: np.ndarray) -> float | None:
        """The fraction of the pages holding byte runs ``[starts[i], ends[i])`` of ``path`` (sorted by start) that
        are in the page cache, estimated from the pages of :func:`probes`; None where the kernel cannot say."""
        if not len(starts):
            return None
        return self.cached(path, probes(starts, ends), int(ends.max()))

    def cached(self, path: Path, offsets: Sequence[int], end: int) -> float | None:
        """The fraction of the pages holding bytes ``offsets`` of ``path`` that are in the page cache (``mincore``),
        or None where the kernel cannot say; ``end`` bounds the bytes the caller will touch."""
        data = self.bytes(path)
        if data is None or _MINCORE is None or not offsets or end > len(data):
            return None
        base = data.data_ptr()
        pages = {(base + offset) // PAGE * PAGE for offset in offsets}  # a small tensor's probes share a page or two
        cached = _resident_pages(pages)
        return None if cached is None else cached / len(pages)

    def no_readahead(self, path: Path, start: int, end: int) -> None:
        """Ask the kernel to read just the faulted page of this range (best effort): for sparse pieces of a
        file that is not in the page cache."""
        data = self.bytes(path)
        if data is None or _MADVISE is None or end <= start:
            return
        lo = (data.data_ptr() + start) // PAGE * PAGE
        _MADVISE(lo, data.data_ptr() + end - lo, MADV_RANDOM)

    def release(self) -> None:
        """Unmap the files' pages from this process (the page cache keeps them) and drop this object's references.

        Tearing down the page-table entries of hundreds of MiB of mapped pages takes tens of milliseconds; it is done
        with ``madvise(MADV_DONTNEED)`` through ctypes, which lets other threads run meanwhile, so a caller can do
        it in the background. Nothing may use :meth:`bytes` tensors any more.
        """
        with self._lock:
            entries = [e for e in self._maps.values() if e is not None]
            self._maps.clear()
        for _, data, _ in entries:
            if _MADVISE is not None and len(data):
                _MADVISE(data.data_ptr(), len(data), MADV_DONTNEED)
        del entries

    def close(self) -> None:
        """Drop this object's references (a mapping stays while an array over it lives)."""
        with self._lock:
            self._maps.clear()


def probes(starts: np.ndarray, ends: np.ndarray, count: int = PROBES) -> list[int]:
    """At most ``count`` byte offsets spread evenly over the bytes of runs ``[starts[i], ends[i])``: the pages
    :meth:`FileMaps.cached` asks about. ``mincore`` costs a page-cache lookup per page, so asking about every page
    of a rank (a quarter of a million for 1 GiB) took longer than copying a good part of it."""
    import numpy as np

    length = ends - starts
    total = int(length.sum())
    k = min(total, count)
    if k <= 0:
        return []
    picks = np.arange(k, dtype=np.int64) * total // k
    before = np.cumsum(length) - length
    run = np.searchsorted(before, picks, side="right") - 1
    return (starts[run] + picks - before[run]).tolist()


def count_mapped(path: Path, nbytes: int) -> None:
    """Record ``nbytes`` of ``path`` copied out of a mapping (no system call) in :func:`count_reads`."""
    if _count is not None:
        _count.add(path, nbytes, 0)


def count_checked(nbytes: int, tiles: int = 1) -> None:
    """Record ``tiles`` tiles of ``nbytes`` in all hashed by a verifying reader in :func:`count_reads`."""
    if _count is not None:
        _count.add_checked(nbytes, tiles)


def count_warmed(nbytes: int) -> None:
    """Record ``nbytes`` read into the page cache for the host's other ranks (a stripe) in :func:`count_reads`."""
    if _count is not None:
        _count.add_warmed(nbytes)


def count_requested(path: Path, nbytes: int) -> None:
    """Record ``nbytes`` of ``path`` requested from storage but not delivered (the rest of the pages planned reads
    fetch for copies out of a mapping) in :func:`count_reads`: moved, not used."""
    if _count is not None:
        _count.add(path, 0, 0, nbytes)


class Mappings:
    """Private (copy-on-write) mappings of checkpoint files, one per file, for tensors returned as views.

    A view costs no copy and no fresh memory: its pages are the page cache's own until written to, and a
    write changes only this process's copy, never the file. The mapping lives as long as any view of it.
    A file that cannot be mapped (the kernel may refuse a private writable mapping under strict overcommit)
    is read instead.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap | None] = {}
        self._lock = threading.Lock()
        self._log = input_log.current()  # the load's: a file mapped here must be the one whose header it parsed

    def _map(self, path: Path) -> mmap.mmap | None:
        with self._lock:
            if path not in self._maps:
                try:
                    with open(path, "rb") as fh:
                        input_log.check_opened(path, os.fstat(fh.fileno()), self._log)
                        self._maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
                except (OSError, ValueError):  # an empty file, or one that cannot be mapped: read it instead
                    self._maps[path] = None
            return self._maps[path]

    def tensor(self, path: Path, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """The ``shape``/``dtype`` tensor stored at ``offset`` of ``path`` as a view of its mapping (None where it
        cannot be one: empty, misaligned, or the file cannot be mapped)."""
        import torch

        size = dtype.itemsize
        nbytes = size * math.prod(shape)
        if nbytes == 0 or offset % size:
            return None
        mm = self._map(path)
        if mm is None:
            return None
        if offset + nbytes > len(mm):
            raise CheckpointError(
                "mapped file is shorter than its header says (changed while loading?)", file=str(path)
            )
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.view(dtype).view(tuple(shape))

    def close(self) -> None:
        """Drop this object's references (each mapping stays while a view of it lives)."""
        with self._lock:
            self._maps.clear()


def _faulted_in(start: int, end: int) -> bool:
    """Whether the page-aligned range ``[start, end)`` of this process's memory looks faulted in already: its
    first, middle and last pages are resident (``mincore``). Memory a caller filled before (a model loaded
    again into its parameters) is; fresh memory is not, and asking costs three calls where populating pages
    already there costs a page-table walk per page. Resident is not always writable (the shared zero page of
    memory only read, copy-on-write pages after a fork) and three pages are a sample: a wrong guess costs the
    copy its page faults, never a byte."""
    last = end - PAGE
    probes = {start, start + (last - start) // PAGE // 2 * PAGE, last}
    return _resident_pages(probes) == len(probes)


def _resident_pages(pages: Iterable[int]) -> int | None:
    """How many of the page-aligned addresses ``pages`` of this process are resident (``mincore``, one page a
    call); None where the kernel cannot say."""
    if _MINCORE is None:
        return None
    vec = (ctypes.c_ubyte * 1)()
    count = 0
    for page in pages:
        if _MINCORE(page, PAGE, vec) != 0:
            return None
        count += vec[0] & 1
    return count


def populate(address: int, nbytes: int) -> None:
    """Fault in the whole pages inside ``[address, address + nbytes)`` of fresh memory in one call (best effort;
    nothing where they look faulted in already)."""
    global _POPULATE
    start = -(-address // PAGE) * PAGE
    end = (address + nbytes) // PAGE * PAGE
    if not _POPULATE or _MADVISE is None or end <= start or _faulted_in(start, end):
        return
    if _MADVISE(start, end - start, MADV_POPULATE_WRITE) != 0:
        _POPULATE = False  # an older kernel: let the copy fault pages in


def populate_runs(ptrs: np.ndarray, buf: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    """Fault in the whole pages between the first and the last byte each buffer (at address ``ptrs[b]``) receives
    from runs ``(buf[i], dst[i], length[i])``, one call per buffer (best effort)."""
    global _POPULATE
    import numpy as np

    if not _POPULATE or _MADVISE is None:
        return
    lo = np.full(len(ptrs), np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(len(ptrs), dtype=np.int64)
    np.minimum.at(lo, buf, dst)
    np.maximum.at(hi, buf, dst + length)
    for b in np.flatnonzero(hi > lo).tolist():
        start = -(-(int(ptrs[b]) + int(lo[b])) // PAGE) * PAGE
        end = (int(ptrs[b]) + int(hi[b])) // PAGE * PAGE
        if end > start and not _faulted_in(start, end) and _MADVISE(start, end - start, MADV_POPULATE_WRITE) != 0:
            _POPULATE = False  # an older kernel: let the copy fault pages in
            return


def _pread_fully(path: Path, fd: int, view: memoryview, offset: int) -> int:
    """Read exactly ``len(view)`` bytes at ``offset`` into ``view``; return the number of calls made."""
    calls = 0
    while len(view):
        try:
            if _HAVE_PREADV:
                got = os.preadv(fd, [view], offset)
            else:
                data = os.pread(fd, len(view), offset)
                got = len(data)
                view[:got] = data
        except InterruptedError:
            continue
        except OSError as err:
            raise CheckpointError(f"cannot read: {err.strerror or err}", file=str(path)) from None
        calls += 1
        if got == 0:
            raise CheckpointError("file is shorter than its header says (changed while loading?)", file=str(path))
        view = view[got:]
        offset += got
    return calls
