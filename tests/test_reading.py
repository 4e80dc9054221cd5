"""The fast read paths against the simple ones and the numpy reference, element for element, and
the bytes they read, counted by the reader's instrumentation (and by the kernel, in /proc/self/io).

Paths: threaded direct ``preadv`` scatter (ctypes) and the portable ``os.preadv`` one, staged reads
through small staging buffers (the CUDA path, run on the CPU), and convert's chunked writer.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardload
import shardload.engine.read_schedule
import shardload.engine.transfer
import shardload.engine.writer
import shardload.sources.reader
from helpers import reference as ref
from helpers.checkpoints import parallel_model, random_array, write_model
from helpers.reading import check_reads_into_slots
from helpers.step_cases import CASES, valid
from shardload.engine.paths import data_path_for
from shardload.engine.run import run_plan
from shardload.engine.transfer import Transfer
from shardload.errors import CheckpointError, PlanError
from shardload.format.shard_info import ShardInfo
from shardload.planning.plan import build_plan
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader, count_reads
from shardload.sources.safetensors_header import read_header

PATHS = ("direct", "portable", "staged", "staged_flat", "convert")


def _chunk_sizes(monkeypatch: pytest.MonkeyPatch, scale: int) -> None:
    monkeypatch.setattr(shardload.engine.transfer, "STAGE_BYTES", 96 * scale)
    monkeypatch.setattr(shardload.engine.read_schedule, "STAGE_MIN_SLICE", 8 * scale)
    monkeypatch.setattr(shardload.engine.transfer, "JOB_BYTES", 72 * scale)
    monkeypatch.setattr(shardload.engine.writer, "STAGE_SET_BYTES", 96 * scale)
    monkeypatch.setattr(shardload.engine.writer, "STAGE_CHUNK_LIMITS", (24 * scale, 200 * scale))
    monkeypatch.setattr(shardload.engine.writer, "READ_THROUGH_BYTES", 16 * scale)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging buffers and jobs of a few dozen bytes, so runs cross chunk and job boundaries."""
    _chunk_sizes(monkeypatch, 1)


@pytest.fixture
def medium_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging buffers and jobs of a few KiB (for the example model)."""
    _chunk_sizes(monkeypatch, 128)


def _shards(path: str, model: Path, n: int, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    plan = shardload.plan_model(model, n)
    if path == "portable":
        monkeypatch.setattr(shardload.sources.reader, "_PREADV", None)
    if path == "staged_flat":  # rank tensors laid end to end in the staging buffers, not side by side
        monkeypatch.setattr(shardload.engine.read_schedule, "STAGE_MIN_SLICE", 1 << 40)
    if path == "convert":
        shardload.convert(model, n, tmp)
        return [shardload.load_rank(tmp, r, n) for r in range(n)]
    return run_plan(plan, range(n), ["cpu"] * n, staged=path.startswith("staged"))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_path_matches_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, path: str) -> None:
    shape, dtype, build = CASES[name]
    for n in (1, 3, 4):
        if not valid(shape, name, n):
            continue
        doc_steps, ref_steps = build(n)
        x = random_array(np.random.default_rng(zlib.crc32(f"{name}-{n}".encode())), shape, dtype)
        info = {"version": 1, "num_shards": None, "params": {"w": doc_steps}}
        other = random_array(np.random.default_rng(n), (3,), dtype)
        model = write_model(tmp_path / f"{n}", {"w": x, "other": other}, info)
        want = ref.rank_slices(x, ref_steps, n)
        got = _shards(path, model, n, tmp_path / f"out{n}", monkeypatch)
        for r in range(n):
            assert got[r]["w"].is_contiguous()
            np.testing.assert_array_equal(got[r]["w"].numpy(), want[r], err_msg=f"{name} n={n} rank {r}")
            np.testing.assert_array_equal(got[r]["other"].numpy(), other)


@pytest.mark.usefixtures("medium_chunks")
@pytest.mark.parametrize("path", PATHS)
def test_example_model_every_path(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    want = shardload.load(example_dir, 4, devices=["cpu"] * 4)
    got = _shards(path, example_dir, 4, tmp_path / "out", monkeypatch)
    for r in range(4):
        assert got[r].keys() == want[r].keys()
        for k in want[r]:
            assert torch.equal(got[r][k], want[r][k]), (path, r, k)


def _rchar() -> int | None:
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return None
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar:")))


@pytest.mark.parametrize("strategy", ("read", "map"))
@pytest.mark.parametrize("n", (2, 4))
def test_load_rank_reads_only_its_bytes(tmp_path: Path, n: int, strategy: str) -> None:
    options = shardload.ReadOptions(strategy=strategy)
    model = parallel_model(tmp_path / "m")
    plan = shardload.plan_model(model, n)
    shardload.load_rank(model, 0, n, read_options=options)  # warm up lazy imports before counting
    for rank in range(n):
        for name, param in plan.params.items():
            single = {name: [[s.name, [None, None], *s.args] for s in param.steps]} if param.steps else {}
            own = param.rank_nbytes  # its shard, or the whole tensor when replicated
            info = {"version": 1, "params": single}
            with count_reads() as seen:
                shardload.load_rank(model, rank, n, shard_info=info, read_options=options)
            # every other tensor is replicated under this one-entry shard_info: count them too
            others = sum(p.source.nbytes for k, p in plan.params.items() if k != name)
            assert own + others <= seen.bytes <= 1.05 * (own + others), (name, rank)
        before = _rchar()
        with count_reads() as seen:
            shardload.load_rank(model, rank, n, read_options=options)
        after = _rchar()
        assert seen.bytes == plan.rank_nbytes(rank)
        assert seen.bytes < sum(p.source.nbytes for p in plan.params.values())
        if before is not None and after is not None:  # the kernel agrees: tensor bytes plus headers and JSON
            read_by_calls = seen.bytes if strategy == "read" else 0  # copies out of a mapping are no read calls
            assert read_by_calls <= after - before <= read_by_calls + (256 << 10)


def test_column_slice_reads_only_its_rows_parts(tmp_path: Path) -> None:
    model = parallel_model(tmp_path / "m")
    info = {"version": 1, "params": {"col": [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]]}}
    plan = shardload.plan_model(model, 4, shard_info=info)
    col = plan.params["col"]
    with count_reads() as seen:
        shardload.load_rank(model, 2, 4, shard_info=info)
    replicated = sum(p.source.nbytes for p in plan.params.values() if p.replicated)
    assert seen.bytes == col.source.nbytes // 4 + replicated


@pytest.mark.parametrize("portable", (False, True))
def test_load_reads_each_stored_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, portable: bool) -> None:
    if portable:
        monkeypatch.setattr(shardload.sources.reader, "_PREADV", None)
    model = parallel_model(tmp_path / "m")
    stored = sum(t.nbytes for t in open_checkpoint(model).tensors.values())
    for n in (1, 2, 4):
        with count_reads() as seen:
            shards = shardload.load(model, n, devices=["cpu"] * n)
        assert seen.bytes == stored
        assert seen.by_file == {str(model / "model.safetensors"): stored}
        for r in range(1, n):  # the replicated tensor was read once and copied
            assert torch.equal(shards[r]["norm"], shards[0]["norm"])
            assert shards[r]["norm"].data_ptr() != shards[0]["norm"].data_ptr()


def test_counting_is_off_outside_the_block(tmp_path: Path) -> None:
    model = parallel_model(tmp_path / "m")
    with count_reads() as seen:
        pass
    shardload.load(model, 2, devices=["cpu"] * 2)
    assert seen.bytes == 0 and shardload.sources.reader._count is None


def test_blocks_that_overlap_each_count_what_is_read_inside_them(tmp_path: Path) -> None:
    """A block inside another, and blocks of two threads left out of order: each counts every read made while it
    is open (an inner block hid its reads from the outer one; a block left while another thread's was open put a dead
    counter back, and the other's reads went uncounted)."""
    import threading

    model = parallel_model(tmp_path / "m")
    stored = sum(t.nbytes for t in open_checkpoint(model).tensors.values())
    with count_reads() as outer:
        with count_reads() as inner:
            shardload.load(model, 2, devices=["cpu"] * 2)
        assert inner.bytes == stored
    assert outer.bytes == stored
    opened, left = threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def first() -> None:
        with count_reads() as mine:
            opened.set()
            left.wait(30)
        seen["first"] = mine.bytes

    thread = threading.Thread(target=first)
    thread.start()
    opened.wait(30)
    with count_reads() as second:
        left.set()
        thread.join(30)  # the first thread's block ends while this one is open
        shardload.load(model, 2, devices=["cpu"] * 2)
    assert second.bytes == stored and seen["first"] == 0
    assert shardload.sources.reader._count is None


def _register_bad(name: str, boxes: Any) -> None:
    def shape(in_shape: tuple[int, ...], dtype: str, num_shards: int) -> tuple[tuple[int, ...], str]:
        return (num_shards, in_shape[0] // num_shards, *in_shape[1:]), dtype

    @shardload.register(name, shape=shape, boxes=boxes)
    def fn(x: torch.Tensor, num_shards: int) -> torch.Tensor:
        return x.reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:])


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("outside", "does not fit"),  # would read past the tensor: refused before any read
        ("gap", "do not cover"),  # would leave bytes of the rank tensor unwritten
    ],
)
def test_faulty_box_rule_is_refused(tmp_path: Path, kind: str, message: str) -> None:
    def boxes(out_box: Any, in_shape: Any, num_shards: int) -> list[Any]:
        (r0, _), rows, cols = out_box
        size = in_shape[0] // num_shards
        a, b = rows
        if kind == "outside":
            return [((((r0 + 1) * size + a, (r0 + 1) * size + b + 5), cols), (out_box[0], (a, b + 5), cols))]
        return [(((r0 * size + a, r0 * size + b - 1), cols), ((r0, r0 + 1), (a, b - 1), cols))]

    _register_bad(f"tests.bad_{kind}", boxes)
    try:
        model = write_model(tmp_path / "m", {"w": random_array(np.random.default_rng(0), (8, 3), "float32")})
        info = {"version": 1, "params": {"w": [[f"tests.bad_{kind}", [None, None], "num_shards"]]}}
        with pytest.raises(PlanError, match=message):
            shardload.load(model, 2, devices=["cpu"] * 2, shard_info=info)
    finally:
        shardload.planning.registry.unregister(f"tests.bad_{kind}")


@pytest.mark.parametrize("portable", (False, True))
def test_file_truncated_after_planning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, portable: bool) -> None:
    if portable:
        monkeypatch.setattr(shardload.sources.reader, "_PREADV", None)
    model = parallel_model(tmp_path / "m")
    plan = shardload.plan_model(model, 2)
    path = model / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match="shorter than its header says"):
        run_plan(plan, range(2), ["cpu"] * 2)
    with pytest.raises(CheckpointError, match="shorter than its header says"):
        run_plan(plan, [1], ["cpu"])


def test_plan_built_elsewhere_still_checks_boxes(tmp_path: Path) -> None:
    model = parallel_model(tmp_path / "m")
    plan = build_plan(ShardInfo.load(model / "shard_info.json"), open_checkpoint(model), 4)
    got = run_plan(plan, [3, 1], ["cpu", "cpu"])
    want = shardload.load(model, 4, devices=["cpu"] * 4)
    for k, rank in enumerate((3, 1)):
        assert all(torch.equal(got[k][name], want[rank][name]) for name in want[rank])


@pytest.mark.parametrize("threads", (1, 3))
def test_convert_with_a_compute_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(shardload.engine.writer, "WRITE_THREADS", threads)

    def rule(shape: tuple[int, ...], dtype: str, num_shards: int) -> tuple[tuple[int, ...], str]:
        return (num_shards, shape[0] // num_shards, *shape[1:]), "float32"

    @shardload.register("tests.doubled_rows", shape=rule)
    def doubled_rows(x: torch.Tensor, num_shards: int) -> torch.Tensor:
        return (x.float() * 2).reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:])

    try:
        model = parallel_model(tmp_path / "m")
        info = json.loads((model / "shard_info.json").read_text())
        info["params"]["norm"] = [["tests.doubled_rows", [None, None], "num_shards"]]
        (model / "shard_info.json").write_text(json.dumps(info))
        want = shardload.load(model, 4, devices=["cpu"] * 4)
        shardload.convert(model, 4, tmp_path / "out")
        for r in range(4):
            got = shardload.load_rank(tmp_path / "out", r, 4, verify=True)
            assert got.keys() == want[r].keys()
            assert all(torch.equal(got[k], want[r][k]) for k in got)
            assert got["norm"].dtype == torch.float32
    finally:
        shardload.planning.registry.unregister("tests.doubled_rows")


@pytest.mark.usefixtures("small_chunks")
def test_converted_file_through_staging(example_dir: Path, tmp_path: Path) -> None:
    shardload.convert(example_dir, 2, tmp_path / "out")
    path = tmp_path / "out" / "rank-00001-of-00002.safetensors"
    infos = list(read_header(path).values())
    with Reader() as reader, Transfer(reader, path=data_path_for(["cpu"], staged=True)) as transfer:
        tensors = transfer.tensors(infos, "cpu")
        transfer.wait()
    want = shardload.load_rank(tmp_path / "out", 1, 2)
    assert [i.name for i in infos] == list(want)
    for info, t in zip(infos, tensors, strict=True):
        assert torch.equal(t, want[info.name]), info.name


@pytest.mark.parametrize("threads", (1, 2))
def test_failed_write_stops_every_worker_and_leaves_nothing(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(shardload.engine.writer, "WRITE_THREADS", threads)
    monkeypatch.setattr(shardload.engine.writer, "STAGE_SET_BYTES", 4096)
    calls = []
    write = shardload.engine.writer.FileWriter.write

    def failing(self: Any, data: memoryview) -> None:
        calls.append(1)
        if len(calls) == 40:
            raise OSError(28, "No space left on device", str(self.path))
        write(self, data)

    monkeypatch.setattr(shardload.engine.writer.FileWriter, "write", failing)
    with pytest.raises((OSError, shardload.ShardloadError), match="No space left"):
        shardload.convert(example_dir, 4, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("strategy", ("auto", "read", "map"))
@pytest.mark.parametrize("copy_out", (False, True))
def test_reading_into_callers_tensors(tmp_path: Path, strategy: str, copy_out: bool) -> None:
    model = parallel_model(tmp_path / "model")
    check_reads_into_slots(model, "cpu", copy_out, strategy)
    plan = shardload.plan_model(model, 4)
    with Reader() as reader, Transfer(reader, read_options=shardload.ReadOptions(strategy=strategy)) as transfer:
        param = plan.params["col"]
        with pytest.raises(ValueError, match="col: out must be 1 contiguous"):
            transfer.param(param, [0], out=[torch.empty((1, *param.shape), dtype=torch.float16)])
        wide = torch.empty((param.shape[0], param.shape[1] * 2), dtype=torch.float16)[:, : param.shape[1]]
        with pytest.raises(ValueError, match="contiguous"):
            transfer.param(param, [0], out=[wide])
