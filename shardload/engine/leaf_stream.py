"""Rank files hashed as ``convert`` writes them: :class:`LeafStream` feeds each written piece to the tiles of the
file's integrity record, so the finished file is never read back; ``streamed_record`` is the record of such files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ShardloadError
from ..format.hash_record import (
    HASH_BYTES,
    LEAF_BYTES,
    FileHashes,
    HashRecord,
    Region,
    Tiling,
    default_hash,
    hasher,
)
from ..sources.safetensors_header import header_tensors
from ..sources.tensor_info import TensorInfo
from .hashing import output_regions


class LeafStream:
    """The leaves of one file's integrity record, hashed from its bytes as they are written (in order, in pieces of
    any size) so the finished file is never read back: the regions :func:`.hashing.output_regions` gives the file
    its ``header`` describes (each tensor's row blocks: a rank file's tensors are always read whole; ``regions_of``
    gives others, :func:`.hashing.regions_for`'s two tilings too), and the same leaves :func:`.hashing.hash_files`
    would hash from the finished file. A tile one piece holds
    whole is hashed in one call; one that pieces split is fed to a hasher kept open for it, a column band gathering
    its rows' slices as they pass. At most one row block's tiles per tiling are open at a time, and nothing is kept
    but their hasher states (the gather of a band copies only the piece at hand)."""

    def __init__(
        self,
        path: Path,
        header: bytes,
        hash_name: str | None = None,
        regions_of: Callable[[int, Sequence[TensorInfo]], list[Region]] = output_regions,
    ) -> None:
        tensors = list(header_tensors(path, header).values())
        self.name = path.name
        self.size = len(header) + sum(t.nbytes for t in tensors)
        self.regions = regions_of(self.size, tensors)
        self.hash_name = hash_name or default_hash()
        self.hash_fn = hasher(self.hash_name)
        self.table = bytearray(sum(r.leaves for r in self.regions) * HASH_BYTES)
        self.region = 0
        self.at = 0
        """Bytes of the current region fed so far."""
        self.base = 0
        """The current region's first leaf in the file's table."""
        self.open: dict[int, Any] = {}
        """Leaf index -> the hasher of a tile some of whose bytes have passed (none between regions)."""

    def update(self, data: Any) -> None:
        """Hash the file's next bytes into the tiles they belong to."""
        view = memoryview(data).cast("B")
        while len(view):
            if self.region == len(self.regions):
                raise ShardloadError(f"more than the {self.size} bytes its header describes were written",
                                     file=self.name)  # fmt: skip
            r = self.regions[self.region]
            n = min(len(view), r.length - self.at)
            base = self.base
            for k in range(len(r.tilings)):
                t = r.tiling(k)
                self._tiling(t, base, self.at, view[:n])
                base += t.leaves
            view = view[n:]
            self.at += n
            if self.at == r.length:
                self.base += r.leaves
                self.region += 1
                self.at = 0

    def hashes(self) -> FileHashes:
        """The file's entry in the record, once every byte its header describes has passed."""
        if self.region != len(self.regions) or self.open:
            raise ShardloadError(f"was cut short: its header describes {self.size} bytes", file=self.name)
        return FileHashes(self.name, self.size, self.regions, bytes(self.table))

    def _tiling(self, t: Tiling, base: int, at: int, piece: memoryview) -> None:
        """Bytes ``[at, at + len(piece))`` of a region into the tiles of tiling ``t`` (its first leaf ``base``): a
        row's end, whole rows, a row's start."""
        import numpy as np

        B = t.row_bytes
        pos, end = at, at + len(piece)
        if pos % B:
            stop = min(end, (pos // B + 1) * B)
            self._row_part(t, base, pos // B, pos % B, piece[: stop - at])
            pos = stop
        ra, rb = pos // B, end // B
        if rb > ra:
            rows = np.frombuffer(piece[pos - at : rb * B - at], dtype=np.uint8).reshape(rb - ra, B)
            self._rows(t, base, ra, rows)
            pos = rb * B
        if pos < end:
            self._row_part(t, base, pos // B, 0, piece[pos - at :])

    def _row_part(self, t: Tiling, base: int, row: int, col: int, data: memoryview) -> None:
        """Bytes ``[col, col + len(data))`` of one row, into each band they reach."""
        blk = row // t.tile_rows
        last = min(t.rows, (blk + 1) * t.tile_rows) - 1
        end = col + len(data)
        for band in range(col // t.tile_bytes, -(-end // t.tile_bytes)):
            c0 = band * t.tile_bytes
            c1 = min(t.row_bytes, c0 + t.tile_bytes)
            a, b = max(col, c0), min(end, c1)
            self._put(base + blk * t.bands + band, data[a - col : b - col], row == last and b == c1)

    def _rows(self, t: Tiling, base: int, first: int, rows: Any) -> None:
        """Whole rows ``first, first + 1, ...`` (a 2-D array), block by block: each band's slice gathered once."""
        import numpy as np

        tr, w = t.tile_rows, t.tile_bytes
        stop = first + len(rows)
        for blk in range(first // tr, -(-stop // tr)):
            x, y = max(first, blk * tr), min(stop, (blk + 1) * tr)
            done = y == min(t.rows, (blk + 1) * tr)
            part = rows[x - first : y - first]
            if t.bands == 1:
                self._put(base + blk, part.reshape(-1), done)
                continue
            for band in range(t.bands):
                self._put(base + blk * t.bands + band, np.ascontiguousarray(part[:, band * w : (band + 1) * w]), done)

    def _put(self, leaf: int, data: Any, complete: bool) -> None:
        """Bytes of tile ``leaf`` in order; ``complete`` when they end the tile (then its leaf is written)."""
        h = self.open.pop(leaf, None)
        if h is None:
            if not complete:  # the tile's first bytes: keep a hasher open for the rest
                self.open[leaf] = self.hash_fn(data)
                return
            digest = self.hash_fn(data).digest()  # the whole tile at once
        else:
            h.update(data)
            if not complete:
                self.open[leaf] = h
                return
            digest = h.digest()
        self.table[leaf * HASH_BYTES : (leaf + 1) * HASH_BYTES] = digest


def streamed_record(files: Sequence[FileHashes], hash_name: str) -> bytes:
    """The integrity record (its bytes) of files whose leaves :class:`LeafStream` hashed as they were written."""
    return HashRecord(hash_name, LEAF_BYTES, list(files)).to_bytes()
