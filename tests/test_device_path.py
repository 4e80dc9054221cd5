"""The device data path (``engine/paths/device.py``): spans of the file read into staging buffers, uploaded whole,
cut on the device by strided copies. Run here with a CPU "device" (``staged=True``), the way a GPU load goes; the
loads are compared element for element with plain numpy slicing of the stored tensors. (Every source x N x
threads is in tests/test_equivalence.py, paths ``device`` and ``device_load``; the CUDA runs in test_cuda.py.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import shardload
import shardload.engine.copy_jobs as copy_jobs
import shardload.engine.paths.device as device_path
import shardload.engine.paths.host as host_path
import shardload.engine.run as run
import shardload.engine.transfer as transfer
from helpers.checkpoints import parallel_model, random_array, write_model
from helpers.reading import stand_in, stand_in_apart
from shardload.engine import staging
from shardload.engine.paths import DevicePath, data_path_for
from shardload.engine.paths.device import PACK_GAP, PACK_JOIN, count_device, span_plan, strided_cuts
from shardload.engine.run import run_plan
from shardload.errors import CheckpointError
from shardload.planning.runs import Runs
from shardload.sources.read_plan import IoModel
from shardload.sources.reader import PAGE

SHARD_DIM = "shard_funcs.shard_dim"


def _expand(buf: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> set[tuple[int, int, int]]:
    """Every byte a set of runs moves, as (tensor, source byte, destination byte)."""
    return {(int(b), int(s) + i, int(d) + i) for b, s, d, n in zip(buf, src, dst, length, strict=True)
            for i in range(int(n))}  # fmt: skip


def _cut_bytes(cuts: object, base: int = 0) -> list[tuple[int, int, int]]:
    out = []
    for t, s, d, n, c, ss, ds in zip(*(getattr(cuts, f).tolist() for f in
                                       ("tensor", "src", "dst", "length", "count", "src_step", "dst_step")),
                                     strict=True):  # fmt: skip
        out += [(t, base + s + k * ss + i, d + k * ds + i) for k in range(c) for i in range(n)]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_strided_cuts_move_exactly_the_runs_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    parts = []
    for t in range(int(rng.integers(1, 4))):  # regular stretches (column slices) and irregular runs, mixed
        src = int(rng.integers(0, 50))
        for _ in range(int(rng.integers(1, 5))):
            rows, n = int(rng.integers(1, 9)), int(rng.integers(1, 6))
            ss, ds = n + int(rng.integers(0, 7)), n + int(rng.integers(0, 3))
            dst = int(rng.integers(0, 40))
            if rng.random() < 0.3:  # a regular source step, an irregular destination one: must not fold
                at = dst + np.concatenate(([0], np.cumsum(n + rng.integers(0, 2, size=rows - 1))))
                parts += [(t, src + k * ss, int(at[k]), n) for k in range(rows)]
            else:
                parts += [(t, src + k * ss, dst + k * ds, n) for k in range(rows)]
            src += rows * ss + int(rng.integers(0, 5))
    buf, src, dst, length = (np.array(x, dtype=np.int64) for x in zip(*sorted(parts), strict=True))
    cuts = strided_cuts(buf, src, dst, length)
    moved = _cut_bytes(cuts)
    assert len(moved) == len(set(moved)) == int(length.sum())
    assert set(moved) == _expand(buf, src, dst, length)
    assert len(cuts) <= len(src)


def test_a_column_slice_folds_into_one_cut() -> None:
    rows, width, stride = 1000, 256, 2048
    src = np.arange(rows, dtype=np.int64) * stride + 512
    cuts = strided_cuts(np.zeros(rows, dtype=np.int64), src, np.arange(rows, dtype=np.int64) * width,
                        np.full(rows, width, dtype=np.int64))  # fmt: skip
    assert (len(cuts), int(cuts.count[0]), int(cuts.src_step[0]), int(cuts.dst_step[0])) == (1, rows, stride, width)


def test_runs_of_alternating_lengths_fold_into_one_cut_per_length() -> None:
    """A fused dim along the columns (segments of 2 and 4 bytes in 6-byte rows, N = 2) gives each row a 1-byte and
    a 2-byte run: each length's runs fold into one strided copy (old code: only consecutive runs of one length
    folded: 262,144 such rows made 524,288 device copies, seconds and hundreds of MB for a 1.6 MB tensor)."""
    rows = 1 << 14
    r = np.arange(rows, dtype=np.int64)
    src = np.stack([r * 6 + 1, r * 6 + 4], axis=1).reshape(-1)
    dst = np.stack([r * 3, r * 3 + 1], axis=1).reshape(-1)
    length = np.tile(np.array([1, 2], dtype=np.int64), rows)
    cuts = strided_cuts(np.zeros(2 * rows, dtype=np.int64), src, dst, length)
    assert len(cuts) == 2 and sorted(cuts.count.tolist()) == [rows, rows]
    moved = _cut_bytes(cuts)
    assert len(moved) == 3 * rows and set(moved) == _expand(np.zeros(2 * rows, dtype=np.int64), src, dst, length)


@pytest.mark.parametrize("skew", (0, 100, 101, PAGE - 8, PAGE - 7))
@pytest.mark.parametrize("gap_s", (0.0, 1.0))
def test_span_plan_reads_every_run_once_within_the_tensor(skew: int, gap_s: float) -> None:
    rng = np.random.default_rng(skew)
    limit = 300_000
    starts = np.sort(rng.choice(limit - 2000, 40, replace=False)).astype(np.int64)
    length = rng.integers(1, 1500, size=40).astype(np.int64)
    length = np.minimum(length, np.append(np.diff(starts), limit - starts[-1]))  # disjoint
    buf = rng.integers(0, 2, size=40).astype(np.int64)
    dst = np.cumsum(length) - length
    runs = Runs(starts, length, buf, dst)
    devices = [1, 0] if skew % 2 else None  # tensor 0 on the second device, tensor 1 on the first; or one device
    plan = span_plan(runs, limit, IoModel(gap_s, 1e9), max_read=4 * PAGE, max_waste=float("inf"), skew=skew,
                     devices=devices)  # fmt: skip
    moved = []
    for k, span in enumerate(plan.spans):
        assert 0 <= span.offset and span.offset + span.length <= limit and 0 < span.length
        staged = span.read.dst[span.read.buf == 0] + span.read.length[span.read.buf == 0]
        assert span.length <= 4 * PAGE or (span.sink and span.length <= PACK_JOIN * 4 * PAGE)  # joined, packed
        assert int(staged.max()) <= 4 * PAGE  # what it stages is not
        assert k == 0 or (span.offset + skew) % PAGE == 0  # page-aligned in the file, but never before the tensor
        assert k == 0 or span.offset >= plan.spans[k - 1].offset + plan.spans[k - 1].length
        assert len({p.device for p in span.parts}) == len(span.parts)  # one part per device, each span read once
        moved += _span_bytes(span)
    assert sorted(moved) == sorted(_expand(buf, starts, dst, length))
    assert plan.used == int(length.sum()) and plan.moved == sum(int(s.read.length.sum()) for s in plan.spans)
    packed = [bool(len(u.src) > 1 and int((u.src[1:] - (u.src + u.length)[:-1]).sum()) >= PACK_GAP * len(u.src))
              for u in (span.used for span in plan.spans)]  # fmt: skip
    assert [bool(span.sink) for span in plan.spans] == packed and any(packed)  # runs far apart: spans packed
    assert all(span.parts for span in plan.spans)  # a stretch of gap alone is not read
    if gap_s:  # every gap is worth reading through: one stretch cut at max_read, less the pieces of gap alone
        assert any(span.length > 4 * PAGE for span in plan.spans)  # packed reads joined up to a buffer of pieces
        assert all((b.offset - a.offset - a.length) % (4 * PAGE) == 0
                   for a, b in zip(plan.spans, plan.spans[1:], strict=False))  # fmt: skip


@pytest.mark.parametrize("rank", (0, 3, 7))
def test_a_ranks_column_slice_packs_into_straight_stretches(rank: int) -> None:
    """Rank r of 8's column slice of 1 KiB rows: pages packed and joined until their pieces fill one buffer, each
    span one contiguous stretch of the tensor, uploaded straight (no scratch, no device cut)."""
    rows, row, piece = 256, 1024, 128
    src = np.arange(rows, dtype=np.int64) * row + rank * piece
    runs = Runs(src, np.full(rows, piece, dtype=np.int64), np.zeros(rows, dtype=np.int64),
                np.arange(rows, dtype=np.int64) * piece)  # fmt: skip
    plan = span_plan(runs, rows * row, None, max_read=PAGE, max_waste=float("inf"), skew=0)
    assert len(plan.spans) == rows * piece // PAGE  # each span stages one buffer of pieces, from 8 pages of file
    moved = []
    for span in plan.spans:
        assert span.sink and span.length <= 8 * PAGE  # packed; the first span starts at the rank's first piece
        (part,) = span.parts
        assert part.straight and len(part.cuts) == 1 and int(part.cuts.length[0]) == PAGE
        moved += _span_bytes(span)
    assert sorted(moved) == sorted(_expand(runs.buf, runs.src, runs.dst, runs.length))


@pytest.mark.parametrize("n", (2, 8))
def test_a_load_onto_several_devices_uploads_each_devices_bytes_once(n: int) -> None:
    """Every rank of N on a device of its own (``load()`` onto N GPUs): the ranks take a column slice's rows in turn,
    so one read stages each device's pieces together and each device uploads its own bytes alone, straight into
    its tensor (before: each device uploaded the whole stretch its pieces lie in, N times the bytes in all)."""
    rows, piece = 64, 1024
    row = piece * n
    src = np.concatenate([np.arange(rows, dtype=np.int64) * row + r * piece for r in range(n)])
    runs = Runs(src, np.full(rows * n, piece, dtype=np.int64), np.repeat(np.arange(n, dtype=np.int64), rows),
                np.tile(np.arange(rows, dtype=np.int64) * piece, n))  # fmt: skip
    plan = span_plan(runs, rows * row, None, max_read=4 * PAGE, max_waste=float("inf"), skew=0,
                     devices=list(range(n)))  # fmt: skip
    moved = []
    for span in plan.spans:
        assert span.packed and not span.sink  # every byte some device's: nothing read through
        assert {p.device for p in span.parts} == set(range(n))
        for part in span.parts:
            assert part.straight and len(part.cuts) == 1  # a stretch of its tensor, straight from the buffer
        assert sum(int(p.cuts.length.sum()) for p in span.parts) == span.length  # uploads carry the span once
        moved += _span_bytes(span)
    assert sorted(moved) == sorted(_expand(runs.buf, runs.src, runs.dst, runs.length))


@pytest.mark.parametrize("seed", range(40))
def test_span_plan_onto_several_devices_delivers_every_byte(seed: int) -> None:
    """Random layouts of ranks over several devices (column and row slices, ranks sharing bytes, odd piece sizes
    and offsets): through the staging buffer as its one read fills it, every rank's bytes reach it; what a span
    stages fits a buffer; devices that share no byte of a packed span upload their own bytes (and alignment
    remainders) alone."""
    rng = np.random.default_rng(seed)
    ranks, limit = int(rng.integers(2, 9)), 200_000
    row = int(rng.integers(1, 4000))
    rows = limit // row
    width = int(rng.integers(1, max(2, row // ranks)))
    src, length, buf = [], [], []
    for r in range(ranks):
        at = int(rng.integers(0, row - width + 1))
        if rng.random() < 0.6:
            at = min(r * (row // ranks), row - width)  # a column slice: rank r's columns
        if rng.random() < 0.2:  # rows of the whole tensor (a row slice, or replicated bytes other ranks share)
            first = int(rng.integers(0, rows))
            src.append(np.arange(first, min(rows, first + rows // ranks + 1), dtype=np.int64) * row)
            length.append(np.full(len(src[-1]), row, dtype=np.int64))
        else:
            src.append(np.arange(rows, dtype=np.int64) * row + at)
            length.append(np.full(rows, width, dtype=np.int64))
        buf.append(np.full(len(src[-1]), r, dtype=np.int64))
    s, n, b = np.concatenate(src), np.concatenate(length), np.concatenate(buf)
    d = np.concatenate([np.cumsum(x) - x for x in length])
    runs = Runs(s, n, b, d)
    devices = [int(x) for x in rng.integers(0, ranks, size=ranks)] if rng.random() < 0.3 else list(range(ranks))
    max_read = int(rng.choice([PAGE, 4 * PAGE]))
    plan = span_plan(runs, rows * row, IoModel(float(rng.choice([0.0, 1.0])), 1e9), max_read=max_read,
                     max_waste=float("inf"), skew=int(rng.integers(0, PAGE)), devices=devices)  # fmt: skip
    moved = []
    for span in plan.spans:
        staged = span.read.dst[span.read.buf == 0] + span.read.length[span.read.buf == 0]
        assert int(staged.max()) <= max_read
        moved += _span_bytes(span)
    assert sorted(moved) == sorted(_expand(b, s, d, n))


def _staged(span: object, runs: Runs, size: int) -> np.ndarray:
    """The file byte (relative to the tensor) each staging-buffer byte holds after ``runs`` of a span are read
    (-1: none)."""
    staged = np.full(size, -1, dtype=np.int64)
    for s, n, b, d in zip(runs.src.tolist(), runs.length.tolist(), runs.buf.tolist(), runs.dst.tolist(), strict=True):
        if b == 0:  # buffer 1 is the sink: bytes read through and thrown away
            staged[d : d + n] = span.offset + s + np.arange(n)  # type: ignore[attr-defined]
    return staged


def _span_bytes(span: object) -> list[tuple[int, int, int]]:
    """Every byte one span's parts deliver, as (tensor, file byte, destination byte), through the staging buffer as
    its one read fills it (and as a checking reader's reads of the used bytes alone fill it: the same bytes)."""
    read, used = span.read, span.used  # type: ignore[attr-defined]
    ends = read.src + read.length
    assert int(read.src[0]) >= 0 and bool((read.src[1:] == ends[:-1]).all())  # one stretch of the file: one preadv
    assert int(ends[-1]) <= span.length  # type: ignore[attr-defined]
    assert bool((read.buf == 1).any()) == bool(span.sink)  # type: ignore[attr-defined]
    if span.sink:  # type: ignore[attr-defined]
        assert int(read.length[read.buf == 1].max()) <= span.sink  # type: ignore[attr-defined]
    size = int(max((read.dst + read.length).max(), (used.dst + used.length).max()))
    assert len({int(d - s) % 16 for s, d in zip(used.src, used.dst, strict=True)}) == 1  # pieces keep alignment
    staged, checked = _staged(span, read, size), _staged(span, used, size)
    out = []
    for part in span.parts:  # type: ignore[attr-defined]
        got = _cut_bytes(part.cuts)  # offsets in the staging buffer (straight) or in the scratch buffer
        if not part.straight:
            assert 0 <= part.lo < part.hi <= size and 0 <= part.at < 16
            assert int(staged[part.lo]) % 16 == part.at  # the part's alignment in the stored tensor is kept
            got = [(t, s - part.at + part.lo, d) for t, s, d in got]
            assert all(part.lo <= s < part.hi for _, s, _ in got)
        assert all(staged[s] >= 0 and staged[s] == checked[s] for _, s, _ in got)
        out += [(t, int(staged[s]), d) for t, s, d in got]
    return out


def _column_model(tmp_path: Path, rows: int = 512, cols: int = 1024) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    tensors = {"col": random_array(rng, (rows, cols), "float16"), "row": random_array(rng, (rows, cols), "float16"),
               "norm": random_array(rng, (cols,), "float32")}  # fmt: skip
    info = {"version": 1, "params": {"col": [[SHARD_DIM, [None, None], 1, "num_shards"]],
                                     "row": [[SHARD_DIM, [None, None], 0, "num_shards"]]}}  # fmt: skip
    return write_model(tmp_path / "m", tensors, info), tensors


def _want(tensors: dict[str, np.ndarray], n: int, r: int) -> dict[str, np.ndarray]:
    col, row = tensors["col"], tensors["row"]
    c, h = col.shape[1] // n, row.shape[0] // n
    return {"col": col[:, r * c : (r + 1) * c], "row": row[r * h : (r + 1) * h], "norm": tensors["norm"]}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].is_contiguous(), k
        np.testing.assert_array_equal(got[k].numpy(), v, err_msg=k)


@pytest.mark.parametrize("spans_only", (False, True))
@pytest.mark.parametrize("threads", (0, 1, 4))
@pytest.mark.parametrize("n", (1, 2, 8))
def test_stand_in_loads_equal_numpy_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, threads: int, spans_only: bool
) -> None:
    """Every rank alone and all together equal numpy's slices; ``spans_only``: a single rank's column slice
    through spans too (by default it is copied out of the mapping at N = 8, where spans would read 8x its bytes)."""
    if spans_only:
        monkeypatch.setattr(device_path, "SPAN_OVER_READ", math.inf)
    model, tensors = _column_model(tmp_path)
    plan = shardload.plan_model(model, n)
    options = shardload.ReadOptions(threads=threads)
    for r in range(n):
        _assert_equal(run_plan(plan, [r], ["cpu"], staged=True, read_options=options)[0], _want(tensors, n, r))
    every = run_plan(plan, range(n), ["cpu"] * n, staged=True, read_options=options)
    for r in range(n):
        _assert_equal(every[r], _want(tensors, n, r))


def test_a_single_rank_copies_a_column_slice_out_of_the_mapping_rather_than_read_8x_its_bytes(
    tmp_path: Path,
) -> None:
    """Rank 3 of 8 alone: its column slice (256 of every 2,048 bytes) would take spans that read the whole tensor,
    so it is copied out of the mapping into the staging buffers; the row slice and the norm still take spans. The
    H200 host measured the mapping's way faster from the page cache (docs/benchmarks.md, session 27)."""
    model, tensors = _column_model(tmp_path)
    plan = shardload.plan_model(model, 8)
    with count_device() as moved:
        got = run_plan(plan, [3], ["cpu"], staged=True)[0]
    _assert_equal(got, _want(tensors, 8, 3))
    assert moved.spans == 2  # row's and norm's
    assert moved.read_bytes == moved.delivered == 64 * 1024 * 2 + 1024 * 4  # col's bytes took no span


def test_uploads_and_cuts_grow_with_spans_not_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A column slice of 512 rows reaches the device as a few spans, each one upload and one cut (a per-row
    gather would be 512 copies); the host copies each byte once, into the staging buffer. (A single rank's takes
    spans only where they would read at most ``SPAN_OVER_READ`` times its bytes: here, always.)"""
    monkeypatch.setattr(device_path, "SPAN_OVER_READ", math.inf)
    model, _ = _column_model(tmp_path)
    plan = shardload.plan_model(model, 8)
    with count_device() as moved:
        run_plan(plan, [3], ["cpu"], staged=True)
    spans_col = -(-512 * 1024 * 2 // (transfer.STAGE_BYTES // PAGE * PAGE))
    assert moved.uploads == moved.spans <= spans_col + 2 + 2  # col's spans, row's and norm's
    assert moved.cuts <= spans_col
    assert moved.delivered == 512 * 128 * 2 + 64 * 1024 * 2 + 1024 * 4
    assert moved.read_bytes <= 512 * 1024 * 2 + 64 * 1024 * 2 + 1024 * 4 + 2 * PAGE  # col's page floor is all of it
    # the other ranks' bytes of col's rows go to the sink: the staging buffers and uploads carry the rank's alone
    assert moved.staged_bytes == moved.upload_bytes == moved.delivered


def test_a_load_onto_several_devices_moves_each_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load()`` of every rank of 8, each on a device of its own: equal to numpy's slices, and the uploads carry
    each byte once (each device its own), every part straight into its tensor."""
    model, tensors = _column_model(tmp_path)
    monkeypatch.setattr(run, "data_path_for", stand_in_apart)
    with count_device() as moved:
        every = shardload.load(model, 8, devices=["cpu"] * 8)
    for r in range(8):
        _assert_equal(every[r], _want(tensors, 8, r))
    assert moved.packed and moved.cuts == 0
    assert moved.upload_bytes == moved.delivered  # each device its own bytes (norm's to each of the 8)
    assert moved.staged_bytes == moved.read_bytes == moved.delivered - 7 * 1024 * 4  # read and staged once


@pytest.mark.parametrize("apart", (False, True))
def test_ranks_holding_only_padding_load_on_the_device_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, apart: bool
) -> None:
    """A vocabulary of 10 rows padded to 64 at N = 8: ranks 2 to 7 hold only padding (no runs). ``load()`` of every
    rank through the device path gives each its rows and zeros, as the host path does."""
    emb = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    info = {"version": 1, "params": {"emb": [["shard_funcs.pad_dim", [None, None], 0, 64, "num_shards"],
                                             [SHARD_DIM, [None, None], 0, "num_shards"]]}}  # fmt: skip
    model = write_model(tmp_path / "m", {"emb": emb}, info)
    padded = np.zeros((64, 4), dtype=np.float32)
    padded[:10] = emb
    monkeypatch.setattr(run, "data_path_for", stand_in_apart if apart else stand_in)
    every = shardload.load(model, 8, devices=["cpu"] * 8)
    for r in range(8):
        np.testing.assert_array_equal(every[r]["emb"].numpy(), padded[r * 8 : (r + 1) * 8], err_msg=str(r))


def test_into_the_callers_tensors(tmp_path: Path) -> None:
    model, tensors = _column_model(tmp_path)
    plan = shardload.plan_model(model, 4)
    want = _want(tensors, 4, 2)
    out = {k: torch.full(v.shape, 7, dtype=torch.from_numpy(v).dtype) for k, v in want.items()}
    got = run_plan(plan, [2], ["cpu"], staged=True, out=out)[0]
    assert all(got[k] is out[k] for k in out)
    _assert_equal(out, want)


def test_truncated_file_is_one_error_and_nothing_returned(tmp_path: Path) -> None:
    model = parallel_model(tmp_path / "m")
    plan = shardload.plan_model(model, 2)
    path = model / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="shorter than its header says"):
        run_plan(plan, [1], ["cpu"], staged=True)
    with pytest.raises(CheckpointError, match="shorter than its header says"):
        run_plan(plan, range(2), ["cpu"] * 2, staged=True)


def test_staging_buffers_are_made_once_per_process(tmp_path: Path) -> None:
    """The second load takes the first one's buffers: no page-locking (on a GPU) after a process's first load."""
    model, _ = _column_model(tmp_path)
    plan = shardload.plan_model(model, 2)
    run_plan(plan, [0], ["cpu"], staged=True, read_options=shardload.ReadOptions(threads=2))
    pool = staging.shared_staging(transfer.STAGE_BYTES, 1, pin=False)
    made = pool.made
    assert 1 <= made <= 3
    for r in (0, 1, 0):
        run_plan(plan, [r], ["cpu"], staged=True, read_options=shardload.ReadOptions(threads=2))
    assert pool.made == made


def test_a_gpu_load_takes_the_device_path() -> None:
    assert type(data_path_for(["cuda:0"])) is DevicePath
    assert type(data_path_for(["cpu"], staged=True)) is DevicePath
    assert type(data_path_for(["cpu"])) is not DevicePath


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ("uint8", "float16", "float32"))
def test_cuda_cuts_equal_numpy_slices(tmp_path: Path, dtype: str) -> None:
    """Odd widths and offsets (cuts of bytes, not words), every rank on one GPU and each alone, padding included."""
    rng = np.random.default_rng(5)
    tensors = {"col": random_array(rng, (37, 30), dtype), "row": random_array(rng, (33, 7), dtype),
               "norm": random_array(rng, (5,), dtype)}  # fmt: skip
    info = {"version": 1, "params": {"col": [[SHARD_DIM, [None, None], 1, "num_shards"]],
                                     "row": [[SHARD_DIM, [None, None], 0, "num_shards"]]}}  # fmt: skip
    model = write_model(tmp_path / "m", tensors, info)
    n = 3
    plan = shardload.plan_model(model, n)
    want = [{"col": tensors["col"][:, r * 10 : (r + 1) * 10], "row": tensors["row"][r * 11 : (r + 1) * 11],
             "norm": tensors["norm"]} for r in range(n)]  # fmt: skip
    gpus = [f"cuda:{k}" for k in range(torch.cuda.device_count())]
    # every rank on one GPU; ranks spread over the GPUs there are (each span read once for all of them)
    for devices in (["cuda:0"] * n, [gpus[r % len(gpus)] for r in range(n)]):
        every = run_plan(plan, range(n), devices)
        for r in range(n):
            assert every[r]["col"].device == torch.device(devices[r])
            _assert_equal({k: v.cpu() for k, v in every[r].items()}, want[r])
    for r in range(n):
        alone = run_plan(plan, [r], ["cuda"])[0]  # no index: the current device
        assert all(t.device == torch.device("cuda", torch.cuda.current_device()) for t in alone.values())
        _assert_equal({k: v.cpu() for k, v in alone.items()}, want[r])


def test_a_checking_reader_checks_the_cuts_bytes_not_the_spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verifying through the device path hashes the tiles of the bytes the rank takes, as the host path does, not
    every byte its spans read through (a column slice's spans are the whole tensor)."""
    from shardload.engine.hashing import hash_model
    from shardload.sources.reader import count_reads

    model, tensors = _column_model(tmp_path, rows=512, cols=4096)
    pin = shardload.Verify(root=hash_model(model).root)
    checked = {}
    for staged in (False, True):
        if staged:
            monkeypatch.setattr(run, "data_path_for", stand_in)
        with count_reads() as seen, count_device() as moved:
            got = shardload.load_rank(model, 3, 8, verify=pin)
        assert bool(moved.spans) == staged
        _assert_equal(got, _want(tensors, 8, 3))
        checked[staged] = seen.checked
    assert 0 < checked[True] <= 1.25 * checked[False], checked


def test_a_file_cut_during_a_staged_copy_out_of_its_mapping_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 3 of 8's column slice goes through the staging buffers out of the mapping; the file cut in half before
    its first copy is one error, never a tensor of the zeros the fault guard reads past the cut (old code: those
    jobs were not checked, and the executor returned 1,024 zero rows)."""
    x = random_array(np.random.default_rng(0), (2048, 1024), "float16")
    info = {"version": 1, "params": {"x": [[SHARD_DIM, [None, None], 1, "num_shards"]]}}
    model = write_model(tmp_path / "m", {"x": x}, info)
    file = model / "model.safetensors"
    size = file.stat().st_size
    real = copy_jobs._stage_copy

    def cut_first(*args: object) -> None:
        if file.stat().st_size == size:
            with open(file, "r+b") as f:
                f.truncate(size // 2)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(copy_jobs, "_stage_copy", cut_first)
    plan = shardload.plan_model(model, 8)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        run_plan(plan, [3], ["cpu"], staged=True, read_options=shardload.ReadOptions(threads=0))


def test_every_staged_upload_waits_for_the_stream_the_destinations_were_made_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller loading inside ``torch.cuda.stream(s)`` gets destinations from memory that work queued on ``s`` may
    still use: every upload on the side stream (spans, copies out of the mapping, staged batches) must wait for an
    event recorded there, not for the default stream alone. Checked with the CPU as the device: each upload's
    ``after`` is the event the loading thread recorded (old code: copies out of the mapping and staged batches
    passed none). The GPU's own case is ``test_a_load_inside_a_side_stream_waits_for_its_work`` (tests/test_cuda.py)."""
    mark = object()
    for module in (device_path, host_path, transfer):
        monkeypatch.setattr(module, "ready_event", lambda device: mark, raising=False)
    seen: list[object] = []

    def on_device(self: object, buf: object, device: object, work: Callable[[], object], after: object = None) -> None:
        seen.append(after)
        work()

    monkeypatch.setattr(staging.StagingBuffers, "on_device", on_device)
    model, tensors = _column_model(tmp_path)
    plan = shardload.plan_model(model, 8)
    _assert_equal(run_plan(plan, [3], ["cpu"], staged=True)[0], _want(tensors, 8, 3))  # col: out of the mapping
    monkeypatch.setattr(device_path, "SPAN_OVER_READ", math.inf)
    _assert_equal(run_plan(plan, [3], ["cpu"], staged=True)[0], _want(tensors, 8, 3))  # col: spans
    options = shardload.ReadOptions(strategy="read")  # the read schedule's staged batches
    _assert_equal(run_plan(plan, [3], ["cpu"], staged=True, read_options=options)[0], _want(tensors, 8, 3))
    assert seen and all(a is mark for a in seen), seen
