"""A single rank's two ways of getting its bytes: strided copies out of a mapping (short runs: column slices) and
``preadv`` of the exact runs (long runs, or a reader whose files cannot be mapped), with cold-storage hints when the
page cache does not hold the rank's pages. Every way gives the unsharded reference's slices, element for element,
and reads only the rank's own bytes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import shardload
import shardload.engine.transfer as transfer
from helpers.checkpoints import write_model
from helpers.model_reference import reference_shards
from helpers.reading import drop_from_cache
from shardload.sources.reader import PAGE, FileMaps, count_reads


@pytest.mark.parametrize("strategy", ["map", "read", "plan", "auto"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_strategies_match_reference(example_dir: Path, strategy: str, n: int) -> None:
    options = shardload.ReadOptions(strategy=strategy)
    want = reference_shards(example_dir, n)
    plan = shardload.plan_model(example_dir, n)
    for r in range(n):
        with count_reads() as seen:
            got = shardload.load_rank(example_dir, r, n, read_options=options)
        assert got.keys() == want[r].keys()
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"{strategy} rank {r} {name}")
        own = sum(t.numel() * t.element_size() for name, t in got.items() if plan.params[name].remap)
        whole = sum(p.source.nbytes for p in plan.params.values() if not p.remap)
        assert own <= seen.bytes <= own + whole
        if strategy == "map":
            assert seen.calls <= len([p for p in plan.params.values() if not p.remap])  # copies make no calls


@pytest.mark.parametrize("n", [2, 8])
def test_staged_copy_out_matches_reference(example_dir: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU route, run on the CPU: strided copies out of the mapping gather a rank's bytes into small staging
    buffers (cycled many times per tensor), each then copied to the rank's tensor."""
    from shardload.engine.run import run_plan

    monkeypatch.setattr(transfer, "STAGE_BYTES", 4096)
    want = reference_shards(example_dir, n)
    plan = shardload.plan_model(example_dir, n)
    for r in range(n):
        with count_reads() as seen:
            got = run_plan(plan, [r], ["cpu"], staged=True, read_options=shardload.ReadOptions(strategy="map"))[0]
        assert got.keys() == want[r].keys()
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"rank {r} {name}")
        own = sum(t.numel() * t.element_size() for name, t in got.items() if plan.params[name].remap)
        assert own <= seen.bytes
        assert seen.calls <= len([p for p in plan.params.values() if not p.remap])  # copies, not reads


def test_column_slice_of_tall_narrow_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny runs (a few bytes per row) are copied out of the mapping, whatever the cache holds."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 8)).astype(np.float32)
    info = {"w": [["shard_funcs.shard_dim", [[4, 4096, 2], "float32"], 1, 4]]}
    model = write_model(tmp_path / "m", {"w": w}, info)
    for r in range(4):
        with count_reads() as seen:
            got = shardload.load_rank(model, r, 4)
        np.testing.assert_array_equal(got["w"].numpy(), w[:, 2 * r : 2 * r + 2])
        assert seen.bytes == w.nbytes // 4 and seen.calls == 0


def _drop_cache(path: Path) -> float | None:
    """Drop ``path``'s pages from the page cache; return the cached fraction that is left."""
    drop_from_cache(path)
    size = path.stat().st_size
    return FileMaps().resident(path, np.array([0]), np.array([size]))


def _two_kinds(directory: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A model with a dim-0 split (one 256 KiB run per rank at N=4) and a column split (512-byte runs)."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((512, 1024)).astype(np.float16)
    cols = rng.standard_normal((512, 1024)).astype(np.float16)
    info = {
        "rows": [["shard_funcs.shard_dim", [[4, 128, 1024], "float16"], 0, 4]],
        "cols": [["shard_funcs.shard_dim", [[4, 512, 256], "float16"], 1, 4]],
    }
    return write_model(directory, {"rows": rows, "cols": cols}, info), rows, cols


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[object]]:
    """Record the reader's cold-storage hints (the calls still happen)."""
    from shardload.sources.reader import Reader

    seen: dict[str, list[object]] = {"prefetch": [], "no_readahead": []}
    prefetch, no_readahead = Reader.prefetch, Reader.no_readahead

    def spy_prefetch(self: Reader, path: Path, starts: list[int], ends: list[int]) -> None:
        seen["prefetch"].append((list(starts), list(ends)))
        prefetch(self, path, starts, ends)

    def spy_no_readahead(self: Reader, path: Path) -> None:
        seen["no_readahead"].append(path)
        no_readahead(self, path)

    monkeypatch.setattr(Reader, "prefetch", spy_prefetch)
    monkeypatch.setattr(Reader, "no_readahead", spy_no_readahead)
    return seen


def _read_bytes() -> int | None:
    """Bytes this process has fetched from storage so far (``/proc/self/io`` read_bytes), None where unknown."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return None
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("read_bytes:")))


def test_auto_warm_copies_short_pieces_out_of_the_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page cache warm: the dim-0 shard (256 KiB) and the column slice are copied out of the mapping (no read
    call), a replicated 1 MiB tensor (one run of ``CACHED_READ_RUN``) is read in one call; every byte counted once,
    and no cold-storage hint is given."""
    model, rows, cols = _two_kinds(tmp_path / "m")
    (model / "model.safetensors").read_bytes()  # warm
    seen = _spy(monkeypatch)
    for r in range(4):
        only_rows = {"version": 1, "params": {"rows": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}}
        with count_reads() as rows_read:
            got = shardload.load_rank(model, r, 4, shard_info=only_rows)
        np.testing.assert_array_equal(got["rows"].numpy(), rows[128 * r : 128 * (r + 1)])
        np.testing.assert_array_equal(got["cols"].numpy(), cols)  # replicated under this shard_info
        assert rows_read.bytes == rows.nbytes // 4 + cols.nbytes and rows_read.calls == 1
        with count_reads() as both:
            got = shardload.load_rank(model, r, 4)
        np.testing.assert_array_equal(got["rows"].numpy(), rows[128 * r : 128 * (r + 1)])
        np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 256 * r : 256 * (r + 1)])
        assert both.bytes == (rows.nbytes + cols.nbytes) // 4 and both.calls == 0
    assert seen == {"prefetch": [], "no_readahead": []}


def test_auto_warm_reads_long_runs_and_maps_short_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page cache warm: a dim-0 shard of at least ``CACHED_READ_RUN`` bytes per rank is read with ``preadv`` (no
    mapping to fault in), a column slice (2 KiB runs) is still copied out of the mapping; both exact, every byte
    counted once, and no cold-storage hint given."""
    from shardload.engine.read_strategy import CACHED_READ_RUN

    rng = np.random.default_rng(2)
    rows = rng.standard_normal((4 * CACHED_READ_RUN // 4096, 1024)).astype(np.float32)  # 1 MiB a rank at N=4
    cols = rng.standard_normal((256, 2048)).astype(np.float32)
    info = {
        "rows": [["shard_funcs.shard_dim", [[4, rows.shape[0] // 4, 1024], "float32"], 0, 4]],
        "cols": [["shard_funcs.shard_dim", [[4, 256, 512], "float32"], 1, 4]],
    }
    model = write_model(tmp_path / "m", {"rows": rows, "cols": cols}, info)
    (model / "model.safetensors").read_bytes()  # warm
    seen = _spy(monkeypatch)
    quarter = rows.shape[0] // 4
    for r in range(4):
        only_cols = {"version": 1, "params": {"cols": info["cols"]}}
        with count_reads() as whole_rows:
            got = shardload.load_rank(model, r, 4, shard_info=only_cols)  # rows replicated: one 4 MiB run, read
        np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 512 * r : 512 * (r + 1)])
        np.testing.assert_array_equal(got["rows"].numpy(), rows)
        assert whole_rows.bytes == rows.nbytes + cols.nbytes // 4 and whole_rows.calls == 1
        with count_reads() as cols_only:
            got = shardload.load_rank(model, r, 4, params=["cols"])
        np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 512 * r : 512 * (r + 1)])
        assert cols_only.bytes == cols.nbytes // 4 and cols_only.calls == 0  # short runs: mapped, no read call
        with count_reads() as both:
            got = shardload.load_rank(model, r, 4)
        np.testing.assert_array_equal(got["rows"].numpy(), rows[quarter * r : quarter * (r + 1)])
        assert both.bytes == (rows.nbytes + cols.nbytes) // 4 and both.calls == 1  # the 1 MiB shard: one call
    assert seen == {"prefetch": [], "no_readahead": []}


def test_auto_cold_fetches_only_the_rank_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page cache cold: the dim-0 shard and the column slice are both read as planned I/O (their pages, readahead
    off, every planned read requested up front); storage is asked for no other page, and the readers deliver
    exactly the rank's bytes while counting the bytes they read through as moved."""
    model, rows, cols = _two_kinds(tmp_path / "m")
    path = model / "model.safetensors"
    plan = shardload.plan_model(model, 4)
    seen = _spy(monkeypatch)
    left = _drop_cache(path)
    if left is None or left > 0.5:
        pytest.skip(f"the kernel kept the file's pages cached ({left})")
    before = _read_bytes()
    with count_reads() as counted:
        got = shardload.load_rank(model, 1, 4)
    after = _read_bytes()
    np.testing.assert_array_equal(got["rows"].numpy(), rows[128:256])
    np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 256:512])
    assert counted.bytes == (rows.nbytes + cols.nbytes) // 4
    assert counted.moved > counted.bytes  # the column slice's rows share pages with other ranks' bytes
    requested = [(a, b) for starts, ends in seen["prefetch"] for a, b in zip(starts, ends, strict=True)]
    assert all(a % PAGE == 0 for a, _ in requested) and seen["no_readahead"]  # whole pages, readahead off
    assert sum(b - a for a, b in requested) == counted.moved  # requested up front: exactly the planned reads
    pages = 0
    for p in plan.params.values():
        lo, hi = p.source.offset, p.source.offset + p.source.nbytes
        pages += (hi - 1) // PAGE - lo // PAGE + 1 if p.name == "cols" else -(-p.rank_nbytes // PAGE) + 1
    assert counted.moved <= pages * PAGE
    if before is not None and after is not None and after > before:  # the kernel reports storage reads here
        assert after - before <= pages * PAGE  # the rank's pages (a column slice touches every row's page)


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("strategy", ["map", "read", "plan"])
def test_forced_strategies_warm_and_cold(tmp_path: Path, strategy: str, cold: bool) -> None:
    """Either way forced, from a warm or a cold page cache: the reference's slices, exactly the rank's bytes."""
    options = shardload.ReadOptions(strategy=strategy)
    model, rows, cols = _two_kinds(tmp_path / "m")
    for r in range(4):
        if cold:
            _drop_cache(model / "model.safetensors")
        with count_reads() as seen:
            got = shardload.load_rank(model, r, 4, read_options=options)
        np.testing.assert_array_equal(got["rows"].numpy(), rows[128 * r : 128 * (r + 1)])
        np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 256 * r : 256 * (r + 1)])
        assert seen.bytes == (rows.nbytes + cols.nbytes) // 4
        assert (seen.calls == 0) == (strategy == "map")


class _Remote(shardload.sources.reader.Reader):
    """A reader whose files must not be mapped (as a remote object store's)."""

    can_map = False


def test_unmappable_reader_is_only_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that says its files cannot be mapped gets read_runs calls only, for every kind of run."""
    from shardload.engine.paths import data_path_for
    from shardload.engine.transfer import Transfer
    from shardload.sources import reader as reader_module

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a file of an unmappable reader was mapped")

    monkeypatch.setattr(reader_module.FileMaps, "bytes", refuse)
    monkeypatch.setattr(reader_module.Mappings, "_map", refuse)
    model, rows, cols = _two_kinds(tmp_path / "m")
    plan = shardload.plan_model(model, 4)
    for mapped in (False, True):
        path = data_path_for(["cpu"], mmap=mapped, one_rank=True)
        with count_reads() as seen, _Remote() as files, Transfer(files, path=path) as t:
            got = {name: t.param(p, [2])[0] for name, p in plan.params.items()}
            t.wait()
        np.testing.assert_array_equal(got["rows"].numpy(), rows[256:384])
        np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 512:768])
        assert seen.bytes == (rows.nbytes + cols.nbytes) // 4 and seen.calls >= 512  # one preadv per row


def test_read_options_set_the_reader_threads() -> None:
    """``threads`` overrides the default and an object store's own number (0: no pool, reads in the calling thread);
    None keeps them."""
    from shardload.engine.read_strategy import READ_THREADS
    from shardload.engine.transfer import Transfer
    from shardload.sources.object_reader import ObjectReader
    from shardload.sources.reader import Reader

    assert shardload.ReadOptions().threads_for(Reader()) == READ_THREADS
    assert shardload.ReadOptions().threads_for(ObjectReader()) == ObjectReader.threads
    assert shardload.ReadOptions(threads=3).threads_for(ObjectReader()) == 3
    with Reader() as files, Transfer(files, read_options=shardload.ReadOptions(threads=0)) as t:
        assert t.threads == 0 and t.pool is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.bool])
def test_copy_bytes_equals_torch_copy(dtype: torch.dtype) -> None:
    """The numpy copy used in reader threads gives what ``copy_`` gives, strided or not, any dtype and rank."""
    from shardload.engine.copy_jobs import copy_bytes

    g = torch.Generator().manual_seed(0)
    whole = torch.randint(0, 100, (64, 48), generator=g).to(dtype)
    for src in (whole, whole[:, 8:24], whole[3:40], whole[5], whole[:, 7], whole[2, 3], whole.t()):
        dst = torch.empty(src.shape, dtype=dtype)
        copy_bytes(dst, src)
        assert torch.equal(dst, src.clone())


def test_probes_lie_in_the_runs() -> None:
    from shardload.sources.reader import PROBES, probes

    starts = np.array([0, 5000, 9000, 100_000], dtype=np.int64)
    ends = np.array([10, 5200, 9100, 200_000], dtype=np.int64)
    got = probes(starts, ends)
    assert 0 < len(got) <= PROBES and got == sorted(got)
    assert all(any(a <= x < b for a, b in zip(starts, ends, strict=True)) for x in got)
    assert probes(starts[:1], ends[:1], 64) == list(range(10))  # fewer bytes than probes: each byte once
    assert max(got) >= 100_000  # spread over the bytes, the long run included


def test_release_keeps_the_page_cache(tmp_path: Path) -> None:
    """Unmapping after a load drops this process's page-table entries only: the file stays cached and readable."""
    model, rows, _ = _two_kinds(tmp_path / "m")
    path = model / "model.safetensors"
    path.read_bytes()
    maps = FileMaps()
    before = maps.resident(path, np.array([0]), np.array([path.stat().st_size]))
    maps.release()
    after = FileMaps().resident(path, np.array([0]), np.array([path.stat().st_size]))
    assert before == after == 1.0
    np.testing.assert_array_equal(shardload.load_rank(model, 0, 4)["rows"].numpy(), rows[:128])


def test_file_cut_short_is_an_error_not_sigbus(tmp_path: Path) -> None:
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    model = write_model(tmp_path / "m", {"w": w}, {"w": [["shard_funcs.shard_dim", [[2, 64, 32], "float32"], 1, 2]]})
    plan = shardload.plan_model(model, 2)
    path = model / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1024)
    with pytest.raises(shardload.CheckpointError, match="shorter than its header says"):
        shardload.engine.run.run_plan(plan, [0], ["cpu"], read_options=shardload.ReadOptions(strategy="map"))


def test_warm_file_is_probed_once_a_partly_cached_one_per_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file found cached as a whole (sampled once) asks no page-cache question per parameter; with one tensor's
    pages dropped the file is not warm, each parameter is asked about, and only the cold one is read from storage."""
    from shardload.sources.reader import FileMaps

    model, rows, cols = _two_kinds(tmp_path / "m")
    path = model / "model.safetensors"
    plan = shardload.plan_model(model, 4)
    asked: list[int] = []
    cached = FileMaps.cached

    def spy_cached(self: FileMaps, file: Path, offsets: list[int], end: int) -> float | None:
        asked.append(len(offsets))
        return cached(self, file, offsets, end)

    monkeypatch.setattr(FileMaps, "cached", spy_cached)
    path.read_bytes()  # warm
    got = shardload.load_rank(model, 2, 4)
    np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 512:768])
    assert asked == [shardload.sources.reader.FILE_PROBES]  # the file-wide sample, nothing per parameter

    col = plan.params["cols"].source
    for thread in threading.enumerate():  # pages still mapped by this process cannot be dropped
        if thread.name == "shardload-unmap":
            thread.join()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, col.offset, col.nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = FileMaps().resident(path, np.array([col.offset]), np.array([col.offset + col.nbytes]))
    if left is None or left > 0.25:  # its first page, shared with the header, stays
        pytest.skip(f"the kernel kept the column tensor's pages cached ({left})")
    asked.clear()
    seen = _spy(monkeypatch)
    got = shardload.load_rank(model, 2, 4)
    np.testing.assert_array_equal(got["rows"].numpy(), rows[256:384])
    np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 512:768])
    assert asked[0] == shardload.sources.reader.FILE_PROBES and len(asked) == 3  # the file, then each parameter
    assert seen["no_readahead"] == [path] and len(seen["prefetch"]) == 1  # the cold one alone, as planned I/O


def test_read_options_refuse_bad_io_settings() -> None:
    """The planned-read settings are checked when the options are made, one line each."""
    for bad in ({"max_waste": -1}, {"max_waste": float("nan")}, {"max_waste": True}, {"io_depth": -1},
                {"io_depth": 2.0}, {"io_model": (1e-4, 1e9)}):  # fmt: skip
        with pytest.raises(shardload.ShardloadError, match=next(iter(bad))):
            shardload.ReadOptions(**bad)  # type: ignore[arg-type]
    assert shardload.ReadOptions(max_waste=float("inf"), io_depth=0, io_model=shardload.IoModel(1e-4, 1e9))


def test_read_options_from_a_servers_json_config(example_dir: Path) -> None:
    """``ReadOptions.from_config`` reads the JSON a server's config holds (vLLM's ``model_loader_extra_config``): the
    options it makes are the ones the constructor makes, and a load with them gives the reference's slices."""
    got = shardload.ReadOptions.from_config(
        {"strategy": "plan", "threads": 1, "max_waste": "inf", "io_depth": 3,
         "io_model": "request_s=2e-4,bandwidth=1.5e9", "object_cost": {"latency": 0.005, "bandwidth": 1e9}}
    )  # fmt: skip
    want = shardload.ReadOptions(strategy="plan", threads=1, max_waste=float("inf"), io_depth=3,
                                 io_model=shardload.IoModel(2e-4, 1.5e9),
                                 object_cost=shardload.ObjectCost(latency=0.005, bandwidth=1e9))  # fmt: skip
    assert got == want
    assert shardload.ReadOptions.from_config({}) == shardload.ReadOptions()
    assert shardload.ReadOptions.from_config({"threads": None}) == shardload.ReadOptions()  # JSON null: the default
    assert shardload.ReadOptions.from_config({"io_model": {"request_s": 0, "bandwidth": 2e9}, "max_waste": 0.1,
                                              "object_cost": "measure"}) == shardload.ReadOptions(
        io_model=shardload.IoModel(0, 2e9), max_waste=0.1, object_cost="measure")  # fmt: skip
    ref = reference_shards(example_dir, 4)
    state = shardload.load_rank(example_dir, 2, 4, read_options=got)
    for name, t in state.items():
        np.testing.assert_array_equal(t.numpy(), ref[2][name], err_msg=name)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"max_waste": "lots"}, "read_options.max_waste: expected a number >= 0 or \"inf\", got 'lots'"),
        ({"max_waste": True}, "read_options.max_waste: expected a number"),
        ({"max_waste": -0.5}, "read_options: max_waste must be a number >= 0"),
        ({"threads": -1}, "read_options.threads: expected an integer >= 0, got -1"),
        ({"threads": 2.0}, "read_options.threads: expected an integer >= 0"),
        ({"io_depth": "8"}, "read_options.io_depth: expected an integer >= 0"),
        ({"io_depth": None}, "read_options.io_depth: expected an integer >= 0, got None"),
        ({"strategy": "mmap"}, "read_options.strategy: expected one of auto, map, read, plan, view, got 'mmap'"),
        ({"max_waste": 10**400}, "read_options.max_waste: int too large to convert to float"),
        ({"io_model": "request_s=1e-4"}, "read_options.io_model: expected request_s and bandwidth, as a mapping"),
        ({"io_model": "request_s=1,request_s=2,bandwidth=1e9"}, "read_options.io_model: expected request_s and"),
        ({"io_model": {"request_s": 1e-4, "bandwidth": 0}}, "read_options.io_model: an I/O model needs finite"),
        ({"io_model": {"request_s": "x", "bandwidth": 1}}, "read_options.io_model: an I/O model needs finite"),
        ({"io_model": "request_s=inf,bandwidth=1e9"}, "read_options.io_model: an I/O model needs finite"),
        ({"io_model": {"request_s": 0, "bandwidth": 1e400}}, "read_options.io_model: an I/O model needs finite"),
        ({"object_cost": "fast"}, "read_options.object_cost: expected exact, merged, measure or latency"),
        ({"object_cost": {"latency": 0.01}}, "read_options.object_cost: expected exact, merged, measure or a mapping"),
        ({"object_cost": {"latency": -1, "bandwidth": 1e9}}, "read_options.object_cost: ObjectCost.latency must be"),
        (
            {"object_cost": {"latency": 0.01, "bandwidth": 1e9, "concurrency": 1.0}},
            "read_options.object_cost: ObjectCost.concurrency must be an int",
        ),
        ({"object_cost": {"latency": 10**400, "bandwidth": 1e9}}, "read_options.object_cost: int too large"),
        ({"threads": 1, "max_wast": 0.1}, "read_options: unknown key(s) ['max_wast']; accepted: ['strategy'"),
        (["threads", 1], "read_options: expected a mapping of read options"),
    ],
)
def test_read_options_from_config_refuse_bad_values_in_one_line(config: object, message: str) -> None:
    with pytest.raises(shardload.ShardloadError) as err:
        shardload.ReadOptions.from_config(config)  # type: ignore[arg-type]
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("waste", [0.0, float("inf")])
def test_planned_reads_tally_used_moved_and_page_floor(tmp_path: Path, waste: float) -> None:
    """A transfer's planned reads report the bytes the rank uses, the page floor of them and the bytes moved: the
    budget 0 moves exactly the floor; an unbounded one under a model where every gap pays moves more, never
    less; either way the tensors are the rank's slices."""
    from shardload.engine.paths import data_path_for
    from shardload.engine.transfer import Transfer
    from shardload.sources.reader import Reader

    model, rows, cols = _two_kinds(tmp_path / "m")
    plan = shardload.plan_model(model, 4)
    options = shardload.ReadOptions(strategy="plan", max_waste=waste, io_model=shardload.IoModel(1.0, 1e9))
    path = data_path_for(["cpu"], one_rank=True)
    with count_reads() as seen, Reader() as files, Transfer(files, path=path, read_options=options) as t:
        got = {name: t.param(p, [1])[0] for name, p in plan.params.items()}
        t.wait()
        tally = t.path.io  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got["rows"].numpy(), rows[128:256])
    np.testing.assert_array_equal(got["cols"].numpy(), cols[:, 256:512])
    assert tally.used == seen.bytes == (rows.nbytes + cols.nbytes) // 4 and tally.reads > 0
    assert tally.moved == seen.moved
    assert (tally.moved == tally.page_floor) if waste == 0 else (tally.moved >= tally.page_floor)


@pytest.mark.parametrize("strategy", ["plan", "auto"])
def test_planned_reads_fill_given_tensors_in_place(tmp_path: Path, strategy: str) -> None:
    """A server's own parameter memory (``out=``, as vLLM passes it) is filled in place by planned cold reads, both
    the long runs read with ``preadv`` and the short ones copied out of the mapping."""
    from shardload.engine.paths import data_path_for
    from shardload.engine.transfer import Transfer
    from shardload.sources.reader import Reader

    model, rows, cols = _two_kinds(tmp_path / "m")
    plan = shardload.plan_model(model, 4)
    _drop_cache(model / "model.safetensors")
    outs = {name: torch.full(p.shape, 7, dtype=torch.float16) for name, p in plan.params.items()}
    options = shardload.ReadOptions(strategy=strategy)
    with Reader() as files, Transfer(files, path=data_path_for(["cpu"], one_rank=True), read_options=options) as t:
        for name, p in plan.params.items():
            assert t.param(p, [2], out=[outs[name]])[0] is outs[name]
        t.wait()
    np.testing.assert_array_equal(outs["rows"].numpy(), rows[256:384])
    np.testing.assert_array_equal(outs["cols"].numpy(), cols[:, 512:768])
