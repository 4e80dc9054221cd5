"""Caller-owned destination tensors for ``load_rank(..., params=, out=)``, made from a rank's reference tensors
(helpers/tp_split.py) for tests/test_equivalence.py's destination cells.

Every destination is a view into one flat byte buffer filled with 0xFF first (a float32 NaN: an element the load
left unwritten never equals the reference), at 16-byte-aligned offsets with at least 16 guard bytes after each,
so a write past a destination's end, or into a destination it was not meant for, shows as a changed guard byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SENTINEL = 0xFF
GUARD = 16


@dataclass
class Slab:
    """Destinations by name, all views of ``buffer``; ``covered`` marks the bytes some destination owns."""

    buffer: torch.Tensor
    covered: torch.Tensor
    views: dict[str, torch.Tensor]

    def guards_intact(self) -> bool:
        """No byte outside every destination was written."""
        return bool((self.buffer[~self.covered] == SENTINEL).all())


def slab(want: dict[str, torch.Tensor], names: list[str]) -> Slab:
    """A 0xFF-filled destination for each of ``names``, of the shape and dtype ``want`` (the reference) gives it."""
    sizes = {name: want[name].numel() * want[name].element_size() for name in names}
    total = sum(-(-(size + GUARD) // 16) * 16 for size in sizes.values()) + GUARD
    buffer = torch.full((total,), SENTINEL, dtype=torch.uint8)
    covered = torch.zeros(total, dtype=torch.bool)
    views, at = {}, GUARD
    for name in names:
        t, size = want[name], sizes[name]
        views[name] = buffer[at : at + size].view(t.dtype).view(t.shape)
        covered[at : at + size] = True
        at = -(-(at + size + GUARD) // 16) * 16
    return Slab(buffer, covered, views)
