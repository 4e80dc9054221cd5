"""A guard that turns the SIGBUS of a file cut short under one of shardload's read-only mappings into a clean error.

When a file is truncated while a copy reads its mapping, the kernel removes the pages past the new end, and the next
access raises SIGBUS, which kills a Python process. While a guarded mapping is registered here, a SIGBUS at an address
inside it is handled instead: the rest of that mapping, from the faulting page on, is replaced by zero pages, the
mapping is marked as cut, and the copy finishes reading zeros. Whoever copied then asks :func:`cut` about its own
mapping (after each job) and raises, so nothing read from such a file is ever returned. A SIGBUS anywhere else is
left to the handler that was there before (restored, so the access faults again under it).

The handler is a ctypes callback, so it runs Python in signal context: it only reads a dict, adds to a set and calls
``mmap``, and the faults it takes are in copy loops over shardload's own mappings, never inside the allocator. A C
handler would be stricter; this project ships no compiled code.

Linux on x86_64 and aarch64 only (the layout of ``struct sigaction`` below); elsewhere :func:`install` does nothing
and a truncation during a copy remains a SIGBUS (docs/untrusted-input.md).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import platform
import signal
import sys
import threading
import weakref
from typing import Any

PAGE = mmap.PAGESIZE
_SUPPORTED = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "amd64", "aarch64")
_PROT_READ = 1
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x02, 0x10, 0x20
_SA_SIGINFO = 4


class _SigInfo(ctypes.Structure):
    """The head of ``siginfo_t``: for SIGBUS, the faulting address follows three ints and padding."""

    _fields_ = [("signo", ctypes.c_int), ("errno", ctypes.c_int), ("code", ctypes.c_int), ("pad", ctypes.c_int),
                ("addr", ctypes.c_void_p)]  # fmt: skip


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)


class _SigAction(ctypes.Structure):
    """glibc's ``struct sigaction`` on x86_64 and aarch64."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]  # fmt: skip


_lock = threading.Lock()
_ranges: dict[int, tuple[int, int, str]] = {}
"""Registered mappings: key -> (first address, end address, file name)."""
_cut: set[int] = set()
"""Keys of the mappings a copy found cut short (read as zeros past the cut): one load's mark, never another's."""
_previous = _SigAction()
_installed = False
_libc: Any = None
_callback: Any = None


def _on_sigbus(signo: int, info: Any, context: Any) -> None:
    """The SIGBUS handler: zero pages over the rest of a guarded mapping that faulted, else the old handler back."""
    addr = info.contents.addr or 0
    for key, (lo, hi, _) in list(_ranges.items()):
        if lo <= addr < hi:
            page = addr // PAGE * PAGE
            anon = _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS
            if _libc.mmap(ctypes.c_void_p(page), ctypes.c_size_t(hi - page), _PROT_READ, anon, -1, 0) == page:
                _cut.add(key)
                return
            break
    _restore()  # not ours (or the zero pages could not be placed): the access faults again under the old handler


def _restore() -> None:
    global _installed
    _libc.sigaction(signal.SIGBUS, ctypes.byref(_previous), None)
    _installed = False


def install() -> bool:
    """Make sure the handler is in place (idempotent); False where this platform has no guard."""
    global _installed, _libc, _callback
    if not _SUPPORTED:
        return False
    with _lock:
        if _installed:
            return True
        if _libc is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_long]  # fmt: skip
                libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                libc.sigaction.restype = ctypes.c_int
            except (OSError, AttributeError):
                return False
            _libc, _callback = libc, _HANDLER(_on_sigbus)
        action = _SigAction()
        action.handler = ctypes.cast(_callback, ctypes.c_void_p).value
        action.flags = _SA_SIGINFO
        if _libc.sigaction(signal.SIGBUS, ctypes.byref(action), ctypes.byref(_previous)) != 0:
            return False
        _installed = True
        return True


def installed() -> bool:
    """Whether the handler is in place now (a fault in a guarded mapping is then caught, not fatal): asked of the
    kernel, since another library may have replaced it since (faulthandler, torchelastic)."""
    if not _installed or _libc is None:
        return False
    current = _SigAction()
    if _libc.sigaction(signal.SIGBUS, None, ctypes.byref(current)) != 0:
        return False
    return current.handler == ctypes.cast(_callback, ctypes.c_void_p).value


_keys = itertools.count(1)


def guard(owner: mmap.mmap, address: int, size: int, name: str) -> int:
    """Guard ``size`` bytes of file ``name`` mapped at ``address`` for as long as the mapping object ``owner``
    lives; return the key :func:`cut` takes (0: not guarded)."""
    if not size or not install():
        return 0
    key = next(_keys)
    with _lock:
        _ranges[key] = (address, address + size, name)
    weakref.finalize(owner, _forget, key)
    return key


def _forget(key: int) -> None:
    _ranges.pop(key, None)
    _cut.discard(key)


def cut(key: int) -> bool:
    """Whether a copy out of the guarded mapping ``key`` met its file cut short (what it read past the cut is
    zeros)."""
    return key in _cut


def _after_fork() -> None:
    """A child of a fork keeps the mappings and the handler, but not a lock another thread may have held."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
