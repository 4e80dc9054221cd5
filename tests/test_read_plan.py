"""The planner of cold reads (``sources/read_plan.py``): a rank's byte runs become page-aligned reads, merged across
gaps cheaper to read than to skip under an I/O model and within a byte budget over the page floor, with the bytes
used and moved accounted; ``fill_reads`` turns each read into one stretch of runs. Pure: no I/O here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardload.sources import io_model as io_model_module
from shardload.sources.read_plan import IoModel, Read, ReadPlan, fill_reads, plan_reads

P = 4096
CHEAP = IoModel(request_s=1.0, bandwidth=1e9)  # every gap is cheaper to read than to skip
DEAR = IoModel(request_s=0.0, bandwidth=1e9)  # no gap is


def plan(starts: list[int], ends: list[int], model: IoModel = CHEAP, **kw: Any) -> ReadPlan:
    return plan_reads(np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), model, page=P, **kw)


def test_one_run_is_its_pages() -> None:
    got = plan([5000], [5100], DEAR)
    assert got.reads == [Read(P, P)] and got.used == 100 and got.page_floor == P and got.moved == P


def test_run_across_pages_reads_all_of_them_aligned() -> None:
    got = plan([P - 10], [2 * P + 10], DEAR)
    assert got.reads == [Read(0, 3 * P)] and got.page_floor == 3 * P


def test_runs_in_one_page_count_the_page_once() -> None:
    got = plan([0, 100, 200], [50, 150, 250], DEAR)
    assert got.reads == [Read(0, P)] and got.used == 150 and got.page_floor == P


def test_overlapping_runs_count_each_byte_once() -> None:
    got = plan([0, 10], [100, 50], DEAR)
    assert got.used == 100


def test_gap_cheaper_than_a_request_is_read_within_the_budget() -> None:
    """A one-page gap between two 40-page stretches: read through when the model says so and the budget allows."""
    starts, ends = [0, 41 * P], [40 * P, 81 * P]
    assert plan(starts, ends, DEAR).reads == [Read(0, 40 * P), Read(41 * P, 40 * P)]
    merged = plan(starts, ends, CHEAP, max_waste=0.05)
    assert merged.reads == [Read(0, 81 * P)] and merged.moved == merged.page_floor + P
    assert plan(starts, ends, CHEAP, max_waste=0.0).reads == [Read(0, 40 * P), Read(41 * P, 40 * P)]


def test_break_even_comes_from_the_model() -> None:
    """The gap read through is the one shorter than request cost x bandwidth: 8 KiB at 100 us and 100 MB/s."""
    model = IoModel(request_s=100e-6, bandwidth=100e6)
    assert model.break_even == 10_000
    two = plan([0, 3 * P], [P, 4 * P], model, max_waste=10)  # 2-page gap: 8192 <= 10000
    three = plan([0, 4 * P], [P, 5 * P], model, max_waste=10)  # 3-page gap: 12288 > 10000
    assert len(two.reads) == 1 and len(three.reads) == 2


def test_budget_takes_the_shortest_gaps_first() -> None:
    """Gaps of 3, 1 and 2 pages between 10-page stretches, a budget of 3 pages: the 1- and 2-page gaps merge."""
    starts = [0, 13 * P, 24 * P, 36 * P]
    ends = [s + 10 * P for s in starts]
    got = plan(starts, ends, CHEAP, max_waste=3 / 40)
    assert got.reads == [Read(0, 10 * P), Read(13 * P, 33 * P)]
    assert got.moved - got.page_floor == 3 * P


def test_long_stretch_is_cut_into_max_read_pieces() -> None:
    got = plan([0], [10 * P + 1], DEAR, max_read=4 * P)
    assert got.reads == [Read(0, 4 * P), Read(4 * P, 4 * P), Read(8 * P, 3 * P)]
    with pytest.raises(ValueError, match="multiple of the page size"):
        plan([0], [1], DEAR, max_read=P + 1)


def test_limit_cuts_the_last_page() -> None:
    got = plan([100], [P + 100], DEAR, limit=P + 100)
    assert got.reads == [Read(0, P + 100)] and got.page_floor == P + 100
    with pytest.raises(ValueError, match="past the limit"):
        plan([100], [P + 200], DEAR, limit=P + 100)


def test_model_refuses_nonsense() -> None:
    """Negative, zero, infinite, NaN or non-numeric figures are refused when the model is made (an infinite one
    would fail later, in the break-even gap)."""
    for request_s, bandwidth in [(-1, 1), (0, 0), (float("inf"), 1e9), (0, float("inf")), (float("nan"), 1e9),
                                 (True, 1e9), ("1e-4", 1e9)]:  # fmt: skip
        with pytest.raises(ValueError, match="finite numbers"):
            IoModel(request_s=request_s, bandwidth=bandwidth)  # type: ignore[arg-type]
    assert IoModel(request_s=0, bandwidth=1).break_even == 0


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("waste", [0.0, 0.05, 1.0, float("inf")])
def test_random_runs_plan_and_fill(seed: int, waste: float) -> None:
    """Random sorted disjoint runs: the reads are aligned, disjoint and sorted, cover every needed page, move at
    most the page floor plus the budget, and the filled runs read each read whole, in order, delivering exactly
    the runs' bytes to their destinations (checked against a file simulated in memory)."""
    rng = np.random.default_rng(seed)
    size = 64 * P
    cuts = np.sort(rng.choice(size, size=2 * int(rng.integers(1, 40)), replace=False))
    starts, ends = cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64)
    model = IoModel(request_s=float(rng.uniform(0, 5e-5)), bandwidth=1e8)
    got = plan_reads(starts, ends, model, page=P, max_waste=waste, max_read=4 * P, limit=size)
    pages = {p for a, b in zip(starts, ends, strict=True) for p in range(a // P, (b - 1) // P + 1)}
    assert got.page_floor == len(pages) * P and got.used == int((ends - starts).sum())
    read_pages = {p for r in got.reads for p in range(r.offset // P, -(-r.end // P))}
    assert pages <= read_pages
    assert all(r.offset % P == 0 and (r.end % P == 0 or r.end == size) and 0 < r.length <= 4 * P for r in got.reads)
    assert all(a.end <= b.offset for a, b in zip(got.reads[:-1], got.reads[1:], strict=True))
    assert got.moved <= got.page_floor * (1 + waste)
    # fill, then "read" each stretch from a simulated file into the destination and the sink
    file = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.concatenate(([0], np.cumsum(ends - starts)[:-1]))
    dest = np.zeros(int((ends - starts).sum()), dtype=np.uint8)
    filled = fill_reads(got, starts, ends - starts, np.zeros(len(starts), dtype=np.int64), dst, sink=1)
    sink = np.zeros(max(1, filled.sink), dtype=np.uint8)
    for k, r in enumerate(got.reads):
        mine = filled.read == k
        s, n = filled.src[mine], filled.length[mine]
        assert s[0] == r.offset and s[-1] + n[-1] == r.end and np.array_equal(s[1:], (s + n)[:-1])
    for s, n, b, d in zip(filled.src, filled.length, filled.buf, filled.dst, strict=True):
        (dest if b == 0 else sink)[d : d + n] = file[s : s + n]
    want = np.concatenate([file[a:b] for a, b in zip(starts, ends, strict=True)])
    assert np.array_equal(dest, want)
    assert int(filled.length[filled.buf == 1].sum()) == got.moved - got.used


def test_fill_refuses_runs_outside_the_reads() -> None:
    got = plan([0], [10], DEAR)
    with pytest.raises(ValueError, match="outside the planned reads"):
        fill_reads(got, np.array([P]), np.array([10]), np.array([0]), np.array([0]), sink=1)


def test_io_model_is_measured_once_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured on the first file of a device, then kept; a file too small to time falls back to the defaults."""
    calls: list[Path] = []
    monkeypatch.setattr(io_model_module, "_models", {})
    monkeypatch.setattr(io_model_module, "measure", lambda p: calls.append(p) or IoModel(1e-4, 1e9))
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    assert io_model_module.io_model(a) is io_model_module.io_model(b)
    assert calls == [a]
    assert io_model_module.io_model(tmp_path / "missing") == io_model_module.FALLBACK


def test_a_small_first_file_does_not_fix_the_device_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first cold file too small to time gets the defaults for itself only: the next, larger file of the same
    device is measured, and its model kept."""
    monkeypatch.setattr(io_model_module, "_models", {})
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"\0" * P)
    big.write_bytes(np.random.default_rng(1).integers(0, 256, 9 << 20, dtype=np.uint8).tobytes())
    assert io_model_module.io_model(small) == io_model_module.FALLBACK
    measured = io_model_module.io_model(big)
    assert measured is not io_model_module.FALLBACK and measured.bandwidth > 0
    assert io_model_module.io_model(small) is measured  # the device's model from now on


def test_measure_times_a_real_file(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.write_bytes(b"\0" * P)
    assert io_model_module.measure(small) is None
    big = tmp_path / "big"
    big.write_bytes(np.random.default_rng(0).integers(0, 256, 9 << 20, dtype=np.uint8).tobytes())
    model = io_model_module.measure(big)
    assert model.request_s >= 0 and model.bandwidth > 0
