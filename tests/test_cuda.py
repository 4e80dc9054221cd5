"""The CUDA paths (pinned staging buffers, side-stream uploads, device placement), checked element for element
against the numpy reference and against the same loads onto the CPU. Skipped cleanly without a GPU; the
quantized formats' own tests (test_quant_formats, test_quantize) add their CUDA comparisons when one is present."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import shardload
from helpers.checkpoints import parallel_model
from helpers.model_reference import assert_same, reference_shards
from helpers.reading import check_reads_into_slots
from shardload.errors import ShardloadError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = "cuda:0"


def same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], device: str = GPU) -> None:
    """Every tensor of ``got`` is on ``device`` and holds exactly ``want``'s dtype, shape and bytes."""
    assert set(got) == set(want)
    for name, t in got.items():
        ref = want[name]
        assert t.device == torch.device(device), name
        assert (t.dtype, t.shape) == (ref.dtype, ref.shape), name
        assert t.is_contiguous(), name
        assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), ref.cpu().reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("n", (1, 2, 4))
def test_load_every_rank_onto_one_gpu(example_dir: Path, example_multi_dir: Path, n: int) -> None:
    want = reference_shards(example_dir, n)
    for model in (example_dir, example_multi_dir):
        shards = shardload.load(model, n, devices=[GPU] * n)
        for r in range(n):
            assert all(t.device == torch.device(GPU) for t in shards[r].values())
            assert_same(shards[r], want[r])


def test_load_rank_onto_gpu(example_dir: Path) -> None:
    n = 4
    want = reference_shards(example_dir, n)
    for r in range(n):
        got = shardload.load_rank(example_dir, r, n, device=GPU)
        assert all(t.device == torch.device(GPU) for t in got.values())
        assert_same(got, want[r])
    with pytest.raises(ShardloadError, match=r"ReadOptions\(strategy=.view.\) maps files into host memory"):
        shardload.load_rank(example_dir, 0, n, device=GPU, mmap=True)


def test_converted_directory_onto_gpu(example_dir: Path, tmp_path: Path) -> None:
    n = 4
    out = tmp_path / "tp4"
    shardload.convert(example_dir, n, out)
    want = reference_shards(example_dir, n)
    shards = shardload.load(out, n, devices=[GPU] * n)
    for r in range(n):
        assert_same(shards[r], want[r])
        assert_same(shardload.load_rank(out, r, n, device=GPU, verify=True), want[r])


# Every dtype a checkpoint may hold, in tensors large enough that a rank's column slice goes through the pinned
# staging buffers (4 MiB each, a 64 KiB slice at least) and several buffers are cycled per tensor.
DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


def _random(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    t = raw.view(dtype).reshape(shape)
    if dtype.is_floating_point:  # no NaN: equality by bytes would still hold, but keep the data plain
        t = torch.where(torch.isfinite(t.float()), t, torch.zeros((), dtype=dtype))
    return t


@pytest.fixture(scope="module")
def dtype_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gen = torch.Generator().manual_seed(17)
    tensors: dict[str, torch.Tensor] = {}
    params = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        cols = (8 << 20) // (1024 * dtype.itemsize)  # 8 MiB: 2 MiB slices for N=4
        tensors[f"{name}.col"] = _random(gen, (1024, cols), dtype)
        tensors[f"{name}.row"] = _random(gen, (1024, 96), dtype)
        tensors[f"{name}.whole"] = _random(gen, (7, 5), dtype)
        for kind, dim, shape in (("col", 1, (1024, cols)), ("row", 0, (1024, 96))):
            out = ["num_shards", *shape]
            out[dim + 1] = f"{shape[dim]} // num_shards"
            params[f"{name}.{kind}"] = [["shard_funcs.shard_dim", [out, name], dim, "num_shards"]]
    model = tmp_path_factory.mktemp("dtypes") / "model"
    model.mkdir()
    save_file(tensors, str(model / "model.safetensors"))
    import json

    (model / "shard_info.json").write_text(json.dumps({"version": 1, "params": params}))
    return model


def test_every_dtype_lands_on_gpu_unchanged(dtype_model: Path, tmp_path: Path) -> None:
    n = 4
    on_cpu = shardload.load(dtype_model, n, devices=["cpu"] * n)
    on_gpu = shardload.load(dtype_model, n, devices=[GPU] * n)
    mixed = shardload.load(dtype_model, n, devices=["cpu", GPU, "cpu", GPU])
    for r in range(n):
        same_bytes(on_gpu[r], on_cpu[r])
        same_bytes(mixed[r], on_cpu[r], "cpu" if r % 2 == 0 else GPU)
        same_bytes(shardload.load_rank(dtype_model, r, n, device=GPU), on_cpu[r])
    out = tmp_path / "converted"
    shardload.convert(dtype_model, n, out)
    for r in range(n):
        same_bytes(shardload.load_rank(out, r, n, device=torch.device(GPU)), on_cpu[r])


def test_gpu_results_are_ready_and_independent(dtype_model: Path) -> None:
    """The uploads ran on side streams: the tensors handed back are complete for work on the default stream (a
    reduction queued at once sees every byte), and each rank's tensors own their memory."""
    shards = shardload.load(dtype_model, 2, devices=[GPU, GPU])
    sums = [int(s["int32.col"].long().sum()) for s in shards]  # queued on the default stream right away
    cpu = shardload.load(dtype_model, 2, devices=["cpu", "cpu"])
    assert sums == [int(s["int32.col"].long().sum()) for s in cpu]
    shards[0]["int8.whole"].fill_(3)
    assert torch.equal(shards[1]["int8.whole"].cpu(), cpu[1]["int8.whole"])


def test_default_devices_are_the_gpus(example_dir: Path) -> None:
    count = torch.cuda.device_count()
    shards = shardload.load(example_dir, count)
    assert [next(iter(s.values())).device for s in shards] == [torch.device("cuda", r) for r in range(count)]


@pytest.mark.parametrize("copy_out", (False, True))
def test_reading_into_callers_gpu_tensors(tmp_path: Path, copy_out: bool) -> None:
    check_reads_into_slots(parallel_model(tmp_path / "model"), GPU, copy_out)


@pytest.mark.parametrize("strategy", ("auto", "map", "read"))
def test_a_load_inside_a_side_stream_waits_for_its_work(tmp_path: Path, strategy: str) -> None:
    """A caller loading inside ``torch.cuda.stream(s)`` while work queued on ``s`` still writes memory it freed
    (the caching allocator hands that memory out again on ``s`` at once): the uploads, on shardload's side stream,
    must wait for ``s``, so the last write of the freed tensor lands before the load's bytes, never after them.
    Rank 3 of 8's column slice goes out of the mapping (auto, map), the rest through spans or staged reads."""
    from helpers.checkpoints import random_array, write_model

    x = random_array(np.random.default_rng(0), (2048, 1024), "float16")
    y = random_array(np.random.default_rng(1), (2048, 1024), "float16")
    info = {"version": 1, "params": {"x": [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]],
                                     "y": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}}  # fmt: skip
    model = write_model(tmp_path / "m", {"x": x, "y": y}, info)
    want = shardload.load_rank(model, 3, 8)
    options = shardload.ReadOptions(strategy=strategy)  # type: ignore[arg-type]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        busy = torch.empty(8 << 20, dtype=torch.uint8, device=GPU)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued on the side stream
        busy.fill_(0x7F)  # written after the sleep, into memory freed below
        del busy
        got = shardload.load_rank(model, 3, 8, device=GPU, read_options=options)
    torch.cuda.synchronize()
    same_bytes(got, want)
