"""A host's ranks loading together: each finds its place on the host (option, else ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``), reads one page-aligned stripe of each cold file into the page cache (the stripes tile the
files' data regions, each byte once), and returns exactly the bytes a rank alone returns; the stripe thread never
outlives the load; each rank's default reader threads are its share of the host's cores."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import shardload
import shardload.engine.host_group as host_group
import shardload.engine.host_stripes as host_stripes
import shardload.engine.routes as routes
from helpers.model_reference import reference_shards
from helpers.reading import drop_from_cache
from shardload.engine.host_group import LocalRanks, local_ranks, rank_threads
from shardload.engine.host_stripes import ByteRange, data_regions, stripe_of
from shardload.errors import ShardloadError
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import PAGE, FileMaps, Reader, count_reads

WORKER = Path(__file__).parent / "host_stripes_worker.py"
ROOT = Path(__file__).resolve().parent.parent


# --- who shares the host --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, (0, 1)),
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, (3, 8)),
        ({"LOCAL_RANK": " 0 ", "LOCAL_WORLD_SIZE": "1"}, (0, 1)),
        ({"LOCAL_RANK": "2"}, (0, 1)),  # no size: alone
        ({"LOCAL_WORLD_SIZE": "4"}, (0, 1)),  # no rank and no process group: alone
    ],
)
def test_local_ranks_from_the_environment(env: dict[str, str], want: tuple[int, int]) -> None:
    got = local_ranks("auto", env)
    assert (got.index, got.count) == want
    if want[1] > 1:
        assert got.source == "LOCAL_RANK/LOCAL_WORLD_SIZE"


def test_the_option_overrides_the_environment() -> None:
    env = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}
    assert local_ranks((1, 2), env) == LocalRanks(1, 2)
    assert local_ranks(None, env).alone and local_ranks("off", env).alone
    assert shardload.ReadOptions(local_ranks=(1, 4)).local_ranks == LocalRanks(1, 4)
    assert shardload.ReadOptions(local_ranks="off").local_ranks is None
    assert shardload.ReadOptions.from_config({"local_ranks": [2, 4]}).local_ranks == LocalRanks(2, 4)
    assert shardload.ReadOptions.from_config({"local_ranks": None}).local_ranks is None


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "eight"}, "LOCAL_WORLD_SIZE"),
        ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK=8 is not below LOCAL_WORLD_SIZE=8"),
        ({"LOCAL_RANK": "-1", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
    ],
)
def test_bad_environment_is_one_warning_and_the_load_goes_on_alone(
    example_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    env: dict[str, str],
    names: str,
) -> None:
    """The launcher's variables only tune speed: a stale or bad value is one warning line, and the rank loads as
    the only one on its host (its bytes as ever)."""
    monkeypatch.setattr(host_group, "_warned", set())
    want = shardload.load_rank(example_dir, 0, 2)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="shardload.host"):
        got = shardload.load_rank(example_dir, 0, 2)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and names in warned[0] and "\n" not in warned[0], warned
    assert host_group.local_ranks("auto").alone


@pytest.mark.parametrize("bad", [(2, 2), (-1, 2), (0, 0), ("0", 2), (0, 1, 2), "some"])
def test_bad_option_is_one_line(bad: object) -> None:
    with pytest.raises(ShardloadError, match="local_ranks") as err:
        shardload.ReadOptions(local_ranks=bad)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
    with pytest.raises(ShardloadError, match=r"read_options\.local_ranks"):
        shardload.ReadOptions.from_config({"local_ranks": list(bad) if isinstance(bad, tuple) else bad})


# --- reader threads from cores ---------------------------------------------------------------------------------


def test_threads_are_the_ranks_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert rank_threads(LocalRanks(0, 1), cores=16) == 8
    assert rank_threads(LocalRanks(0, 2), cores=16) == 8
    assert rank_threads(LocalRanks(5, 8), cores=16) == 2
    assert rank_threads(LocalRanks(5, 8), cores=4) == 1
    monkeypatch.setattr(host_group, "host_cores", lambda: 16)
    monkeypatch.setattr(host_group, "_announced", set())
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with caplog.at_level(logging.INFO, logger="shardload.host"):
        assert shardload.ReadOptions().threads_for(Reader()) == 2
        assert shardload.ReadOptions().threads_for(Reader()) == 2
        assert shardload.ReadOptions(threads=5).threads_for(Reader()) == 5  # as given
        assert shardload.ReadOptions(local_ranks=None).threads_for(Reader()) == 8
    lines = [r.getMessage() for r in caplog.records if r.name == "shardload.host"]
    assert lines == [
        "shardload: local rank 3 of 8 (LOCAL_RANK/LOCAL_WORLD_SIZE): 2 reader threads (16 cores / 8 local ranks)",
        "shardload: alone on this host (local_ranks off): reads its own bytes; 8 reader threads",
    ]


# --- the stripes -----------------------------------------------------------------------------------------------


REGIONS = [(0, 1), (1000, 5000), (4096, 8192), (333, 3 * PAGE + 17), (1242, 1242 + 50 * PAGE + 5), (7, 1 << 30)]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("region", REGIONS)
def test_stripes_tile_the_region(region: tuple[int, int], count: int) -> None:
    whole = ByteRange(*region)
    stripes = [stripe_of(whole, i, count) for i in range(count)]
    assert stripes[0].start == whole.start and stripes[-1].end == whole.end
    for a, b in itertools.pairwise(stripes):
        assert a.end == b.start  # in order, no gap, no overlap
        assert a.start <= a.end
        assert b.start % PAGE == 0 or b.start in (whole.start, whole.end)
    assert sum(s.nbytes for s in stripes) == whole.nbytes
    pages = {p for s in stripes if s.nbytes for p in range(s.start // PAGE, (s.end - 1) // PAGE + 1)}
    owners = [sum(1 for s in stripes if s.nbytes and s.start // PAGE <= p <= (s.end - 1) // PAGE) for p in pages]
    assert set(owners) <= {1}  # each page read by one rank
    sizes = [s.nbytes for s in stripes]
    assert max(sizes) - min(sizes) <= 2 * PAGE  # even, to a page (the ends are not page-aligned)


def test_data_regions_are_the_tensor_bytes(example_multi_dir: Path) -> None:
    checkpoint = open_checkpoint(example_multi_dir)
    regions = data_regions(checkpoint)
    assert set(regions) == set(checkpoint.files)
    for path, region in regions.items():
        infos = [t for t in checkpoint.tensors.values() if t.file == path]
        assert region.start == min(t.offset for t in infos)
        assert region.end == max(t.offset + t.nbytes for t in infos) == path.stat().st_size


# --- loading together ------------------------------------------------------------------------------------------


def drop(model: Path) -> bool:
    """Evict ``model``'s weights from the page cache; whether they are out now."""
    for f in model.glob("*.safetensors"):
        drop_from_cache(f)
    for f in model.glob("*.safetensors"):
        maps = FileMaps()
        size = f.stat().st_size
        cached = maps.cached(f, list(range(0, size, PAGE)), size)
        maps.release()
        if cached is None or cached > 0.1:
            return False
    return True


def together(model: Path, n: int, tmp: Path, *, count: int | None = None, off: bool = False) -> list[dict]:
    """Ranks 0..n-1 as n processes started at once from a cold cache, local ranks of ``count`` (default n; 1:
    alone); each rank's result line, with its tensors as numpy arrays under ``"state"``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    procs = []
    for r in range(n):
        rank_env = {**env, "LOCAL_RANK": str(r % (count or n)), "LOCAL_WORLD_SIZE": str(count or n)}
        cmd = [sys.executable, str(WORKER), str(model), str(r), str(n), str(tmp / f"rank{r}.safetensors")]
        procs.append(subprocess.Popen([*cmd, *(["off"] if off else [])], env=rank_env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    watchdog = threading.Timer(120, lambda: [p.kill() for p in procs])  # a worker stuck before "checked" ends
    watchdog.start()
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.communicate()[1]
        if not drop(model):
            pytest.skip("the page cache cannot be dropped here")
        for line, answer in (("check\n", "checked"), ("go\n", None)):  # all look at the cache, then all load
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(line)
                p.stdin.flush()
            for p in procs if answer else ():
                assert p.stdout is not None and p.stdout.readline().strip() == answer, p.communicate()[1]
        watchdog.cancel()
        results = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            line = json.loads(out.strip().splitlines()[-1])
            line["state"] = load_file(str(tmp / f"rank{r}.safetensors"))
            results.append(line)
        return results
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def data_bytes(model: Path) -> int:
    return sum(r.nbytes for r in data_regions(open_checkpoint(model)).values())


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_loading_together_stripe_and_match_the_reference(example_dir: Path, tmp_path: Path, n: int) -> None:
    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    results = together(model, n, tmp_path)
    want = reference_shards(model, n)
    for r, got in enumerate(results):
        assert got["state"].keys() == want[r].keys()
        for name, t in got["state"].items():
            np.testing.assert_array_equal(t, want[r][name], err_msg=f"rank {r} of {n}: {name}")
        assert got["alive"] == []
    # each stripe was read, and together they are the data region once: a stripe miscomputed reads more or less
    assert all(got["warmed"] > 0 for got in results)
    assert sum(got["warmed"] for got in results) == data_bytes(model)


def test_multi_file_stripes_each_file(example_multi_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(example_multi_dir, model)
    results = together(model, 2, tmp_path)
    want = reference_shards(model, 2)
    for r, got in enumerate(results):
        for name, t in got["state"].items():
            np.testing.assert_array_equal(t, want[r][name], err_msg=f"rank {r}: {name}")
    assert sum(got["warmed"] for got in results) == data_bytes(model)


@pytest.mark.parametrize("how", ["alone", "off"])
def test_a_rank_alone_reads_only_its_own_bytes(example_dir: Path, tmp_path: Path, how: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    results = together(model, 2, tmp_path, count=1 if how == "alone" else None, off=how == "off")
    want = reference_shards(model, 2)
    for r, got in enumerate(results):
        for name, t in got["state"].items():
            np.testing.assert_array_equal(t, want[r][name], err_msg=f"rank {r}: {name}")
        assert got["warmed"] == 0


# --- the stripe thread ends with the load ----------------------------------------------------------------------


def stripe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardload-stripe")]


@pytest.fixture
def cold_rank(example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the example, dropped from the page cache, loaded as local rank 0 of 2."""
    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    if not drop(model):
        pytest.skip("the page cache cannot be dropped here")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(host_stripes, "SETTLE_STALL_S", 0.01)  # no peer is coming
    return model


def test_the_stripe_thread_is_gone_after_a_load(cold_rank: Path) -> None:
    with count_reads() as seen:
        got = shardload.load_rank(cold_rank, 0, 2)
    assert seen.warmed == stripe_of(next(iter(data_regions(open_checkpoint(cold_rank)).values())), 0, 2).nbytes
    assert stripe_threads() == []
    want = reference_shards(cold_rank, 2)[0]
    for name, t in got.items():
        np.testing.assert_array_equal(t.numpy(), want[name], err_msg=name)


def test_a_failing_load_stops_its_stripe_early(cold_rank: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan fails while the stripe is being read (slowly here): the load raises that error at once, and the
    stripe thread has stopped and ended."""
    monkeypatch.setattr(host_stripes, "STRIPE_READ", PAGE)
    slow = host_stripes.count_warmed
    first_page = threading.Event()

    def count_slowly(nbytes: int) -> None:
        time.sleep(0.005)
        slow(nbytes)
        first_page.set()

    monkeypatch.setattr(host_stripes, "count_warmed", count_slowly)

    def failing_plan(*args: object, **kwargs: object) -> None:
        assert first_page.wait(60) and stripe_threads(), "the stripe should be running"
        raise shardload.PlanError("a plan that fails")

    monkeypatch.setattr(routes, "build_plan", failing_plan)
    with count_reads() as seen, pytest.raises(shardload.PlanError, match="a plan that fails"):
        shardload.load_rank(cold_rank, 0, 2)
    assert stripe_threads() == []
    assert 0 < seen.warmed < data_bytes(cold_rank) // 2 - 10 * PAGE  # stopped part way


def test_a_file_cut_under_the_stripe_is_the_loads_one_line(cold_rank: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is cut while the rank plans: the stripe stops at the cut, quietly; the rank's own reads raise the
    one-line error; no thread is left."""
    real = routes.build_plan

    def cut_then_plan(*args: object, **kwargs: object) -> object:
        os.truncate(cold_rank / "model.safetensors", (cold_rank / "model.safetensors").stat().st_size // 3)
        return real(*args, **kwargs)

    monkeypatch.setattr(routes, "build_plan", cut_then_plan)
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(cold_rank, 0, 2)
    assert "\n" not in str(err.value)
    assert stripe_threads() == []


def test_auto_stripes_only_when_the_host_holds_the_tensor_parallel_group(
    cold_rank: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two local ranks loading at N = 4 (tensor parallelism across hosts): no stripe, said in one line; given the
    local ranks explicitly, the stripe runs."""
    with caplog.at_level(logging.INFO, logger="shardload.host"), count_reads() as seen:
        got = shardload.load_rank(cold_rank, 1, 4)
    assert seen.warmed == 0
    assert any("no stripes: 2 local ranks" in r.getMessage() for r in caplog.records)
    want = reference_shards(cold_rank, 4)[1]
    for name, t in got.items():
        np.testing.assert_array_equal(t.numpy(), want[name], err_msg=name)
    if not drop(cold_rank):
        pytest.skip("the page cache cannot be dropped here")
    with count_reads() as seen:
        shardload.load_rank(cold_rank, 1, 4, read_options=shardload.ReadOptions(local_ranks=(0, 2)))
    assert seen.warmed > 0


def test_no_stripe_for_a_warm_file_or_a_partial_load(cold_rank: Path) -> None:
    name = next(iter(reference_shards(cold_rank, 2)[0]))
    with count_reads() as seen:
        shardload.load_rank(cold_rank, 0, 2, into=shardload.Destination({}, only=[name]))
    assert seen.warmed == 0  # only some tensors: the rest of the file is no rank's business here
    shardload.load_rank(cold_rank, 0, 2)  # now cached
    with count_reads() as seen:
        shardload.load_rank(cold_rank, 0, 2)
    assert seen.warmed == 0


def test_a_rank_whose_peers_never_load_waits_once_not_per_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for the peers' stripes has one budget for the whole load (on a clock the test drives): with ten
    files that never arrive, it ends after one stall, not ten."""
    clock = [0.0]

    class NeverCached:
        def cached(self, path: object, offsets: object, end: object) -> float:
            return 0.5

        def release(self) -> None:
            pass

    monkeypatch.setattr(host_stripes, "FileMaps", NeverCached)
    monkeypatch.setattr(host_stripes.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(host_stripes.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    region = host_stripes.ByteRange(0, 64 * PAGE)
    files = [host_stripes.FileStripe(Path(f"/nowhere/{k}"), region, region) for k in range(10)]
    host_stripes.HostStripes(files, LocalRanks(0, 2))._settle()
    assert host_stripes.SETTLE_STALL_S <= clock[0] <= host_stripes.SETTLE_STALL_S + 3 * host_stripes.SETTLE_POLL_S


def _cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, dict[str, str]], own: str) -> None:
    """A fake cgroup tree under ``tmp_path``/cgroup (``files``: a group's directory under the root -> file name ->
    contents), /proc/self/cgroup reading ``own`` and /proc/meminfo saying 64 GiB available, pointed at."""
    root = tmp_path / "cgroup"
    for group, contents in files.items():
        d = root / group.strip("/") if group.strip("/") else root
        d.mkdir(parents=True, exist_ok=True)
        for name, text in contents.items():
            (d / name).write_text(f"{text}\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {128 << 20} kB\nMemAvailable: {64 << 20} kB\n")
    (tmp_path / "self_cgroup").write_text(own)
    monkeypatch.setattr(host_stripes, "MEMINFO", meminfo)
    monkeypatch.setattr(host_group, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_group, "SELF_CGROUP", tmp_path / "self_cgroup")


def _memory_v2(limits: dict[str, tuple[str, int, int]]) -> dict[str, dict[str, str]]:
    """cgroup v2 groups (path -> memory.max, memory.current, file bytes in memory.stat) as :func:`_cgroups` files."""
    return {group: {"memory.max": most, "memory.current": str(current), "memory.stat": f"anon 1000\nfile {file}"}
            for group, (most, current, file) in limits.items()}  # fmt: skip


@pytest.mark.parametrize(
    ("limits", "want_gib"),
    [
        ({"/": ("max", 0, 0)}, 64),  # no limit: the host's MemAvailable
        ({"/": ("max", 0, 0), "/pod": (str(8 << 30), 6 << 30, 1 << 30)}, 3),  # 8 GiB limit, 6 used, 1 of it cache
        ({"/": ("max", 0, 0), "/pod": (str(4 << 30), 1 << 30, 0), "/pod/ctr": ("max", 1 << 30, 0)}, 3),  # parent's
        ({"/": ("max", 0, 0), "/pod": (str(8 << 30), 9 << 30, 0)}, 0),  # over its limit: nothing to spare
    ],
)
def test_memory_available_is_the_containers_not_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limits: dict[str, tuple[str, int, int]], want_gib: int
) -> None:
    """A rank in a container limited to 8 GiB of a 128 GiB host: the stripes' memory guard takes the limit, less
    what the container holds that it cannot drop (a parent group's limit counts too), not the host's MemAvailable."""
    _cgroups(tmp_path, monkeypatch, _memory_v2(limits), f"0::{max(limits, key=len)}\n")
    assert host_stripes.memory_available() == want_gib << 30


UNLIMITED_V1 = 9223372036854771712  # what cgroup v1 reports for no limit


@pytest.mark.parametrize(
    ("limits", "own", "want_gib"),
    [
        ({"/": (UNLIMITED_V1, 0, 0)}, "/", 64),  # no limit: the host's MemAvailable
        ({"/": (UNLIMITED_V1, 0, 0), "/kubepods/pod": (8 << 30, 6 << 30, 1 << 30)}, "/kubepods/pod", 3),
        ({"/": (UNLIMITED_V1, 0, 0), "/kubepods": (4 << 30, 1 << 30, 0), "/kubepods/ctr": (UNLIMITED_V1, 1 << 30, 0)},
         "/kubepods/ctr", 3),  # a parent's limit
        # docker's own mount: /proc/self/cgroup names a path the container cannot see; its mount is its group
        ({"/": (8 << 30, 6 << 30, 1 << 30)}, "/docker/0123abcd", 3),
        ({"/": (UNLIMITED_V1, 0, 0), "/pod": (8 << 30, 9 << 30, 0)}, "/pod", 0),  # over its limit
    ],
)  # fmt: skip
def test_memory_available_reads_a_cgroup_v1_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limits: dict[str, tuple[int, int, int]], own: str, want_gib: int
) -> None:
    """Hosts still on cgroup v1 (or hybrid: the memory controller on v1) limit a container the same way: the
    stripes' memory guard takes the limit, less what the group holds that it cannot drop."""
    files = {f"memory/{group.strip('/')}": {"memory.limit_in_bytes": str(most), "memory.usage_in_bytes": str(used),
                                           "memory.stat": f"cache {cache // 2}\nrss 1000\ntotal_cache {cache}"}
             for group, (most, used, cache) in limits.items()}  # fmt: skip
    _cgroups(tmp_path, monkeypatch, files, f"12:cpu,cpuacct:{own}\n9:memory:{own}\n0::/\n")  # a hybrid host's
    assert host_stripes.memory_available() == want_gib << 30


def test_no_stripes_past_the_containers_memory(
    cold_rank: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Files larger than half of what the container may still hold are not striped (each rank reads its own)."""
    size = data_bytes(cold_rank)
    limits = {"/": ("max", 0, 0), "/pod": (str(size + (1 << 20)), 1 << 20, 0)}
    _cgroups(tmp_path, monkeypatch, _memory_v2(limits), "0::/pod\n")
    with caplog.at_level(logging.DEBUG, logger="shardload.host"), count_reads() as seen:
        got = shardload.load_rank(cold_rank, 0, 2)
    assert seen.warmed == 0
    assert any("no stripes" in r.getMessage() and "memory" in r.getMessage() for r in caplog.records)
    want = reference_shards(cold_rank, 2)[0]
    for name, t in got.items():
        np.testing.assert_array_equal(t.numpy(), want[name], err_msg=name)


@pytest.mark.parametrize(
    ("files", "own", "want"),
    [
        ({"/": {"cpu.max": "max 100000"}}, "0::/\n", 16),  # no quota: the affinity's 16
        ({"/": {"cpu.max": "max 100000"}, "/pod": {"cpu.max": "250000 100000"}}, "0::/pod\n", 3),  # --cpus=2.5
        ({"/": {}, "/pod": {"cpu.max": "400000 100000"}, "/pod/c": {"cpu.max": "max 100000"}}, "0::/pod/c\n", 4),
        ({"/": {}, "/pod": {"cpu.max": "50000 100000"}}, "0::/pod\n", 1),  # half a core: at least one
        ({"cpu": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
          "cpu/kubepods": {"cpu.cfs_quota_us": "200000", "cpu.cfs_period_us": "100000"}},
         "4:cpu,cpuacct:/kubepods\n0::/\n", 2),  # cgroup v1's cpu controller (a hybrid host)
        ({"cpu": {"cpu.cfs_quota_us": "300000", "cpu.cfs_period_us": "100000"}}, "4:cpu,cpuacct:/docker/ab\n", 3),
    ],
)  # fmt: skip
def test_host_cores_count_a_containers_cpu_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, dict[str, str]], own: str, want: int
) -> None:
    """A container limited to 2.5 CPUs (``docker --cpus``, a Kubernetes CPU limit) on a 16-core host keeps every
    core in its affinity; its reader, writer and hashing threads count 3 cores, not 16 (v2's ``cpu.max`` or v1's
    ``cpu.cfs_quota_us``, its group's or a parent's, the least)."""
    _cgroups(tmp_path, monkeypatch, files, own)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert host_group.host_cores() == want
