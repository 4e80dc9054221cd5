"""load / load_rank / convert on real checkpoints, against an unsharded numpy reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import shardload
from helpers.checkpoints import random_array, write_model
from helpers.model_reference import assert_same, reference_shards
from shardload.errors import CheckpointError, PlanError, ShardloadError

SEED_FORM = {"x_0": [["shard_funcs.shard_dim", [[2, 64, 64], "float16"], 1, 2]]}


def test_seed_form_example_from_design(tmp_path: Path) -> None:
    x = random_array(np.random.default_rng(7), (64, 128), "float16")
    model = write_model(tmp_path / "seed", {"x_0": x}, SEED_FORM)
    shards = shardload.load(model, 2, devices=["cpu", "cpu"])
    for r in range(2):
        np.testing.assert_array_equal(shards[r]["x_0"].numpy(), x[:, r * 64 : (r + 1) * 64])
        assert torch.equal(shardload.load_rank(model, r, 2)["x_0"], shards[r]["x_0"])
    shardload.convert(model, 2, tmp_path / "out")
    for r in range(2):
        assert torch.equal(shardload.load_rank(tmp_path / "out", r, 2)["x_0"], shards[r]["x_0"])
    with pytest.raises(PlanError, match="for num_shards=2 only"):
        shardload.load_rank(model, 0, 4)


@pytest.mark.parametrize("n", (1, 2, 4, 8))
def test_example_all_paths_agree_with_reference(example_dir: Path, tmp_path: Path, n: int) -> None:
    want = reference_shards(example_dir, n)
    shards = shardload.load(example_dir, n, devices=["cpu"] * n)
    out = tmp_path / f"tp{n}"
    shardload.convert(example_dir, n, out)
    for r in range(n):
        assert_same(shards[r], want[r])
        assert_same(shardload.load_rank(example_dir, r, n), want[r])
        assert_same(shardload.load_rank(out, r, n, verify=True), want[r])
    converted = shardload.load(out, n, devices=["cpu"] * n)
    for r in range(n):
        assert_same(converted[r], want[r])


def test_multi_file_index_matches_single_file(example_dir: Path, example_multi_dir: Path) -> None:
    assert (example_multi_dir / "model.safetensors.index.json").exists()
    single = shardload.load(example_dir, 4, devices=["cpu"] * 4)
    multi = shardload.load(example_multi_dir, 4, devices=["cpu"] * 4)
    want = reference_shards(example_multi_dir, 4)
    for r in range(4):
        assert_same(multi[r], want[r])
        assert single[r].keys() == multi[r].keys()
        for k in single[r]:
            assert torch.equal(single[r][k], multi[r][k])


def test_an_index_naming_one_file_two_ways_reads_it_once(example_multi_dir: Path, tmp_path: Path) -> None:
    """An index that names a file as "a.safetensors" for some tensors and "./a.safetensors" for others (written by
    hand or by another tool) was refused as a tensor stored in two files, a and a."""
    model = tmp_path / "model"
    shutil.copytree(example_multi_dir, model)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "./" + index["weight_map"][first]
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    want = reference_shards(example_multi_dir, 2)
    for r in range(2):
        assert_same(shardload.load_rank(model, r, 2), want[r])


def test_safetensors_file_path_and_explicit_shard_info(example_dir: Path) -> None:
    info = shardload.ShardInfo.load(example_dir / "shard_info.json")
    via_file = shardload.load_rank(example_dir / "model.safetensors", 1, 2, shard_info=info)
    via_dict = shardload.load_rank(example_dir, 1, 2, shard_info=info.to_dict())
    via_path = shardload.load_rank(example_dir, 1, 2, shard_info=str(example_dir / "shard_info.json"))
    assert_same(via_file, reference_shards(example_dir, 2)[1])
    for other in (via_dict, via_path):
        assert all(torch.equal(via_file[k], other[k]) for k in via_file)


def test_missing_shard_info_is_a_clear_error(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(PlanError, match=r"no shard_info given and .*shard_info.json does not exist"):
        shardload.load(model, 2, devices=["cpu", "cpu"])


def test_converted_directory_checks(example_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    result = shardload.convert(example_dir, 2, out)
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["num_shards"] == 2
    assert manifest["shard_info"] == result.plan.resolved_shard_info()
    listed = {f["path"]: f for f in manifest["files"]}
    assert set(listed) == {p.name for p in out.iterdir()} - {"shard_manifest.json"}
    assert {"config.json", "tokenizer_config.json", "generation_config.json"} <= set(listed)
    assert "shard_info.json" not in listed and "model.safetensors" not in listed
    for name, entry in listed.items():  # a rank file by its leaves in shardload.hashes (tests/test_convert_checks.py)
        assert (out / name).stat().st_size == entry["size"]
        if "sha256" in entry:
            assert shardload.engine.verify.sha256_file(out / name) == entry["sha256"]
        else:
            assert name.startswith("rank-") and len(entry["leaves_sha256"]) == 64
    # a rank file must be a standard safetensors file
    assert_same({k: torch.from_numpy(v) for k, v in load_file(str(out / "rank-00001-of-00002.safetensors")).items()},
                reference_shards(example_dir, 2)[1])  # fmt: skip
    assert_same(shardload.load_rank(out, 3, 4), reference_shards(example_dir, 4)[3])  # another N: docs/reshard.md
    with pytest.raises(ShardloadError, match="carries its own shard_info"):
        shardload.load_rank(out, 0, 2, shard_info=example_dir / "shard_info.json")
    with pytest.raises(ShardloadError, match="carries its own shard_info"):
        shardload.convert(out, 2, tmp_path / "again", shard_info=example_dir / "shard_info.json")
    # corrupt one byte: sizes still match, the checksum does not
    rank1 = out / "rank-00001-of-00002.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-1] ^= 0xFF
    rank1.write_bytes(bytes(data))
    shardload.load_rank(out, 1, 2)
    with pytest.raises(CheckpointError, match="does not match its leaves"):
        shardload.load_rank(out, 1, 2, verify=True)
    rank1.write_bytes(bytes(data[:-2]))
    with pytest.raises(CheckpointError, match="the manifest says"):
        shardload.load_rank(out, 1, 2)
    rank1.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        shardload.load_rank(out, 1, 2)


def test_convert_refuses_existing_output_and_replaces_with_overwrite(example_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ShardloadError, match="output directory exists"):
        shardload.convert(example_dir, 2, out)
    with pytest.raises(ShardloadError, match="is not an output of shardload"):  # a user's directory: never deleted
        shardload.convert(example_dir, 2, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    shardload.convert(example_dir, 2, out, overwrite=True)  # an empty directory may be replaced
    shardload.convert(example_dir, 4, out, overwrite=True)  # and so may an earlier output
    assert json.loads((out / "shard_manifest.json").read_text())["num_shards"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["tp2"], "no temporary directories may be left behind"


def test_failed_convert_leaves_nothing(example_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PlanError):
        shardload.convert(example_dir, 3, tmp_path / "tp3")
    assert list(tmp_path.iterdir()) == []


def test_registered_compute_step(tmp_path: Path) -> None:
    def rule(shape: tuple[int, ...], dtype: str, num_shards: int, scale: int) -> tuple[tuple[int, ...], str]:
        return (num_shards, shape[0] // num_shards, *shape[1:]), "float32"

    @shardload.register("tests.scaled_rows", shape=rule)
    def scaled_rows(x: torch.Tensor, num_shards: int, scale: int) -> torch.Tensor:
        return (x.float() * scale).reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:])

    try:
        x = random_array(np.random.default_rng(3), (8, 3), "float16")
        info = {"version": 1, "params": {"w": [["tests.scaled_rows", [None, None], "num_shards", 3]]}}
        model = write_model(tmp_path / "m", {"w": x}, info)
        plan = shardload.plan_model(model, 4)
        assert not plan.params["w"].remap and plan.params["w"].dtype == "float32"
        shards = shardload.load(model, 4, devices=["cpu"] * 4)
        for r in range(4):
            want = x.astype(np.float32)[r * 2 : (r + 1) * 2] * 3
            np.testing.assert_array_equal(shards[r]["w"].numpy(), want)
            assert torch.equal(shardload.load_rank(model, r, 4)["w"], shards[r]["w"])
        with pytest.raises(ValueError, match="already registered"):
            shardload.register("tests.scaled_rows", shape=rule)(lambda x, num_shards: x)
    finally:
        shardload.planning.registry.unregister("tests.scaled_rows")


def test_step_returning_wrong_shape_is_caught(tmp_path: Path) -> None:
    @shardload.register("tests.liar", shape=lambda s, d, n: ((n, *s), d))
    def liar(x: torch.Tensor, num_shards: int) -> torch.Tensor:
        return x.unsqueeze(0)

    try:
        info = {"version": 1, "params": {"w": [["tests.liar", [None, None], "num_shards"]]}}
        model = write_model(tmp_path / "m", {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, info)
        with pytest.raises(PlanError, match=r"w: step 1 \(tests.liar\): returned \[1, 2, 3\]"):
            shardload.load_rank(model, 0, 2)
    finally:
        shardload.planning.registry.unregister("tests.liar")


def test_a_failing_step_is_located_in_the_shard_info_that_names_it(tmp_path: Path) -> None:
    """A registered step that raises, or returns the wrong shape, while a load or a convert runs it is one line
    naming the shard_info file that put it there, the parameter and the step (old code named no file)."""

    @shardload.register("tests.boom", shape=lambda s, d, n: ((n, *s), d))
    def boom(x: torch.Tensor, num_shards: int) -> torch.Tensor:
        raise RuntimeError("kaboom")

    @shardload.register("tests.liar2", shape=lambda s, d, n: ((n, *s), d))
    def liar(x: torch.Tensor, num_shards: int) -> torch.Tensor:
        return x.unsqueeze(0)

    try:
        for name, says in [("tests.boom", "step function failed: RuntimeError: kaboom"), ("tests.liar2", "returned")]:
            info = {"version": 1, "params": {"w": [[name, [None, None], "num_shards"]]}}
            model = write_model(tmp_path / name, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, info)
            where = f"{model / 'shard_info.json'}: w: step 1 ({name}): {says}"
            for convert in (False, True):
                with pytest.raises(PlanError) as err:
                    shardload.convert(model, 2, tmp_path / "o") if convert else shardload.load_rank(model, 0, 2)
                assert str(err.value).startswith(where) and err.value.file == str(model / "shard_info.json"), err.value
    finally:
        shardload.planning.registry.unregister("tests.boom")
        shardload.planning.registry.unregister("tests.liar2")


def test_outputs_are_independent_copies(example_dir: Path) -> None:
    shards = shardload.load(example_dir, 2, devices=["cpu", "cpu"])
    norm = "model.norm.weight"
    shards[0][norm].fill_(0)
    assert shards[1][norm].abs().sum() > 0
    assert shardload.load_rank(example_dir, 0, 2)[norm].abs().sum() > 0


def test_load_rank_under_torch_distributed(example_dir: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    with pytest.raises(ShardloadError, match=r"no torch\.distributed process group"):
        shardload.load_rank(example_dir)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert_same(shardload.load_rank(example_dir), reference_shards(example_dir, 1)[0])
        assert_same(shardload.load_rank(example_dir, num_shards=2), reference_shards(example_dir, 2)[0])
    finally:
        dist.destroy_process_group()


def test_bad_arguments(example_dir: Path) -> None:
    with pytest.raises(ShardloadError, match="rank 2 is out of range"):
        shardload.load_rank(example_dir, 2, 2)
    with pytest.raises(ShardloadError, match="got 1 devices for num_shards=2"):
        shardload.load(example_dir, 2, devices=["cpu"])
    with pytest.raises(CheckpointError, match="no such file or directory"):
        shardload.load(example_dir / "nope", 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_onto_cuda(example_dir: Path) -> None:
    n = min(torch.cuda.device_count(), 2)
    devices = [f"cuda:{r}" for r in range(n)]
    shards = shardload.load(example_dir, n, devices=devices)
    want = reference_shards(example_dir, n)
    for r in range(n):
        assert all(t.device == torch.device(devices[r]) for t in shards[r].values())
        assert_same(shards[r], want[r])
        assert_same(shardload.load_rank(example_dir, r, n, device=devices[r]), want[r])


def test_convert_reports_progress(example_dir: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []
    result = shardload.convert(example_dir, 2, tmp_path / "o", progress=lambda done, name: seen.append((done, name)))
    assert [name for _, name in seen] == list(result.plan.params)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == sum(p.source.nbytes for p in result.plan.params.values())


@pytest.mark.parametrize("n", (2, 4))
def test_mmap_views_match_reads_and_leave_the_file_alone(example_dir: Path, tmp_path: Path, n: int) -> None:
    """load_rank(mmap=True) gives the reference's tensors; what it maps is not read, and writing to a view
    changes neither the file nor a later load."""
    from shardload.sources.reader import count_reads

    want = reference_shards(example_dir, n)
    converted = tmp_path / "tp"
    shardload.convert(example_dir, n, converted)
    for model in (example_dir, converted):
        for r in range(n):
            with count_reads() as seen:
                got = shardload.load_rank(model, r, n, mmap=True)
            assert got.keys() == want[r].keys()
            for name, t in got.items():
                assert t.is_contiguous() and t.shape == want[r][name].shape
                np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"{model.name} rank {r} {name}")
            own = sum(t.numel() * t.element_size() for t in got.values())
            if model == converted:
                assert seen.bytes == 0, "every tensor of a rank file is a view"
            else:  # dim-0 shards and replicated tensors are mapped; fused and column shards are read
                assert 0 < seen.bytes < own
    files = {p: p.read_bytes() for p in [example_dir / "model.safetensors", *converted.glob("rank-*.safetensors")]}
    for model in (example_dir, converted):
        got = shardload.load_rank(model, 0, n, mmap=True)
        for t in got.values():
            t.fill_(7)
        again = shardload.load_rank(model, 0, n)
        assert all(np.array_equal(again[k].numpy(), want[0][k]) for k in again)
    assert all(p.read_bytes() == data for p, data in files.items())


def test_mmap_needs_the_cpu(example_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any GPU is touched
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ShardloadError, match=r"ReadOptions\(strategy=.view.\) .* needs device='cpu'"):
        shardload.load_rank(example_dir, 0, 2, device="cuda:0", mmap=True)


def test_mmap_of_a_file_cut_short_is_a_clear_error(example_dir: Path, tmp_path: Path) -> None:
    """A file cut short after planning is a CheckpointError (never SIGBUS from a view past the end)."""
    from shardload.engine.run import run_plan

    model = tmp_path / "m"
    model.mkdir()
    for f in example_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    plan = shardload.plan_model(model, 2)
    last = max(plan.params.values(), key=lambda p: p.source.offset)
    assert not last.steps, "the last stored tensor is replicated, so it would be mapped"
    path = model / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 8)
    with pytest.raises(CheckpointError, match="mapped file is shorter than its header says"):
        run_plan(plan, [1], ["cpu"], mmap=True)
    converted = tmp_path / "tp"
    shardload.convert(example_dir, 2, converted)
    rank_file = converted / "rank-00001-of-00002.safetensors"
    with open(rank_file, "r+b") as fh:
        fh.truncate(rank_file.stat().st_size - 8)
    with pytest.raises(CheckpointError, match="manifest says"):
        shardload.load_rank(converted, 1, 2, mmap=True)


def test_mmap_maps_what_it_can_and_reads_the_rest_of_a_rank_file(tmp_path: Path) -> None:
    """An empty tensor cannot be a view: it is read while its neighbours are mapped, in header order."""
    rng = np.random.default_rng(3)
    tensors = {
        "w": random_array(rng, (8, 4), "float16"),
        "e": np.zeros((0, 4), dtype=np.float32),
        "b": random_array(rng, (3,), "uint8"),
    }
    model = write_model(
        tmp_path / "m",
        tensors,
        {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}},
    )
    out = tmp_path / "tp"
    shardload.convert(model, 2, out)
    for r in range(2):
        got = shardload.load_rank(out, r, 2, mmap=True)
        assert list(got) == list(shardload.load_rank(out, r, 2))
        np.testing.assert_array_equal(got["w"].numpy(), tensors["w"][4 * r : 4 * r + 4])
        np.testing.assert_array_equal(got["b"].numpy(), tensors["b"])
        assert got["e"].shape == (0, 4) and got["e"].dtype == torch.float32
