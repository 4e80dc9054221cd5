"""Request planning for object storage by cost: :class:`ObjectCost`, the pure planner ``plan_requests``, the probe
that measures a store, and where a load's cost comes from (``ReadOptions``, ``SHARDLOAD_S3_COST``, the default).

No server here: the planner is a function of runs and a cost model, and the probe is run against a store in memory
whose requests advance a fake clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardload
from shardload.errors import ShardloadError
from shardload.sources import objects
from shardload.sources.object_reader import ObjectReader, Request, plan_requests
from shardload.sources.objects import ObjectCost, ObjectPath, cost_from_environment, measure_cost


def _spans(requests: list[Request]) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(r.start, r.end, r.runs) for r in requests]


def _runs(spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in spans], [e - a for a, e in spans]


def test_the_merge_gap_is_latency_times_bandwidth_over_concurrency() -> None:
    """``g / bandwidth < latency / concurrency``: 10 ms, 16 kB/s over 16 requests make a 10-byte gap the break-even."""
    cost = ObjectCost(latency=0.01, bandwidth=16_000, concurrency=16, request_bytes=1 << 20)
    assert cost.merge_gap == pytest.approx(10)
    assert [cost.fetches(g) for g in (0, 9, 10, 11)] == [True, True, False, False]  # a tie stays exact (fewer bytes)
    src, length = _runs([(0, 100), (109, 200), (210, 300)])  # gaps of 9 and 10 bytes
    assert _spans(plan_requests(src, length, cost)) == [(0, 200, (0, 1)), (210, 300, (2,))]
    # twice the requests in flight halve what a request costs, so the 9-byte gap is no longer worth fetching
    doubled = dataclasses.replace(cost, concurrency=32)
    assert _spans(plan_requests(src, length, doubled)) == [(0, 100, (0,)), (109, 200, (1,)), (210, 300, (2,))]
    # ten times the latency (a distant store) makes both gaps worth fetching
    far = dataclasses.replace(cost, latency=0.1)
    assert _spans(plan_requests(src, length, far)) == [(0, 300, (0, 1, 2))]


def test_a_column_slice_merges_and_row_blocks_stay_exact() -> None:
    """The case the model is for: a column slice (one short run per row, short gaps) becomes a few requests,
    while the row blocks of other tensors, megabytes apart, are fetched exactly."""
    cost = ObjectCost()  # the default: 30 ms, 1.5 GB/s over 16 requests, a 2.8 MB break-even gap
    rows, row, part = 2048, 2048 * 2, 2048 * 2 // 8  # a 2048 x 2048 float16 tensor, rank 3 of 8's columns
    column = [(k * row + 3 * part, k * row + 4 * part) for k in range(rows)]
    base = rows * row
    blocks = [(base + 3 * (1 << 20), base + 4 * (1 << 20)), (base + 11 * (1 << 20), base + 12 * (1 << 20))]
    src, length = _runs(column + blocks)
    requests = plan_requests(src, length, cost)
    assert len(requests) == 3  # 8 MiB of the column slice's span in one request; each block alone
    assert (requests[0].start, requests[0].end) == (column[0][0], column[-1][1])
    assert [(r.start, r.end) for r in requests[1:]] == blocks
    exact = plan_requests(src, length, ObjectCost.exact())
    assert len(exact) == rows + 2 and sum(r.end - r.start for r in exact) == sum(length)


def test_exact_and_merged_presets() -> None:
    src, length = _runs([(0, 10), (10, 20), (25, 30), (1000, 1010)])
    assert _spans(plan_requests(src, length, ObjectCost.exact())) == [
        (0, 20, (0, 1)),
        (25, 30, (2,)),
        (1000, 1010, (3,)),
    ]  # fmt: skip  (adjacent runs share a request even when exact: no gap bytes are fetched)
    assert _spans(plan_requests(src, length, ObjectCost.merged())) == [(0, 1010, (0, 1, 2, 3))]
    small = dataclasses.replace(ObjectCost.merged(), request_bytes=100)  # a gap that no request can hold stays
    assert _spans(plan_requests(src, length, small)) == [(0, 30, (0, 1, 2)), (1000, 1010, (3,))]
    assert ObjectCost.exact().merge_gap == 0 and math.isinf(ObjectCost.merged().merge_gap)
    assert ObjectCost.exact(concurrency=4).concurrency == 4


def test_requests_split_long_runs_and_carry_shared_bytes_once() -> None:
    cost = ObjectCost(latency=0.001, bandwidth=16_000, concurrency=16, request_bytes=100)  # a 1-byte break-even gap
    # adjacent runs share a request; a long run is split into whole requests and its rest
    assert _spans(plan_requests([0, 40, 80, 300], [40, 40, 20, 250], cost)) == [
        (0, 100, (0, 1, 2)), (300, 400, (3,)), (400, 500, (3,)), (500, 550, (3,)),
    ]  # fmt: skip
    # overlapping runs (bytes two ranks hold) are fetched once; unsorted runs are taken in source order
    assert _spans(plan_requests([5, 0], [10, 10], cost)) == [(0, 15, (1, 0))]
    # a run inside a long split run is carried by the request holding its bytes, not by the split's tail
    assert _spans(plan_requests([0, 5, 5], [250, 10, 10], cost)) == [
        (0, 100, (0, 1, 2)), (100, 200, (0,)), (200, 250, (0,)),
    ]  # fmt: skip
    assert plan_requests([], [], cost) == [] and plan_requests([7], [0], cost) == []


@st.composite
def _costs(draw: st.DrawFn) -> ObjectCost:
    latency = draw(st.sampled_from([0.0, 1e-4, 1e-3, 0.01, 0.1]))
    bandwidth = draw(st.sampled_from([1e3, 1e5, 1e7] + ([math.inf] if latency else [])))
    request_bytes = draw(st.sampled_from([1, 7, 64, 1000, 1 << 20]))
    return ObjectCost(latency, bandwidth, draw(st.integers(1, 64)), request_bytes)


_run_lists = st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 600)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(runs=_run_lists, cost=_costs())
def test_every_run_is_carried_and_every_gap_follows_the_rule(runs: list[tuple[int, int]], cost: ObjectCost) -> None:
    """Whatever the runs (overlapping, repeated, empty) and the cost: requests are sorted, disjoint, within
    ``request_bytes``, cover each run's bytes exactly once between them and list exactly the runs they carry;
    every gap a request fetches is one the cost says to fetch, and every gap between two requests is one it says to
    skip, or one a request could not hold."""
    src, length = [a for a, _ in runs], [n for _, n in runs]
    requests = plan_requests(src, length, cost)
    for a, b in itertools.pairwise(requests):
        assert a.end <= b.start
    wanted = sorted({x for a, n in runs for x in range(a, a + n)})
    fetched = [x for r in requests for x in range(r.start, r.end)]
    assert set(wanted) <= set(fetched)
    for r in requests:
        assert 0 < r.end - r.start <= cost.request_bytes
        assert r.start in wanted and r.end - 1 in wanted  # a request starts and ends on wanted bytes
        inside = [x for x in wanted if r.start <= x < r.end]
        gaps = [b - a - 1 for a, b in itertools.pairwise(inside) if b - a > 1]
        assert all(cost.fetches(g) for g in gaps), (r, gaps)
        carried = [i for i, (a, n) in enumerate(runs) if n and a < r.end and a + n > r.start]
        assert sorted(r.runs) == carried
    for a, b in itertools.pairwise(requests):
        if a.end < b.start:  # a gap left between two requests: skipped by the rule, or too big to join them
            assert not cost.fetches(b.start - a.end) or b.end - a.start > cost.request_bytes


@settings(max_examples=150, deadline=None)
@given(runs=_run_lists, cost=_costs())
def test_the_plan_is_never_slower_than_exact_or_merged_by_the_model(
    runs: list[tuple[int, int]], cost: ObjectCost
) -> None:
    """With requests large enough to hold any stretch, each gap's choice is independent, so the plan's modelled
    time is the least of every way to group the runs, in particular of exact and merged."""
    cost = dataclasses.replace(cost, request_bytes=1 << 30)
    src, length = [a for a, _ in runs], [n for _, n in runs]

    def seconds(requests: list[Request]) -> float:
        return cost.seconds(len(requests), sum(r.end - r.start for r in requests))

    ours = seconds(plan_requests(src, length, cost))
    exact = seconds(plan_requests(src, length, dataclasses.replace(ObjectCost.exact(), request_bytes=1 << 30)))
    merged = seconds(plan_requests(src, length, dataclasses.replace(ObjectCost.merged(), request_bytes=1 << 30)))
    assert ours <= min(exact, merged) * (1 + 1e-12)


class _ClockedStore(objects.ObjectStore):
    """One object in memory, whose every ranged read advances a fake clock by ``latency + bytes / bandwidth``."""

    def __init__(self, data: bytes, latency: float, bandwidth: float) -> None:
        super().__init__("memory")
        self.data, self.latency, self.bandwidth = data, latency, bandwidth
        self.now = 0.0
        self.reads: list[tuple[int, int]] = []

    def clock(self) -> float:
        return self.now

    def _head(self, key: str) -> int | None:
        return len(self.data) if key == "m" else None

    def read_into(self, key: str, start: int, views: Sequence[memoryview]) -> None:
        at = start
        for view in views:
            view[:] = self.data[at : at + len(view)]
            at += len(view)
        self.reads.append((start, at))
        self.now += self.latency + (at - start) / self.bandwidth


def test_the_probe_measures_latency_and_bandwidth() -> None:
    """Three small GETs give the latency, one large GET a request's bandwidth; the store keeps what it measured."""
    store = _ClockedStore(bytes(10 << 20), latency=0.02, bandwidth=50e6)
    cost = measure_cost(store, "m", concurrency=8, clock=store.clock)
    assert cost.latency == pytest.approx(0.02, rel=0.01)
    assert cost.bandwidth == pytest.approx(8 * 50e6, rel=0.01) and cost.concurrency == 8
    assert cost.merge_gap == pytest.approx(0.02 * 50e6, rel=0.02)  # a request's latency times its bandwidth
    assert store.reads == [(0, 4096)] * 3 + [(0, 4 << 20)]
    tiny = _ClockedStore(bytes(1000), latency=0.02, bandwidth=50e6)  # too small to time a transfer: latency only
    measured = measure_cost(tiny, "m", clock=tiny.clock)
    assert measured.latency == pytest.approx(0.02, rel=0.01) and measured.bandwidth == ObjectCost().bandwidth
    assert measure_cost(_ClockedStore(b"", 0.02, 50e6), "m") == ObjectCost()  # nothing to read: the default


def test_measure_runs_once_per_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"measure"`` probes the store on the first read and keeps the result for every later reader."""
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    store = _ClockedStore(data, latency=0.01, bandwidth=1e6)
    probe = objects.measure_cost
    monkeypatch.setattr(objects, "measure_cost", lambda s, key, n=None: probe(s, key, n, clock=store.clock))
    path = ObjectPath(store, "m")
    for _ in range(2):
        out = torch.zeros(300, dtype=torch.uint8)
        with ObjectReader("measure") as reader:
            z = np.zeros(3, dtype=np.int64)
            reader.read_runs(path, np.array([0, 5000, 9000]), np.array([100] * 3), z, np.array([0, 100, 200]), [out])
            assert reader.cost(path).latency == pytest.approx(0.01 + 4096 / 1e6)  # a small GET's time
        assert out.numpy().tobytes() == data[0:100] + data[5000:5100] + data[9000:9100]
    probes = [r for r in store.reads if r[0] == 0 and r[1] in (4096, 1 << 16)]
    assert len(probes) == 4  # 3 small and 1 large GET, on the first load only


def test_where_a_loads_cost_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ReadOptions(object_cost=)`` first, then ``SHARDLOAD_S3_COST``, then the default; each checked."""
    monkeypatch.delenv(objects.COST_ENV, raising=False)
    store = _ClockedStore(bytes(100), 0.0, 1.0)
    path = ObjectPath(store, "m")
    assert ObjectReader().cost(path) == ObjectCost()
    monkeypatch.setenv(objects.COST_ENV, "latency=0.005, bandwidth=2e9, concurrency=32")
    assert ObjectReader().cost(path) == ObjectCost(latency=0.005, bandwidth=2e9, concurrency=32)
    assert ObjectReader(ObjectCost.merged()).cost(path) == ObjectCost.merged()
    monkeypatch.setenv(objects.COST_ENV, "exact")
    assert ObjectReader().cost(path) == ObjectCost.exact()
    monkeypatch.setenv(objects.COST_ENV, "measure")
    assert cost_from_environment() == "measure"
    options = shardload.ReadOptions(object_cost=shardload.ObjectCost(latency=0.1, bandwidth=1e8))
    assert options.object_cost.merge_gap == pytest.approx(0.1 * 1e8 / objects.CONCURRENCY)
    assert shardload.ReadOptions(object_cost="measure").object_cost == "measure"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fast", "SHARDLOAD_S3_COST: expected exact, merged, measure or latency=SECONDS,bandwidth=BYTES_PER_S"
                 "[,concurrency=N][,request_bytes=N], got 'fast'"),
        ("latency=0.01", "SHARDLOAD_S3_COST: expected exact"),
        ("latency=0.01,bandwidth=1e9,latency=2", "SHARDLOAD_S3_COST: expected exact"),
        ("latency=0.01,bandwidth=lots", "SHARDLOAD_S3_COST: expected exact"),
        ("latency=0.01,bandwidth=1e9,concurrency=1.5", "SHARDLOAD_S3_COST: expected exact"),
        ("latency=-1,bandwidth=1e9", "SHARDLOAD_S3_COST: ObjectCost.latency must be a number >= 0"),
        ("latency=0.01,bandwidth=1e9,concurrency=0", "SHARDLOAD_S3_COST: ObjectCost.concurrency must be an int"),
        ("latency=0,bandwidth=inf", "SHARDLOAD_S3_COST: ObjectCost: latency 0 with an infinite bandwidth"),
    ],
)  # fmt: skip
def test_a_bad_cost_in_the_environment_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv(objects.COST_ENV, value)
    with pytest.raises(ShardloadError) as err:
        cost_from_environment()
    assert err.value.message.startswith(message) and "\n" not in err.value.message


def test_bad_costs_are_refused() -> None:
    for bad in (
        {"latency": float("nan")},
        {"bandwidth": 0},
        {"latency": "1"},
        {"latency": True},
        {"concurrency": 1000},
    ):
        with pytest.raises(ShardloadError, match=r"^ObjectCost\.\w+ must be"):
            ObjectCost(**bad)
    with pytest.raises(ShardloadError, match=r'^object_cost must be an ObjectCost, "measure" or None, got 0\.1$'):
        shardload.ReadOptions(object_cost=0.1)
    with pytest.raises(ShardloadError, match=r"^object_cost must be"):
        ObjectReader("fast")
