"""What one load parsed from its inputs, kept for the length of the load: the bytes of each small input (safetensors
headers, shard_info, config.json, indexes), so a verified load checks exactly those bytes against its integrity
record instead of reading the file again (a store that answers differently twice cannot slip a forged plan
through); and each local weight file's identity when its header was read, so a file changed under the load (rewritten
in place, truncated, replaced) is an error rather than a mix of old and new bytes."""

from __future__ import annotations

import errno
import functools
import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import CheckpointError

F = TypeVar("F", bound=Callable[..., Any])

Stamp = tuple[int, int, int, int, int]
"""A local file's device, inode, size, modification and change time (ns): any write, truncation or replacement
changes one of them."""


@dataclass
class InputLog:
    """The inputs one load parsed: bytes by path, and local files' stamps when their headers were read."""

    data: dict[str, bytes] = field(default_factory=dict)
    stamps: dict[str, Stamp] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    """Objects in a store by address: the version (ETag) of the first answer; every later answer must be it."""
    listings: dict[Any, dict[str, dict[str, int]]] = field(default_factory=dict)
    """Object-store listings this load made, by store and prefix (sizes by key): a later load lists afresh."""
    agreeing: bool = False
    """Inside ``same_checkpoint``: the ranks compare what they read at the end, so no other collective may run."""
    reads: list[tuple[str, int]] = field(default_factory=list)
    """Every read made to open and plan the model, in order: path and bytes (a file read twice is listed twice);
    what ``shardload preflight`` reports as fetched."""
    leases: dict[str, int] = field(default_factory=dict)
    """Read leases held for the whole load, by path (the descriptor holding each): files on a file system whose
    times a write through a mapping does not change (:data:`UNTIMED_FILE_SYSTEMS`); released when the load ends."""
    broken: set[str] = field(default_factory=set)
    """Files whose lease a writer's open broke during the load (let go at once: see :func:`_watch_leases`)."""
    serial: int = field(default_factory=lambda: next(_SERIALS))
    """This load's number in the process (never reused, unlike ``id``): what a cache valid for one load is keyed by."""


_SERIALS = itertools.count(1)


_LOG: ContextVar[InputLog | None] = ContextVar("shardload_input_log", default=None)


def changed(path: Any, how: str) -> CheckpointError:
    """The one line for a file that changed while a load, a convert or a hash read it (``how``: rewritten,
    truncated, ...)."""
    return CheckpointError(f"changed while it was being read ({how}); nothing was returned or written: try again "
                           "once nothing writes to it", file=str(path))  # fmt: skip


def stamp_of(st: os.stat_result) -> Stamp:
    """The :data:`Stamp` of a ``stat`` result."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def note(path: Any, data: bytes, st: os.stat_result | None = None) -> None:
    """Record that ``data`` (the file's bytes from offset 0) was read from ``path`` to be parsed, and the file's
    ``stat`` then, if a load is recording."""
    log = _LOG.get()
    if log is None:
        return
    key = str(path)
    before = log.data.get(key)
    stamp = None if st is None else stamp_of(st)
    if before is not None and before != data:
        # read twice in one load with different bytes (a plan input, or a companion copied after it was checked)
        raise changed(key, "read twice, with different bytes")
    if stamp is not None and log.stamps.get(key, stamp) != stamp:  # the same bytes, from a file changed between
        raise changed(key, _how_changed(log.stamps[key], stamp))
    log.data[key] = bytes(data)
    log.reads.append((key, len(data)))
    if stamp is not None:
        log.stamps[key] = stamp


def stamp(path: Any, st: os.stat_result | None = None) -> None:
    """Record a local data file's identity (``st``, else its ``stat`` now) if a load is recording and has none for
    it yet, and refuse it while open for writing (:func:`no_writer`): the files whose headers are not safetensors
    headers (a GGUF file, a TVM cache's record files) when the load opens them. A file recorded before with another
    identity is an error."""
    log = _LOG.get()
    if log is None or not isinstance(path, (str, os.PathLike)):
        return
    key = str(path)
    try:
        now = stamp_of(os.stat(path) if st is None else st)
    except OSError:
        return  # not there: the read that needs it says so
    before = log.stamps.get(key)
    if before is not None and before != now:
        raise changed(key, _how_changed(before, now))
    if before is None:  # first seen in this load
        log.stamps[key] = now
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        try:
            no_writer(path, fd)
        finally:
            os.close(fd)


F_SETLEASE = 1024
"""Linux's ``fcntl`` command taking a lease (``F_RDLCK``: refused with EAGAIN while any descriptor of the file is
open for writing)."""
F_GETLEASE = 1025
"""Linux's ``fcntl`` command asking which lease a descriptor holds (``F_UNLCK`` once a writer's open broke it)."""
F_SETSIG = 10
"""Linux's ``fcntl`` command choosing the signal a broken lease sends its holder (SIGIO, which ends a process that
does not handle it, unless set)."""


LEASE_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "tmpfs",
                                "ramfs", "overlay"})  # fmt: skip
"""Local file systems, where a refused read lease means a writer holds the file open. On NFSv4 without a read
delegation and SMB without an oplock every read lease is refused (EAGAIN) writer or not, so there, and on any file
system not listed, the lease test is not asked."""
MOUNTINFO = "/proc/self/mountinfo"


@functools.lru_cache(maxsize=64)
def file_system(dev: int) -> str | None:
    """The type of the file system mounted as device ``dev`` (a ``stat``'s ``st_dev``), from the mount table; None
    where it cannot be read or no mount is that device (a btrfs subvolume's own device number). Kept per device
    for the process."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(MOUNTINFO) as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 3 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None


UNTIMED_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
"""File systems where a write through a shared writable mapping changes no timestamp (no write fault updates them),
so a writer that maps the file after the lease test would go unseen by the identity check: a load holds a read
lease on such a file until it ends, and a writer's open breaks it (:func:`lease_broken`)."""
MAX_LEASES = 1024
"""Leases one load holds at most (a descriptor each); past it, a file is tested, not held."""


def no_writer(path: Any, fd: int) -> None:
    """Inside a load, refuse ``path`` (open as ``fd``) while some descriptor holds it open for writing: a write that
    began before the load took the file's identity changes no timestamp later, so the end-of-load check cannot see
    it mixing old and new bytes into the load. Asked on :data:`LEASE_FILE_SYSTEMS` only; on
    :data:`UNTIMED_FILE_SYSTEMS` the lease is kept until the load ends."""
    log = _LOG.get()
    if log is None:
        return
    system = file_system(os.fstat(fd).st_dev)
    if system not in LEASE_FILE_SYSTEMS:
        return
    if system in UNTIMED_FILE_SYSTEMS and len(log.leases) < MAX_LEASES and str(path) not in log.leases:
        held = _hold_lease(fd)
        if held is not None:
            if held < 0:
                _refuse_writer(path)
            _keep_lease(log, str(path), held)
            return
    if open_for_writing(fd):
        _refuse_writer(path)


def _refuse_writer(path: Any) -> None:
    why = "a write under way could mix old and new bytes into what is read"
    raise CheckpointError(f"is open for writing ({why}); try again once the writer has closed it", file=str(path))


def _hold_lease(fd: int) -> int | None:
    """A new descriptor of ``fd``'s file holding a read lease, kept until the load ends: a writer's open breaks it,
    and the lease watcher (:func:`_watch_leases`) lets it go at once, so the writer goes on, and notes the file as
    changed. -1 when a writer holds the file open; None where no lease can be held: not Linux, a SIGURG handler of
    the program's own (the signal a broken lease sends, see :func:`open_for_writing`), a file this process may not
    lease."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    import signal

    if signal.getsignal(signal.SIGURG) not in (signal.SIG_DFL, signal.SIG_IGN):
        return None
    try:
        held = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # this very file
    except OSError:
        return None
    try:
        fcntl.fcntl(held, F_SETSIG, signal.SIGURG)
        fcntl.fcntl(held, F_SETLEASE, fcntl.F_RDLCK)
    except OSError as err:
        os.close(held)
        return -1 if err.errno == errno.EAGAIN else None
    return held


_HELD: dict[int, tuple[InputLog, str]] = {}
"""Every lease the process's loads hold: descriptor -> (the load's log, the file's path)."""
_HELD_LOCK = threading.Lock()
_WATCHING: list[threading.Thread] = []
LEASE_WATCH_S = 0.01
"""How often the lease watcher asks whether a lease was broken: the longest a writer waits for a load."""


def _keep_lease(log: InputLog, path: str, held: int) -> None:
    """Record a lease ``log``'s load holds, and start the watcher if none runs."""
    with _HELD_LOCK:
        _HELD[held] = (log, path)
        log.leases[path] = held
        if not _WATCHING or not _WATCHING[0].is_alive():
            watcher = threading.Thread(target=_watch_leases, name="shardload-leases", daemon=True)
            _WATCHING[:] = [watcher]
            watcher.start()


def _watch_leases() -> None:
    """While leases are held: every :data:`LEASE_WATCH_S`, let go of each one a writer's open broke (the writer
    waits until then: otherwise until the load ends, or the kernel's lease-break time of 45 s, and a load's own
    thread would wait on itself) and note its file as changed in its load's log. A thread, not a signal handler: a
    handler would interrupt the program's own calls (a ``truncate`` failing with EINTR)."""
    import fcntl
    import time

    while True:
        with _HELD_LOCK:  # asked under the lock: a descriptor let go meanwhile could be another file's by now
            if not _HELD:
                _WATCHING.clear()
                return
            for fd in list(_HELD):
                try:
                    broken = fcntl.fcntl(fd, F_GETLEASE) != fcntl.F_RDLCK
                except OSError:
                    broken = True
                if broken:
                    log, path = _HELD.pop(fd)
                    log.broken.add(path)
                    log.leases.pop(path, None)
                    os.close(fd)
        time.sleep(LEASE_WATCH_S)


def _forget_in_child() -> None:
    """After a fork: the child lets go of its copies of the leases' descriptors (a lease lives as long as any copy,
    so a writer would wait for the child), without touching the parent's; its lock is a fresh one (another thread
    may have held the parent's) and no watcher runs in it."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    for fd, (log, _) in list(_HELD.items()):
        log.leases.clear()
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _WATCHING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def lease_broken(log: InputLog, path: Any) -> bool:
    """Whether the lease ``log`` holds on ``path`` was broken: some descriptor opened the file for writing during
    the load."""
    import fcntl

    with _HELD_LOCK:
        if str(path) in log.broken:
            return True
        held = log.leases.get(str(path))
        if held is None:
            return False
        try:
            return fcntl.fcntl(held, F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True


def release_leases(log: InputLog) -> None:
    """Let go of every lease ``log`` holds (a writer waiting on one goes on)."""
    with _HELD_LOCK:
        leases, log.leases = log.leases, {}
        for held in leases.values():
            if _HELD.pop(held, None) is not None:
                try:
                    os.close(held)
                except OSError:
                    pass


def open_for_writing(fd: int) -> bool:
    """Whether some descriptor (any process's) holds ``fd``'s file open for writing, by taking a read lease and
    letting it go: Linux refuses the lease then. A writer opening the file in the instant the lease is held breaks
    it, and the kernel signals this process: SIGURG, ignored by default, not SIGIO (so where SIGURG has a handler of
    the program's own, nothing is tested). False where it cannot tell (not Linux, a file system without leases,
    leases turned off, a file this process may not lease)."""
    if not sys.platform.startswith("linux"):
        return False
    import fcntl
    import signal

    if signal.getsignal(signal.SIGURG) not in (signal.SIG_DFL, signal.SIG_IGN):
        return False
    try:
        fcntl.fcntl(fd, F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError as err:
        return err.errno == errno.EAGAIN
    try:
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        pass
    return False


MODIFIED = "modified "
"""How a version taken from an answer's Last-Modified and object size starts (a store, or a proxy in front of one,
that sends no ETag): an object replaced with one of the same size within the same second is not told apart."""


def unversioned(uri: str, etag: Any) -> bool:
    """Whether an answer from object ``uri`` came without an ETag where this load's first answer had one: such an
    answer cannot be held to that version, and is asked for again."""
    log = _LOG.get()
    first = None if log is None else log.versions.get(uri)
    return not etag and first is not None and not first.startswith(MODIFIED)


def object_version(uri: str, version: Any) -> None:
    """Inside a load, hold every answer from object ``uri`` to the version of its first (its ETag, else its
    :data:`MODIFIED` version): an object replaced while the load reads it (its header parsed from one version,
    tensor bytes from another) is an error."""
    log = _LOG.get()
    if log is None:
        return
    version = version or None  # a store that sends neither ETag nor Last-Modified is taken as it is
    first = log.versions.setdefault(uri, version)
    if first == version:
        return
    if first is None or version is None or first.startswith(MODIFIED) != version.startswith(MODIFIED):
        raise CheckpointError(
            "answered once with a version (ETag) and once without, so its bytes cannot be held to one version; "
            "nothing was returned or written (a cache or proxy in front of the store may drop the header)",
            file=uri,
        )
    raise changed(uri, "replaced: another version of the object answered")


@contextmanager
def using(log: InputLog | None) -> Iterator[None]:
    """Record into ``log`` (a load's, taken on its own thread) inside this block, on a worker thread of the load."""
    token = _LOG.set(log)
    try:
        yield
    finally:
        _LOG.reset(token)


def count(path: Any, nbytes: int) -> None:
    """Record that ``nbytes`` were read from ``path`` to look at, not to parse (a file's first bytes, to tell its
    kind), if a load is recording."""
    log = _LOG.get()
    if log is not None:
        log.reads.append((str(path), nbytes))


def parsed(path: Any) -> bytes | None:
    """The bytes last read from ``path`` in this load for parsing, or None (not recorded: read it again)."""
    log = _LOG.get()
    return None if log is None else log.data.get(str(path))


def current() -> InputLog | None:
    """The log of the load running in this context (None outside one)."""
    return _LOG.get()


@contextmanager
def recording() -> Iterator[InputLog]:
    """Record the inputs parsed inside this block (nested blocks share the outer one's record)."""
    log = _LOG.get()
    if log is not None:
        yield log
        return
    log = InputLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)
        release_leases(log)


def records_inputs(fn: F) -> F:
    """Decorate an entry point (a load, a convert) so the inputs it parses are recorded for its checks."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with recording():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


REWRITTEN = "rewritten in place, or its modification time set, or replaced by a file given the same inode number"
"""How a file that kept its inode number and size but not its modification time changed: any of these."""


def _how_changed(before: Stamp, now: Stamp | None) -> str:
    if now is None:
        return "removed"
    if now[:2] != before[:2]:
        return "replaced"
    if now[2] != before[2]:
        return "truncated" if now[2] < before[2] else "extended"
    if now[3] != before[3]:
        return REWRITTEN  # a write and a touch look alike, and a new file may get a freed inode's number
    # the change time alone, which no tool sets back
    return (
        "its change time moved: written with its modification time put back, or its permissions, owner or links changed"
    )


def check_opened(path: Any, st: os.stat_result, log: InputLog | None) -> None:
    """A file a load opens to read tensor bytes from (``st``: the open descriptor's ``fstat``) is the file whose
    header it parsed, where ``log`` has its identity: one replaced in between is refused before a byte is read."""
    before = None if log is None else log.stamps.get(str(path))
    if before is not None and stamp_of(st) != before:
        raise changed(path, _how_changed(before, stamp_of(st)))


def check_recorded() -> None:
    """Inside a load: every local file it took the identity of is still that file (see :func:`check_unchanged`)."""
    log = _LOG.get()
    if log is not None:
        check_unchanged(list(log.stamps), log)


def check_unchanged(files: Iterable[Any], log: InputLog | None) -> None:
    """After a load's last read: every local file read is still the file whose header the load parsed (same device,
    inode, size, modification and change time); one rewritten in place, truncated or replaced meanwhile is an error,
    never a tensor of mixed bytes."""
    if log is None or not log.stamps:
        return
    for path in files:
        before = log.stamps.get(str(path))
        if before is None:
            continue
        try:
            now = stamp_of(os.stat(path))
        except OSError:
            now = None
        if now != before:
            raise changed(path, _how_changed(before, now))
        if lease_broken(log, path):  # no time moved (a write through a mapping on tmpfs), but a writer opened it
            raise changed(path, "opened for writing while it was read")
