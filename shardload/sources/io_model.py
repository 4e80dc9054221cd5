"""The :class:`~shardload.sources.read_plan.IoModel` of a local file system, measured once per device and process on
the first cold file of it large enough to time (:data:`PROBE_BYTES` x 4): what one more request costs at depth, and
what a long read delivers. Smaller files before it are planned with :data:`FALLBACK`."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from .read_plan import IoModel
from .reader import PAGE

PROBE_PAGES = 32
"""Single pages requested at once (spread over the file) to time one request at depth."""
PROBE_BYTES = 2 << 20
"""Bytes of the one long read that times the bandwidth."""
FALLBACK = IoModel(request_s=100e-6, bandwidth=1e9)
"""Used where nothing can be measured (a file too small, a platform without ``posix_fadvise``)."""

_models: dict[int, IoModel] = {}
_lock = threading.Lock()


def io_model(path: Path) -> IoModel:
    """The I/O model of the file system holding ``path``: measured on the first file of its device large enough to
    time in this process, then kept (:data:`FALLBACK` for a smaller file before it, not kept)."""
    try:
        device = os.stat(path).st_dev
    except OSError:
        return FALLBACK
    model = _models.get(device)
    if model is None:
        with _lock:
            model = _models.get(device)
            if model is None:
                model = measure(path)
                if model is None:  # too small a file to time: a later, larger one of this device is measured
                    return FALLBACK
                _models[device] = model
    return model


def measure(path: Path) -> IoModel | None:
    """Time :data:`PROBE_PAGES` pages requested together and one read of :data:`PROBE_BYTES`, both from the middle
    half of ``path`` (pages the load may read anyway; a cached page makes a request look cheaper, never dearer
    than the device, so the model errs towards fewer merged bytes). None where ``path`` is too small to time."""
    if not hasattr(os, "posix_fadvise"):
        return FALLBACK
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return FALLBACK
    try:
        size = os.fstat(fd).st_size
        if size < 4 * PROBE_BYTES:
            return None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly the bytes asked for
        lo = size // 4 // PAGE * PAGE
        step = (size // 2 - PROBE_BYTES) // PROBE_PAGES // PAGE * PAGE
        pages = [lo + PROBE_BYTES + k * step for k in range(PROBE_PAGES)]
        one = bytearray(PAGE)
        t0 = time.perf_counter()
        for at in pages:  # the kernel queues them all: latency over the requests in flight
            os.posix_fadvise(fd, at, PAGE, os.POSIX_FADV_WILLNEED)
        for at in pages:
            os.preadv(fd, [one], at)
        request_s = (time.perf_counter() - t0) / PROBE_PAGES
        big = bytearray(PROBE_BYTES)
        t0 = time.perf_counter()
        got = os.preadv(fd, [big], lo)
        elapsed = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        if got <= 0 or elapsed <= 0:
            return FALLBACK
        return IoModel(request_s=request_s, bandwidth=got / elapsed)
    except OSError:
        return FALLBACK
    finally:
        os.close(fd)
