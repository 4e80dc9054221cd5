"""The two shapes a rank's read job of one tensor takes, found from its runs with a few array operations: whole
row blocks of a row-block tiling (a dim-0 split), or one column slice whose edges fall on a band tiling's tiles (a
last-dim split). A verifying reader copies and checks such a job tile by tile without working out, per run and
per tile, which tiles the runs touch; any other job (runs cut off tile edges, several slices, runs across regions)
gives None and takes the general way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..format.hash_record import Region, Tiling

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class RowBlocks:
    """Runs each of whole tiles of a row-block tiling of region ``region``: run i is ``length[i]`` bytes from byte
    ``start[i]`` of the region, to byte ``dst[i]`` of buffer ``buf[i]``; ``leaf0`` is the tiling's first leaf."""

    region: int
    tiling: Tiling
    leaf0: int
    start: list[int]
    length: list[int]
    buf: list[int]
    dst: list[int]


@dataclass(frozen=True)
class BandBox:
    """Rows ``[r0, r1)``, bytes ``[c0, c1)`` of each, of region ``region``, exactly the tiles of a band tiling (first
    leaf ``leaf0``) they cover, to buffer ``buf`` from byte ``dst`` on, one row every ``pitch`` bytes."""

    region: int
    tiling: Tiling
    leaf0: int
    r0: int
    r1: int
    c0: int
    c1: int
    buf: int
    dst: int
    pitch: int


def tile_box(
    starts: Any, bases: list[int], regions: list[Region], src: np.ndarray, length: np.ndarray, buf: np.ndarray,
    dst: np.ndarray,
) -> RowBlocks | BandBox | None:  # fmt: skip
    """The shape of runs ``(src, length, buf, dst)`` (file offsets; at least one run, none empty) in a file of
    ``regions`` (region k starts at ``starts[k]``, its first leaf is ``bases[k]``): whole row blocks, one column
    slice on band edges, or None."""
    import numpy as np

    k = int(np.searchsorted(starts, int(src[0]), side="right")) - 1
    if k < 0:
        return None
    region = regions[k]
    o = src - region.offset
    e = o + length
    if int(o.min()) < 0 or int(e.max()) > region.length:
        return None  # runs in more than one region
    B, L = region.row_bytes, region.length
    first = region.tiling(0)
    if first.bands == 1:
        span = first.tile_rows * B
        if bool((o % span == 0).all()) and bool(((e % span == 0) | (e == L)).all()):
            return RowBlocks(k, first, bases[k], o.tolist(), length.tolist(), buf.tolist(), dst.tolist())
    n, w, at = len(o), int(length[0]), int(o[0])
    if n > 1:
        ds, dd = np.diff(src), np.diff(dst)
        pitch = int(dd[0])
        if not (bool((ds == B).all()) and bool((dd == pitch).all()) and bool((length == w).all())
                and bool((buf == buf[0]).all()) and pitch >= w):  # fmt: skip
            return None
    else:
        pitch = w
    r0, c0 = divmod(at, B)
    r1, c1 = r0 + n, c0 + w
    if c1 > B:
        return None  # a run across rows
    leaf0 = bases[k]
    for index in range(len(region.tilings)):
        tiling = region.tiling(index)
        h, tw = tiling.tile_rows, tiling.tile_bytes
        if (tiling.bands > 1 and c0 % tw == 0 and (c1 % tw == 0 or c1 == B) and r0 % h == 0
                and (r1 % h == 0 or r1 == tiling.rows)):  # fmt: skip
            return BandBox(k, tiling, leaf0, r0, r1, c0, c1, int(buf[0]), int(dst[0]), pitch)
        leaf0 += tiling.leaves
    return None
