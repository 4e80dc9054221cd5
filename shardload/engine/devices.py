"""Checking the devices a caller names before anything is read: a one-line error for a name torch does not know
(``"gpu"``), for ``cuda:N`` on a machine or torch build without that GPU, and for a value that is no device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError

if TYPE_CHECKING:
    import torch


def resolve_device(device: Any, where: str) -> torch.device:
    """``device`` (a string, a ``torch.device`` or a CUDA index) as a ``torch.device`` that exists here."""
    import torch

    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ShardloadError(f"device must be a string, an int or a torch.device, got {device!r}", file=where)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        known = "an accelerator index, and there is none" if isinstance(device, int) else "not a device torch knows"
        raise ShardloadError(f"device {device!r} is {known} (e.g. 'cpu', 'cuda:0')", file=where) from None
    if dev.type == "meta":
        raise ShardloadError(f"device {device!r} holds no memory: a load there would read every byte for nothing; "
                             "give 'cpu' or a GPU", file=where)  # fmt: skip
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ShardloadError(
                f"device {device!r} needs a CUDA GPU, and this torch ({torch.__version__}) sees none", file=where
            )
        if dev.index is not None and dev.index >= count:
            raise ShardloadError(f"device {device!r} does not exist: this machine has {count} CUDA GPU(s)", file=where)
    return dev
