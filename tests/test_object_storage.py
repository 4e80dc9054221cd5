"""Models in object storage: a real S3 server (moto in server mode) on loopback, behind a faulty proxy.

Every load from ``s3://`` is compared element for element with the same load from the local directory it was
uploaded from; the proxy counts the bytes each load fetched and injects transient failures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shardload
from shardload.errors import CheckpointError, ShardloadError

if os.environ.get("CI") == "true":  # CI installs boto3 and moto[server] through the test extra: never skip there
    import boto3  # noqa: F401
    import moto.server  # noqa: F401
else:
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")

from helpers.checkpoints import write_model
from helpers.s3 import BUCKET, S3, Faults, use_endpoint
from helpers.verified import shard
from shardload.cli.main import main
from shardload.sources import objects
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.objects import ObjectCost
from shardload.sources.safetensors_header import read_header


@pytest.fixture(scope="module")
def uris(s3: S3, example_dir: Path, example_multi_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The example model uploaded three ways: one file, an HF index over two files, converted for 2 ranks."""
    converted = tmp_path_factory.mktemp("converted") / "tp2"
    shardload.convert(example_dir, 2, converted)
    return {
        "single": (example_dir, s3.upload_dir(example_dir, "single")),
        "multi": (example_multi_dir, s3.upload_dir(example_multi_dir, "multi")),
        "converted": (converted, s3.upload_dir(converted, "converted")),
    }


@pytest.fixture
def endpoint(s3: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3]:
    """The server, reached through the proxy, with the default request cost (``SHARDLOAD_S3_COST`` unset): the
    example model's column slices (rows of a few bytes) merge into few GETs; the byte count tests below read
    exactly, and by the default cost, a model whose runs are long enough to fetch exactly."""
    use_endpoint(monkeypatch, s3.url, tmp_path)
    monkeypatch.delenv(objects.COST_ENV, raising=False)
    s3.proxy.reset()
    yield s3
    s3.proxy.reset()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", ["single", "multi", "converted"])
def test_load_rank_from_s3_equals_local(endpoint: S3, uris: dict, kind: str) -> None:
    local, uri = uris[kind]
    for rank in range(2):
        _equal(shardload.load_rank(uri, rank, 2), shardload.load_rank(local, rank, 2))
    assert endpoint.proxy.get_bytes() > 0  # the loads really went through the server
    if kind == "converted":  # verify=True re-hashes the rank file's leaves against the record the manifest pins
        _equal(shardload.load_rank(uri, 1, 2, verify=True), shardload.load_rank(local, 1, 2))


def test_converted_rank_damaged_in_the_store(endpoint: S3, uris: dict, tmp_path: Path) -> None:
    local, _ = uris["converted"]
    damaged = tmp_path / "damaged"
    shutil.copytree(local, damaged)
    rank_file = damaged / "rank-00001-of-00002.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed: only its leaves can tell
    rank_file.write_bytes(bytes(data))
    uri = endpoint.upload_dir(damaged, "damaged")
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002.safetensors: does not match its leaves"):
        shardload.load_rank(uri, 1, 2, verify=True)


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_load_all_ranks_and_mesh_from_s3(endpoint: S3, uris: dict, kind: str) -> None:
    local, uri = uris[kind]
    cpus = ["cpu"] * 4
    for got, want in zip(shardload.load(uri, 4, devices=cpus), shardload.load(local, 4, devices=cpus), strict=True):
        _equal(got, want)
    _equal(shardload.load_rank(uri, 3, mesh="pp=2,tp=2"), shardload.load_rank(local, 3, mesh="pp=2,tp=2"))


def _header_bytes(files: list[Path]) -> int:
    return sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)


def _wide_model(directory: Path) -> Path:
    """Column slices of rows long enough to fetch exactly, a row split, a 3-d slice and replicated tensors."""
    rng = np.random.default_rng(5)
    shard = {
        "col.weight": [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]],
        "row.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
        "cube.weight": [["shard_funcs.shard_dim", [None, None], 2, "num_shards"]],
    }
    tensors = {
        "col.weight": rng.standard_normal((24, 8192)).astype("float16"),
        "row.weight": rng.standard_normal((4096, 24)).astype("float32"),
        "cube.weight": rng.standard_normal((3, 4, 4096)).astype("float16"),
        "norm.weight": rng.standard_normal(4096).astype("float32"),
        "mid.bias": rng.standard_normal(1000).astype("float16"),
    }
    return write_model(directory, tensors, {"version": 1, "params": shard})


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_fetches_only_its_bytes(endpoint: S3, tmp_path: Path, n: int) -> None:
    """Counted at the server, exact requests (``ObjectCost.exact()``): a rank's GETs of the weights carry the header
    and exactly its own bytes (replicated tensors included), every one a range request, never the whole object."""
    exact = shardload.ReadOptions(object_cost=ObjectCost.exact())
    local = _wide_model(tmp_path / "wide")
    uri = endpoint.upload_dir(local, f"wide-{n}")
    weights = local / "model.safetensors"
    for rank in range(n):
        endpoint.proxy.reset()
        state = shardload.load_rank(uri, rank, n, read_options=exact)
        _equal(state, shardload.load_rank(local, rank, n))
        own = sum(t.numel() * t.element_size() for t in state.values())
        assert own < weights.stat().st_size / 1.5  # it holds a part, so fetching it all could not pass below
        assert endpoint.proxy.get_bytes(".safetensors") == own + _header_bytes([weights]), rank
        gets = [s for s in endpoint.proxy.served if s.method == "GET" and s.key.endswith(".safetensors")]
        assert gets and all(s.range is not None and s.range[1] - s.range[0] < weights.stat().st_size for s in gets)


def _tensor_gets(proxy: object, start: int) -> list:
    return [s for s in proxy.served if s.method == "GET" and s.key.endswith(".safetensors") and s.range[0] >= start]


def test_the_cost_decides_between_exact_and_merged_requests(
    endpoint: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted at the server: a column slice of 24 rows (gaps of 8-12 KiB) is one GET by the default cost and 24
    exact ones where requests are cheap (``SHARDLOAD_S3_COST``); the row split stays one exact GET either way,
    and the tensors are the same."""
    local = _wide_model(tmp_path / "wide")
    uri = endpoint.upload_dir(local, "wide-cost")
    header = _header_bytes([local / "model.safetensors"])
    info = read_header(local / "model.safetensors")["col.weight"]
    want = shardload.load_rank(local, 1, 4)
    gets: dict[str, list] = {}
    for label, env in {"default": "", "cheap requests": "latency=0.0001,bandwidth=1e9"}.items():
        monkeypatch.setenv(objects.COST_ENV, env)
        endpoint.proxy.reset()
        with shardload.count_reads() as seen:
            _equal(shardload.load_rank(uri, 1, 4), want)
        gets[label] = _tensor_gets(endpoint.proxy, header)
        served = sum(s.nbytes for s in gets[label])
        assert seen.bytes == sum(t.numel() * t.element_size() for t in want.values())  # what the rank uses
        assert seen.moved == served  # what it fetched, gaps included (seen equal to the used bytes before)
    col = range(info.offset, info.offset + info.nbytes)
    in_col = {k: [s for s in v if s.range[0] in col] for k, v in gets.items()}
    assert len(in_col["default"]) == 1 and len(in_col["cheap requests"]) == 24
    assert sum(s.nbytes for s in gets["default"]) > sum(s.nbytes for s in gets["cheap requests"])


def test_a_measured_cost_probes_the_store_once(endpoint: S3, uris: dict, tmp_path: Path) -> None:
    """``object_cost="measure"``: three small GETs and one larger one, on the first load from the store only."""
    local, uri = uris["single"]
    from shardload.sources.location import forget_stores

    forget_stores()  # a fresh store: nothing measured yet
    measure = shardload.ReadOptions(object_cost="measure")
    for rank in range(2):
        endpoint.proxy.reset()
        _equal(shardload.load_rank(uri, rank, 2, read_options=measure), shardload.load_rank(local, rank, 2))
        size = (local / "model.safetensors").stat().st_size
        small, large = (0, objects.PROBE_SMALL), (0, min(size, objects.PROBE_LARGE))
        probes = [s.range for s in endpoint.proxy.served if s.method == "GET" and s.range in (small, large)]
        assert probes == ([small] * 3 + [large] if rank == 0 else []), rank


def test_staged_reads_from_s3(endpoint: S3, uris: dict) -> None:
    """The path a GPU destination takes (reads into staging buffers, then copies), run on the CPU."""
    from shardload.engine.run import run_plan

    local, uri = uris["multi"]
    plan = shardload.plan_model(uri, 4)
    for rank in (0, 3):
        _equal(run_plan(plan, [rank], ["cpu"], staged=True)[0], shardload.load_rank(local, rank, 4))


def test_progress_of_a_load_from_s3(endpoint: S3, uris: dict) -> None:
    local, uri = uris["multi"]
    seen: list[tuple[int, int]] = []
    state = shardload.load_rank(uri, 1, 2, progress=lambda done, total: seen.append((done, total)))
    _equal(state, shardload.load_rank(local, 1, 2))
    assert seen and seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == list(range(1, len(seen) + 1))


def test_converted_rank_fetches_its_file_only(endpoint: S3, uris: dict) -> None:
    local, uri = uris["converted"]
    shardload.load_rank(uri, 1, 2)
    served = {s.key.rsplit("/", 1)[-1] for s in endpoint.proxy.served if s.method == "GET"}
    assert "rank-00000-of-00002.safetensors" not in served
    rank_file = local / "rank-00001-of-00002.safetensors"
    assert endpoint.proxy.get_bytes("rank-00001-of-00002.safetensors") == rank_file.stat().st_size + _header_bytes(
        [rank_file]
    )  # the header (read to check the file), then the tensors


@pytest.mark.parametrize("fault", ["503", "500", "reset", "cut"])
@pytest.mark.slow
def test_transient_failures_are_retried(endpoint: S3, uris: dict, fault: str) -> None:
    local, uri = uris["multi"]
    want = [shardload.load_rank(local, r, 2) for r in range(2)]
    endpoint.proxy.faults.kind = fault
    endpoint.proxy.faults.every = 4
    for rank in range(2):
        _equal(shardload.load_rank(uri, rank, 2), want[rank])
    assert endpoint.proxy.faults.injected >= 2


def test_retry_policy_is_botocores_standard_mode(endpoint: S3, uris: dict) -> None:
    from shardload.sources import s3 as s3_store
    from shardload.sources.location import object_path

    store = object_path(uris["single"][1]).store
    retries = store.client.meta.config.retries
    assert retries["mode"] == "standard" and retries["total_max_attempts"] == s3_store.ATTEMPTS


def test_throttling_past_the_retry_budget_is_one_line(endpoint: S3, uris: dict, monkeypatch) -> None:
    from shardload.sources import s3 as s3_store

    monkeypatch.setattr(s3_store, "ATTEMPTS", 2)
    endpoint.proxy.faults.kind = "503"
    endpoint.proxy.faults.every = 1
    uri = uris["single"][1]
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank(uri, 0, 2)
    assert err.value.message == f"{uri}: the store answered SlowDown (HTTP 503) after 2 attempts"  # its listing


def test_permanent_errors_name_bucket_and_key(endpoint: S3, uris: dict) -> None:
    uri = uris["single"][1]
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank(f"s3://{BUCKET}/no-such-model", 0, 2)
    assert err.value.message == f"s3://{BUCKET}/no-such-model: no such object, and no objects under this prefix"
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank("s3://no-such-bucket/model", 0, 2)
    assert err.value.message == "s3://no-such-bucket/model: no such bucket"
    endpoint.proxy.faults.forbidden.add("single/model.safetensors")
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank(uri, 0, 2)
    message = err.value.message
    assert message == f"{uri}/model.safetensors: access denied (check the credentials and the bucket policy)"
    assert "testing" not in message and "\n" not in message  # never a credential


def test_an_expired_session_token_is_named(endpoint: S3, uris: dict) -> None:
    """An expired STS session token was ``the store answered 400 (HTTP 400)``: a GET's answer names it, and a HEAD's
    (no body, no code) says what a bare 400 most often means."""
    uri = uris["single"][1]
    key = uri.split("/", 3)[3] + "/model.safetensors"
    endpoint.proxy.faults.expired.add(key)
    try:
        with pytest.raises(CheckpointError) as err:
            shardload.load_rank(f"{uri}/model.safetensors", 0, 2)  # a HEAD first
        assert "expired or invalid session token" in err.value.message and "\n" not in err.value.message
        endpoint.proxy.faults.expired.add(f"{BUCKET}/")  # the bucket's listing too: a GET, with the code
        with pytest.raises(CheckpointError) as err:
            shardload.load_rank(uri, 0, 2)
        assert "the session token has expired" in err.value.message, err.value.message
    finally:
        endpoint.proxy.faults.expired.clear()


def test_index_naming_a_missing_object(endpoint: S3, example_multi_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(example_multi_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-00009-of-00009.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    uri = endpoint.upload_dir(broken, "broken-index")
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(uri)
    assert err.value.message == (
        f"{uri}/model.safetensors.index.json: references missing file 'model-00009-of-00009.safetensors'"
    )


def test_cli_over_s3(endpoint: S3, uris: dict, tmp_path: Path) -> None:
    local, uri = uris["single"]
    runner = CliRunner()
    got = runner.invoke(main, ["inspect", uri, "-n", "2", "--json"])
    assert got.exit_code == 0, got.output
    want = runner.invoke(main, ["inspect", str(local), "-n", "2", "--json"])
    assert json.loads(got.output) == json.loads(want.output)
    got = runner.invoke(main, ["validate", str(local / "shard_info.json"), "--model", uri, "-n", "2", "-n", "4"])
    assert got.exit_code == 0 and "valid for num_shards 2, 4" in got.output, got.output
    out = tmp_path / "tp2"
    got = runner.invoke(main, ["convert", uri, "-n", "2", "-o", str(out), "-q"])
    assert got.exit_code == 0, got.output
    assert (out / "config.json").read_bytes() == (local / "config.json").read_bytes()  # companions came along
    for rank in range(2):
        _equal(shardload.load_rank(out, rank, 2), shardload.load_rank(local, rank, 2))
    got = runner.invoke(main, ["verify", str(out), "--source", uri])
    assert got.exit_code == 0 and "every rank equals" in got.output, got.output
    got = runner.invoke(main, ["plan", uri, "--overwrite"])
    assert got.exit_code == 0, got.output
    plan_doc = json.loads(got.stdout)  # no -o: a model in object storage gets its plan on stdout
    assert plan_doc["params"]
    got = runner.invoke(main, ["inspect", f"s3://{BUCKET}/nothing-here", "-n", "2"])
    assert got.exit_code == 1
    assert got.output == f"error: s3://{BUCKET}/nothing-here: no such object, and no objects under this prefix\n"


def test_config_json_is_read_like_a_local_one(endpoint: S3, example_dir: Path, tmp_path: Path) -> None:
    from shardload.models.plan_source import plan_shard_info

    bare = tmp_path / "bare"
    shutil.copytree(example_dir, bare)
    (bare / "shard_info.json").unlink()
    uri = endpoint.upload_dir(bare, "bare-config")  # moto's buckets live as long as the process: a prefix of its own
    remote, how = plan_shard_info(open_checkpoint(uri), None)
    local, _ = plan_shard_info(open_checkpoint(bare), None)
    assert "config.json" in how and remote.source == f"<planned from {uri}/config.json>"
    assert remote.params == local.params


def test_single_object_uri_and_header_by_ranges(endpoint: S3, uris: dict) -> None:
    local, uri = uris["single"]
    ckpt = open_checkpoint(f"{uri}/model.safetensors")
    assert ckpt.tensors.keys() == read_header(local / "model.safetensors").keys()
    gets = [s for s in endpoint.proxy.served if s.method == "GET"]
    assert [g.range for g in gets] == [(0, 8), (8, 8 + _header_bytes([local / "model.safetensors"]) - 8)]


def test_mmap_over_s3_is_an_error(endpoint: S3, uris: dict) -> None:
    uri = uris["converted"][1]
    with pytest.raises(ShardloadError, match=r"ReadOptions\(strategy=.view.\) maps local files; this model is in"):
        shardload.load_rank(uri, 0, 2, mmap=True)


def test_unsupported_scheme_is_one_line() -> None:
    with pytest.raises(CheckpointError, match=r"^gs://b/m: gs:// is not a supported object store"):
        shardload.load_rank("gs://b/m", 0, 2)


def test_tuned_requests_still_load_equal(endpoint: S3, uris: dict) -> None:
    """Small requests merged through every gap: many more, split and merged GETs, the same tensors."""
    local, uri = uris["single"]
    merged = dataclasses.replace(ObjectCost.merged(), request_bytes=4096)
    state = shardload.load_rank(uri, 1, 4, read_options=shardload.ReadOptions(object_cost=merged))
    _equal(state, shardload.load_rank(local, 1, 4))
    own = sum(t.numel() * t.element_size() for t in state.values())
    assert endpoint.proxy.get_bytes(".safetensors") > 1.05 * own  # merging through gaps fetched more


def test_unreachable_endpoint_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import socket

    from shardload.sources import s3 as s3_store

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    use_endpoint(monkeypatch, f"http://127.0.0.1:{port}", tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-key")
    monkeypatch.setattr(s3_store, "ATTEMPTS", 2)
    result = CliRunner().invoke(main, ["inspect", f"s3://{BUCKET}/model", "-n", "2"])
    assert result.exit_code == 1
    assert result.output == f"error: s3://{BUCKET}/model: cannot reach the store: EndpointConnectionError\n"


class _MemoryStore(objects.ObjectStore):
    """An object store in memory: ranged reads of one bytes object, for the reader's own tests."""

    def __init__(self, data: bytes) -> None:
        super().__init__("memory")
        self.data = data

    def read_into(self, key: str, start: int, views) -> None:
        at = start
        for view in views:
            view[:] = self.data[at : at + len(view)]
            at += len(view)


@pytest.mark.parametrize("seed", range(6))
def test_object_reader_fills_every_run_whatever_they_overlap(seed: int) -> None:
    """Runs as a writer thread serving several ranks plans them: the same bytes for several destinations
    (replicated tensors), runs inside runs, long runs split over requests, destinations interleaved between
    buffers; each run gets exactly its bytes, whatever the request limits."""
    from shardload.sources.object_reader import ObjectReader
    from shardload.sources.objects import ObjectPath

    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    cost = ObjectCost(
        latency=float(rng.choice([0.0, 1e-6, 1e-3])),
        bandwidth=float(rng.choice([1e6, 1e9])),
        concurrency=4,
        request_bytes=int(rng.choice([64, 100, 512, 8192])),
    )  # break-even gaps of 0, 0.25, 250 or 250,000 bytes
    count = 60
    src = np.sort(rng.integers(0, 3500, count)).astype(np.int64)
    length = rng.integers(1, 500, count).astype(np.int64)
    src[5:8] = src[4]  # the same bytes for four destinations (a replicated tensor, four ranks)
    length[5:8] = length[4]
    src[20], length[20] = src[19], 3000  # a long run containing many later ones
    length = np.minimum(length, len(data) - src)
    buffers = [torch.zeros(int(length.sum()), dtype=torch.uint8) for _ in range(3)]
    buf = (np.arange(count) % 3).astype(np.int64)  # destinations interleaved between the buffers
    dst = np.zeros(count, dtype=np.int64)
    at = [0, 0, 0]
    for i in rng.permutation(count):  # destinations in no particular order of the sources
        dst[i] = at[buf[i]]
        at[buf[i]] += int(length[i])
    order = rng.permutation(count) if seed % 2 else np.arange(count)  # runs in any order, not only by source
    reader = ObjectReader(cost)
    try:
        path = ObjectPath(_MemoryStore(data), "m")
        reader.read_runs(path, src[order], length[order], buf[order], dst[order], buffers)
    finally:
        reader.close()
    for i in range(count):
        got = buffers[buf[i]][dst[i] : dst[i] + length[i]].numpy().tobytes()
        assert got == data[src[i] : src[i] + length[i]], i


@pytest.mark.parametrize("n", [4, 8])
def test_convert_from_s3_with_fewer_write_threads_than_ranks(
    endpoint: S3, uris: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """Each writer thread serves several ranks, so one read carries the same bytes (a replicated norm) for
    several rank files: every rank file equals the local load, element for element."""
    from shardload.engine import writer

    monkeypatch.setattr(writer, "WRITE_THREADS", 2)
    for kind in ("single", "multi"):
        local, uri = uris[kind]
        out = tmp_path / f"{kind}-tp{n}"
        shardload.convert(uri, n, out)
        for rank in range(n):
            _equal(shardload.load_rank(out, rank, n), shardload.load_rank(local, rank, n))
        result = CliRunner().invoke(main, ["verify", str(out), "--source", str(local)])
        assert result.exit_code == 0 and "every rank equals" in result.output, result.output


def _fails_alone(call, limit_s: float = 60.0) -> BaseException | None:
    """Run ``call`` in a thread; what it raised (None when it returned). A call still running after ``limit_s``
    (a hang, where a deadline should have ended it) fails the test instead of hanging it."""
    import threading

    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as err:
            raised.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert raised, f"still running after {limit_s} s"
    return raised[0]


HOSTILE_REASONS = {
    "whole": r"the store answered HTTP 200 instead of 206 Partial Content \(does it ignore Range\?\)",
    "lie": r"the store answered Content-Range 'bytes \d+-\d+/\d+'",
    "short": r"the store answered \d+ bytes \(Content-Length\) for a \d+-byte range",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_REASONS))
def test_a_wrong_answer_to_a_range_is_refused(
    endpoint: S3, uris: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A store (or a proxy, a CDN) that ignores Range, lies in Content-Range or sends a short body: never bytes
    from the wrong place in a tensor; retried, then one line naming the object, the range and the reason."""
    from shardload.sources import s3 as s3_store

    monkeypatch.setattr(s3_store, "STREAM_ATTEMPTS", 3)
    monkeypatch.setattr(s3_store, "STREAM_BACKOFF", 0.001)
    local, uri = uris["single"]
    endpoint.proxy.faults.kind = kind
    endpoint.proxy.faults.every = 1
    endpoint.proxy.faults.from_byte = _header_bytes([local / "model.safetensors"])  # the tensors' bytes only
    err = _fails_alone(lambda: shardload.load_rank(uri, 1, 2))
    assert isinstance(err, CheckpointError), err
    pattern = rf"{uri}/model.safetensors: bytes \d+-\d+: {HOSTILE_REASONS[kind]}, 3 times"
    assert re.fullmatch(pattern, err.message), err.message
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", uri, "-n", "4", "-o", str(out), "-q"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and re.search(HOSTILE_REASONS[kind], result.output)
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written
    endpoint.proxy.reset()  # now one answer in five is wrong: retried, and the load is right
    monkeypatch.setattr(s3_store, "STREAM_ATTEMPTS", 8)
    endpoint.proxy.faults.kind = kind
    endpoint.proxy.faults.every = 5
    endpoint.proxy.faults.from_byte = _header_bytes([local / "model.safetensors"])
    _equal(shardload.load_rank(uri, 1, 2), shardload.load_rank(local, 1, 2))
    assert endpoint.proxy.faults.injected >= 1


@pytest.mark.parametrize("kind", ["trickle", "trickle-headers"])
def test_a_trickling_store_fails_within_the_deadline(
    endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One byte a second keeps every socket read alive; the request's deadline and minimum rate end it."""
    monkeypatch.setenv("SHARDLOAD_S3_DEADLINE", "3")
    monkeypatch.setenv("SHARDLOAD_S3_MIN_RATE", "1000000")
    uri = uris["single"][1]
    endpoint.proxy.faults.kind = kind
    endpoint.proxy.faults.every = 1
    endpoint.proxy.faults.trickle_s = 1.0
    err = _fails_alone(lambda: open_checkpoint(uri), limit_s=30)
    assert isinstance(err, CheckpointError), err
    # the trickled ranged GET ends at the deadline; on a machine loaded enough that the (untrickled) listing before
    # it takes 3 s, the listing does: the same bounded failure, naming the prefix instead of a byte range
    assert re.fullmatch(
        rf"{uri}(/[\w.-]+: bytes \d+-\d+)?: no complete answer within the 3 s deadline \(SHARDLOAD_S3_DEADLINE\)",
        err.message,
    ), err.message


@pytest.mark.parametrize("work", ["load", "hash"])
def test_a_load_stopped_while_its_requests_stall_ends_at_once(
    endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch, work: str
) -> None:
    """Ctrl-C (here a signal's exception in the main thread) while the reader threads' GETs stall: the load waited
    for each in-flight request to reach its deadline (minutes; a CLI convert 40-120 s after the signal, a hash 239 s),
    retrying after the interrupt. The requests of a stopped load or hash are cut off and never retried: it ends at
    once."""
    import signal

    class Stop(BaseException):  # as KeyboardInterrupt is
        pass

    def stop(signum: int, frame: object) -> None:
        raise Stop

    monkeypatch.setenv("SHARDLOAD_S3_DEADLINE", "60")
    monkeypatch.setenv("SHARDLOAD_S3_MIN_RATE", "1")
    local, uri = uris["multi"]
    first_tensor = min(t.offset for t in open_checkpoint(local).tensors.values())
    endpoint.proxy.faults = Faults(every=1, kind="trickle-headers", trickle_s=30.0, from_byte=first_tensor)
    previous = signal.signal(signal.SIGALRM, stop)
    started = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        with pytest.raises(Stop):
            shardload.load_rank(uri, 1, 2) if work == "load" else shardload.hash_checkpoint(uri)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 20, "the load waited for its stalled requests (60 s deadline)"


def test_a_trickling_listing_fails_within_the_deadline(
    endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests botocore reads whole (a listing, a HEAD) have the same deadline."""
    monkeypatch.setenv("SHARDLOAD_S3_DEADLINE", "2")
    uri = uris["single"][1]
    endpoint.proxy.faults.kind = "trickle-all"
    endpoint.proxy.faults.every = 1
    endpoint.proxy.faults.only_get = False
    endpoint.proxy.faults.trickle_s = 1.0
    err = _fails_alone(lambda: open_checkpoint(uri), limit_s=30)
    assert isinstance(err, CheckpointError), err
    assert err.message == f"{uri}: no complete answer within the 2 s deadline (SHARDLOAD_S3_DEADLINE)", err.message


def test_a_range_past_the_object_end_is_one_line(endpoint: S3, uris: dict) -> None:
    """The store answers what it has (206, a shorter Content-Range): an object shorter than asked, not retried."""
    from shardload.sources.location import object_path

    local, uri = uris["single"]
    path = object_path(f"{uri}/config.json")
    size = (local / "config.json").stat().st_size
    assert path.store.read(path.key, 0, size) == (local / "config.json").read_bytes()
    endpoint.proxy.reset()
    with pytest.raises(CheckpointError) as err:
        path.store.read(path.key, 2, size + 10)
    assert err.value.message == (
        f"{uri}/config.json: bytes 2-{size + 9}: the object is {size} bytes, shorter than this range "
        "(changed while loading?)"
    )
    assert len([s for s in endpoint.proxy.served if s.method == "GET"]) == 1


def test_a_slow_store_is_cut_off_by_the_minimum_rate(endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Well within the deadline, an attempt slower than the minimum rate is cut off and retried, then one line."""
    from shardload.sources import deadlines
    from shardload.sources import s3 as s3_store

    monkeypatch.setattr(deadlines, "RATE_GRACE", 0.5)
    monkeypatch.setattr(deadlines, "UNKNOWN_SIZE", 1 << 30)  # the listing and HEADs (untrickled) are never cut off
    monkeypatch.setattr(s3_store, "STREAM_ATTEMPTS", 2)
    monkeypatch.setenv("SHARDLOAD_S3_DEADLINE", "600")
    monkeypatch.setenv("SHARDLOAD_S3_MIN_RATE", "1000000")
    uri = uris["single"][1]
    endpoint.proxy.faults.kind = "trickle"
    endpoint.proxy.faults.every = 1
    endpoint.proxy.faults.trickle_s = 1.0
    err = _fails_alone(lambda: open_checkpoint(uri), limit_s=30)
    assert isinstance(err, CheckpointError), err
    assert re.fullmatch(
        rf"{uri}/[\w.-]+: bytes \d+-\d+: the store sent under 1000000 bytes/s \(SHARDLOAD_S3_MIN_RATE\), 2 times",
        err.message,
    ), err.message


@pytest.mark.parametrize("name", ["SHARDLOAD_S3_DEADLINE", "SHARDLOAD_S3_MIN_RATE"])
@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan"])
def test_request_limits_from_the_environment_are_checked(
    endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    result = CliRunner().invoke(main, ["inspect", uris["single"][1], "-n", "2"])
    assert result.exit_code == 1 and result.output == f"error: {name}: must be a positive number, got {value!r}\n"


def test_a_redirect_naming_no_region_is_one_line(endpoint: S3, uris: dict, tmp_path: Path) -> None:
    uri = uris["single"][1]
    endpoint.proxy.faults.kind = "redirect"
    endpoint.proxy.faults.every = 1
    err = _fails_alone(lambda: shardload.load_rank(uri, 0, 2))
    assert isinstance(err, CheckpointError), err
    assert re.fullmatch(
        rf"{uri}(/model.safetensors)?: the store redirected the request \(HTTP 301( PermanentRedirect)?\) without "
        r"naming the bucket's region: set AWS_DEFAULT_REGION to the bucket's region, or AWS_ENDPOINT_URL_S3 to the "
        "endpoint it answers at",
        err.message,
    ), err.message
    result = CliRunner().invoke(main, ["convert", uri, "-n", "2", "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and result.output == f"error: {err.message}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "url",
    ["http://AKIDSECRET:very-secret-key@[::1", "http://AKIDSECRET:very-secret-key@host:99999", "not a url at all"],
)
def test_a_malformed_endpoint_is_one_line_without_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str
) -> None:
    use_endpoint(monkeypatch, url, tmp_path)
    result = CliRunner().invoke(main, ["inspect", f"s3://{BUCKET}/model", "-n", "2"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output == (
        f"error: s3://{BUCKET}/model: AWS_ENDPOINT_URL_S3 is not an endpoint URL (http:// or https://, a host, "
        "an optional port below 65536, no user name or password)\n"
    )
    assert "secret" not in result.output and "AKID" not in result.output


def test_small_objects_over_the_cap_are_refused_before_any_get(
    endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small file read whole (config, index, shard_info, manifest, companion) is refused when its listed size is
    over objects.MAX_SMALL_OBJECT, whatever limit its reader asked for, and never fetched."""
    uri = uris["multi"][1]
    monkeypatch.setattr(objects, "MAX_SMALL_OBJECT", 16)
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank(uri, 0, 2)
    message = err.value.message
    assert re.fullmatch(rf"{re.escape(uri)}/[\w.]+: .+ is \d+ bytes, over the 16 byte cap on small objects", message)
    assert "\n" not in message
    name = message.split(": ", 1)[0].rsplit("/", 1)[1]
    assert not [s for s in endpoint.proxy.served if s.method == "GET" and s.key.endswith(name)]


@pytest.mark.parametrize("when", ["between reads", "after the header"])
def test_an_object_replaced_during_a_load_is_an_error(
    endpoint: S3, example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """An object overwritten while a load reads it (same size, same header, every tensor byte changed: a new ETag)
    is one line naming it, never a state dict of old and new bytes; ``convert`` from it writes nothing. Every
    ranged GET's answer must be the version whose header the load parsed (its ETag)."""
    prefix = f"swap-{when.split()[0]}"
    uri = endpoint.upload_dir(example_dir, prefix)
    old = (example_dir / "model.safetensors").read_bytes()
    (n,) = np.frombuffer(old[:8], dtype="<u8")
    new = old[: 8 + int(n)] + bytes(b ^ 0x01 for b in old[8 + int(n) :])
    key = f"{prefix}/model.safetensors"

    def replace() -> None:
        endpoint.client().put_object(Bucket=BUCKET, Key=key, Body=new)

    options = shardload.ReadOptions(object_cost=ObjectCost.exact(concurrency=1))
    if when == "between reads":
        calls: list[int] = []

        def progress(done: int, total: int) -> None:
            if not calls:
                replace()
            calls.append(done)

        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(uri, 1, 2, progress=progress, read_options=options)
        assert calls, "the object was never replaced"
    else:
        from shardload.sources import checkpoint as checkpoint_module

        real = checkpoint_module._open_object

        def opened_then_replaced(path: object) -> object:
            got = real(path)
            replace()  # right after the header was parsed, before any tensor byte is read
            return got

        monkeypatch.setattr(checkpoint_module, "_open_object", opened_then_replaced)
        with pytest.raises(ShardloadError) as err:
            shardload.convert(uri, 2, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    text = str(err.value)
    assert key in text and "changed while" in text and "\n" not in text, text


@pytest.mark.parametrize("every", [1, 3])
def test_an_answer_without_the_version_the_load_pinned_is_never_taken(
    endpoint: S3, example_dir: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """A store (or a cache in front of it) that sends the ETag on some answers only: an answer without one, after
    the header's answer pinned a version, cannot be held to that version, so it is asked for again, and a load
    whose answers keep coming without one is refused in one line (old code took them, and an object replaced
    meanwhile loaded as a mix of two versions). One answer in three without it: the load is exact."""
    from shardload.sources import s3 as s3_store

    monkeypatch.setattr(s3_store, "STREAM_ATTEMPTS", 3)
    monkeypatch.setattr(s3_store, "STREAM_BACKOFF", 0.001)
    uri = endpoint.upload_dir(example_dir, f"etag-sometimes-{every}")
    header = 8 + int(np.frombuffer((example_dir / "model.safetensors").read_bytes()[:8], dtype="<u8")[0])
    endpoint.proxy.faults = Faults(every=every, kind="no-etag", from_byte=header)  # only tensor bytes lose it
    options = shardload.ReadOptions(object_cost=ObjectCost.exact(concurrency=1))
    if every == 1:
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(uri, 1, 2, read_options=options)
        text = str(err.value)
        assert f"etag-sometimes-{every}/model.safetensors" in text and "ETag" in text and "\n" not in text, text
    else:
        _equal(shardload.load_rank(uri, 1, 2, read_options=options), shardload.load_rank(example_dir, 1, 2))
    assert endpoint.proxy.faults.injected, "no answer lost its ETag"


def test_a_model_updated_in_place_loads_as_it_is_now_in_the_same_process(endpoint: S3, tmp_path: Path) -> None:
    """A long-lived process (a server reloading weights) loads a model, the model under the same prefix is updated
    (bigger tensors; then a file removed), and it loads again: each load lists the prefix afresh. Old code kept the
    first listing for the process, and the update failed as a "truncated file" until a restart."""
    rng = np.random.default_rng(5)
    versions = []
    for rows in (64, 128):
        tensors = {"w.weight": rng.standard_normal((rows, 32)).astype(np.float16)}
        info = {"version": 1, "num_shards": None, "params": {"w.weight": [shard([rows, 32], 0)]}}
        versions.append((write_model(tmp_path / f"v{rows}", tensors, info), tensors["w.weight"]))
    uri = endpoint.upload_dir(versions[0][0], "updated")
    assert np.array_equal(shardload.load_rank(uri, 1, 2)["w.weight"].numpy(), versions[0][1][32:])
    endpoint.upload_dir(versions[1][0], "updated")
    assert np.array_equal(shardload.load_rank(uri, 1, 2)["w.weight"].numpy(), versions[1][1][64:])
    endpoint.client().delete_object(Bucket=BUCKET, Key="updated/shard_info.json")
    with pytest.raises(ShardloadError, match=r"shard_info\.json does not exist"):  # seen gone, not read from a listing
        shardload.load_rank(uri, 1, 2)
    endpoint.upload_dir(versions[0][0], "updated")  # opened outside a load too (inspect, validate): as it is now
    assert open_checkpoint(uri).tensors["w.weight"].shape == (64, 32)
    endpoint.upload_dir(versions[1][0], "updated")
    assert open_checkpoint(uri).tensors["w.weight"].shape == (128, 32)


def test_verify_a_model_in_object_storage(endpoint: S3, example_dir: Path, tmp_path: Path) -> None:
    """``shardload verify s3://...`` checks the objects against the record ``shardload hash s3://...`` put beside
    them (the URI was taken for a local path: "s3:/bucket: no such file or directory"); a changed object is named."""
    uri = endpoint.upload_dir(example_dir, "verify-me")
    runner = CliRunner()
    done = runner.invoke(main, ["hash", uri, "-q"])
    assert done.exit_code == 0, done.output
    done = runner.invoke(main, ["verify", uri])
    assert done.exit_code == 0 and "no such file" not in done.output, done.output
    outs = ((f"{uri}/copy.hashes", "verify-me/copy.hashes"), (f"s3://{BUCKET}/records/", "records/shardload.hashes"))
    for out, key in outs:
        done = runner.invoke(main, ["hash", uri, "-q", "-o", out])  # -o an object (it wrote a local ./s3:/ tree)
        assert done.exit_code == 0 and not Path("s3:").exists(), done.output
        assert endpoint.client().get_object(Bucket=BUCKET, Key=key)["Body"].read().startswith(b"SLHASH1\n")
    data = bytearray((example_dir / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    endpoint.client().put_object(Bucket=BUCKET, Key="verify-me/model.safetensors", Body=bytes(data))
    done = runner.invoke(main, ["verify", uri, "--json"])
    assert done.exit_code == 1 and not json.loads(done.stdout)["ok"], done.output


def test_an_object_replaced_while_it_is_hashed_is_an_error(endpoint: S3, example_dir: Path) -> None:
    """``shardload hash s3://...`` of an object overwritten while it is hashed refuses in one line and puts no record
    beside it: every answer must be the version of the first (its ETag), as in a load."""
    from shardload.engine.hashing import hash_model

    uri = endpoint.upload_dir(example_dir, "hash-swap")
    old = (example_dir / "model.safetensors").read_bytes()
    key = "hash-swap/model.safetensors"
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        if not calls:
            endpoint.client().put_object(Bucket=BUCKET, Key=key, Body=old[:-1] + bytes([old[-1] ^ 1]))
        calls.append(done)

    with pytest.raises(ShardloadError) as err:
        hash_model(uri, threads=1, progress=progress)
    text = str(err.value)
    assert key in text and "changed while" in text and "\n" not in text, text
    assert calls, "the object was never replaced"
    listed = endpoint.client().list_objects_v2(Bucket=BUCKET, Prefix="hash-swap/")
    assert not [o["Key"] for o in listed.get("Contents", ()) if o["Key"].endswith("shardload.hashes")], listed


def test_hash_never_puts_its_record_over_an_object_that_is_not_one(endpoint: S3, example_dir: Path) -> None:
    """``hash s3://...`` refuses in one line to put its record over an object of the record's name that is not a
    record, and leaves it as it was (the check read the object whole as a "small" one, failed, and overwrote it)."""
    from shardload.engine.hashing import hash_model

    uri = endpoint.upload_dir(example_dir, "hash-onto")
    junk = b"someone else's notes, not an integrity record\n" * 4
    endpoint.client().put_object(Bucket=BUCKET, Key="hash-onto/shardload.hashes", Body=junk)
    with pytest.raises(ShardloadError) as err:
        hash_model(uri)
    assert "is not an integrity record" in str(err.value) and "\n" not in str(err.value), err.value
    kept = endpoint.client().get_object(Bucket=BUCKET, Key="hash-onto/shardload.hashes")["Body"].read()
    assert kept == junk


def test_an_object_replaced_behind_a_store_that_sends_no_etag_is_an_error(endpoint: S3, example_dir: Path) -> None:
    """A store, or a proxy in front of one, that sends no ETag on any answer: an object replaced (the same size and
    header) a second after the load's first answer loaded as a mix of its two versions. Each answer is now held to
    the first one's Last-Modified and size; without a replacement the load is exact."""
    prefix = "no-etag-anywhere"
    uri = endpoint.upload_dir(example_dir, prefix)
    old = (example_dir / "model.safetensors").read_bytes()
    (n,) = np.frombuffer(old[:8], dtype="<u8")
    new = old[: 8 + int(n)] + bytes(b ^ 0x01 for b in old[8 + int(n) :])
    key = f"{prefix}/model.safetensors"
    options = shardload.ReadOptions(object_cost=ObjectCost.exact(concurrency=1))
    endpoint.proxy.faults = Faults(every=1, kind="no-etag")
    _equal(shardload.load_rank(uri, 1, 2, read_options=options), shardload.load_rank(example_dir, 1, 2))
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        if not calls:
            time.sleep(1.1)  # Last-Modified counts whole seconds
            endpoint.client().put_object(Bucket=BUCKET, Key=key, Body=new)
        calls.append(done)

    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(uri, 1, 2, progress=progress, read_options=options)
    assert calls and endpoint.proxy.faults.injected
    text = str(err.value)
    assert key in text and "changed while" in text and "\n" not in text, text


def test_a_listing_that_never_ends_is_refused_before_it_fills_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that answers every listing page with 1,000 new keys of 1 kB and a new continuation token: the listing
    held every key until its 10,000th page (about 10 GB)."""
    from shardload.sources import s3 as s3_store

    pages = []

    def endless(self: object, key: object, operation: object, **kwargs: object) -> dict:
        pages.append(kwargs.get("ContinuationToken"))
        start = len(pages) * 1000
        contents = [{"Key": f"m/{i:0>1000}", "Size": 1} for i in range(start, start + 1000)]
        return {"Contents": contents, "IsTruncated": True, "NextContinuationToken": f"t{len(pages)}"}

    monkeypatch.setattr(s3_store.S3Store, "_call", endless)
    with pytest.raises(ShardloadError, match=r"listing of this prefix ran past 64 MiB of keys") as err:
        s3_store.S3Store("bucket")._list("m/")
    assert "\n" not in str(err.value) and len(pages) < 100, len(pages)


@pytest.mark.parametrize("request_kind", ["listing", "head"])
def test_a_listing_or_head_cut_off_once_is_asked_again(
    endpoint: S3, example_dir: Path, monkeypatch: pytest.MonkeyPatch, request_kind: str
) -> None:
    """Every request is cut off past its minimum rate and asked again within the deadline; a listing page and a
    HEAD were made once, and a store that sent nothing for the first attempt failed the load, blamed on its rate."""
    from shardload.sources import s3 as s3_store

    monkeypatch.setenv("SHARDLOAD_S3_MIN_RATE", str(1 << 30))  # an attempt of a small answer gets RATE_GRACE
    monkeypatch.setattr(s3_store, "STREAM_BACKOFF", 0.001)
    monkeypatch.setattr("shardload.sources.deadlines.RATE_GRACE", 1.0)
    uri = endpoint.upload_dir(example_dir, f"cut-once-{request_kind}")
    endpoint.proxy.faults = Faults(every=1, kind="trickle-all", only_get=False, trickle_s=3.0, limit=1)
    path = shardload.sources.location.object_path(uri)
    if request_kind == "listing":
        assert "model.safetensors" in {c.rsplit("/", 1)[-1] for c in path.children()}
    else:
        assert (path / "model.safetensors").store._head(f"cut-once-{request_kind}/model.safetensors") > 0
    assert endpoint.proxy.faults.injected == 1


def test_an_endpoint_or_credentials_changed_in_a_long_lived_process_reach_the_next_load(
    endpoint: S3, uris: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The S3 client was made once per bucket and kept for the process: after AWS_ENDPOINT_URL_S3 was pointed at
    another store, a load still read the first one (reviewer L: another server's model, no error), and new
    credentials were never used. The client follows the configuration; the store's byte counts show which endpoint
    a load used (the proxy counts every request it serves)."""
    from shardload.sources.location import object_path

    local, uri = uris["single"]
    want = shardload.load_rank(local, 1, 2)
    _equal(shardload.load_rank(uri, 1, 2), want)
    assert endpoint.proxy.get_bytes() > 0
    host, port = endpoint.moto.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{host}:{port}")  # the same store, without the proxy
    endpoint.proxy.reset()
    _equal(shardload.load_rank(uri, 1, 2), want)
    assert endpoint.proxy.get_bytes() == 0, "the load went to the endpoint set before"
    store = object_path(uri).store
    first = store.client
    assert store.client is first, "an unchanged configuration keeps its client"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    assert store.client is not first, "new credentials make a new client"


def test_the_client_s_configuration_is_read_while_another_thread_changes_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The S3 client's configuration was read with ``os.environ.items()``, which lists the names and then looks each
    up: a variable another thread deleted in between ended a load with a bare KeyError (reviewer H, 2 in 47,000
    calls under churn). A name that vanishes is skipped."""
    from collections.abc import MutableMapping

    from shardload.sources import s3

    class Vanishing(MutableMapping[str, str]):
        """An environment in which GONE is listed but deleted before it is looked up."""

        def __init__(self) -> None:
            self.data = {"AWS_REGION": "us-east-1", "GONE": "x"}

        def __getitem__(self, key: str) -> str:
            if key == "GONE":
                raise KeyError(key)
            return self.data[key]

        def __iter__(self) -> Iterator[str]:
            return iter(list(self.data))

        def __len__(self) -> int:
            return len(self.data)

        def __setitem__(self, key: str, value: str) -> None:
            self.data[key] = value

        def __delitem__(self, key: str) -> None:
            del self.data[key]

    monkeypatch.setattr(s3.os, "environ", Vanishing())
    assert s3._configuration() == s3._configuration()


def test_an_s3_model_without_boto3_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the ``[s3]`` extra an ``s3://`` model is the documented install hint, from the API and the command
    line (old code: a bare ``ModuleNotFoundError`` for botocore, "internal error" on the command line)."""
    import sys

    from shardload.sources import location

    monkeypatch.setattr(location, "_stores", {})
    for name in ("boto3", "botocore", "botocore.exceptions", "botocore.config"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as when it is not installed
    with pytest.raises(ShardloadError, match=re.escape('s3:// models need boto3: pip install "shardload[s3]"')):
        shardload.load_rank("s3://no-such-bucket/model", 0, 2)
    got = CliRunner().invoke(main, ["inspect", "s3://no-such-bucket/model", "-n", "2"])
    assert got.exit_code == 1 and "internal error" not in got.output, got.output
    assert 'pip install "shardload[s3]"' in got.output, got.output
