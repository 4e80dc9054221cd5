"""The mapped path (``mmap=True``): a single CPU rank's tensor that is one contiguous stretch of its file, and a
whole stored tensor on the CPU, is returned as a view of a private file mapping
(:class:`~shardload.sources.reader.Mappings`) instead of being read; everything else as the host path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...sources.dtypes import to_torch
from ...sources.reader import Mappings
from .base import LoadContext
from .host import HostPath

if TYPE_CHECKING:
    import torch

    from ...planning.plan import ParamPlan
    from ...sources.tensor_info import TensorInfo
    from ..read_schedule import StructureKey


class MappedPath(HostPath):
    """Views of a private mapping where a CPU tensor is one stretch of its file; the host path for the rest."""

    def __init__(self, *, one_rank: bool = False) -> None:
        super().__init__(one_rank=one_rank)
        self.mappings: Mappings | None = None
        self.whole: dict[StructureKey, int | None] = {}
        """Per structure: where its one stretch starts in the stored tensor (None: it is not one stretch)."""

    def bind(self, ctx: LoadContext) -> None:
        """Attach to the executor; the files are mapped where the reader can (an object store's cannot)."""
        super().bind(ctx)
        self.mappings = Mappings() if ctx.reader.can_map else None

    def param(
        self,
        plan: ParamPlan,
        ranks: Sequence[int],
        devices: Sequence[torch.device],
        key: StructureKey,
        out: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor] | None:
        """A single CPU rank's fresh tensor as a view of the mapping where it is one stretch, else the host way."""
        if out is None and self.mappings is not None and len(ranks) == 1 and devices[0].type == "cpu":
            view = self._view(plan, ranks, key)
            if view is not None:
                return [view]
        return super().param(plan, ranks, devices, key, out)

    def _view(self, plan: ParamPlan, ranks: Sequence[int], key: StructureKey) -> torch.Tensor | None:
        """The rank's tensor as a view of the file mapping, where it is one contiguous stretch of the file."""
        if key not in self.whole:
            runs = self.ctx.runs.get(plan, ranks, key)
            whole = runs is not None and len(runs) == 1 and int(runs.length[0]) == plan.rank_nbytes
            self.whole[key] = int(runs.src[0]) if whole and runs is not None else None
        at = self.whole[key]
        if at is None or self.mappings is None:
            return None
        return self.mappings.tensor(plan.source.file, plan.source.offset + at, plan.shape, to_torch(plan.dtype))

    def tensors(self, infos: Sequence[TensorInfo], device: Any) -> list[torch.Tensor | None] | None:
        """Views of the mapping of whole stored tensors on the CPU (None where one cannot be mapped)."""
        import torch

        if self.mappings is None or torch.device(device).type != "cpu":
            return None
        return [self.mappings.tensor(t.file, t.offset, t.shape, to_torch(t.dtype)) for t in infos]
