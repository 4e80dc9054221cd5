"""``shardload preflight``: the N (and expert splits) a model allows, from config.json, the index and the safetensors
headers alone, for a local directory, a Hub id in a hand-laid offline cache and an ``s3://`` model on a real S3
server (moto) behind the counting proxy; with the bytes it read, checked against what was served."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from shardload.cli.main import main
from shardload.models.generated import generate

pytest.importorskip("transformers")
from helpers.tiny_models import build

REPO = "shardload-test/tiny-gqa"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GQA Llama (8 heads, 2 KV heads), it quantized int4 with groups of 32, a Mixtral with 2 experts stored
    stacked, and one with 4 experts stored one tensor each."""
    from shardload.engine.quantize import quantize

    root = tmp_path_factory.mktemp("preflight")
    build("llama_gqa", root / "gqa")
    quantize(root / "gqa", root / "gqa-int4-g32", "int4-g32")
    build("mixtral_stacked", root / "moe", num_local_experts=2)
    build("mixtral", root / "moe-per-expert")
    return {p.name: p for p in root.iterdir()}


def _run(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["preflight", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def _header_end(path: Path) -> int:
    """8 + the length of a safetensors file's header: its first tensor byte."""
    with open(path, "rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


def _results(doc: dict[str, Any], experts: str | None = None) -> dict[int, dict[str, Any]]:
    return {r["num_shards"]: r for r in doc["results"] if r["experts"] == experts}


def test_gqa_llama_allows_n_up_to_the_heads_replicating_kv_heads(models: dict[str, Path]) -> None:
    code, doc = _run(str(models["gqa"]))
    assert code == 0 and doc["ok"] is True
    assert doc["checked"] == [1, 2, 4, 8, 16, 32, 64]
    assert doc["modes"] == [{"experts": None, "ep": 1, "allowed": [1, 2, 4, 8], "refused": None}]
    results = _results(doc)
    # 2 KV heads: N=4 and N=8 hold each KV head on N/2 ranks; 16 cuts the 8 query heads
    assert {n: r["kv_head_replicas"] for n, r in results.items() if r["ok"]} == {1: 1, 2: 1, 4: 2, 8: 4}
    assert results[16]["reason"] == "num_attention_heads=8 is not divisible by num_shards=16"
    # the same N `shardload plan` records for the model (it checks every N up to 64)
    supported = generate(models["gqa"]).supported
    assert [n for n in doc["checked"] if n in supported] == [1, 2, 4, 8]


def test_only_config_and_header_bytes_are_read(models: dict[str, Path]) -> None:
    model = models["gqa"]
    code, doc = _run(str(model))
    assert code == 0
    fetched = doc["fetched"]
    expected = {"config.json": (model / "config.json").stat().st_size,
                "model.safetensors": _header_end(model / "model.safetensors")}  # fmt: skip
    assert {r["file"]: r["bytes"] for r in fetched["reads"]} == expected
    assert fetched["bytes"] == sum(expected.values()) and fetched["tensor_bytes"] == 0
    assert fetched["checkpoint_tensor_bytes"] > 100 * fetched["bytes"]


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")
def test_the_process_reads_no_weight_bytes(models: dict[str, Path]) -> None:
    """Independent of shardload's own count: the bytes this process read (rchar) while checking stay far below the
    weights' (a tensor read would add at least its size)."""
    model = models["gqa"]
    _run(str(model))  # imports done

    def rchar() -> int:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))

    before = rchar()
    code, doc = _run(str(model))
    read = rchar() - before
    assert code == 0
    assert read < doc["fetched"]["bytes"] + 64 * 1024 < doc["fetched"]["checkpoint_tensor_bytes"] // 4


def test_quantized_group_size_bounds_n(models: dict[str, Path]) -> None:
    code, doc = _run(str(models["gqa-int4-g32"]))
    assert code == 0 and doc["modes"][0]["allowed"] == [1, 2]
    assert "quantized weights: compressed-tensors" in doc["plan_source"]
    results = _results(doc)
    # o_proj's 64 inputs over 4 ranks are 16 each: a group of 32 would be cut
    assert "o_proj.weight_scale" in results[4]["reason"]
    assert "does not fall on boundaries of 32 (pack or group size) for num_shards=4" in results[4]["reason"]
    assert "(group size 32)" in results[8]["reason"]
    assert results[16]["reason"] == "num_attention_heads=8 is not divisible by num_shards=16"


def test_moe_reports_tp_and_ep_combinations(models: dict[str, Path]) -> None:
    code, doc = _run(str(models["moe"]))
    assert code == 0 and doc["num_experts"] == 2
    assert [(m["experts"], m["ep"], m["allowed"]) for m in doc["modes"]] == [
        ("tp", 1, [1, 2, 4]), ("parallel", "num_shards", [1, 2])
    ]  # fmt: skip
    parallel = _results(doc, "parallel")
    assert parallel[2]["ep"] == 2 and parallel[2]["ok"]
    assert parallel[4]["reason"] == "2 experts are not divisible by num_shards=4 (expert parallel)"
    assert _results(doc, "tp")[4]["ok"] and _results(doc, "tp")[4]["ep"] == 1


def test_experts_stored_one_tensor_each_cannot_be_expert_parallel(models: dict[str, Path]) -> None:
    code, doc = _run(str(models["moe-per-expert"]))
    assert code == 0
    tp, parallel = doc["modes"]
    assert tp["allowed"] == [1, 2, 4] and parallel["allowed"] == []
    assert "needs expert weights stacked" in parallel["refused"]
    text = CliRunner().invoke(main, ["preflight", str(models["moe-per-expert"]), "-n", "2"]).stdout
    assert "tp=2 ep=1 (experts tp): ok\n" in text
    assert "allowed with experts parallel (ep=tp): tp none (checked 2): refused for every N: " in text


def test_text_report(models: dict[str, Path]) -> None:
    model = models["gqa"]
    result = CliRunner().invoke(main, ["preflight", str(model), "-n", "4", "-n", "16", "-n", "4"])
    lines = result.stdout.splitlines()
    assert result.exit_code == 1, result.output
    assert lines[0] == f"{model}: llama, num_attention_heads=8, num_key_value_heads=2; planned with config.json " \
                       "(the llama preset)"  # fmt: skip
    assert lines[1].startswith("read ") and lines[1].endswith(" of tensor data") and "none of the" in lines[1]
    assert lines[2:] == [
        "tp=4: ok (each KV head on 2 ranks)",
        "tp=16: refused: num_attention_heads=8 is not divisible by num_shards=16 (and 4 more)",
        "allowed: tp 4 (checked 4, 16)",
    ]


def test_exit_codes_and_json_on_error(models: dict[str, Path], tmp_path: Path) -> None:
    assert _run(str(models["gqa"]), "-n", "8")[0] == 0
    code, doc = _run(str(models["gqa"]), "-n", "2", "-n", "16")
    assert code == 1 and doc["ok"] is False and doc["exit_code"] == 1
    code, doc = _run(str(tmp_path / "missing"))
    assert code == 1 and doc["ok"] is False and "no such file or directory" in doc["error"]["message"]
    result = CliRunner().invoke(main, ["preflight", str(models["gqa"]), "-n", "0", "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "UsageError"


def test_a_shard_info_beside_the_weights_is_what_is_checked(example_multi_dir: Path) -> None:
    code, doc = _run(str(example_multi_dir))
    assert code == 0 and doc["plan_source"] == "shard_info.json beside the weights"
    assert doc["modes"][0]["allowed"] == [1, 2, 4, 8]
    assert "so a head would be cut" in _results(doc)[16]["reason"]
    read = {r["file"] for r in doc["fetched"]["reads"]}
    assert read == {"config.json", "shard_info.json", "model.safetensors.index.json",
                    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}  # fmt: skip
    for r in doc["fetched"]["reads"]:
        if r["file"].endswith(".safetensors"):
            assert r["bytes"] == _header_end(example_multi_dir / r["file"])
    assert doc["fetched"]["tensor_bytes"] == 0


# -- a Hub id, from a hand-laid offline cache


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models: dict[str, Path]) -> Path:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from helpers.hub import put_revision

    cache = tmp_path / "hub"
    put_revision(cache, REPO, models["gqa"], "c" * 40, "main")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # the id names no local path here
    return cache


def test_hub_id_from_the_cache_alone_never_downloading(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # online: still nothing is downloaded
    calls: list[dict[str, Any]] = []
    real = huggingface_hub.snapshot_download

    def snapshot_download(*args: Any, **kwargs: Any) -> str:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    code, doc = _run(REPO)
    assert code == 0, doc
    assert [c.get("local_files_only") for c in calls] == [True]
    assert doc["model"] == REPO and doc["modes"][0]["allowed"] == [1, 2, 4, 8]
    snapshot = hub / "models--shardload-test--tiny-gqa" / "snapshots" / ("c" * 40)
    expected = {"config.json": (snapshot / "config.json").stat().st_size,
                "model.safetensors": _header_end(snapshot / "model.safetensors")}  # fmt: skip
    assert {r["file"]: r["bytes"] for r in doc["fetched"]["reads"]} == expected
    assert doc["fetched"]["tensor_bytes"] == 0

    # offline, an id not in the cache is the cache's error (online it is read over HTTP: below)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, doc = _run("shardload-test/not-cached")
    assert code == 1 and [c.get("local_files_only") for c in calls[1:]] == [True]
    assert "is not in the local cache" in doc["error"]["message"] and "HF_HUB_OFFLINE is set" in doc["error"]["message"]


# -- a Hub id not in the cache: over HTTP from a fake Hub on loopback

COMMIT = "d" * 40


@pytest.fixture
def fake_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models: dict[str, Path], example_multi_dir: Path
) -> Iterator[Any]:
    """The fake Hub serving the GQA Llama, the stacked-expert Mixtral and the two-file example (an index, two
    shards and a shard_info.json), a gated, a private and a forbidden model; huggingface_hub pointed at it, online,
    with an empty cache under tmp_path."""
    pytest.importorskip("huggingface_hub")
    from helpers.fake_hub import FakeHub, use_fake_hub

    hub = FakeHub()
    try:
        for name, source in {"gqa": models["gqa"], "moe": models["moe"], "example": example_multi_dir}.items():
            hub.add(f"shardload-test/{name}", source, COMMIT)
        hub.add("shardload-test/gated", models["gqa"], COMMIT, gated=True)
        hub.add("shardload-test/private", models["gqa"], COMMIT, private=True)
        hub.add("shardload-test/forbidden", models["gqa"], COMMIT, forbidden=True)
        use_fake_hub(monkeypatch, hub.url, tmp_path / "hf")
        monkeypatch.chdir(tmp_path)  # the ids name no local path here
        yield hub
    finally:
        hub.close()


LOCAL = {"gqa": "gqa", "moe": "moe", "example": None}


@pytest.mark.parametrize("name", ["gqa", "moe", "example"])
def test_hub_id_not_cached_reads_config_index_and_headers_over_http(
    fake_hub: Any, name: str, models: dict[str, Path], example_multi_dir: Path, tmp_path: Path
) -> None:
    local = models[name] if name != "example" else example_multi_dir
    code, doc = _run(f"shardload-test/{name}")
    assert code == 0, doc
    # the same answer as the directory the Hub serves
    _, here = _run(str(local))
    assert doc["modes"] == here["modes"] and doc["plan_source"] == here["plan_source"]
    root = f"{fake_hub.url}/shardload-test/{name}/resolve/{COMMIT}"
    assert [(r["num_shards"], r["experts"], r["ok"], r["reason"]) for r in doc["results"]] == [
        (r["num_shards"], r["experts"], r["ok"], r["reason"] and r["reason"].replace(str(local), root))
        for r in here["results"]
    ]  # a reason naming a file names it by its URL
    # each safetensors file: ranged GETs inside its header; the JSON files whole; nothing else, never a HEAD
    gets = fake_hub.resolved("GET")
    assert gets and not fake_hub.resolved("HEAD")
    served: dict[str, int] = {}
    for s in gets:
        assert s.path.startswith(f"/shardload-test/{name}/resolve/{COMMIT}/"), s  # pinned to the commit
        if s.file.endswith(".safetensors"):
            assert s.status == 206 and s.range is not None and s.range[1] < _header_end(local / s.file), s
        else:
            assert s.range is None and s.file in ("config.json", "model.safetensors.index.json", "shard_info.json")
        served[s.file] = served.get(s.file, 0) + s.nbytes
    expected = {f.name: (_header_end(f) if f.suffix == ".safetensors" else f.stat().st_size)
                for f in local.iterdir() if f.name in served or f.suffix == ".safetensors"}  # fmt: skip
    assert served == expected  # every safetensors file's 8 + header bytes exactly, the JSON files whole
    assert {r["file"]: r["bytes"] for r in doc["fetched"]["reads"]} == served
    assert doc["fetched"]["bytes"] == sum(served.values()) and doc["fetched"]["tensor_bytes"] == 0
    assert doc["fetched"]["checkpoint_tensor_bytes"] == here["fetched"]["checkpoint_tensor_bytes"]
    assert {r["path"] for r in doc["fetched"]["reads"]} == {f"{root}/{f}" for f in served}
    if name == "example":
        assert {"shard_info.json", "model.safetensors.index.json"} <= served.keys()
    # nothing went into the Hub cache
    cache = tmp_path / "hf" / "hub"
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))


def test_hub_text_report_and_revision(fake_hub: Any, models: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["preflight", f"shardload-test/gqa@{COMMIT}", "-n", "8"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"shardload-test/gqa@{COMMIT}: llama, num_attention_heads=8")
    from shardload.cli.report import human_bytes

    config, header = (models["gqa"] / "config.json").stat().st_size, _header_end(models["gqa"] / "model.safetensors")
    assert lines[1].startswith(f"read {human_bytes(config + header)} (config.json {human_bytes(config)}, "
                               f"model.safetensors {human_bytes(header)}): none of the ")  # fmt: skip
    assert lines[1].endswith(" of tensor data") and "none of the" in lines[1]
    assert lines[2:] == ["tp=8: ok (each KV head on 4 ranks)", "allowed: tp 8 (checked 8)"]
    code, doc = _run("shardload-test/gqa@main")
    assert code == 0 and doc["modes"][0]["allowed"] == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("shardload-test/missing", "no such file or directory, and no Hugging Face Hub model shardload-test/missing"),
        ("shardload-test/gqa@nope", "the Hugging Face Hub model shardload-test/gqa has no revision 'nope'"),
        ("shardload-test/private", "no Hugging Face Hub model shardload-test/private (or it is private: log in"),
        ("shardload-test/gated", "the Hugging Face Hub model shardload-test/gated is gated: accept its terms"),
        ("shardload-test/forbidden", "the Hugging Face Hub refused access to shardload-test/forbidden (HTTP 403)"),
    ],
)
def test_hub_errors_are_one_line(fake_hub: Any, model: str, message: str) -> None:
    result = CliRunner().invoke(main, ["preflight", model])
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {model}: ") and message in line
    assert not [s for s in fake_hub.resolved("GET") if s.file.endswith(".safetensors")]


def test_hub_unreachable_offline_and_range_ignored(fake_hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    fake_hub.ignore_range = True  # a proxy that answers 200 and the whole file: refused, the body not read
    code, doc = _run("shardload-test/gqa")
    assert code == 1 and "answered a range request with HTTP 200, not 206" in doc["error"]["message"]
    fake_hub.reset()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, doc = _run("shardload-test/gqa")
    assert code == 1 and "is not in the local cache" in doc["error"]["message"]
    assert "HF_HUB_OFFLINE is set" in doc["error"]["message"] and fake_hub.served == []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    url = fake_hub.url
    fake_hub.close()  # nothing listens there now
    result = CliRunner().invoke(main, ["preflight", "shardload-test/gqa"])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert f"error: shardload-test/gqa: cannot reach the Hugging Face Hub at {url} (ConnectError" in result.stderr


def test_an_endpoint_s_credentials_never_reach_a_message(
    fake_hub: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """HF_ENDPOINT may carry a user and token (``http://user:token@host``): the lines naming the Hub or one of its
    URLs printed them, in the terminal and in --json."""
    from helpers.fake_hub import use_fake_hub

    use_fake_hub(monkeypatch, fake_hub.url.replace("http://", "http://alice:S3CRET-TOKEN@"), tmp_path / "hf2")
    fake_hub.ignore_range = True  # an error that names a file by its URL
    code, doc = _run("shardload-test/gqa")
    assert code == 1 and "answered a range request" in doc["error"]["message"], doc
    assert "S3CRET" not in json.dumps(doc) and "http://***@127.0.0.1" in json.dumps(doc), doc
    fake_hub.close()  # nothing listens there now: an error that names the endpoint
    result = CliRunner().invoke(main, ["preflight", "shardload-test/gqa"])
    assert result.exit_code == 1 and "cannot reach the Hugging Face Hub at http://***@" in result.stderr
    assert "S3CRET" not in result.output
    from shardload.errors import CheckpointError  # a signed URL a redirect named: its query's secrets too

    line = str(CheckpointError("answered 403", file="https://cdn.example/x?X-Amz-Signature=abc1&X-Amz-Date=2&token=t0"))
    assert "abc1" not in line and "t0" not in line and "X-Amz-Date=2" in line, line


def test_hiding_secrets_in_a_huge_name_from_a_file_is_bounded() -> None:
    """A tensor name from a file (``a.a.a.…=``, a megabyte) in an error line: the search for URLs' secrets tried the
    scheme pattern at every word boundary to the end (64 kB: 27 s; a megabyte: hours). Run in a child with a
    generous limit: the line takes milliseconds."""
    import subprocess
    import sys

    code = (
        "from shardload.errors import CheckpointError\n"
        "line = str(CheckpointError('bad dtype', file='model.safetensors', param='a.' * 500_000 + '='))\n"
        "assert 'characters cut' in line and len(line) < 10_000\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_hub_answer_that_trickles_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub (or a proxy) that sends a header's bytes one every few seconds held preflight for as long as it kept
    sending, each read inside the HTTP client's own timeout; the answer is now held to the object stores' minimum
    rate after a grace period."""
    import time

    from shardload.errors import CheckpointError
    from shardload.sources import deadlines, hub_remote

    monkeypatch.setattr(deadlines, "RATE_GRACE", 0.2)

    class Answer:
        def __init__(self) -> None:
            self.status_code = 206
            self.headers = {"Content-Range": "bytes 0-7/100"}

    def chunks() -> Iterator[bytes]:
        for byte in b"\x10\x00\x00\x00\x00\x00\x00\x00":
            time.sleep(0.1)
            yield bytes([byte])

    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"the Hub sent \d of 8 bytes in \d+ s, under 65536 bytes/s") as err:
        hub_remote._body(Answer(), "http://hub/x/resolve/c/model.safetensors", 8, (0, 7), chunks)
    assert time.monotonic() - started < 0.7 and "\n" not in str(err.value)


# -- an s3:// model: the proxy shows what was fetched


def _s3_available() -> bool:
    if os.environ.get("CI") == "true":
        return True
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _s3_available(), reason="needs boto3 and moto[server]")
@pytest.mark.parametrize("name", ["gqa", "gqa-int4-g32", "moe", "example"])
def test_s3_reads_only_config_index_and_headers(
    s3: Any, name: str, models: dict[str, Path], example_multi_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from helpers.s3 import use_endpoint

    local = example_multi_dir if name == "example" else models[name]
    use_endpoint(monkeypatch, s3.url, tmp_path)
    uri = s3.upload_dir(local, f"preflight-{name}")
    s3.proxy.reset()
    code, doc = _run(uri)
    assert code == 0, doc
    gets = [s for s in s3.proxy.served if s.method == "GET" and s.key]
    assert gets, s3.proxy.served
    for s in gets:
        file = s.key.rsplit("/", 1)[-1]
        if file.endswith(".safetensors"):  # the 8-byte length, then the header: never a tensor byte
            assert s.range is not None and s.range[1] <= _header_end(local / file), (file, s.range)
        else:
            assert file in ("config.json", "model.safetensors.index.json", "shard_info.json"), file
    served = sum(s.nbytes for s in gets)  # object bytes (the prefix's listing aside)
    assert doc["fetched"]["bytes"] == served and doc["fetched"]["tensor_bytes"] == 0
    # the same answer as from the directory it was uploaded from
    _, here = _run(str(local))
    assert doc["modes"] == here["modes"]
    assert [(r["num_shards"], r["experts"], r["ok"]) for r in doc["results"]] == [
        (r["num_shards"], r["experts"], r["ok"]) for r in here["results"]
    ]
