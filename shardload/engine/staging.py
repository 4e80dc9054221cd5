"""Host staging buffers for ranks whose tensors are not filled directly: reusable buffers (page-locked for CUDA)
that reader threads fill and hand on to non-blocking uploads on a side stream per device. A buffer is reused once
the event recorded behind its uploads has completed, so reading overlaps host-to-device copies.

One pool per buffer size lives as long as the process (:func:`shared_staging`): page-locking memory is most of a
fresh process's first GPU load, so it is paid once, and only for the buffers a load keeps in flight.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class StagingBuffers:
    """Up to ``depth`` host buffers of ``size`` bytes (page-locked with ``pin``), made as they are first needed and
    cycled between reads and uploads."""

    def __init__(self, size: int, depth: int, *, pin: bool) -> None:
        self.size = size
        self.depth = depth
        self.pin = pin
        self.made = 0
        self.free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.events: dict[int, list[Any]] = {}
        self.streams: dict[Any, Any] = {}
        self.lock = threading.Lock()

    def grow(self, depth: int) -> None:
        """Allow up to ``depth`` buffers (a load with more reader threads than the pool has served)."""
        with self.lock:
            self.depth = max(self.depth, depth)

    def acquire(self) -> torch.Tensor:
        """A free buffer whose earlier uploads have completed (a new one while fewer than ``depth`` exist)."""
        import torch

        try:
            buf = self.free.get_nowait()
        except queue.Empty:
            with self.lock:
                new = self.made < self.depth
                self.made += new
            buf = torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pin) if new else self.free.get()
        with self.lock:
            events = self.events.pop(buf.data_ptr(), [])
        for event in events:
            event.synchronize()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Hand a buffer back (its uploads may still be in flight: their events guard its reuse)."""
        self.free.put(buf)

    def stream(self, device: Any) -> Any:
        """The side stream uploads to ``device`` go on, made once per process."""
        import torch

        with self.lock:
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
            return stream

    def upload(self, buf: torch.Tensor, offset: int, dest: torch.Tensor, lo: int, hi: int, after: Any) -> None:
        """Copy ``hi - lo`` bytes at ``offset`` of ``buf`` to bytes ``[lo, hi)`` of ``dest`` (behind ``after``: see
        :meth:`on_device`)."""
        import torch

        self.copy(buf, buf[offset : offset + hi - lo], dest.reshape(-1).view(torch.uint8)[lo:hi], after)

    def copy(self, buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, after: Any) -> None:
        """Copy ``src`` (a view of ``buf``) into ``dst``: on a CUDA device a non-blocking copy on a side stream
        behind ``after`` (:func:`ready_event`), with an event that keeps ``buf`` from reuse until it completes."""
        self.on_device(buf, dst.device, lambda: dst.copy_(src, non_blocking=self.pin), after)

    def on_device(self, buf: torch.Tensor, device: Any, work: Callable[[], Any], after: Any) -> None:
        """Run ``work`` (copies out of ``buf`` to ``device``, and work on the device after them): for a CUDA
        device with page-locked buffers, queued on its side stream behind ``after`` (an event recorded where the
        destinations were allocated; None: behind the device's default stream), with an event that keeps ``buf``
        from reuse until it has run (recorded even when ``work`` fails part way).

        The calling thread is moved to ``device`` for good, not for the block: moving it back to a device it never
        used would make a CUDA context there (one per process on GPU 0, with one process per GPU)."""
        import torch

        device = torch.device(device)
        if not (self.pin and device.type == "cuda"):
            work()
            return
        assert device.index is not None, "a CUDA device with its index (the destination tensor's own device)"
        if torch.cuda.current_device() != device.index:
            torch.cuda.set_device(device.index)
        stream = self.stream(device)
        if after is None:
            stream.wait_stream(torch.cuda.default_stream(device))
        else:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            try:
                work()
            finally:
                event = torch.cuda.Event()
                event.record(stream)
                with self.lock:
                    self.events.setdefault(buf.data_ptr(), []).append(event)

    def sync(self) -> None:
        """Wait for every upload issued so far."""
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            stream.synchronize()


def ready_event(device: Any) -> Any:
    """An event on ``device``'s current stream in the calling thread, for uploads on a side stream to wait on; None
    off CUDA. Recorded where a load allocates its destinations (and zeroes their padding): memory the caching
    allocator hands out there may still be in use by work queued on that stream (a caller loading inside
    ``torch.cuda.stream(s)``), which the default stream does not order."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


_SHARED: dict[tuple[int, bool], StagingBuffers] = {}
_SHARED_LOCK = threading.Lock()


def shared_staging(size: int, depth: int, *, pin: bool) -> StagingBuffers:
    """This process's pool of ``size``-byte staging buffers (page-locked with ``pin``), allowed ``depth`` of them."""
    with _SHARED_LOCK:
        pool = _SHARED.get((size, pin))
        if pool is None:
            pool = _SHARED[(size, pin)] = StagingBuffers(size, depth, pin=pin)
    pool.grow(depth)
    return pool
