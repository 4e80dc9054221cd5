"""The staged path: every tensor, CPU ones included, filled through the host staging buffers (page-locked for CUDA,
each buffer's parts uploaded on a side stream per device): the way bytes reach a GPU today, chosen for CPU
tensors to test that way without one (``data_path_for(..., staged=True)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .host import HostPath

if TYPE_CHECKING:
    import torch


class StagedPath(HostPath):
    """Staging buffers, then an upload, for every tensor; a single rank's strategy copies out of a mapping into the
    buffers or reads its runs into them (never planned reads: those fill CPU tensors in place)."""

    def direct(self, device: torch.device) -> bool:
        """No tensor is filled in place: each goes through the staging buffers."""
        return False
