"""TVM/MLC compatibility that needs no TVM: bad cache tables, destination-passing steps, user steps from installed
packages (the ``shardload.steps`` entry point group), and seed-form detection that parameter names cannot fool."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardload
from shardload.planning import registry
from shardload.sources.checkpoint import open_checkpoint


def write_cache(path: Path, arrays: dict[str, np.ndarray], **overrides: Any) -> Path:
    """A one-file cache laid out as TVM lays it out (records end to end); ``overrides`` patch the first record."""
    path.mkdir(parents=True, exist_ok=True)
    data, records = b"", []
    for name, a in arrays.items():
        raw = a.tobytes()
        records.append({"name": name, "shape": list(a.shape), "dtype": str(a.dtype), "format": "raw",
                        "nbytes": len(raw), "byteOffset": len(data)})  # fmt: skip
        data += raw
    records[0].update(overrides)
    (path / "params_shard_0.bin").write_bytes(data)
    shard = {"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": len(data), "records": records}
    (path / "tensor-cache.json").write_text(json.dumps({"metadata": {}, "records": [shard]}))
    return path


ARRAYS = {"w": np.arange(32, dtype="float16").reshape(4, 8), "b": np.arange(4, dtype="float32")}


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"nbytes": 10}, "nbytes is 10 but shape [4, 8] of float16 needs 64"),
        ({"byteOffset": 1 << 20}, "run past the end of params_shard_0.bin"),
        ({"dtype": "complex64"}, "dtype 'complex64' is not one shardload reads"),
        ({"format": "f16-to-f8"}, "format 'f16-to-f8' is neither 'raw' nor 'f32-to-bf16'"),
        ({"shape": [4, -8]}, "shape must be a list of non-negative integers"),
        ({"name": "b"}, "stored twice in the cache"),
        ({"name": "x_shard-1-of-2"}, "shard 2 of 2 is missing"),
    ],
)
def test_bad_record_is_one_located_error(tmp_path: Path, overrides: dict[str, Any], reason: str) -> None:
    path = write_cache(tmp_path / "cache", ARRAYS, **overrides)
    with pytest.raises(shardload.CheckpointError) as err:
        open_checkpoint(path)
    message = str(err.value)
    assert "\n" not in message and reason in message and "tensor-cache.json" in message


def test_bad_table(tmp_path: Path) -> None:
    path = write_cache(tmp_path / "cache", ARRAYS)
    table = json.loads((path / "tensor-cache.json").read_text())
    table["records"][0]["dataPath"] = "../outside.bin"
    (path / "tensor-cache.json").write_text(json.dumps(table))
    with pytest.raises(shardload.CheckpointError, match="points outside the model directory"):
        open_checkpoint(path)
    table["records"][0].update(dataPath="params_shard_0.bin", nbytes=3)
    (path / "tensor-cache.json").write_text(json.dumps(table))
    with pytest.raises(shardload.CheckpointError, match="bytes but the cache table says 3"):
        open_checkpoint(path)
    (path / "tensor-cache.json").write_text('{"records": {}}')
    with pytest.raises(shardload.CheckpointError, match="needs 'records'"):
        open_checkpoint(path / "tensor-cache.json")


def test_hand_written_cache_loads_like_the_arrays(tmp_path: Path) -> None:
    path = write_cache(tmp_path / "cache", ARRAYS)
    info = {"w": [["shard_funcs.shard_dim", [[2, 2, 8], "float16"], 0, 2]]}
    for r in range(2):
        got = shardload.load_rank(path, r, 2, shard_info=info)
        np.testing.assert_array_equal(got["w"].numpy(), ARRAYS["w"][2 * r : 2 * r + 2])
        np.testing.assert_array_equal(got["b"].numpy(), ARRAYS["b"])


def test_f32_to_bf16_record_decodes_to_float32(tmp_path: Path) -> None:
    """Stored as the upper 16 bits; decoded as TVM does (bits << 16), before the steps run."""
    values = torch.randn(4, 6).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    path = write_cache(tmp_path / "cache", {"r": bits}, dtype="float32", format="f32-to-bf16")
    decoded = (bits.astype(np.uint32) << 16).view(np.float32)
    plan = shardload.plan_model(path, 2, shard_info={"r": [["shard_funcs.shard_dim", [[2, 4, 3], "float32"], 1, 2]]})
    assert plan.params["r"].dtype == "float32" and not plan.params["r"].remap
    for r in range(2):
        got = shardload.load_rank(
            path, r, 2, shard_info={"r": [["shard_funcs.shard_dim", [[2, 4, 3], "float32"], 1, 2]]}
        )
        assert got["r"].dtype == torch.float32
        np.testing.assert_array_equal(got["r"].numpy(), np.split(decoded, 2, axis=1)[r])
    whole = shardload.load_rank(path, 1, 2, shard_info={})
    np.testing.assert_array_equal(whole["r"].numpy(), decoded)


# --- destination-passing steps ---------------------------------------------------------------------------


@pytest.fixture
def steps() -> Any:
    names: list[str] = []

    def reg(name: str, **kw: Any) -> Any:
        names.append(name)
        return shardload.register(name, replace=True, **kw)

    yield reg
    for name in names:
        registry.unregister(name)


def test_destination_passing_step_matches_builtin(tmp_path: Path, steps: Any) -> None:
    @steps("t.rows", out=True)
    def rows(x, num_shards: int, out):
        out.copy_(x.reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:]))

    path = write_cache(tmp_path / "cache", ARRAYS)
    ours = {"w": [["t.rows", [[2, 2, 8], "float16"], 2]]}
    builtin = {"w": [["shard_funcs.shard_dim", [[2, 2, 8], "float16"], 0, 2]]}
    for r in range(2):
        a, b = shardload.load_rank(path, r, 2, shard_info=ours), shardload.load_rank(path, r, 2, shard_info=builtin)
        assert torch.equal(a["w"], b["w"])


def test_destination_passing_needs_its_declaration(tmp_path: Path, steps: Any) -> None:
    steps("t.nodecl", out=True)(lambda x, num_shards, out: None)
    path = write_cache(tmp_path / "cache", ARRAYS)
    doc = {"version": 1, "num_shards": None, "params": {"w": [["t.nodecl", [None, None], 2]]}}
    problems = shardload.validate(doc and _doc_file(tmp_path, doc), model=path, num_shards=2)
    assert len(problems) == 1 and "must declare its output shape and dtype" in str(problems[0])


def _doc_file(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "shard_info.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("misbehaviour", ["returns another tensor", "resizes out"])
def test_destination_passing_misbehaviour_is_caught(tmp_path: Path, steps: Any, misbehaviour: str) -> None:
    @steps("t.bad", out=True)
    def bad(x, num_shards: int, out):
        if misbehaviour == "resizes out":
            out.resize_(1)
            return None
        return x.reshape(num_shards, -1, x.shape[1]).clone()

    path = write_cache(tmp_path / "cache", ARRAYS)
    with pytest.raises(shardload.PlanError, match=r"w: step 1 \(t.bad\)"):
        shardload.load_rank(path, 0, 2, shard_info={"w": [["t.bad", [[2, 2, 8], "float16"], 2]]})


def test_destination_passing_signature_is_checked() -> None:
    with pytest.raises(TypeError, match="must take \\(x, \\*fixed args, out\\)"):
        shardload.register("t.varargs", out=True)(lambda x, *args: None)
    with pytest.raises(TypeError, match="needs a shape rule"):
        shardload.register("t.norule")(lambda x: x)


# --- user steps from installed packages ------------------------------------------------------------------


def _fake_distribution(site: Path) -> None:
    """An installed package declaring a ``shardload.steps`` entry point, as pip would leave it."""
    (site / "acme_steps.py").write_text(
        textwrap.dedent(
            """
            import shardload

            def register():
                @shardload.register("acme.halves", shape=lambda s, d, n: ((n, s[0] // n, *s[1:]), d), replace=True)
                def halves(x, num_shards: int):
                    return x.reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:])
            """
        )
    )
    dist = site / "acme_steps-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-steps\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[shardload.steps]\nacme = acme_steps:register\n")


def test_entry_point_steps_reach_the_cli(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _fake_distribution(site)
    path = write_cache(tmp_path / "cache", ARRAYS)
    (path / "shard_info.json").write_text(json.dumps({"w": [["acme.halves", [[2, 2, 8], "float16"], 2]]}))
    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": f"{site}:{root}", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(root / "cli.py"), "validate", str(path / "shard_info.json"), "--model", str(path)]
    with_ep = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert with_ep.returncode == 0, with_ep.stdout + with_ep.stderr
    without = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(root)}, timeout=120)
    assert without.returncode == 1 and "unknown function 'acme.halves'" in without.stdout + without.stderr


def test_plugin_that_fails_is_a_usage_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from shardload.cli.main import main

    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    result = CliRunner().invoke(main, ["--plugin", str(bad), "validate", "x.json"])
    assert result.exit_code == 2 and "failed to import: RuntimeError: boom" in result.output
    result = CliRunner().invoke(main, ["validate", "--plugin", "no_such_module_xyz", "x.json"])
    assert result.exit_code == 2 and "no_such_module_xyz" in result.output


# --- seed-form detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["version", "params", "num_shards", "description"])
def test_parameter_named_like_a_document_key_is_seed_form(tmp_path: Path, name: str) -> None:
    arrays = {name: np.arange(32, dtype="float16").reshape(4, 8)}
    path = write_cache(tmp_path / "cache", arrays)
    seed = {name: [["shard_funcs.shard_dim", [[2, 2, 8], "float16"], 0, 2]]}
    info = shardload.ShardInfo.from_dict(seed)
    assert info.form == "seed" and info.num_shards == 2 and list(info.params) == [name]
    got = shardload.load_rank(path, 1, 2, shard_info=info)
    np.testing.assert_array_equal(got[name].numpy(), arrays[name][2:])


def test_unknown_key_says_tvm_would_ignore_it(tmp_path: Path) -> None:
    path = write_cache(tmp_path / "cache", ARRAYS)
    info = _doc_file(tmp_path, {"ww": [["shard_funcs.shard_dim", [[2, 2, 8], "float16"], 0, 2]]})
    problems = shardload.validate(info, model=path, num_shards=2)
    assert len(problems) == 1
    assert "names no parameter" in str(problems[0]) and "TVM's loader would ignore this key" in str(problems[0])


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (
            ["a_shard-1-of-2", "a_shard-2-of-2", "a_shard-01-of-2"],
            "a_shard-01-of-2: a shard record named with a leading",
        ),
        (["a_shard-01-of-2", "a_shard-02-of-2"], "a_shard-01-of-2: a shard record named with a leading zero"),
    ],
)
def test_a_shard_record_tvm_would_not_look_up_is_refused(tmp_path: Path, names: list[str], reason: str) -> None:
    """TVM finds NAME_shard-K-of-N by that exact name: a record spelled with leading zeros beside the real ones was
    read as shard K in their place (rank 0 got the 7s, TVM the 1s), and alone it loaded what TVM cannot find."""
    arrays = {name: np.full((2, 2), 1 + i, dtype="float16") for i, name in enumerate(names)}
    path = write_cache(tmp_path / "cache", arrays)
    with pytest.raises(shardload.CheckpointError) as err:
        open_checkpoint(path)
    assert "\n" not in str(err.value) and reason in str(err.value) and "tensor-cache.json" in str(err.value)


@pytest.mark.parametrize(
    ("tvm_name", "dtype"), [("e4m3_float8", torch.float8_e4m3fn), ("e5m2_float8", torch.float8_e5m2)]
)
def test_older_tvm_float8_names_are_read(tmp_path: Path, tvm_name: str, dtype: torch.dtype) -> None:
    """Older TVM records float8 tensors as e4m3_float8 and e5m2_float8 (ml_dtypes' float8_e4m3fn, float8_e5m2);
    such a cache was refused."""
    values = torch.arange(16, dtype=torch.float32).reshape(2, 8).to(dtype)
    raw = values.view(torch.uint8).numpy()
    path = write_cache(tmp_path / "cache", {"w": raw}, dtype=tvm_name)
    got = shardload.load_rank(path, 0, 1, shard_info={"version": 1, "params": {}})["w"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), values.view(torch.uint8))


def test_a_cache_table_linked_from_outside_the_directory_is_refused(tmp_path: Path) -> None:
    """A directory's tensor-cache.json that links out of it was read (its data files are checked, the table was not)."""
    outside = write_cache(tmp_path / "outside", ARRAYS)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tensor-cache.json").symlink_to(outside / "tensor-cache.json")
    (model / "params_shard_0.bin").write_bytes((outside / "params_shard_0.bin").read_bytes())  # the data inside
    with pytest.raises(shardload.CheckpointError, match="resolves outside the model directory"):
        open_checkpoint(model)
