"""Verified reading: a reader wrapped so that every byte it hands out lies in a tile whose hash matched the
integrity record. Only the tiles that cover the requested runs are read. A tile that lies whole inside a run (or a
column band the runs hold exactly) is read straight into its destination and hashed there, on the reader thread
that read it; a tile a run covers only in part is read into a private buffer, hashed, and only then the run's bytes
of it copied out. Either way the bytes returned are the bytes checked, and every check is made before the read
returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format.hash_record import FileHashes, Region, Tiling, hasher
from .read_plan import MAX_WASTE, IoModel, fill_reads, plan_reads
from .reader import PAGE, FileMaps, RunReader, count_checked, count_mapped, count_requested, populate, populate_runs
from .tile_boxes import BandBox, RowBlocks, tile_box

if TYPE_CHECKING:
    import numpy as np


CANVAS_BYTES = 8 << 20
"""The least a reader thread's reusable buffer for checked tiles holds."""


class IntegrityError(CheckpointError):
    """Bytes that do not match the checkpoint's integrity record (or a file that differs from it in size)."""


@dataclass
class VerifiedFile:
    """One file as the verifier knows it: its record entry, region starts, each region's first leaf, and the
    names of the tensors stored in it (by byte range) for messages."""

    hashes: FileHashes
    starts: Any
    bases: list[int]
    names: Callable[[int, int], list[str]]
    ends: Any = None
    """Each region's end (computed once here, not per read)."""

    def __post_init__(self) -> None:
        import numpy as np

        if self.ends is None:
            self.ends = np.array([r.end for r in self.hashes.regions], dtype=np.int64)
        self._single: Any = None

    def single_leaf(self) -> Any:
        """Per region, whether it is hashed as one leaf (computed once)."""
        import numpy as np

        if self._single is None:
            self._single = np.array([r.leaves == 1 for r in self.hashes.regions], dtype=bool)
        return self._single


def region_bases(hashes: FileHashes) -> list[int]:
    """The index of each region's first leaf in the file's leaf table."""
    bases, count = [], 0
    for region in hashes.regions:
        bases.append(count)
        count += region.leaves
    return bases


def _progressions(src: np.ndarray, length: np.ndarray, buf: np.ndarray, dst: np.ndarray) -> list[tuple[int, int]]:
    """Split runs into maximal stretches ``[a, b)`` that are one strided copy: equal lengths and buffers, constant
    source and destination strides."""
    import numpy as np

    n = len(src)
    if n == 1:
        return [(0, 1)]
    same = (length[1:] == length[:-1]) & (buf[1:] == buf[:-1])
    ds, dd = np.diff(src), np.diff(dst)
    if bool(same.all()) and bool((ds == ds[0]).all()) and bool((dd == dd[0]).all()):
        return [(0, n)]
    out = []
    i = 0
    while i < n:
        j = i + 1
        if j < n and same[i]:
            s, d = ds[i], dd[i]
            while j < n and same[j - 1] and ds[j - 1] == s and dd[j - 1] == d:
                j += 1
        out.append((i, j))
        i = j
    return out


class VerifiedReader(RunReader):
    """Wraps a reader: each ``read_runs`` reads the tiles covering its runs (whole ones straight into the
    destinations), checks every one against the record before it returns, and hands out only checked bytes.
    ``files`` maps each readable path to its :class:`VerifiedFile`."""

    can_map = False  # nothing may bypass the check by reading the file's pages directly

    def __init__(self, inner: RunReader, files: dict[Any, VerifiedFile], hash_name: str) -> None:
        self.inner = inner
        self.files = files
        self.hash = hasher(hash_name)
        self.hash_name = hash_name
        self.threads = inner.threads
        self.maps = FileMaps() if inner.can_map else None
        self._scratch = threading.local()
        self.culprit = "the file was changed or corrupted"
        """What a mismatch says went wrong."""
        self.io_model: IoModel | None = None
        """The model cold tile reads are planned with (None: the file system's, measured)."""
        self.max_waste = MAX_WASTE
        """The byte budget of merged gaps, a fraction of the page floor."""

    @property
    def can_plan(self) -> bool:
        """Whether this reader plans cold reads of local files itself (its jobs then deserve a deep queue)."""
        return self.maps is not None

    def warm(self, path: Any) -> bool:
        """Whether the local file ``path`` looks cached as a whole (its jobs then copy and hash, and wait on no I/O)."""
        return self.maps is not None and self.maps.warm(path)

    def plan_with(self, model: IoModel | None, max_waste: float) -> None:
        """Plan cold tile reads with ``model`` (None: measured) and a budget of ``max_waste`` over the page floor."""
        self.io_model, self.max_waste = model, max_waste

    def _plan(self, path: Any, starts: np.ndarray, ends: np.ndarray, limit: int) -> Any:
        """The planned reads of the local file ``path`` for runs ``[starts[i], ends[i])`` (sorted by start)."""
        model = self.io_model
        if model is None:
            from .io_model import io_model

            model = io_model(path)
        return plan_reads(starts, ends, model, max_waste=self.max_waste, limit=limit)

    def no_readahead(self, path: Any) -> None:
        self.inner.no_readahead(path)  # type: ignore[attr-defined]

    def prefetch(self, path: Any, starts: Sequence[int], ends: Sequence[int]) -> None:
        pass  # the tiles read are wider than the runs; let the reads themselves fetch them

    def _check(self, data: np.ndarray, entry: VerifiedFile, leaf: int) -> bool:
        """Whether the contiguous bytes ``data`` hash to leaf ``leaf`` of the file's record (counted as checked)."""
        count_checked(data.nbytes)
        return bool(self.hash(data).digest() == entry.hashes.leaf(leaf))

    def _mismatch(self, path: Any, entry: VerifiedFile, region: Any, tiling: Tiling, index: int) -> IntegrityError:
        """The one-line error for tile ``index`` of ``tiling``: file, byte range, the tensors it feeds, why."""
        if self.maps is not None:
            self.maps.intact(path, 0)  # a file cut under its mapping reads zeros past the cut: say that, not "tampered"
        t0, th, c0, tw = tiling.tile(index)
        B = region.row_bytes
        lo = region.offset + t0 * B + c0
        hi = region.offset + (t0 + th - 1) * B + c0 + tw
        span = f"bytes {lo}-{hi}" if tw == B else f"bytes {lo}-{hi} ({th} rows x {tw} of every {B})"
        names = entry.names(lo, hi)
        feeds = f", feeding {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}" if names else ""
        return IntegrityError(f"{span}{feeds}: hash mismatch against the integrity record ({self.culprit})",
                              file=str(path))  # fmt: skip

    def _linear(
        self,
        path: Any,
        entry: VerifiedFile,
        region: Any,
        tiling: Tiling,
        leaf0: int,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        buffers: Sequence[Any],
    ) -> None:
        """Runs under a tiling whose tiles follow one another in the file (row blocks, or the leaves of a one-row
        region): each run's whole tiles are read straight into its destination and hashed there, so no byte is
        copied twice; only the tiles a run covers in part (at most two a run: a span cut on pages, not on tiles)
        are read into this thread's scratch, hashed, and the run's bytes of them copied out."""
        import numpy as np

        B, L = region.row_bytes, region.length
        span = tiling.tile_rows * B if tiling.bands == 1 else tiling.tile_bytes
        o = src - region.offset
        e = o + length
        ia = -(-o // span)  # each run's first whole tile
        ib = np.maximum(np.where(e == L, -(-e // span), e // span), ia)  # ... and the tile after its last
        lo_in = np.minimum(ia * span, e)  # its whole tiles' bytes: [lo_in, hi_in)
        hi_in = np.where(ib > ia, np.minimum(ib * span, L), lo_in)
        head, tail = o < lo_in, e > hi_in
        edges = np.unique(np.concatenate((o[head] // span, hi_in[tail] // span)))
        inner = np.flatnonzero(hi_in > lo_in)
        outs = [buffer_array(t) for t in buffers]
        sb, eb = o // span * span, np.minimum(-(-e // span) * span, L)  # the bytes of the tiles each run touches
        rb = -(-eb // B)
        boxes = list(zip((sb // B).tolist(), rb.tolist(), (sb % B).tolist(), (eb - (rb - 1) * B).tolist(), strict=True))
        mapped = self.maps.array(path) if self.maps is not None and self._cached(path, region, boxes) else None
        canvas = self._canvas(len(edges) * span) if len(edges) else None
        flat = canvas.numpy() if canvas is not None else None
        sizes = np.minimum(edges * span + span, L) - edges * span
        if mapped is not None:
            self.maps.intact(path, region.end)  # type: ignore[union-attr]
            _populate(buffers, buf, dst, length)
            count_mapped(path, int((hi_in - lo_in).sum() + sizes.sum()))
        else:
            # one call for the whole tiles (into the destinations) and the edge tiles (into scratch), by file offset
            rsrc = np.concatenate((lo_in[inner], edges * span)) + region.offset
            rlen = np.concatenate((hi_in[inner] - lo_in[inner], sizes))
            rbuf = np.concatenate((buf[inner], np.full(len(edges), len(buffers), dtype=np.int64)))
            rdst = np.concatenate((dst[inner] + lo_in[inner] - o[inner], np.arange(len(edges), dtype=np.int64) * span))
            order = np.argsort(rsrc, kind="stable")
            rsrc, rlen, rbuf, rdst = rsrc[order], rlen[order], rbuf[order], rdst[order]
            if self.maps is not None:
                self.inner.no_readahead(path)  # type: ignore[attr-defined]
                self.inner.prefetch(path, *_pages(rsrc, rsrc + rlen))  # type: ignore[attr-defined]
            into = [*buffers, canvas] if canvas is not None else list(buffers)
            self.inner.read_runs(path, rsrc, rlen, rbuf, rdst, into,  # type: ignore[call-arg]
                                 **({"populate": True} if self.maps is not None else {}))  # fmt: skip
        for j, k in enumerate(edges.tolist()):
            at, n = j * span, int(sizes[j])
            if mapped is not None:
                start = region.offset + k * span
                flat[at : at + n] = mapped[start : start + n]  # type: ignore[index]
            if not self._check(flat[at : at + n], entry, leaf0 + k):  # type: ignore[index]
                raise self._mismatch(path, entry, region, tiling, k)
        for i in inner.tolist():
            out, d0 = outs[int(buf[i])], int(dst[i]) - int(o[i])
            for k in range(int(ia[i]), int(ib[i])):
                lo, hi = d0 + k * span, d0 + min((k + 1) * span, L)
                if mapped is not None:  # tile by tile, so each is hashed while its copy is still in the cache
                    start = region.offset + k * span
                    out[lo:hi] = mapped[start : start + hi - lo]
                if not self._check(out[lo:hi], entry, leaf0 + k):
                    raise self._mismatch(path, entry, region, tiling, k)
        if len(edges):  # the runs' bytes outside their whole tiles, out of the checked edge tiles
            ps = np.concatenate((o[head], hi_in[tail]))
            pe = np.concatenate((lo_in[head], e[tail]))
            pb = np.concatenate((buf[head], buf[tail]))
            pd = np.concatenate((dst[head], dst[tail] + hi_in[tail] - o[tail]))
            at = np.searchsorted(edges, ps // span) * span + ps % span
            copy_runs(flat, at, outs, pb, pd, pe - ps)  # type: ignore[arg-type]

    def _direct_bands(
        self,
        path: Any,
        entry: VerifiedFile,
        region: Any,
        tiling: Tiling,
        leaf0: int,
        need: np.ndarray,
        need_bytes: int,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        buffers: Sequence[Any],
    ) -> bool:
        """Runs that together are exactly the needed column-band tiles (a last-dim split on band edges): read
        straight into their destinations, then each tile hashed from there, so no byte is copied twice. False
        (nothing read) when the runs are not exactly those tiles."""
        import numpy as np

        if int(length.sum()) != need_bytes:
            return False
        order = np.argsort(src, kind="stable")
        src, length, buf, dst = src[order], length[order], buf[order], dst[order]
        o = src - region.offset
        if len(o) > 1 and bool((o[1:] < o[:-1] + length[:-1]).any()):
            return False  # overlapping runs: the same bytes for two destinations
        B, h, w = region.row_bytes, tiling.tile_rows, tiling.tile_bytes
        blk, band = np.nonzero(need)
        t0 = blk * h
        th = np.minimum(h, region.rows - t0)
        c0 = band * w
        tw = np.minimum(w, B - c0)
        first = np.repeat(np.cumsum(th) - th, th)
        rows = np.repeat(t0, th) + np.arange(int(th.sum())) - first  # every row of every needed tile
        starts = rows * B + np.repeat(c0, th)
        j = np.searchsorted(o, starts, side="right") - 1
        jj = np.maximum(j, 0)
        if bool((j < 0).any()) or bool((starts + np.repeat(tw, th) > o[jj] + length[jj]).any()):
            return False  # a tile row not inside one run
        pos = dst[jj] + (starts - o[jj])
        owner = buf[jj]
        outs = [buffer_array(t) for t in buffers]
        boxes = [(a, a + n, int(c), int(c + d)) for a, n, c, d in zip(t0.tolist(), th.tolist(), c0, tw, strict=True)]
        mapped = self.maps.array(path) if self.maps is not None and self._cached(path, region, boxes) else None
        if mapped is not None:
            self.maps.intact(path, region.end)  # type: ignore[union-attr]
        if mapped is None and self.maps is not None and int(length.sum()) < len(length) * (PAGE // 2):
            mapped = self._request_pages(path, src, src + length)  # short runs: copied out as their pages arrive
        if mapped is None and self.maps is None:
            self.inner.read_runs(path, src, length, buf, dst, buffers)
        elif mapped is None:  # a local file not in the page cache: its pages as planned reads, all requested first
            planned = self._plan(path, src, src + length, region.end)
            filled = fill_reads(planned, src, length, buf, dst, sink=len(buffers))
            sink = self._sink(filled.sink)
            self.inner.no_readahead(path)  # type: ignore[attr-defined]
            self.inner.prefetch(path, [r.offset for r in planned.reads], [r.end for r in planned.reads])  # type: ignore[attr-defined]
            self.inner.read_runs(path, filled.src, filled.length, filled.buf, filled.dst, [*buffers, sink],  # type: ignore[call-arg]
                                 sink=len(buffers))  # fmt: skip
        heads = np.flatnonzero(np.concatenate(([True], blk[1:] != blk[:-1])))  # each row block's first tile
        if mapped is not None:  # row block by row block, so each block's tiles are hashed while still in the cache
            _populate(buffers, buf, dst, length)
            count_mapped(path, int(length.sum()))  # (cold, the block's pages arrive as the copy reaches them)
            cuts = [*np.searchsorted(o, blk[heads] * h * B).tolist(), len(o)]
        bounds = [*heads.tolist(), len(blk)]  # each row block's tiles: [bounds[i], bounds[i + 1])
        row_at = (np.cumsum(th) - th).tolist()  # each tile's first row in ``pos`` and ``owner``
        scratch = np.empty(h * w, dtype=np.uint8)  # one tile, gathered where its rows lie apart
        for i in range(len(bounds) - 1):
            ka, kb = bounds[i], bounds[i + 1]
            if mapped is not None and cuts[i + 1] > cuts[i]:  # (none: a run from an earlier block copied this one)
                a, b = cuts[i], cuts[i + 1]
                copy_runs(mapped, src[a:b], outs, buf[a:b], dst[a:b], length[a:b])
            block = _block_view(blk, band, th, tw, pos, owner, outs, ka, kb, row_at[ka])
            if block is not None:
                self._block_hashed(path, entry, region, tiling, leaf0, block, int(blk[ka]), int(band[ka]))
                continue
            for k in range(ka, kb):  # tile by tile: rows in other buffers, uneven, or bands apart
                n, width, at = int(th[k]), int(tw[k]), row_at[k]
                p, b = pos[at : at + n], owner[at : at + n]
                out = outs[int(b[0])]
                step = int(p[1] - p[0]) if n > 1 else width
                if n > 1 and not (step >= width and bool((b == b[0]).all()) and bool((np.diff(p) == step).all())):
                    data = np.concatenate([outs[int(x)][int(y) : int(y) + width] for x, y in zip(b, p, strict=True)])
                elif step == width:
                    data = out[int(p[0]) : int(p[0]) + n * width]
                else:
                    view = np.lib.stride_tricks.as_strided(out[int(p[0]) :], (n, width), (step, 1), writeable=False)
                    data = scratch[: n * width]
                    np.copyto(data.reshape(n, width), view)
                index = int(blk[k]) * tiling.bands + int(band[k])
                if not self._check(data, entry, leaf0 + index):
                    raise self._mismatch(path, entry, region, tiling, index)
        return True

    def _block_hashed(
        self, path: Any, entry: VerifiedFile, region: Region, tiling: Tiling, leaf0: int, block: np.ndarray, blk: int,
        band0: int,
    ) -> bool:  # fmt: skip
        """Check the tiles of row block ``blk`` from band ``band0`` on that ``block`` (their rows, side by side: rows
        apart, bytes contiguous) holds: gathered tile after tile in one strided copy where a tile's rows lie apart,
        then one hash per tile. True once every one matched."""
        import numpy as np

        th, w = block.shape
        tw = tiling.tile_bytes
        full, last = divmod(w, tw)
        if th == 1 or (full + (last > 0) == 1 and block.strides[0] == w):
            flat = block.reshape(-1)  # the tiles lie whole and in order already
        else:
            flat = self._canvas(th * w).numpy()
            if full:
                tiles = block[:, : full * tw].reshape(th, full, tw).transpose(1, 0, 2)
                np.copyto(flat[: full * th * tw].reshape(full, th, tw), tiles)
            if last:
                np.copyto(flat[full * th * tw :].reshape(th, last), block[:, full * tw :])
        digests, first = entry.hashes.leaf, blk * tiling.bands + band0
        for j in range(full + (last > 0)):
            at = j * th * tw
            if self.hash(flat[at : at + th * min(tw, w - j * tw)]).digest() != digests(leaf0 + first + j):
                raise self._mismatch(path, entry, region, tiling, first + j)
        count_checked(th * w, full + (last > 0))
        return True

    def _warm_box(
        self, path: Any, entry: VerifiedFile, src: np.ndarray, length: np.ndarray, buf: np.ndarray, dst: np.ndarray,
        buffers: Sequence[Any],
    ) -> bool:  # fmt: skip
        """A job of whole row blocks, or of one column slice on band edges, of a file in the page cache: copied out
        of its mapping and checked tile by tile, with no per-run bookkeeping of which tiles the runs touch. False
        (nothing read) for any other job."""
        if self.maps is None:
            return False
        box = tile_box(entry.starts, entry.bases, entry.hashes.regions, src, length, buf, dst)
        if box is None:
            return False
        region = entry.hashes.regions[box.region]
        B = region.row_bytes
        if isinstance(box, RowBlocks):
            boxes = [(o // B, -(-(o + n) // B), 0, B) for o, n in zip(box.start, box.length, strict=True)]
        else:
            boxes = [(box.r0, box.r1, box.c0, box.c1)]
        mapped = self.maps.array(path) if self._cached(path, region, boxes) else None
        if mapped is None:
            return False
        self.maps.intact(path, region.end)
        if isinstance(box, RowBlocks):
            self._rows_copied(path, entry, region, box, mapped, buffers)
        else:
            self._band_copied(path, entry, region, box, mapped, buffers)
        return True

    def _rows_copied(
        self, path: Any, entry: VerifiedFile, region: Region, box: RowBlocks, mapped: np.ndarray, buffers: Sequence[Any]
    ) -> None:
        """Copy whole row blocks out of the mapping tile by tile, each hashed in its destination while still in the
        cache."""
        span, base, digests = box.tiling.tile_rows * region.row_bytes, region.offset, entry.hashes.leaf
        outs = {b: buffer_array(buffers[b]) for b in set(box.buf)}
        total = 0
        for o, n, b, d in zip(box.start, box.length, box.buf, box.dst, strict=True):
            out = outs[b]
            populate(buffers[b].data_ptr() + d, n)
            for at in range(0, n, span):
                size, k = min(span, n - at), (o + at) // span
                out[d + at : d + at + size] = mapped[base + o + at : base + o + at + size]
                if self.hash(out[d + at : d + at + size]).digest() != digests(box.leaf0 + k):
                    raise self._mismatch(path, entry, region, box.tiling, k)
            total += n
        count_mapped(path, total)
        count_checked(total, sum(-(-n // span) for n in box.length))

    def _band_copied(
        self, path: Any, entry: VerifiedFile, region: Region, box: BandBox, mapped: np.ndarray, buffers: Sequence[Any]
    ) -> None:
        """Copy a column slice out of the mapping a row block at a time, each block's tiles checked while it is still
        in the cache."""
        import numpy as np

        B, n, w, h = region.row_bytes, box.r1 - box.r0, box.c1 - box.c0, box.tiling.tile_rows
        out = buffer_array(buffers[box.buf])
        populate(buffers[box.buf].data_ptr() + box.dst, (n - 1) * box.pitch + w)
        rows = mapped[region.offset + box.r0 * B : region.offset + box.r1 * B].reshape(n, B)[:, box.c0 : box.c1]
        if box.pitch == w:
            into = out[box.dst : box.dst + n * w].reshape(n, w)
        else:
            into = np.lib.stride_tricks.as_strided(out[box.dst :], (n, w), (box.pitch, 1))
        band0 = box.c0 // box.tiling.tile_bytes
        for a in range(0, n, h):
            np.copyto(into[a : a + h], rows[a : a + h])
            self._block_hashed(path, entry, region, box.tiling, box.leaf0, into[a : a + h], (box.r0 + a) // h, band0)
        count_mapped(path, n * w)

    def _request_pages(self, path: Any, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
        """Ask for the pages of sorted runs ``[starts[i], ends[i])`` of a cold local file, all up front and without
        readahead, and return its mapping to copy them out of as they arrive (None: it cannot be mapped). A column
        slice is a few hundred bytes a row: a ``preadv`` would move every page's other bytes into a sink as well."""
        import numpy as np

        assert self.maps is not None
        mapped = self.maps.array(path)
        if mapped is None:
            return None
        self.maps.intact(path, int(ends[-1]))
        lo, hi = _pages(starts, ends)
        self.inner.no_readahead(path)  # type: ignore[attr-defined]
        self.maps.no_readahead(path, lo[0], hi[-1])
        self.inner.prefetch(path, lo, hi)  # type: ignore[attr-defined]
        moved = int(np.minimum(np.array(hi), len(mapped)).sum()) - sum(lo)
        count_requested(path, moved - int((ends - starts).sum()))  # the copies count the bytes used
        return mapped

    def _sink(self, nbytes: int) -> Any:
        """A byte tensor of at least ``nbytes`` for this thread, for bytes read through and thrown away."""
        import torch

        held = getattr(self._scratch, "sink", None)
        if held is None or held.numel() < nbytes:
            held = self._scratch.sink = torch.empty(max(nbytes, 64 << 10), dtype=torch.uint8)
        return held

    def _canvas(self, nbytes: int) -> Any:
        """A byte tensor of ``nbytes`` for this thread, reused between calls (fresh pages cost a fault each)."""
        import torch

        held = getattr(self._scratch, "buf", None)
        if held is None or held.numel() < nbytes:
            held = self._scratch.buf = torch.empty(max(nbytes, CANVAS_BYTES), dtype=torch.uint8)
        return held[:nbytes]

    def close(self) -> None:
        if self.maps is not None:  # unmapping hundreds of MiB takes tens of ms: done in the background, as loads do
            threading.Thread(target=self.maps.release, name="shardload-unmap").start()  # joined at exit
        self.inner.close()

    def _file(self, path: Any) -> VerifiedFile:
        entry = self.files.get(path)
        if entry is None:
            raise IntegrityError("this file is not in the integrity record", file=str(path))
        return entry

    def _cached(self, path: Any, region: Any, boxes: list[tuple[int, int, int, int]]) -> bool:
        """Whether the boxes' pages look cached: the whole file, else 90% of pages sampled over the boxes."""
        import numpy as np

        assert self.maps is not None
        if self.maps.warm(path):
            return True
        B = region.row_bytes
        starts = np.array([region.offset + a * B + lo for a, _, lo, _ in boxes], dtype=np.int64)
        ends = np.array([region.offset + (b - 1) * B + hi for _, b, _, hi in boxes], dtype=np.int64)
        resident = self.maps.resident(path, starts, ends)
        return resident is not None and resident >= 0.9

    def _fill(
        self,
        path: Any,
        region: Any,
        first_row: int,
        boxes: list[tuple[int, int, int, int]],
        flat: Any,
        canvas: Any,
        at: int,
    ) -> None:
        """Fill the canvas (``flat``: bytes ``at`` on of tensor ``canvas``, laid out as the region's rows from
        ``first_row`` are in the file) with ``boxes`` (rows
        ``[a, b)``, bytes ``[lo, hi)`` of each row): strided copies out of a mapping when the file is in the page
        cache, else the inner reader's runs (one per row and box, adjacent ones merged)."""
        import numpy as np

        B = region.row_bytes
        mapped = self.maps.array(path) if self.maps is not None and self._cached(path, region, boxes) else None
        if mapped is not None:
            self.maps.intact(path, region.end)  # type: ignore[union-attr]
        if mapped is not None:
            grid = flat.reshape(-1, B)
            rows = mapped[region.offset : region.end].reshape(-1, B)
            total = 0
            for a, b, lo, hi in boxes:
                np.copyto(grid[a - first_row : b - first_row, lo:hi], rows[a:b, lo:hi])
                total += (b - a) * (hi - lo)
            count_mapped(path, total)
            return
        rs = [np.arange(a, b, dtype=np.int64) * B + lo for a, b, lo, _ in boxes]
        rl = [np.full(b - a, hi - lo, dtype=np.int64) for a, b, lo, hi in boxes]
        rsrc = np.concatenate(rs)
        order = np.argsort(rsrc, kind="stable")
        rsrc = rsrc[order]
        rend = rsrc + np.concatenate(rl)[order]
        if self.maps is not None:  # a local file not in the page cache: its pages as planned reads, requested first
            # the canvas is laid out as the file is, so each read (cut to the canvas) goes straight into it
            base = region.offset + first_row * B
            planned = self._plan(path, rsrc + region.offset, rend + region.offset, region.end)
            lo = np.array([max(r.offset, base) for r in planned.reads], dtype=np.int64)
            hi = np.array([min(r.end, base + flat.size - at) for r in planned.reads], dtype=np.int64)
            self.inner.no_readahead(path)  # type: ignore[attr-defined]
            self.inner.prefetch(path, lo.tolist(), hi.tolist())  # type: ignore[attr-defined]
            self.inner.read_runs(path, lo, hi - lo, np.zeros(len(lo), dtype=np.int64), lo - base + at, [canvas])
            return
        starts = np.flatnonzero(np.concatenate(([True], rsrc[1:] - rend[:-1] > 0)))
        src = rsrc[starts]
        length = np.concatenate((rend[starts[1:] - 1], rend[-1:])) - src
        zero = np.zeros(len(src), dtype=np.int64)
        self.inner.read_runs(path, src + region.offset, length, zero, src - first_row * B + at, [canvas])

    def read_runs(self, path: Any, src: Any, length: Any, buf: Any, dst: Any, buffers: Sequence[Any], **_: Any) -> None:
        """Copy run i: ``length[i]`` bytes at ``src[i]`` of ``path`` to byte ``dst[i]`` of ``buffers[buf[i]]``,
        after checking every tile they touch."""
        import numpy as np

        from .reader import check_destinations

        n = len(src)
        if n == 0:
            return
        src = np.asarray(src, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        buf = np.asarray(buf, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        check_destinations(length, buf, dst, buffers)
        entry = self._file(path)
        ends = src + length
        if int(src.min()) < 0 or int(ends.max()) > entry.hashes.size:
            raise IntegrityError(
                f"a read of bytes {int(src.min())}-{int(ends.max())} reaches past the {entry.hashes.size} bytes "
                "the integrity record gives this file",
                file=str(path),
            )
        if self._warm_box(path, entry, src, length, buf, dst, buffers):
            return
        ridx = np.searchsorted(entry.starts, src, side="right") - 1
        if bool((ends > entry.ends[ridx]).any()):  # a run across regions: cut it at each region end
            src, length, buf, dst = _cut(src, length, buf, dst, entry)
            ridx = np.searchsorted(entry.starts, src, side="right") - 1
        if len(ridx) > 8:  # many runs: the ones in regions of a single leaf (small tensors) are checked as a batch
            single = entry.single_leaf()[ridx]
            if bool(single.any()):
                self._single_leaves(path, entry, ridx[single], src[single], length[single], buf[single], dst[single],
                                    buffers)  # fmt: skip
                keep = ~single
                src, length, buf, dst, ridx = src[keep], length[keep], buf[keep], dst[keep], ridx[keep]
                if not len(src):
                    return
        order = np.argsort(ridx, kind="stable")
        ridx = ridx[order]
        cuts = np.flatnonzero(np.diff(ridx)) + 1
        for first, part in zip(np.concatenate(([0], cuts)).tolist(), np.split(order, cuts), strict=True):
            bufs, own = buf[part], buffers
            if len(buffers) > 8:  # a batch of many small tensors: hand each region only the buffers it fills
                used, inverse = np.unique(bufs, return_inverse=True)
                bufs, own = inverse.astype(np.int64), [buffers[i] for i in used.tolist()]
            self._region(path, entry, int(ridx[first]), src[part], length[part], bufs, dst[part], own)

    def _single_leaves(
        self,
        path: Any,
        entry: VerifiedFile,
        ridx: np.ndarray,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        buffers: Sequence[Any],
    ) -> None:
        """Runs each inside a region of one leaf (a tensor of at most a tile): every such region read whole with one
        ``read_runs`` into a scratch buffer, each hashed against its leaf, then the runs copied out of it."""
        import numpy as np
        import torch

        regions, at = np.unique(ridx, return_inverse=True)
        starts = entry.starts[regions]
        sizes = entry.ends[regions] - starts
        pos = np.cumsum(sizes) - sizes
        scratch = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        zero = np.zeros(len(regions), dtype=np.int64)
        self.inner.read_runs(path, starts, sizes, zero, pos, [scratch])
        flat = scratch.numpy()
        for k, r in enumerate(regions.tolist()):
            if not self._check(flat[int(pos[k]) : int(pos[k] + sizes[k])], entry, entry.bases[r]):
                region = entry.hashes.regions[r]
                raise self._mismatch(path, entry, region, region.tiling(0), 0)
        copy_runs(flat, pos[at] + (src - starts[at]), [buffer_array(t) for t in buffers], buf, dst, length)

    def _region(
        self,
        path: Any,
        entry: VerifiedFile,
        index: int,
        src: np.ndarray,
        length: np.ndarray,
        buf: np.ndarray,
        dst: np.ndarray,
        buffers: Sequence[Any],
    ) -> None:
        import numpy as np

        region = entry.hashes.regions[index]
        B = region.row_bytes
        o = src - region.offset
        e = o + length - 1
        base = entry.bases[index]
        first = region.tiling(0)
        span = first.tile_rows * B
        ends = o + length
        if first.bands == 1 and bool(((o % span == 0) & ((ends % span == 0) | (ends == region.length))).all()):
            # whole row blocks of the first tiling: read exactly, so no other tiling needs fewer bytes (nor is asked)
            self._linear(path, entry, region, first, base, src, length, buf, dst, buffers)
            return
        # the tiling that needs the fewest bytes read for these runs (row blocks for a dim-0 split, bands for columns)
        best = None
        for k in range(len(region.tilings)):
            tiling = region.tiling(k)
            need = _needed(tiling, o, e)
            nbytes = int((need * np.outer(_sizes(tiling.rows, tiling.tile_rows), _sizes(B, tiling.tile_bytes))).sum())
            if best is None or nbytes < best[0]:
                best = (nbytes, tiling, need, base)
            base += tiling.leaves
        assert best is not None
        _, tiling, need, leaf0 = best
        h, w = tiling.tile_rows, tiling.tile_bytes
        blocks = np.flatnonzero(need.any(axis=1))
        first_row = int(blocks[0]) * h
        last_row = min(region.rows, (int(blocks[-1]) + 1) * h)
        base = region.offset + first_row * B
        span = h * B
        ends = o + length
        if tiling.bands == 1 or region.rows == 1:  # tiles one after another in the file
            self._linear(path, entry, region, tiling, leaf0, src, length, buf, dst, buffers)
            return
        if tiling.bands > 1 and self._direct_bands(path, entry, region, tiling, leaf0, need, best[0],
                                                   src, length, buf, dst, buffers):  # fmt: skip
            return
        canvas, at = self._canvas((last_row - first_row) * B), 0
        flat = canvas.numpy()
        # per row block, each stretch of needed bands: a box of rows x bytes to fill the canvas with
        boxes = []
        for blk in blocks.tolist():
            edges = np.flatnonzero(np.diff(np.concatenate(([False], need[blk], [False])).astype(np.int8)))
            for c, d in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                boxes.append((blk * h, min(region.rows, (blk + 1) * h), c * w, min(d * w, B)))
        self._fill(path, region, first_row, boxes, flat, canvas, at)
        grid = flat.reshape(last_row - first_row, B)
        for blk, band in zip(*np.nonzero(need), strict=True):
            t0, th, c0, tw = tiling.tile(int(blk) * tiling.bands + int(band))
            tile = grid[t0 - first_row : t0 - first_row + th, c0 : c0 + tw]
            data = tile.reshape(-1) if tw == B else np.ascontiguousarray(tile).reshape(-1)
            leaf = leaf0 + int(blk) * tiling.bands + int(band)
            if not self._check(data, entry, leaf):
                raise self._mismatch(path, entry, region, tiling, int(blk) * tiling.bands + int(band))
        copy_runs(flat, src - base, [buffer_array(t) for t in buffers], buf, dst, length)


def _block_view(
    blk: np.ndarray, band: np.ndarray, th: np.ndarray, tw: np.ndarray, pos: np.ndarray, owner: np.ndarray,
    outs: Sequence[np.ndarray], ka: int, kb: int, at: int,
) -> np.ndarray | None:  # fmt: skip
    """Tiles ``[ka, kb)`` of one row block (bands one after another, of one width, their rows first at ``pos[at:]`` in
    ``outs[owner[at:]]``) as one block of rows side by side in one destination, each row an equal step after the
    one before (a column slice of several bands); None where they do not lie so."""
    import numpy as np

    m, n, width = kb - ka, int(th[ka]), int(tw[ka])
    if m < 2 or not bool((tw[ka:kb] == width).all()) or not bool((np.diff(band[ka:kb]) == 1).all()):
        return None
    p, b = pos[at : at + m * n].reshape(m, n), owner[at : at + m * n]
    step = int(p[0, 1] - p[0, 0]) if n > 1 else m * width
    p0 = int(p[0, 0])
    if not (bool((b == b[0]).all()) and np.array_equal(p, p0 + np.arange(m)[:, None] * width
                                                       + np.arange(n)[None, :] * step)):  # fmt: skip
        return None
    return np.lib.stride_tricks.as_strided(outs[int(b[0])][p0:], (n, m * width), (step, 1), writeable=False)


def copy_runs(
    source: np.ndarray, at: np.ndarray, outs: Sequence[np.ndarray], buf: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> None:
    """Copy run i: ``length[i]`` bytes at ``at[i]`` of the byte array ``source`` to ``dst[i]`` of ``outs[buf[i]]``,
    each stretch of equally long, equally spaced runs as one strided copy."""
    import numpy as np

    for a, b in _progressions(at, length, buf, dst):
        size = int(length[a])
        count = b - a
        out = outs[int(buf[a])]
        if count == 1:
            out[int(dst[a]) : int(dst[a]) + size] = source[int(at[a]) : int(at[a]) + size]
            continue
        ss = int(at[a + 1] - at[a])
        sd = int(dst[a + 1] - dst[a])
        s_view = np.lib.stride_tricks.as_strided(source[int(at[a]) :], (count, size), (ss, 1), writeable=False)
        d_view = np.lib.stride_tricks.as_strided(out[int(dst[a]) :], (count, size), (sd, 1))
        np.copyto(d_view, s_view)


def _populate(buffers: Sequence[Any], buf: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    """Fault in the fresh destination pages runs are copied to, one call per buffer rather than a fault per page."""
    import numpy as np

    populate_runs(np.array([t.data_ptr() for t in buffers], dtype=np.uint64), buf, dst, length)


def _needed(tiling: Tiling, o: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Which tiles of ``tiling`` (row blocks x bands, booleans) hold a byte of the runs ``[o, e]`` (inclusive,
    offsets within the region, sorted); a run over several rows takes every band of the row blocks it spans."""
    import numpy as np

    B, h, w = tiling.row_bytes, tiling.tile_rows, tiling.tile_bytes
    r0, r1 = o // B, e // B
    b0 = np.where(r0 == r1, (o % B) // w, 0)
    b1 = np.where(r0 == r1, (e % B) // w, tiling.bands - 1)
    boxes = np.stack([r0 // h, r1 // h, b0, b1], axis=1)
    if len(boxes) > 1:  # runs come sorted: drop each box equal to the one before it
        boxes = boxes[np.concatenate(([True], (boxes[1:] != boxes[:-1]).any(axis=1)))]
    need = np.zeros((tiling.row_blocks, tiling.bands), dtype=bool)
    for a, b, c, d in boxes.tolist():
        need[a : b + 1, c : d + 1] = True
    return need


def _pages(starts: np.ndarray, ends: np.ndarray) -> tuple[list[int], list[int]]:
    """The whole-page byte ranges that sorted runs ``[starts[i], ends[i])`` touch, touching pages merged."""
    import numpy as np

    first = starts // PAGE
    last = (ends - 1) // PAGE + 1
    top = np.maximum.accumulate(last)
    new = np.concatenate(([True], first[1:] > top[:-1]))
    heads = np.flatnonzero(new)
    tails = np.concatenate((heads[1:] - 1, [len(first) - 1]))
    return (first[heads] * PAGE).tolist(), (top[tails] * PAGE).tolist()


def _sizes(total: int, step: int) -> np.ndarray:
    """The lengths of ``total`` cut into pieces of ``step`` (the last one shorter)."""
    import numpy as np

    out = np.full(-(-total // step), step, dtype=np.int64)
    out[-1] = total - step * (len(out) - 1)
    return out


def buffer_array(t: Any) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat writable numpy array (its storage, not a copy)."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def _cut(src: np.ndarray, length: np.ndarray, buf: np.ndarray, dst: np.ndarray, entry: VerifiedFile) -> tuple:
    """Runs cut at every region boundary they cross (rare: reads of header and data in one run)."""
    import numpy as np

    out: list[tuple[int, int, int, int]] = []
    bounds = [r.end for r in entry.hashes.regions]
    for s, n, b, d in zip(src.tolist(), length.tolist(), buf.tolist(), dst.tolist(), strict=True):
        while n > 0:
            i = int(np.searchsorted(entry.starts, s, side="right") - 1)
            take = min(n, bounds[i] - s)
            out.append((s, take, b, d))
            s, n, d = s + take, n - take, d + take
    arr = np.array(out, dtype=np.int64)
    return arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]


class ReceivedBytes(RunReader):
    """Bytes of one stored tensor as a rank received them from its group (``share_reads``): runs inside the rank's
    own runs are copied out of its tensor, the rest of a tile is read by ``storage``. Wrapped in a
    :class:`VerifiedReader`, it checks the received bytes against the record."""

    def __init__(self, own_src: np.ndarray, own_len: np.ndarray, own_dst: np.ndarray, tensor: np.ndarray,
                 storage: RunReader) -> None:  # fmt: skip
        self.src, self.len, self.dst = own_src, own_len, own_dst
        self.tensor = tensor
        self.storage = storage

    def read_runs(self, path: Any, src: Any, length: Any, buf: Any, dst: Any, buffers: Sequence[Any], **_: Any) -> None:
        """Copy run i from the rank's tensor where its own runs hold it, from storage elsewhere."""
        import numpy as np

        ends = src + length
        points = np.unique(np.concatenate((self.src, self.src + self.len)))
        lo = np.searchsorted(points, src, side="right")
        hi = np.searchsorted(points, ends, side="left")
        cuts = hi - lo  # inner boundaries of the rank's runs each requested run crosses
        counts = cuts + 1
        first = np.repeat(np.cumsum(counts) - counts, counts)
        k = np.arange(int(counts.sum())) - first  # piece k of its run
        owner = np.repeat(np.arange(len(src)), counts)
        inner = points[np.minimum(np.repeat(lo, counts) + k - 1, len(points) - 1)]
        starts = np.where(k == 0, src[owner], inner)
        nxt = points[np.minimum(np.repeat(lo, counts) + k, len(points) - 1)]
        stops = np.where(k == cuts[owner], ends[owner], nxt)
        keep = stops > starts
        starts, stops, owner = starts[keep], stops[keep], owner[keep]
        at = dst[owner] + (starts - src[owner])
        j = np.searchsorted(self.src, starts, side="right") - 1
        jj = np.maximum(j, 0)
        covered = (j >= 0) & (stops <= self.src[jj] + self.len[jj])
        outs = [buffer_array(t) for t in buffers]
        if bool(covered.any()):
            c = np.flatnonzero(covered)
            copy_runs(self.tensor, self.dst[jj[c]] + (starts[c] - self.src[jj[c]]), outs, buf[owner[c]], at[c],
                      stops[c] - starts[c])  # fmt: skip
        if not bool(covered.all()):
            u = np.flatnonzero(~covered)
            self.storage.read_runs(path, starts[u], stops[u] - starts[u], buf[owner[u]], at[u], buffers)
