"""The bad-input corpus: every malformed shard_info, checkpoint and converted directory gets one clear
line naming the file, the parameter (where there is one) and the reason, exit 1 from the CLI, no
traceback, and nothing written.

Each table row is one bad input; every row is tried through the CLI (validate / inspect / convert /
verify, as fits) and through the Python API (load_rank).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import shardload
from shardload.cli.main import main
from shardload.errors import CheckpointError, ShardloadError
from shardload.sources import safetensors_header
from shardload.sources.checkpoint import TMP_MARKER

RNG = np.random.default_rng(6)
W = RNG.standard_normal((8, 6)).astype(np.float16)
V = RNG.standard_normal(12).astype(np.float32)
E = RNG.standard_normal((16, 4)).astype(np.float16)
L = RNG.standard_normal((16, 4)).astype(np.float16)
GOOD_INFO: dict[str, Any] = {
    "version": 1,
    "num_shards": None,
    "params": {
        "w": [["shard_funcs.shard_dim", [["num_shards", "8 // num_shards", 6], "float16"], 0, "num_shards"]],
        "model.embed_tokens.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
    },
}


def st_bytes(
    tensors: dict[str, Any], *, header: dict[str, Any] | None = None, raw_header: bytes | None = None
) -> bytes:
    """A safetensors file built by hand (so it can be broken on purpose)."""
    data, entries, offset = b"", {}, 0
    codes = {np.float16: "F16", np.float32: "F32"}
    for name, x in tensors.items():
        entries[name] = {
            "dtype": codes[x.dtype.type],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        data += x.tobytes()
        offset += x.nbytes
    if header is not None:
        entries = header
    raw = raw_header if raw_header is not None else json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


GIANT_EMPTY = {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [96, 96]}
"""A tensor of no element whose strides run past int64."""


def base_header() -> dict[str, Any]:
    return {
        "w": {"dtype": "F16", "shape": [8, 6], "data_offsets": [0, 96]},
        "v": {"dtype": "F32", "shape": [12], "data_offsets": [96, 144]},
    }


def model_dir(path: Path, weights: bytes | None = None, *, tied: bool = False) -> Path:
    """A small model: w [8, 6] float16, v [12] float32, and tied embeddings, plus config and shard_info."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {"w": W, "v": V, "model.embed_tokens.weight": E, "lm_head.weight": L}
    if weights is None:
        weights = st_bytes(tensors)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    (path / "shard_info.json").write_text(json.dumps(GOOD_INFO))
    return path


def assert_one_line(text: str, must: list[str]) -> None:
    lines = text.strip().splitlines()
    assert lines, "no message at all"
    assert "Traceback" not in text
    for line in lines:
        assert all(m in line for m in must), (line, must)


def assert_nothing_written(parent: Path, out: Path) -> None:
    assert not out.exists(), "a failed convert must not leave an output directory"
    assert not [p for p in parent.iterdir() if TMP_MARKER in p.name], "temporary files left behind"


# ---------------------------------------------------------------------------------------------
# shard_info files: (id, file text, parameter named in the message or None, reason)

SHARD_DIM = "shard_funcs.shard_dim"


def doc(params: dict[str, Any], **top: Any) -> str:
    return json.dumps({"version": 1, "num_shards": None, "params": params, **top})


def w_step(*args: Any, shape: Any = None, dtype: Any = None, func: Any = SHARD_DIM) -> str:
    return doc({"w": [[func, [shape, dtype], *args]]})


SHARD_INFO_CASES: list[tuple[str, str | bytes, str | None, str]] = [
    ("not-json", '{"version": 1, "params": {', None, "not valid JSON"),
    ("empty-file", "", None, "not valid JSON"),
    ("not-utf8", b'{"version": 1, "params": {"\xff": []}}', None, "not UTF-8"),
    ("nan-constant", '{"version": 1, "params": {"w": [["f", [[NaN], null]]]}}', None, "not valid JSON"),
    ("deep-nesting", "[" * 200_000, None, "not valid JSON"),
    ("top-level-array", "[1, 2]", None, "top level must be a JSON object"),
    ("params-not-object", '{"version": 1, "params": []}', None, "does not match shard_info.schema.json"),
    ("unknown-top-key", doc({}, extra=1), None, "'extra' was unexpected"),
    ("unknown-version", '{"version": 2, "params": {}}', None, "unsupported version 2"),
    ("version-string", '{"version": "1", "params": {}}', None, "unsupported version '1'"),
    ("steps-not-a-list", doc({"w": {"a": 1}}), "w", "is not of type 'array'"),
    ("step-not-a-list", doc({"w": ["shard_funcs.shard_dim"]}), "w", "is not of type 'array'"),
    ("step-too-short", doc({"w": [[SHARD_DIM]]}), "w", "step 1"),
    ("shape-dtype-pair-wrong", doc({"w": [[SHARD_DIM, [None], 0, 2]]}), "w", "[shape, dtype]"),
    ("function-not-string", doc({"w": [[5, [None, None], 0, 2]]}), "w", "function name"),
    ("wrong-arity-few", w_step(0), "w", "takes 2 extra argument(s), got 1"),
    ("wrong-arity-many", w_step(0, 2, 3), "w", "takes 2 extra argument(s), got 3"),
    ("unknown-function", w_step(0, 2, func="shard_funcs.nope"), "w", "unknown function 'shard_funcs.nope'"),
    ("arg-list-for-int", w_step([0], 2), "w", "argument 'dim': expected an integer"),
    ("arg-float-for-int", w_step(0.5, 2), "w", "argument 'dim': expected an integer"),
    ("arg-bool-for-int", w_step(True, 2), "w", "argument 'dim': expected an integer"),
    (
        "arg-int-for-list",
        doc({"w": [["shard_funcs.reorder_segments", [None, None], 0, 8, 2]]}),
        "w",
        "list of integers",
    ),
    ("arg-name-in-expr", w_step("zero", 2), "w", "is not allowed"),
    ("negative-shape-dim", w_step(0, 2, shape=[2, -4, 6]), "w", "does not match shard_info.schema.json (shape)"),
    ("negative-dim-arg", w_step(-5, 2), "w", "dim -5 is out of range"),
    ("negative-dim-expr", w_step(0, 2, shape=["num_shards", "2 - num_shards * 4", 6]), "w", "negative dim"),
    ("zero-num-shards-arg", w_step(0, 0), "w", "num_shards must be >= 1"),
    ("zero-shape-dim", w_step(0, 2, shape=[2, 0, 6]), "w", "declared output shape [2, 0, 6]"),
    ("huge-shape-dim", w_step(0, 2, shape=[2, 4, 10**30]), "w", "overflows"),
    ("huge-dim-arg", w_step(2**70, 2), "w", "overflows"),
    ("huge-dim-expr", w_step(0, 2, shape=[2, "4 * 99999999999 * 99999999999", 6]), "w", "overflows"),
    ("expr-malformed", w_step(0, "num_shards +"), "w", "malformed expression"),
    ("expr-unbalanced", w_step(0, "(num_shards"), "w", "malformed expression"),
    ("expr-call", w_step(0, "__import__('os').getpid()"), "w", "is not allowed"),
    ("expr-power", w_step(0, "num_shards ** 2"), "w", "is not allowed"),
    ("expr-true-division", w_step(0, "num_shards / 1"), "w", "is not allowed"),
    ("expr-divide-by-zero", w_step(0, 2, shape=[2, "8 // (num_shards - 2)", 6]), "w", "divides by zero"),
    ("expr-not-exact", w_step(0, 2, shape=[2, "7 // num_shards", 6]), "w", "7 is not divisible by 2"),
    ("expr-absurdly-long-shape", w_step(0, 2, shape=[2, "1+" * 300 + "1", 6]), "w", "is too long"),
    ("expr-absurdly-long-arg", w_step(0, "num_shards" + " + 0" * 100), "w", "too long (limit 200)"),
    ("shape-disagrees-with-rule", w_step(0, 2, shape=[2, 4, 7]), "w", "declared output shape [2, 4, 7]"),
    ("dtype-disagrees-with-rule", w_step(0, 2, dtype="float32"), "w", "declared dtype float32"),
    ("dtype-unknown", w_step(0, 2, dtype="float17"), "w", "does not match shard_info.schema.json (dtype)"),
    ("not-divisible-by-n", w_step(1, 4), "w", "dim 1 of size 6 is not divisible by num_shards=4"),
    (
        "last-step-not-leading-n",
        doc({"w": [["shard_funcs.reorder_segments", [None, None], 0, [4, 4], 2]]}),
        "w",
        "last step must output [num_shards=2, ...]",
    ),
    ("file-for-other-n", doc({"w": [[SHARD_DIM, [None, None], 0, 4]]}, num_shards=4), None, "for num_shards=4 only"),
    (
        "seed-form-mixed-n",
        json.dumps({"w": [[SHARD_DIM, [[2, 4, 6], "float16"], 0, 2]], "v": [[SHARD_DIM, [[4, 3], "float32"], 0, 4]]}),
        None,
        "one num_shards",
    ),
    ("duplicate-key-params", '{"version": 1, "params": {"w": [], "w": []}}', None, "duplicate key 'w'"),
    ("duplicate-key-top", '{"version": 1, "version": 1, "params": {}}', None, "duplicate key 'version'"),
    ("key-names-no-parameter", doc({"model.w": [[SHARD_DIM, [None, None], 0, 2]]}), "model.w", "names no parameter"),
    ("alias-json-escape", '{"version": 1, "params": {"w": [], "\\u0077": []}}', None, "duplicate key 'w'"),
    ("alias-unicode-nfc", doc({"caf\u00e9": [], "cafe\u0301": []}), "cafe\u0301", "listed twice through an alias"),
    (
        "alias-tied-weights",
        doc(
            {
                "lm_head.weight": [[SHARD_DIM, [None, None], 0, "num_shards"]],
                "model.embed_tokens.weight": [[SHARD_DIM, [None, None], 1, "num_shards"]],
            }
        ),
        "model.embed_tokens.weight",
        "listed twice through an alias",
    ),
]


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("tied") / "m", tied=True)


@pytest.mark.parametrize(("text", "param", "reason"), [c[1:] for c in SHARD_INFO_CASES],
                         ids=[c[0] for c in SHARD_INFO_CASES])  # fmt: skip
def test_bad_shard_info(
    tied_model: Path, tmp_path: Path, text: str | bytes, param: str | None, reason: str, monkeypatch: Any
) -> None:
    bad = tmp_path / "shard_info.json"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    must = [f"{bad}: ", reason] + ([f": {param}: "] if param else [])
    runner = CliRunner()
    # validate: one line per problem, exit 1
    result = runner.invoke(main, ["validate", str(bad), "--model", str(tied_model), "-n", "2"])
    assert result.exit_code == 1, result.output
    assert_one_line(result.stdout, must)
    # convert: one error line, exit 1, nothing written
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(tied_model), "-n", "2", "-o", str(out), "--shard-info", str(bad)])
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert_one_line(result.stderr.removeprefix("error: "), must)
    assert_nothing_written(tmp_path, out)
    # the API raises one ShardloadError with the same message
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(tied_model, 0, 2, shard_info=bad)
    assert_one_line(str(err.value), must)


def test_tied_weights_listed_identically_are_fine(tied_model: Path) -> None:
    step = [[SHARD_DIM, [None, None], 0, "num_shards"]]
    info = {"version": 1, "params": {"lm_head.weight": step, "model.embed_tokens.weight": step}}
    state = shardload.load_rank(tied_model, 1, 2, shard_info=info)
    np.testing.assert_array_equal(state["lm_head.weight"].numpy(), L[8:])


def test_a_config_that_cannot_be_read_is_no_licence_to_split_tied_weights_apart(
    tied_model: Path, tmp_path: Path
) -> None:
    """Tied weights listed with different steps are refused; with config.json unreadable (trailing bytes) the ties
    were taken as absent and the load returned: now the config's problem is the one line."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tied_model, model)
    rows, cols = [[SHARD_DIM, [None, None], 0, "num_shards"]], [[SHARD_DIM, [None, None], 1, "num_shards"]]
    info = {"version": 1, "params": {"lm_head.weight": rows, "model.embed_tokens.weight": cols}}
    with pytest.raises(ShardloadError, match="tied"):
        shardload.load_rank(model, 1, 2, shard_info=info)
    config = model / "config.json"
    config.write_text(config.read_text() + "xx")
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 1, 2, shard_info=info)
    assert str(config) in str(err.value) and "\n" not in str(err.value)


def test_model_prefix_is_not_an_alias(tmp_path: Path) -> None:
    tensors = {"x": W, "model.x": W}
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(st_bytes(tensors))
    step = [[SHARD_DIM, [None, None], 0, "num_shards"]]
    info = {"version": 1, "params": {"x": step, "model.x": [[SHARD_DIM, [None, None], 1, "num_shards"]]}}
    state = shardload.load_rank(model, 0, 2, shard_info=info)
    np.testing.assert_array_equal(state["x"].numpy(), W[:4])
    np.testing.assert_array_equal(state["model.x"].numpy(), W[:, :3])


# ---------------------------------------------------------------------------------------------
# checkpoints: (id, builder(model dir) -> path to open, file name in the message, reason)

Builder = Callable[[Path], Path]


def with_weights(data: bytes) -> Builder:
    def build(d: Path) -> Path:
        model_dir(d, data)
        return d

    return build


def with_header(mutate: Callable[[dict[str, Any]], None]) -> Builder:
    header = base_header()
    mutate(header)
    return with_weights(st_bytes({"w": W, "v": V}, header=header))


def good() -> bytes:
    return st_bytes({"w": W, "v": V})


def with_index(weight_map: dict[str, str], files: dict[str, bytes], index_text: str | None = None) -> Builder:
    def build(d: Path) -> Path:
        model_dir(d)
        (d / "model.safetensors").unlink()
        for name, data in files.items():
            (d / name).write_bytes(data)
        text = index_text if index_text is not None else json.dumps({"weight_map": weight_map})
        (d / "model.safetensors.index.json").write_text(text)
        return d

    return build


def symlink_out(index: bool) -> Builder:
    def build(d: Path) -> Path:
        elsewhere = d.parent / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "secret.safetensors").write_bytes(good())
        model_dir(d)
        (d / "model.safetensors").unlink()
        if index:
            (d / "a.safetensors").symlink_to(elsewhere / "secret.safetensors")
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
        else:
            (d / "model.safetensors").symlink_to(elsewhere / "secret.safetensors")
        return d

    return build


def two_files_one_tensor(d: Path) -> Path:
    model_dir(d)
    (d / "model.safetensors").unlink()
    (d / "a.safetensors").write_bytes(good())
    (d / "b.safetensors").write_bytes(st_bytes({"w": W}))
    return d


def index_names_directory(d: Path) -> Path:
    with_index({"w": "sub"}, {})(d)
    (d / "sub").mkdir()
    return d


def temp_dir_as_model(d: Path) -> Path:
    tmp = d / f".out{TMP_MARKER}123-abcd"
    model_dir(tmp)
    return tmp


def rank_files_no_manifest(d: Path) -> Path:
    d.mkdir()
    (d / "rank-00000-of-00002.safetensors").write_bytes(good())
    (d / "rank-00001-of-00002.safetensors").write_bytes(good())
    (d / "shard_info.json").write_text(json.dumps(GOOD_INFO))
    return d


def big_claimed_header(d: Path) -> Path:
    model_dir(d, struct.pack("<Q", 300 << 20) + b"{}" + b" " * 64)
    return d


CHECKPOINT_CASES: list[tuple[str, Builder, str, str]] = [
    ("truncated", with_weights(good()[:-10]), "model.safetensors", "run past the end of the data"),
    ("too-short", with_weights(b"\x01\x00"), "model.safetensors", "too short for a safetensors header"),
    (
        "header-longer-than-file",
        with_weights(struct.pack("<Q", 4096) + b"{}"),
        "model.safetensors",
        "runs past the end of the",
    ),
    ("header-cap", big_claimed_header, "model.safetensors", "exceeds the"),
    ("header-not-json", with_weights(st_bytes({}, raw_header=b"{not json")), "model.safetensors", "not valid JSON"),
    ("header-not-utf8", with_weights(st_bytes({}, raw_header=b'{"\xff": 1}')), "model.safetensors", "not UTF-8"),
    ("header-not-object", with_weights(st_bytes({}, raw_header=b"[]")), "model.safetensors", "not a JSON object"),
    (
        "header-duplicate-tensor",
        with_weights(
            st_bytes({}, raw_header=b'{"w": {"dtype": "F16", "shape": [0], "data_offsets": [0, 0]}, "w": {}}')
        ),
        "model.safetensors",
        "listed twice in the safetensors header",
    ),
    (
        "header-duplicate-metadata",
        with_weights(st_bytes({}, raw_header=b'{"__metadata__": {}, "__metadata__": {}}')),
        "model.safetensors",
        "'__metadata__' is given twice in the safetensors header",
    ),
    (
        "metadata-not-strings",
        with_header(lambda h: h.update(__metadata__={"a": 1})),
        "model.safetensors",
        "__metadata__",
    ),
    ("entry-not-object", with_header(lambda h: h.update(v=[1])), "model.safetensors", "not an object"),
    (
        "offsets-overlap",
        with_header(lambda h: h["v"].update(data_offsets=[48, 96])),
        "model.safetensors",
        "overlaps tensor",
    ),
    (
        "offsets-out-of-bounds",
        with_header(lambda h: h["v"].update(data_offsets=[96, 400])),
        "model.safetensors",
        "run past the end of the data",
    ),
    (
        "offsets-reversed",
        with_header(lambda h: h["v"].update(data_offsets=[144, 96])),
        "model.safetensors",
        "bad data_offsets",
    ),
    (
        "offsets-negative",
        with_header(lambda h: h["v"].update(data_offsets=[-48, 0])),
        "model.safetensors",
        "bad data_offsets",
    ),
    (
        "data-gap",
        with_weights(
            st_bytes({}, header={"v": {"dtype": "F32", "shape": [12], "data_offsets": [96, 144]}}) + b"\0" * 144
        ),
        "model.safetensors",
        "belong to no tensor",
    ),
    ("trailing-bytes", with_weights(good() + b"\0" * 8), "model.safetensors", "8 trailing bytes"),
    ("dtype-unknown", with_header(lambda h: h["v"].update(dtype="F17")), "model.safetensors", "unknown dtype 'F17'"),
    ("shape-size-disagree", with_header(lambda h: h["v"].update(shape=[13])), "model.safetensors", "needs 52 bytes"),
    ("shape-negative", with_header(lambda h: h["v"].update(shape=[-12])), "model.safetensors", "bad shape"),
    ("shape-not-ints", with_header(lambda h: h["v"].update(shape=["12"])), "model.safetensors", "bad shape"),
    (
        "shape-empty-but-overflowing",  # no element, but strides past int64: torch cannot make the tensor
        with_weights(st_bytes({"w": W}, header={**base_header(), "v": GIANT_EMPTY})),
        "model.safetensors",
        "too large",
    ),
    ("index-missing-file", with_index({"w": "nope.safetensors"}, {}), "index.json", "references missing file"),
    ("index-dotdot", with_index({"w": "../../etc/passwd"}, {}), "index.json", "points outside the model directory"),
    ("index-absolute", with_index({"w": "/etc/passwd"}, {}), "index.json", "points outside the model directory"),
    ("index-nul", with_index({"w": "a\0.safetensors"}, {}), "index.json", "points outside the model directory"),
    ("index-symlink-out", symlink_out(index=True), "index.json", "resolves outside the model directory"),
    ("single-symlink-out", symlink_out(index=False), "m", "resolves outside the model directory"),
    ("index-names-directory", index_names_directory, "index.json", "is not a regular file"),
    ("index-not-json", with_index({}, {}, "{oops"), "index.json", "index is not valid JSON"),
    (
        "index-duplicate-key",
        with_index({}, {"a.safetensors": good()}, '{"weight_map": {"w": "a.safetensors", "w": "a.safetensors"}}'),
        "index.json",
        "twice",
    ),
    ("index-weight-map-wrong", with_index({}, {}, '{"weight_map": ["a"]}'), "index.json", "'weight_map' must be"),
    (
        "index-lists-unstored",
        with_index({"w": "a.safetensors", "zz": "a.safetensors"}, {"a.safetensors": good()}),
        "index.json",
        "listed in the index but not stored",
    ),
    (
        "index-wrong-file",
        with_index(
            {"w": "a.safetensors", "v": "a.safetensors", "z": "b.safetensors"},
            {"a.safetensors": st_bytes({"w": W}), "b.safetensors": st_bytes({"v": V, "z": V})},
        ),
        "index.json",
        "the index says a.safetensors, but it is stored in b.safetensors",
    ),
    (
        "index-two-files-one-tensor",
        with_index(
            {"w": "a.safetensors", "v": "b.safetensors"}, {"a.safetensors": good(), "b.safetensors": st_bytes({"v": V})}
        ),
        "safetensors",
        "tensor is stored in two files",
    ),
    ("two-files-one-tensor", two_files_one_tensor, "b.safetensors", "tensor is stored in two files"),
    ("temporary-dir-as-model", temp_dir_as_model, TMP_MARKER, "temporary entry of an unfinished"),
    ("rank-files-without-manifest", rank_files_no_manifest, "m", "no shard_manifest.json"),
]


@pytest.mark.parametrize(("build", "file_part", "reason"), [c[1:] for c in CHECKPOINT_CASES],
                         ids=[c[0] for c in CHECKPOINT_CASES])  # fmt: skip
def test_bad_checkpoint(tmp_path: Path, build: Builder, file_part: str, reason: str) -> None:
    model = build(tmp_path / "m")
    runner = CliRunner()
    (tmp_path / "info.json").write_text(json.dumps(GOOD_INFO))
    result = runner.invoke(main, ["inspect", str(model), "-n", "2", "--shard-info", str(tmp_path / "info.json")])
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert_one_line(result.stderr, ["error: ", file_part, reason])
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(model), "-n", "2", "-o", str(out), "--shard-info",
                                  str(tmp_path / "info.json")])  # fmt: skip
    assert result.exit_code == 1, result.output
    assert_one_line(result.stderr, ["error: ", file_part, reason])
    assert_nothing_written(tmp_path, out)
    result = runner.invoke(main, ["validate", str(tmp_path / "info.json"), "--model", str(model)])
    assert result.exit_code == 1
    assert_one_line(result.stdout, [file_part, reason])
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank(model, 0, 2, shard_info=tmp_path / "info.json")
    assert_one_line(str(err.value), [file_part, reason])


def test_real_header_over_the_cap(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", 64)
    model = model_dir(tmp_path / "m", good())
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header of \d+ bytes exceeds the 64 byte cap"):
        shardload.load_rank(model, 0, 2)


def test_huggingface_cache_symlinks_are_allowed(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--m"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / "f00d").write_bytes(good())
    (snapshot / "model.safetensors").symlink_to("../../blobs/f00d")
    (snapshot / "shard_info.json").write_text(json.dumps({"version": 1, "params": {"w": GOOD_INFO["params"]["w"]}}))
    np.testing.assert_array_equal(shardload.load_rank(snapshot, 1, 2)["w"].numpy(), W[4:])


# ---------------------------------------------------------------------------------------------
# converted directories: (id, mutate(out dir), rank whose load fails, fails without verify, reason)


def edit_manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def mutate(out: Path) -> None:
        manifest = json.loads((out / "shard_manifest.json").read_text())
        change(manifest)
        (out / "shard_manifest.json").write_text(json.dumps(manifest))

    return mutate


def flip_last_byte(name: str) -> Callable[[Path], None]:
    def mutate(out: Path) -> None:
        data = bytearray((out / name).read_bytes())
        data[-1] ^= 0x5A
        (out / name).write_bytes(bytes(data))

    return mutate


def swap_ranks(out: Path) -> None:
    a, b = out / "rank-00000-of-00002.safetensors", out / "rank-00001-of-00002.safetensors"
    os.replace(a, out / "tmp")
    os.replace(b, a)
    os.replace(out / "tmp", b)


R0, R1 = "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"
CONVERTED_CASES: list[tuple[str, Callable[[Path], None], int | None, bool, str]] = [
    ("manifest-missing", lambda o: (o / "shard_manifest.json").unlink(), 0, True, "no shard_manifest.json"),
    ("manifest-not-json", lambda o: (o / "shard_manifest.json").write_text("{"), 0, True, "manifest is not valid JSON"),
    ("manifest-not-object", lambda o: (o / "shard_manifest.json").write_text("[]"), 0, True, "not a JSON object"),
    ("manifest-format", edit_manifest(lambda m: m.update(format="other")), 0, True, "'format' is 'other'"),
    ("manifest-version", edit_manifest(lambda m: m.update(version=7)), 0, True, "unsupported version 7"),
    ("manifest-num-shards", edit_manifest(lambda m: m.update(num_shards="2")), 0, True, "integer 'num_shards'"),
    (
        "manifest-n-inconsistent",
        edit_manifest(lambda m: m.update(num_shards=3)),
        0,
        True,
        "'shard_info' must be an object for num_shards=3",
    ),
    ("manifest-rank-unlisted", edit_manifest(lambda m: m["files"].pop(1)), 0, True, f"lists no file {R1}"),
    (
        "manifest-rank-other-n",
        edit_manifest(lambda m: m["files"][1].update(path="rank-00001-of-00004.safetensors")),
        0,
        True,
        "not a rank file of num_shards=2",
    ),
    ("manifest-listed-twice", edit_manifest(lambda m: m["files"].append(m["files"][0])), 0, True, "listed twice"),
    (
        "manifest-path-escapes",
        edit_manifest(lambda m: m["files"].append({**m["files"][0], "path": "../x"})),
        0,
        True,
        "not a plain file name",
    ),
    ("manifest-bad-sha", edit_manifest(lambda m: m["files"][0].update(sha256="xyz")), 0, True, "bad 'files' entry"),
    ("manifest-bad-size", edit_manifest(lambda m: m["files"][0].update(size=-1)), 0, True, "bad 'files' entry"),
    ("rank-file-missing", lambda o: (o / R1).unlink(), 1, True, "is missing"),
    ("rank-file-size", lambda o: (o / R1).write_bytes((o / R1).read_bytes()[:-3]), 1, True, "the manifest says"),
    ("rank-file-checksum", flip_last_byte(R1), 1, False, "does not match its leaves"),
    ("rank-files-swapped", swap_ranks, 0, True, "header says rank 1 of 2, not rank 0 of 2"),
    ("copied-file-checksum", flip_last_byte("config.json"), None, False, "does not match its sha256"),
    ("copied-file-missing", lambda o: (o / "config.json").unlink(), None, False, "is missing"),
    (
        "unlisted-weights",
        lambda o: shutil.copyfile(o / R0, o / "extra.safetensors"),
        None,
        False,
        "is not listed in the manifest",
    ),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("converted")
    model = model_dir(base / "m")
    shardload.convert(model, 2, base / "out")
    return base / "out"


@pytest.mark.parametrize(("mutate", "rank", "always", "reason"), [c[1:] for c in CONVERTED_CASES],
                         ids=[c[0] for c in CONVERTED_CASES])  # fmt: skip
def test_bad_converted_directory(
    converted: Path, tmp_path: Path, mutate: Callable[[Path], None], rank: int | None, always: bool, reason: str
) -> None:
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    mutate(out)
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    problems = result.stdout.strip().splitlines() or [result.stderr.strip().removeprefix("error: ")]
    assert any(reason in line for line in problems), problems
    assert all(line.startswith(str(out)) for line in problems), problems
    if rank is not None:
        with pytest.raises(CheckpointError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            shardload.load_rank(out, rank, 2, verify=True)
        if not always:
            shardload.load_rank(out, rank, 2)  # sizes still match: only the checksum tells
        else:
            with pytest.raises(CheckpointError):
                shardload.load_rank(out, rank, 2)


def test_converted_n_mismatch_and_rank_range(converted: Path) -> None:
    with pytest.raises(CheckpointError, match="rank 4 is out of range for num_shards=4"):
        shardload.load_rank(converted, 4, 4)  # another N is served (docs/reshard.md), in its own range
    with pytest.raises(CheckpointError, match="rank 2 is out of range"):
        shardload.load_rank(converted, 2, 2)
    result = CliRunner().invoke(main, ["verify", str(converted)])
    assert result.exit_code == 0 and "match shard_manifest.json (num_shards=2)" in result.stdout
    shards = shardload.load(converted, 2, devices=["cpu", "cpu"], verify=True)
    np.testing.assert_array_equal(shards[1]["w"].numpy(), W[4:])


def test_convert_refuses_to_copy_a_file_linked_from_outside(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    (tmp_path / "secret.txt").write_text("private")
    (model / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(CheckpointError, match=r"'tokenizer.json' resolves outside the model directory"):
        shardload.convert(model, 2, tmp_path / "out")
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_verify_on_a_source_checkpoint_without_a_record_says_how_to_make_one(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    result = CliRunner().invoke(main, ["verify", str(model)])
    assert result.exit_code == 1 and result.stderr.startswith(f"error: {model}: a source checkpoint without an")
    assert f"`shardload hash {model}`" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert CliRunner().invoke(main, ["verify"]).exit_code == 2


# ---------------------------------------------------------------------------------------------
# round 3: a TVM record's dtype under validate --json, vLLM-layout manifests, outputs against their sources,
# entry points only from installed distributions


def test_tvm_record_with_a_list_dtype_is_reported_as_json(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "params_shard_0.bin").write_bytes(b"\0" * 16)
    rec = {"name": "w", "shape": [4], "dtype": ["float32"], "format": "raw", "nbytes": 16, "byteOffset": 0}
    shard = {"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": 16, "records": [rec]}
    (cache / "tensor-cache.json").write_text(json.dumps({"records": [shard]}))
    info = tmp_path / "si.json"
    info.write_text(doc({"w": [[SHARD_DIM, [["num_shards", "4 // num_shards"], "float32"], 0, "num_shards"]]}))
    result = CliRunner().invoke(main, ["validate", str(info), "--model", str(cache), "--json", "-n", "2"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "fail"
    assert any("dtype ['float32'] is not one shardload reads" in p["message"] for p in report["problems"]), report


def _vllm_out(tmp_path: Path, shard_info: Path | None = None) -> tuple[Path, Path]:
    """A tiny llama converted with ``--layout vllm`` for 2 ranks: (model, out)."""
    pytest.importorskip("transformers")
    from helpers.tiny_models import build
    from shardload.integrations.vllm.writer import convert_vllm

    model = tmp_path / "model"
    if not model.exists():
        build("llama_gqa", model)
    out = tmp_path / ("out" if shard_info is None else "out-custom")
    convert_vllm(model, 2, out, shard_info)
    return model, out


def _rehash(out: Path) -> None:
    """Make the manifest's sizes and checksums match the files again (as a forger would): the record of the rank
    files listed by their leaves hashed again, its root pinned, every sha256 recomputed."""
    from shardload.engine.hashing import output_record
    from shardload.format.hash_record import RECORD_NAME, parse_record, root_of

    manifest = json.loads((out / "shard_manifest.json").read_text())
    by_leaves = [e for e in manifest["files"] if "leaves_sha256" in e]
    if by_leaves:
        data = output_record(out, [e["path"] for e in by_leaves])
        (out / RECORD_NAME).write_bytes(data)
        record = parse_record(data, RECORD_NAME)
        for entry in by_leaves:
            entry["leaves_sha256"] = hashlib.sha256(record.file(entry["path"]).leaves).hexdigest()
        manifest["integrity"]["root"] = root_of(data)
    for entry in manifest["files"]:
        if (out / entry["path"]).is_file():
            data = (out / entry["path"]).read_bytes()
            entry["size"] = len(data)
            if "sha256" in entry:
                entry["sha256"] = hashlib.sha256(data).hexdigest()
    (out / "shard_manifest.json").write_text(json.dumps(manifest))


V1 = "model-rank-1-part-0.safetensors"
VLLM_MANIFEST_CASES = [
    ("rank listed twice", lambda m: m["files"].append(dict(m["files"][1])), f"file {V1!r} is listed twice"),
    ("num_shards above the files", lambda m: m.update(num_shards=3), "lists no file model-rank-2-part-0"),
    ("num_shards below the files", lambda m: m.update(num_shards=1), f"lists {V1}, which is not a rank file"),
    ("rank unlisted", lambda m: m["files"].pop(1), f"lists no file {V1}"),
    ("num_shards 10**9", lambda m: m.update(num_shards=10**9), "over the limit of 65536"),
    ("a path outside", lambda m: m["files"][0].update(path="../x"), "not a plain file name"),
]


@pytest.mark.parametrize(("change", "reason"), [c[1:] for c in VLLM_MANIFEST_CASES],
                         ids=[c[0] for c in VLLM_MANIFEST_CASES])  # fmt: skip
def test_vllm_layout_manifest_follows_the_plain_rules(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], reason: str
) -> None:
    _, out = _vllm_out(tmp_path)
    manifest = json.loads((out / "shard_manifest.json").read_text())
    change(manifest)
    (out / "shard_manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert any(reason in p["message"] for p in report["problems"]), report
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert_one_line(result.stderr, [reason])


def test_vllm_layout_manifest_stores_no_absolute_path(tmp_path: Path) -> None:
    model, out = _vllm_out(tmp_path)
    custom = tmp_path / "plans" / "custom.json"
    custom.parent.mkdir()
    assert CliRunner().invoke(main, ["plan", str(model), "-o", str(custom), "-q"]).exit_code == 0
    _, out2 = _vllm_out(tmp_path, custom)
    for directory in (out, out2):
        text = (directory / "shard_manifest.json").read_text()
        assert str(tmp_path) not in text, text

        def walk(value: Any) -> None:
            if isinstance(value, str):
                assert not os.path.isabs(value) and "/" not in value.split(" (")[0].split(" ")[-1], value
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, list):
                for v in value:
                    walk(v)

        walk(json.loads(text))


def _other_plan(model: Path, tmp_path: Path) -> Path:
    """A shard_info for ``model`` that splits lm_head.weight by columns rather than by rows."""
    info = json.loads((model / "shard_info.json").read_text())
    info["params"]["lm_head.weight"] = [
        [SHARD_DIM, [["num_shards", 1024, "256 // num_shards"], "float16"], 1, "num_shards"]
    ]
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(info))
    return path


def test_verify_source_compares_the_sources_own_plan(tmp_path: Path) -> None:
    from shardload.cli.example import write_example

    model = write_example(tmp_path / "m")
    custom = _other_plan(model, tmp_path)
    shardload.convert(model, 2, tmp_path / "out", custom)
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "out"), "--source", str(model), "--json"])
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["problems"]
    assert problems and all(p["param"] == "lm_head.weight" for p in problems), problems
    assert "the manifest's plan differs from the plan the source gives" in problems[0]["message"]
    result = CliRunner().invoke(
        main, ["verify", str(tmp_path / "out"), "--source", str(model), "--shard-info", str(custom)]
    )
    assert result.exit_code == 0, result.output
    shardload.convert(model, 2, tmp_path / "plain")
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "plain"), "--source", str(model)]).exit_code == 0


def test_verify_source_of_a_vllm_layout_output(tmp_path: Path) -> None:
    model, out = _vllm_out(tmp_path)
    result = CliRunner().invoke(main, ["verify", str(out), "--source", str(model)])
    assert result.exit_code == 0, result.output
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["plan", str(model), "-o", str(plan), "-q"]).exit_code == 0
    info = json.loads(plan.read_text())
    name = "model.layers.0.self_attn.o_proj.weight"
    info["params"][name] = [["shard_funcs.replicate", [["num_shards", 64, 64], "float32"], "num_shards"]]
    plan.write_text(json.dumps(info))
    _, custom = _vllm_out(tmp_path, plan)
    result = CliRunner().invoke(main, ["verify", str(custom), "--source", str(model), "--json"])
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["problems"]
    assert any(p["param"] == name and "plan differs" in p["message"] for p in problems), problems
    # a forged rank file whose manifest entry was rewritten to match: only the source tells
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(out / V1), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(out / V1))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(out / V1), metadata={"format": "pt"})
    _rehash(out)
    result = CliRunner().invoke(main, ["verify", str(out)])  # written without its rank, N, conversion and seal
    assert result.exit_code == 1 and "its header says rank None of None, not rank 1 of 2" in result.output
    save_file(tensors, str(out / V1), metadata=metadata)  # with them, but its tensors in safetensors' own order
    _rehash(out)
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1 and "its seal does not match" in result.output, result.output
    from shardload.integrations.vllm.writer import convert_vllm
    from shardload.sources.safetensors_header import read_header

    convert_vllm(model, 2, out, overwrite=True)  # the values alone changed, in place: only the source tells
    norm = read_header(out / V1)["model.norm.weight"]
    with open(out / V1, "r+b") as f:
        f.seek(norm.offset)
        f.write(bytes(b ^ 0x40 for b in f.read(4)))
    _rehash(out)
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    result = CliRunner().invoke(main, ["verify", str(out), "--source", str(model)])
    assert result.exit_code == 1 and "model.norm.weight" in result.output and "rank 1" in result.output


def _planted_distribution(where: Path) -> Path:
    """A ``*.dist-info`` in ``where`` whose ``shardload.steps`` entry point would create ``where/PWNED``."""
    (where / "planted_steps.py").write_text(
        "from pathlib import Path\n\ndef register():\n    (Path(__file__).parent / 'PWNED').write_text('ran')\n"
    )
    dist = where / "planted_steps-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-steps\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[shardload.steps]\nplanted = planted_steps:register\n")
    return where / "PWNED"


def test_entry_points_never_come_from_the_current_or_the_model_directory(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    model = model_dir(tmp_path / "m")
    marker = _planted_distribution(model)
    load = "import shardload.planning.registry as r; r.load_entry_points(); print('loaded')"
    runs = {
        "python -c in the model directory": ([sys.executable, "-c", load], model, str(root)),
        "PYTHONPATH=. in the model directory": ([sys.executable, "-c", load], model, f"{root}:."),
        "PYTHONPATH=$PWD": ([sys.executable, "-c", load], model, f"{root}:{model}"),
        "a script in the model directory": ([sys.executable, str(model / "run.py")], tmp_path, str(root)),
        "python -m from the model directory": ([sys.executable, "-m", "run"], model, str(root)),
    }
    (model / "run.py").write_text(load + "\n")
    for what, (cmd, cwd, path) in runs.items():
        r = subprocess.run(cmd, cwd=cwd, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0 and "loaded" in r.stdout, (what, r.stderr[-500:])
        assert not marker.exists(), f"{what}: a planted entry point ran"


def corpus_size() -> int:
    """Bad inputs in this file's tables (for the closing report)."""
    return len(SHARD_INFO_CASES) + len(CHECKPOINT_CASES) + len(CONVERTED_CASES)


def test_a_fifo_or_device_given_as_the_model_is_named_as_such(tmp_path: Path) -> None:
    """A FIFO (or /dev/zero) exists: "no such file or directory" sent the user looking for a typo."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    for model in (fifo, Path("/dev/zero")):
        with pytest.raises(CheckpointError) as err:
            shardload.load_rank(model, 0, 2)
        assert_one_line(str(err.value), [str(model), "is not a regular file or a directory"])


def test_an_integer_of_thousands_of_digits_is_one_plain_line(tmp_path: Path) -> None:
    """CPython refuses to parse an int of over 4300 digits and advises ``sys.set_int_max_str_digits()``: advice for
    the interpreter's owner, not for whoever holds a bad shard_info."""
    info = tmp_path / "shard_info.json"
    info.write_text('{"version": 1, "num_shards": ' + "9" * 5000 + ', "params": {}}')
    result = CliRunner().invoke(main, ["validate", str(info), "-n", "2"])
    assert result.exit_code == 1, result.output
    assert "set_int_max_str_digits" not in result.output and "more digits than" in result.output, result.output


def test_a_huge_value_from_a_file_makes_a_bounded_line(tmp_path: Path) -> None:
    """A value a file controls (a 5 MB ``version`` string, a 20 MB parameter name) printed in an error is cut: the
    line stays a line a terminal and a log can take, the text and the --json forms alike (old lines ran to the
    megabytes, twice over in --json)."""
    info = tmp_path / "si.json"
    info.write_text(json.dumps({"version": "A" * 5_000_000, "params": {}}))
    for args in (["validate", str(info)], ["validate", str(info), "--json"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and len(result.output) < 20_000, len(result.output)
    err = ShardloadError("x" * 10_000_000, file="f", param="p" * 20_000_000)
    assert len(err.message) < 20_000 and err.message.startswith("f: pppp") and "characters cut" in err.message
    assert len(json.dumps(err.to_dict())) < 40_000


def test_many_keys_naming_no_parameter_are_counted_not_listed(tmp_path: Path) -> None:
    """A shard_info with thousands of keys the checkpoint does not hold: the first are listed, the rest counted in
    one problem, so validate's report (and its memory) stays bounded (old code made a problem per key per N: 530 MB
    of --json for a million keys)."""
    model = tmp_path / "m"
    model.mkdir()
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 4), np.float16)}, str(model / "model.safetensors"))
    info = tmp_path / "si.json"
    info.write_text(json.dumps({"version": 1, "params": {f"nope.{i}": [] for i in range(5000)}}))
    result = CliRunner().invoke(main, ["validate", str(info), "--model", str(model), "-n", "2", "--json"])
    problems = json.loads(result.stdout)["problems"]
    assert result.exit_code == 1 and len(problems) == 101, len(problems)
    assert problems[-1]["message"].endswith(f"and 4900 more keys that name no parameter of {model}")


@pytest.mark.parametrize("kind", ["fifo", "dangling", "directory"])
def test_a_weight_file_that_is_no_regular_file_is_named(example_dir: Path, tmp_path: Path, kind: str) -> None:
    """``model.safetensors`` as a FIFO, a dangling link or a directory was reported as "no model.safetensors, ... file
    here", as if the model had none; the file is named with what it is."""
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "shard_info.json"):
        shutil.copy(example_dir / name, model / name)
    weights = model / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(weights)
    elif kind == "dangling":
        weights.symlink_to(tmp_path / "gone")
    else:
        weights.mkdir()
    with pytest.raises(shardload.ShardloadError) as err:
        shardload.load_rank(model, 0, 2)
    text = str(err.value)
    assert str(weights) in text and "file here" not in text and "\n" not in text, text
