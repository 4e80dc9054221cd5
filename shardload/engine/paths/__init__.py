"""Data paths: how a load's bytes reach its destination tensors, one object per load chosen by :func:`data_path_for`
and handed to the executor (:class:`~shardload.engine.transfer.Transfer`), which runs the jobs it submits.

- :class:`HostPath` (:mod:`.host`): CPU tensors read in place; a single rank's read strategy per parameter (copies
  out of a mapping, ``preadv``, planned cold reads); other devices' tensors through the staging buffers.
- :class:`MappedPath` (:mod:`.mapped`, ``mmap=True``): a CPU tensor that is one stretch of its file as a view of a
  private mapping; the rest as the host path.
- :class:`DevicePath` (:mod:`.device`): every rank not on the CPU (a GPU): the page-aligned spans holding its bytes
  read into page-locked buffers (packed where gaps are wide), uploaded and cut on the device; ``staged=True``
  sends CPU ranks this way too (tests take the GPU's way on the CPU).

A new path is one subclass of :class:`DataPath` (or of :class:`HostPath`, to keep its single-rank strategy for what
it does not take itself), overriding :meth:`DataPath.param` (and :meth:`DataPath.direct` or
:meth:`DataPath.tensors` as needed), plus one line in :func:`data_path_for`; the executor does not change
(docs/extending.md, "A data path").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import DataPath, LoadContext, fill_padding
from .device import DevicePath
from .host import HostPath
from .mapped import MappedPath

__all__ = ["DataPath", "DevicePath", "HostPath", "LoadContext", "MappedPath", "data_path_for", "fill_padding"]


def data_path_for(
    devices: Sequence[Any], *, mmap: bool = False, one_rank: bool = False, staged: bool = False
) -> DataPath:
    """The data path of a load onto ``devices``: the device path for a load onto a GPU (``staged``: CPU ranks too,
    tests taking the GPU's way on the CPU), ``mmap`` maps what a CPU rank can instead of reading it, else host
    memory. ``one_rank``: a single rank's load, whose read strategy picks each parameter's way."""
    import torch

    if staged or any(torch.device(d).type != "cpu" for d in devices):
        return DevicePath(one_rank=one_rank, stand_in=staged)
    if mmap and any(torch.device(d).type == "cpu" for d in devices):
        return MappedPath(one_rank=one_rank)
    return HostPath(one_rank=one_rank)
