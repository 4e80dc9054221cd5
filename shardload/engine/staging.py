"""Host staging buffers for ranks whose tensors are not filled directly: a few reusable buffers (page-locked for
CUDA) that reader threads fill and hand on to non-blocking uploads on a side stream per device. A buffer is
reused once the event recorded behind its uploads has completed, so reading overlaps host-to-device copies.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class StagingBuffers:
    """``depth`` host buffers of ``size`` bytes (page-locked with ``pin``) cycled between reads and uploads."""

    def __init__(self, size: int, depth: int, *, pin: bool) -> None:
        import torch

        self.size = size
        self.pin = pin
        self.free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.events: dict[int, list[Any]] = {}
        self.streams: dict[Any, Any] = {}
        self.lock = threading.Lock()
        for _ in range(depth):
            self.free.put(torch.empty(size, dtype=torch.uint8, pin_memory=pin))

    def acquire(self) -> torch.Tensor:
        """A free buffer whose earlier uploads have completed."""
        buf = self.free.get()
        with self.lock:
            events = self.events.pop(buf.data_ptr(), [])
        for event in events:
            event.synchronize()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Hand a buffer back (its uploads may still be in flight: their events guard its reuse)."""
        self.free.put(buf)

    def _stream(self, device: Any) -> Any:
        import torch

        with self.lock:
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
            return stream

    def upload(self, buf: torch.Tensor, offset: int, dest: torch.Tensor, lo: int, hi: int) -> None:
        """Copy ``hi - lo`` bytes at ``offset`` of ``buf`` to bytes ``[lo, hi)`` of ``dest``."""
        import torch

        self.copy(buf, buf[offset : offset + hi - lo], dest.reshape(-1).view(torch.uint8)[lo:hi])

    def copy(self, buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` (a view of ``buf``) into ``dst``: on a CUDA device a non-blocking copy on a side stream,
        with an event that keeps ``buf`` from reuse until it completes."""
        import torch

        if dst.device.type == "cuda" and self.pin:
            stream = self._stream(dst.device)
            # ``dest`` was allocated on the default stream, whose queued work may still use its memory's last owner
            stream.wait_stream(torch.cuda.default_stream(dst.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            with self.lock:
                self.events.setdefault(buf.data_ptr(), []).append(event)
        else:
            dst.copy_(src)

    def sync(self) -> None:
        """Wait for every upload issued so far."""
        for stream in self.streams.values():
            stream.synchronize()
