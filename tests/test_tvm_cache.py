"""TVM tensor caches as a source, judged by TVM itself: caches written by TVM's own ``dump_tensor_cache`` and
read back by TVM's own ``load_tensor_cache`` as the reference; TVM's Disco loader test cases re-created with
destination-passing steps, through the Python API and through the CLI with ``--plugin``."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers.tvm_cache import dump, presharded
from shardload.cli.main import main
from shardload.planning.registry import unregister
from shardload.sources.reader import count_reads

if os.environ.get("CI") == "true":  # CI installs apache-tvm through the test extra: never skip these there
    import tvm
else:
    tvm = pytest.importorskip("tvm")
from tvm.contrib import tvmjs

DEV = None  # set on first use: tvm.cpu()


def tvm_reference(path: Path) -> dict[str, np.ndarray]:
    """What TVM's own reader gives for a cache (f32-to-bf16 records decoded to float32)."""
    table = path / ("tensor-cache.json" if (path / "tensor-cache.json").exists() else "ndarray-cache.json")
    arrays, _ = tvmjs.load_tensor_cache(str(table), tvm.cpu())
    return {name: a.numpy() for name, a in arrays.items()}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def mlc_like_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A small MLC-style model: float16 weights, a float32 tensor (f32-to-bf16 when encoded), int4 in uint32 with
    float16 scales (q4f16_1: 8 values per uint32 along the input dim, one scale per 32 inputs), a norm."""
    return {
        "embed.weight": rng.standard_normal((64, 32)).astype("float16"),
        "qkv.q_weight": rng.integers(0, 2**32, size=(96, 4), dtype=np.uint32),  # [out, in/8]
        "qkv.q_scale": rng.standard_normal((96, 1)).astype("float16"),  # [out, in/32]
        "o.q_weight": rng.integers(0, 2**32, size=(32, 16), dtype=np.uint32),  # in = 128
        "o.q_scale": rng.standard_normal((32, 4)).astype("float16"),
        "router.weight": rng.standard_normal((8, 32)).astype("float32"),
        "norm.weight": rng.standard_normal((32,)).astype("float16"),
    }


MLC_SHARD_INFO = {
    "version": 1,
    "num_shards": None,
    "params": {
        "embed.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
        "qkv.q_weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
        "qkv.q_scale": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
        "o.q_weight": [["shard_funcs.shard_packed", [None, None], 1, 8, "num_shards"]],
        "o.q_scale": [["shard_funcs.shard_groups", [None, None], 1, 32, "num_shards", 128]],
        "router.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
    },
}
# how each parameter is split: (axis, or None for replicated); the reference splits TVM's arrays the same way
SPLIT_AXIS = {"embed.weight": 0, "qkv.q_weight": 0, "qkv.q_scale": 0, "o.q_weight": 1, "o.q_scale": 1,
              "router.weight": 0, "norm.weight": None}  # fmt: skip


@pytest.fixture(scope="module", params=["single", "multi"])
def mlc_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"mlc-{request.param}")
    params = mlc_like_params(np.random.default_rng(7))
    if request.param == "multi":  # several raw-shard files; a cap of 0 MB puts every record in a file of its own
        dump(params, path, encode="f32-to-bf16", cap_mb=0)
    else:
        dump(params, path, encode="f32-to-bf16")
    (path / "shard_info.json").write_text(json.dumps(MLC_SHARD_INFO))
    return path


def expected_ranks(path: Path, n: int) -> list[dict[str, np.ndarray]]:
    ref = tvm_reference(path)
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name, array in ref.items():
        axis = SPLIT_AXIS[name]
        parts = [array] * n if axis is None else np.split(array, n, axis=axis)
        for r in range(n):
            out[r][name] = parts[r]
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ranks_equal_tvm_reader(mlc_cache: Path, n: int, tmp_path: Path) -> None:
    table = json.loads((mlc_cache / "tensor-cache.json").read_text())
    assert len(table["records"]) > (3 if "multi" in mlc_cache.name else 0)
    want = expected_ranks(mlc_cache, n)
    assert want[0]["router.weight"].dtype == np.float32  # TVM decodes f32-to-bf16 to float32
    got_all = shardload.load(mlc_cache, n, devices=["cpu"] * n)
    converted = tmp_path / "tp"
    shardload.convert(mlc_cache, n, converted)
    for r in range(n):
        for source, got in (
            ("load", got_all[r]),
            ("load_rank", shardload.load_rank(mlc_cache, r, n)),
            ("load_rank via table", shardload.load_rank(mlc_cache / "tensor-cache.json", r, n)),
            ("converted", shardload.load_rank(converted, r, n, verify=True)),
        ):
            assert got.keys() == want[r].keys(), source
            for name, t in got.items():
                np.testing.assert_array_equal(as_numpy(t), want[r][name], err_msg=f"{source} rank {r} {name}")
                assert as_numpy(t).dtype == want[r][name].dtype


def test_remap_ranks_read_only_their_bytes(mlc_cache: Path) -> None:
    """A rank reads its own part of every split raw record, the replicated ones whole, and (decoded only whole)
    the f32-to-bf16 record whole: at most 1.05x of that."""
    n = 4
    plan = shardload.plan_model(mlc_cache, n)
    for r in range(n):
        with count_reads() as seen:
            got = shardload.load_rank(mlc_cache, r, n)
        own = sum(t.numel() * t.element_size() for name, t in got.items() if plan.params[name].source.decode is None)
        decoded_whole = sum(p.source.nbytes for p in plan.params.values() if p.source.decode is not None)
        assert decoded_whole > 0
        assert seen.bytes <= 1.05 * (own + decoded_whole)
        assert seen.bytes >= own


def test_legacy_table_name_and_cli_inspect(tmp_path: Path) -> None:
    """ndarray-cache.json (TVM before 0.22) is a cache, not a safetensors file read as a 7e18-byte header."""
    params = {"w": np.arange(64, dtype="float16").reshape(8, 8)}
    path = dump(params, tmp_path / "cache", legacy=True)
    info = {"version": 1, "num_shards": None, "params": {"w": [["shard_funcs.shard_dim", [None, None], 1, 2]]}}
    (path / "shard_info.json").write_text(json.dumps(info))
    result = CliRunner().invoke(main, ["inspect", str(path / "ndarray-cache.json"), "-n", "2"])
    assert result.exit_code == 0, result.output
    assert "bytes per rank: 64 B" in result.output
    for r in range(2):
        state = shardload.load_rank(path / "ndarray-cache.json", r, 2)
        np.testing.assert_array_equal(state["w"].numpy(), np.split(tvm_reference(path)["w"], 2, axis=1)[r])


# --- TVM's own Disco loader test cases (tests/python/disco/test_loader.py), with destination-passing steps ---

PLUGIN = textwrap.dedent(
    '''
    """TVM's test step functions ported to shardload: same names, same destination-passing calling convention."""
    import shardload


    @shardload.register("tests.disco.shard_dim_0", out=True, replace=True)
    def shard_dim_0(src, num_shards: int, tgt):
        s_0, s_1 = src.shape
        tgt.copy_(src.reshape(num_shards, s_0 // num_shards, s_1))


    @shardload.register("tests.disco.shard_dim_1", out=True, replace=True)
    def shard_dim_1(src, num_shards: int, tgt):
        s_0, s_1 = src.shape
        tgt.copy_(src.reshape(s_0, num_shards, s_1 // num_shards).transpose(0, 1))


    @shardload.register("tests.disco.shard_qkv_0", out=True, replace=True)
    def shard_qkv_0(src, num_shards: int, q_heads: int, kv_heads: int, tgt):
        total_dim, hidden_size = src.shape
        head_dim = total_dim // (q_heads + kv_heads + kv_heads)
        q_dim, kv_dim = q_heads * head_dim, kv_heads * head_dim
        w_q = src[:q_dim].reshape(num_shards, q_heads // num_shards, head_dim, hidden_size)
        w_k = src[q_dim : q_dim + kv_dim].reshape(num_shards, kv_heads // num_shards, head_dim, hidden_size)
        w_v = src[q_dim + kv_dim :].reshape(num_shards, kv_heads // num_shards, head_dim, hidden_size)
        tgt.copy_(__import__("torch").cat([w_q, w_k, w_v], dim=1))


    @shardload.register("tests.disco.shard_qkv_1", out=True, replace=True)
    def shard_qkv_1(src, tgt):
        s, _, _, h = src.shape
        tgt.copy_(src.reshape(s, -1, h))
    '''
)
DISCO_NAMES = (
    "tests.disco.shard_dim_0",
    "tests.disco.shard_dim_1",
    "tests.disco.shard_qkv_0",
    "tests.disco.shard_qkv_1",
)


@pytest.fixture
def disco_plugin(tmp_path: Path) -> Any:
    path = tmp_path / "disco_steps.py"
    path.write_text(PLUGIN)
    yield path
    for name in DISCO_NAMES:
        unregister(name)


def _disco_case(name: str, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any], list[dict]]:
    """(params, seed-form shard_info, expected per-worker arrays) of one of TVM's test cases, for 2 workers."""
    n = 2
    p0 = rng.uniform(size=[64, 128]).astype("float16")
    p1 = rng.uniform(size=[32, 128]).astype("float32")
    if name == "shard_dim":
        info = {
            "x_0": [["tests.disco.shard_dim_1", [[n, 64, 64], "float16"], n]],
            "x_1": [["tests.disco.shard_dim_0", [[n, 16, 128], "float32"], n]],
        }
        want = [{"x_0": p0[:, :64], "x_1": p1[:16]}, {"x_0": p0[:, 64:], "x_1": p1[16:]}]
        return {"x_0": p0, "x_1": p1}, info, want
    if name == "broadcast":
        return {"param_0": p0, "param_1": p1}, {}, [{"param_0": p0, "param_1": p1}] * n
    assert name == "qkv"
    q_heads, kv_heads, head_dim, hidden = 8, 10, 10, 20
    w_q = rng.uniform(size=[q_heads * head_dim, hidden]).astype("float16")
    w_k = rng.uniform(size=[kv_heads * head_dim, hidden]).astype("float16")
    w_v = rng.uniform(size=[kv_heads * head_dim, hidden]).astype("float16")
    fused = np.concatenate(
        [
            w_q.reshape(n, q_heads // n, head_dim, hidden),
            w_k.reshape(n, kv_heads // n, head_dim, hidden),
            w_v.reshape(n, kv_heads // n, head_dim, hidden),
        ],
        axis=1,
    ).reshape(n, -1, hidden)
    heads = (q_heads + 2 * kv_heads) // n
    info = {
        "w_qkv": [
            ["tests.disco.shard_qkv_0", [[n, heads, head_dim, hidden], "float16"], n, q_heads, kv_heads],
            ["tests.disco.shard_qkv_1", [[n, heads * head_dim, hidden], "float16"]],
        ]
    }
    return {"w_qkv": np.concatenate([w_q, w_k, w_v])}, info, [{"w_qkv": fused[0]}, {"w_qkv": fused[1]}]


@pytest.mark.parametrize("case", ["shard_dim", "broadcast", "qkv"])
def test_disco_loader_cases_python_api(case: str, disco_plugin: Path, tmp_path: Path) -> None:
    from shardload.cli.plugins import load_plugin

    load_plugin(str(disco_plugin))
    params, info, want = _disco_case(case, np.random.default_rng(3))
    path = dump(params, tmp_path / "cache", legacy=True)  # TVM's test writes ndarray-cache.json
    (path / "shard_info.json").write_text(json.dumps(info))
    for r in range(2):
        got = shardload.load_rank(path, r, 2)
        assert got.keys() == want[r].keys()
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"{case} worker {r} {name}")


@pytest.mark.parametrize("case", ["shard_dim", "qkv"])
def test_disco_loader_cases_cli_plugin(case: str, disco_plugin: Path, tmp_path: Path) -> None:
    params, info, want = _disco_case(case, np.random.default_rng(4))
    path = dump(params, tmp_path / "cache")
    (path / "shard_info.json").write_text(json.dumps(info))
    for name in DISCO_NAMES:
        unregister(name)  # only --plugin may bring them back
    runner = CliRunner()
    unknown = runner.invoke(main, ["validate", str(path / "shard_info.json"), "--model", str(path)])
    assert unknown.exit_code == 1 and "unknown function" in unknown.output
    ok = runner.invoke(
        main, ["validate", "--plugin", str(disco_plugin), str(path / "shard_info.json"), "--model", str(path)]
    )
    assert ok.exit_code == 0, ok.output
    out = tmp_path / "tp2"
    conv = runner.invoke(main, ["--plugin", str(disco_plugin), "convert", str(path), "-n", "2", "-o", str(out), "-q"])
    assert conv.exit_code == 0, conv.output
    for r in range(2):
        got = shardload.load_rank(out, r, 2, verify=True)
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"{case} worker {r} {name}")


def test_presharded_cache(tmp_path: Path) -> None:
    path, split = presharded(tmp_path, 2)
    shards = shardload.load(path, 2, devices=["cpu", "cpu"], shard_info={})
    for r in range(2):
        one = shardload.load_rank(path, r, 2)
        for got in (shards[r], one):
            assert set(got) == {"param_0", "param_1", "norm"}
            for name in ("param_0", "param_1"):
                np.testing.assert_array_equal(got[name].numpy(), split[name][r])
            np.testing.assert_array_equal(got["norm"].numpy(), np.ones(16, dtype="float16"))
        with count_reads() as seen:
            shardload.load_rank(path, r, 2)
        assert seen.bytes == sum(t.numel() * t.element_size() for t in one.values())
    with pytest.raises(shardload.ShardloadError, match="pre-sharded for num_shards=2"):
        shardload.load_rank(path, 0, 4)
    result = CliRunner().invoke(main, ["inspect", str(path), "-n", "4"])
    assert result.exit_code == 1 and "pre-sharded for num_shards=2" in result.output


def test_presharded_cache_at_its_own_n_with_a_plan_beside(tmp_path: Path) -> None:
    """The plan of the whole parameters beside a pre-sharded cache (which reading it at another N takes) leaves its own
    N as it is: each rank gets its records, the plan checked against them; a plan that does not describe them, or
    steps for a tensor the cache stores whole, are one line, not a guess."""
    path, split = presharded(tmp_path, 2)
    plan = {"param_0": [["shard_funcs.shard_dim", [[2, 32, 128], "float16"], 0, "num_shards"]],
            "param_1": [["shard_funcs.shard_dim", [[2, 32, 64], "float32"], 1, "num_shards"]]}  # fmt: skip
    (path / "shard_info.json").write_text(json.dumps(plan))
    for r in range(2):
        got = shardload.load_rank(path, r, 2)
        for name in ("param_0", "param_1"):
            np.testing.assert_array_equal(got[name].numpy(), split[name][r])
    shown = CliRunner().invoke(main, ["inspect", str(path), "-n", "2", "--json"])
    assert shown.exit_code == 0, shown.output  # inspect reads it as load does
    rows = {row["parameter"]: row for row in json.loads(shown.output)["rows"]}
    assert rows["param_1"]["rank_shape"] == [32, 64], rows["param_1"]
    wrong = {**plan, "param_1": [["shard_funcs.shard_dim", [[2, 16, 128], "float32"], 0, "num_shards"]]}
    with pytest.raises(shardload.PlanError, match=r"param_1: its steps give each of 2 ranks \[16, 128\] float32, "
                                                  r"but its records are \[32, 64\] float32"):  # fmt: skip
        shardload.load_rank(path, 0, 2, shard_info=wrong)  # a plan that does not describe the records: not ignored
    (path / "shard_info.json").write_text(json.dumps({"norm": [["shard_funcs.shard_dim", [[2, 8], "float16"], 0, 2]]}))
    with pytest.raises(shardload.PlanError, match="norm: lists steps for a tensor this cache stores whole"):
        shardload.load_rank(path, 0, 2)


def test_validate_and_plan_model_read_a_presharded_cache_as_load_does(tmp_path: Path) -> None:
    """``validate --model`` and ``plan_model`` plan a pre-sharded cache with the whole model's plan beside it the way
    a load reads it: at its own N each rank's records (the plan checked against them), at any other N the whole
    tensors they were cut from; both load, so neither is reported invalid."""
    path, _ = presharded(tmp_path, 2)
    plan = {"param_0": [["shard_funcs.shard_dim", [["num_shards", "64 // num_shards", 128], "float16"], 0,
                         "num_shards"]],
            "param_1": [["shard_funcs.shard_dim", [["num_shards", 32, "128 // num_shards"], "float32"], 1,
                         "num_shards"]]}  # fmt: skip
    info = path / "shard_info.json"
    info.write_text(json.dumps({"version": 1, "num_shards": None, "params": plan}))  # the document form: any N
    for n in (1, 2, 4):
        got = shardload.load_rank(path, n - 1, n)
        planned = shardload.plan_model(path, n)
        assert {k: tuple(p.shape) for k, p in planned.params.items()} == {k: tuple(t.shape) for k, t in got.items()}
        assert shardload.validate(info, model=path, num_shards=n) == [], n
    result = CliRunner().invoke(main, ["validate", str(info), "--model", str(path), "-n", "1", "-n", "2", "-n", "4"])
    assert result.exit_code == 0, result.output
    wrong = {**plan, "param_1": [["shard_funcs.shard_dim", [[2, 16, 128], "float32"], 0, "num_shards"]]}
    info.write_text(json.dumps({"version": 1, "num_shards": None, "params": wrong}))
    problems = shardload.validate(info, model=path, num_shards=2)
    assert [(p.param, p.reason) for p in problems] == [
        (
            "param_1",
            "its steps give each of 2 ranks [16, 128] float32, but its records are [32, 64] float32: this shard_info "
            "does not describe this cache",
        )
    ], problems


def test_one_integrity_record_covers_both_tables_of_an_f32_to_bf16_cache(tmp_path: Path) -> None:
    """TVM's writer encodes float32 as bf16 by default and then writes ``tensor-cache-b16.json`` beside the main
    table. ``shardload hash`` of the directory holds both tables, so a verified load through either passes, and one
    through a changed b16 table is refused (old code: the b16 table was never hashed, and a load through it was
    refused as 'not in the integrity record' however it was hashed)."""
    d = tmp_path / "c"
    tvmjs.dump_tensor_cache({"a": np.arange(16, dtype="float32").reshape(4, 4)}, str(d),
                            encode_format="f32-to-bf16", show_progress=False)  # fmt: skip
    (d / "shard_info.json").write_text("{}")
    assert (d / "tensor-cache-b16.json").is_file()
    assert CliRunner().invoke(main, ["hash", str(d)]).exit_code == 0
    for path in (d, d / "tensor-cache.json", d / "tensor-cache-b16.json"):
        got = shardload.load_rank(path, 0, 1, verify=True)
        assert got["a"].shape == (4, 4), path
    table = d / "tensor-cache-b16.json"
    table.write_text(table.read_text().replace('"records"', '"records" ', 1))
    with pytest.raises(shardload.ShardloadError, match=r"tensor-cache-b16\.json"):
        shardload.load_rank(table, 0, 1, verify=True)


def test_a_cache_mlc_llm_presharded_names_each_worker_s_record_from_0(tmp_path: Path) -> None:
    """MLC-LLM's ``--preshard`` names worker I's record ``NAME_shard-I`` (I from 0, no count: its
    ``support/preshard.py``, and its runtime's presharded loader looks them up so), unlike TVM's Disco
    ``NAME_shard-K-of-N``. Written by TVM's own writer beside an ``mlc-chat-config.json`` of
    ``tensor_parallel_shards`` 3, rank I gets record I as ``NAME`` and the whole records as they are; another N
    without a plan is one line (old code: every rank got ``w_shard-0`` ... as tensors of their own, and read all).
    Without that config the names are the tensors' own (a name alone could be any tensor's); a verified load pins
    the config."""
    w = [np.arange(8, dtype="float16").reshape(2, 4) + 10 * k for k in range(3)]
    norm = np.ones(4, dtype="float16")
    d = tmp_path / "c"
    tvmjs.dump_tensor_cache({"w_shard-0": w[0], "w_shard-1": w[1], "w_shard-2": w[2], "norm": norm}, str(d),
                            encode_format="raw", show_progress=False)  # fmt: skip
    (d / "shard_info.json").write_text("{}")
    assert set(shardload.load_rank(d, 1, 2)) == {"w_shard-0", "w_shard-1", "w_shard-2", "norm"}  # no config
    (d / "mlc-chat-config.json").write_text(json.dumps({"tensor_parallel_shards": 3}))
    (d / "shard_info.json").unlink()
    for r in range(3):
        got = shardload.load_rank(d, r, 3)
        assert set(got) == {"w", "norm"}, set(got)
        np.testing.assert_array_equal(got["w"].numpy(), w[r])
        np.testing.assert_array_equal(got["norm"].numpy(), norm)
    with pytest.raises(shardload.ShardloadError, match="pre-sharded for num_shards=3"):
        shardload.load_rank(d, 0, 2)
    # the whole w is the records one after another (rows): at N = 6 each rank reads its row out of them
    plan = {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}}
    whole = np.concatenate(w)
    for r in range(6):
        got = shardload.load_rank(d, r, 6, shard_info=plan)
        np.testing.assert_array_equal(got["w"].numpy(), whole[r : r + 1])
    shardload.hash_checkpoint(d)
    np.testing.assert_array_equal(shardload.load_rank(d, 2, 3, verify=True)["w"].numpy(), w[2])
    (d / "mlc-chat-config.json").write_text(json.dumps({"tensor_parallel_shards": 3, "x": 1}))
    with pytest.raises(shardload.ShardloadError, match=r"mlc-chat-config\.json: differs from the integrity record"):
        shardload.load_rank(d, 2, 3, verify=True)


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (["w_shard-0", "w_shard-2"], "w: pre-sharded for tensor_parallel_shards=3 (mlc-chat-config.json) but its "
                                     "record w_shard-1 is missing"),
        (["w_shard-0", "w_shard-01", "w_shard-2"], "leading zero"),
        (["w_shard-0", "w_shard-1", "w_shard-2", "v_shard-0"], "v: pre-sharded for tensor_parallel_shards=3"),
        (["w_shard-0", "w_shard-1", "w_shard-3"], "w_shard-3: is worker 3's record, but mlc-chat-config.json says "
                                                  "tensor_parallel_shards=3"),
        (["w_shard-0", "w_shard-1", "w_shard-2", "v_shard-1-of-2", "v_shard-2-of-2"], "both MLC-LLM's"),
    ],
)  # fmt: skip
def test_an_mlc_llm_presharded_cache_that_does_not_add_up_is_one_line(
    tmp_path: Path, names: list[str], says: str
) -> None:
    d = tmp_path / "c"
    tvmjs.dump_tensor_cache({n: np.zeros((2, 4), dtype="float16") for n in names}, str(d), encode_format="raw",
                            show_progress=False)  # fmt: skip
    (d / "mlc-chat-config.json").write_text(json.dumps({"tensor_parallel_shards": 3}))
    with pytest.raises(shardload.ShardloadError, match=re.escape(says) if "'" not in says else says):
        shardload.load_rank(d, 0, 2)


def test_a_record_hashed_before_the_bf16_table_was_kept_still_verifies_what_it_covers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record an earlier shardload wrote (without ``tensor-cache-b16.json``) still verifies loads that never read
    that table, through the directory or the main table, and ``shardload verify``; a load through the bf16 table
    itself is refused, since the record does not pin it (review of the previous commit: every verification of
    such a record failed, blaming a file 'added after shardload hash')."""
    from shardload.engine import hashing

    d = tmp_path / "c"
    tvmjs.dump_tensor_cache({"a": np.arange(16, dtype="float32").reshape(4, 4)}, str(d),
                            encode_format="f32-to-bf16", show_progress=False)  # fmt: skip
    (d / "shard_info.json").write_text("{}")
    older = tuple(n for n in hashing.METADATA_NAMES if n != "tensor-cache-b16.json")
    with monkeypatch.context() as m:
        m.setattr(hashing, "METADATA_NAMES", older)  # hashed as the earlier shardload did
        shardload.hash_checkpoint(d)
    for path in (d, d / "tensor-cache.json"):
        assert shardload.load_rank(path, 0, 1, verify=True)["a"].shape == (4, 4), path
    assert CliRunner().invoke(main, ["verify", str(d)]).exit_code == 0
    with pytest.raises(shardload.ShardloadError, match=r"tensor-cache-b16\.json: exists but is not in the integrity"):
        shardload.load_rank(d / "tensor-cache-b16.json", 0, 1, verify=True)
