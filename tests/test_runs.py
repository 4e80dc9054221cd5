"""Byte runs against numpy slicing: a box copied run by run equals the sliced array, and chunking,
splitting and de-duplicating runs leave the bytes they copy unchanged. Hypothesis draws the boxes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardload.planning.runs import Runs, box_runs, chunks, coalesce, dedupe, jobs, split


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple, tuple[int, ...], tuple]:
    """A source shape and box, and a destination shape and box holding the same elements."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        box.append((a, draw(st.integers(a + 1, n))))
    dst_shape, dst_box = [], []
    for a, b in box:
        for _ in range(draw(st.integers(0, 1))):  # unit dims may come and go
            n = draw(st.integers(1, 3))
            i = draw(st.integers(0, n - 1))
            dst_shape.append(n)
            dst_box.append((i, i + 1))
        if b - a == 1 and draw(st.booleans()):
            continue
        pad = draw(st.integers(0, 2))
        start = draw(st.integers(0, pad))
        dst_shape.append(b - a + pad)
        dst_box.append((start, start + b - a))
    return shape, tuple(box), tuple(dst_shape), tuple(dst_box)


@settings(max_examples=300, deadline=None)
@given(_boxes())
def test_box_runs_copy_the_box(boxes: tuple) -> None:
    shape, box, dst_shape, dst_box = boxes
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    want = np.zeros(dst_shape, dtype=np.int64)
    want[tuple(slice(a, b) for a, b in dst_box)] = x[tuple(slice(a, b) for a, b in box)].reshape(
        [b - a for a, b in dst_box]
    )
    src, dst, run = box_runs(shape, box, dst_shape, dst_box)
    got = np.zeros(int(np.prod(dst_shape)), dtype=np.int64)
    flat = x.reshape(-1)
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        got[d : d + run] = flat[s : s + run]
    np.testing.assert_array_equal(got.reshape(dst_shape), want)
    assert len(src) * run == int(np.prod([b - a for a, b in box]))


@st.composite
def _runs(draw: st.DrawFn) -> tuple[Runs, int]:
    """Runs from a random file into 1-3 buffers of ``size`` bytes, every buffer byte written once."""
    nbuf, size = draw(st.integers(1, 3)), draw(st.integers(1, 60))
    src, length, buf, dst = [], [], [], []
    for b in range(nbuf):
        at = 0
        while at < size:
            n = draw(st.integers(1, size - at))
            src.append(draw(st.integers(0, 100)))
            length.append(n)
            buf.append(b)
            dst.append(at)
            at += n
    runs = Runs(*(np.array(v, dtype=np.int64) for v in (src, length, buf, dst)))
    return runs.take(np.lexsort((-runs.length, runs.src))), size


def _apply(runs: Runs, file: np.ndarray, bufs: np.ndarray, base: int = 0) -> None:
    for s, n, b, d in zip(runs.src.tolist(), runs.length.tolist(), runs.buf.tolist(), runs.dst.tolist(), strict=True):
        bufs[b, base + d : base + d + n] = file[s : s + n]


@settings(max_examples=200, deadline=None)
@given(_runs(), st.integers(1, 20))
def test_run_transforms_keep_the_bytes(drawn: tuple[Runs, int], cut: int) -> None:
    runs, size = drawn
    file = np.random.default_rng(cut).integers(1, 255, 200, dtype=np.uint8)
    nbuf = int(runs.buf.max()) + 1
    want = np.zeros((nbuf, size), dtype=np.uint8)
    _apply(runs, file, want)

    got = np.zeros_like(want)
    _apply(coalesce(split(runs, cut)), file, got)
    np.testing.assert_array_equal(got, want)

    got = np.zeros_like(want)
    pieces = split(runs, cut)
    for part in jobs(pieces, cut):
        _apply(pieces.take(part), file, got)
    np.testing.assert_array_equal(got, want)

    got = np.zeros_like(want)
    seen = []
    for k, part in chunks(runs, cut):
        assert int((part.dst + part.length).max()) <= cut and bool(np.all(np.diff(part.src) >= 0))
        _apply(part, file, got, base=k * cut)
        seen.append(k)
    assert seen == sorted(set(seen))
    np.testing.assert_array_equal(got, want)

    reads, copies = dedupe(runs)
    got = np.zeros_like(want)
    _apply(reads, file, got)
    rows = zip(
        *(v.tolist() for v in (copies.from_buf, copies.from_dst, copies.buf, copies.dst, copies.length)), strict=True
    )
    for a, a_off, b, b_off, n in rows:
        got[b, b_off : b_off + n] = got[a, a_off : a_off + n]
    np.testing.assert_array_equal(got, want)
    assert reads.nbytes <= runs.nbytes
