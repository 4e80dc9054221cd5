"""shard_info.json parsing: both forms, the schema, and clear one-line errors for malformed files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardload.errors import FormatError
from shardload.format.shard_info import ShardInfo, StepSpec, schema

SEED = {"x_0": [["shard_funcs.shard_dim", [[2, 64, 64], "float16"], 1, 2]]}
DOC = {
    "$schema": "https://shardload.dev/shard_info.schema.json",
    "version": 1,
    "num_shards": None,
    "params": {
        "model.layers.0.self_attn.qkv_proj.weight": [
            ["shard_funcs.reorder_segments", [[6144, 4096], "float16"], 0, [4096, 1024, 1024], "num_shards"],
            ["shard_funcs.shard_dim", [["num_shards", "6144 // num_shards", 4096], "float16"], 0, "num_shards"],
        ]
    },
}


def test_seed_form_reads_as_is() -> None:
    info = ShardInfo.from_dict(SEED)
    assert info.form == "seed"
    assert info.num_shards == 2
    assert info.params == {"x_0": [StepSpec("shard_funcs.shard_dim", (2, 64, 64), "float16", (1, 2))]}


def test_document_form_reads_expressions_unevaluated() -> None:
    info = ShardInfo.from_dict(DOC)
    assert info.form == "document"
    assert info.num_shards is None
    steps = info.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert steps[1].shape == ("num_shards", "6144 // num_shards", 4096)
    assert steps[0].args == (0, [4096, 1024, 1024], "num_shards")


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    info = ShardInfo.from_dict(DOC)
    info.save(tmp_path / "s.json")
    again = ShardInfo.load(tmp_path / "s.json")
    assert again.params == info.params and again.num_shards is None
    seed = ShardInfo.from_dict(SEED)
    seed.save(tmp_path / "seed.json")
    assert ShardInfo.load(tmp_path / "seed.json").to_dict() == seed.to_dict()


def test_schema_file_is_valid_and_matches_examples() -> None:
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.validate(DOC, schema())
    jsonschema.validate(SEED, schema())
    example = json.loads(json.dumps(DOC))
    example["params"]["p"] = [["f", [None, None], {"any": "json"}]]
    jsonschema.validate(example, schema())


BAD = [
    ("[]", None, "top level must be a JSON object"),
    ("{", None, "not valid JSON"),
    ('{"a": 1, "a": 2}', None, "duplicate key 'a'"),
    ('{"version": 1, "params": {"p": [], "p": []}}', None, "duplicate key 'p'"),
    ('{"version": 2, "params": {}}', None, "unsupported version 2"),
    ('{"params": {}}', None, "needs a 'version'"),
    ('{"version": 1}', None, "does not match shard_info.schema.json"),
    ('{"version": 1, "params": {}, "extra": 1}', None, "'extra' was unexpected"),
    ('{"version": 1, "num_shards": 0, "params": {}}', None, "num_shards"),
    ('{"p": 3}', "p", "is not of type 'array'"),
    ('{"p": [3]}', "p", "is not of type 'array'"),
    ('{"p": [["f"]]}', "p", "step 1"),
    ('{"p": [[1, [[2], "float16"]]]}', "p", "function name"),
    ('{"p": [["f", [[-2], "float16"]]]}', "p", "shape"),
    ('{"p": [["f", [[2], "float17"]]]}', "p", "dtype"),
    ('{"p": [["f", [["num_shards"], "float16"]]]}', "p", "shape"),
    ('{"version": 1, "params": {"p": [["f", [[1.5], null]]]}}', "p", "shape"),
    ('{"p": [["f", [[2], "float16"]]], "q": [["f", [[4], "float16"]]]}', None, "one num_shards"),
    ('{"p": [["f", [[3], "float16"]], ["g", [[0, 3], "float16"]]]}', "p", "step 2: the last step's output must lead"),
    ("NaN", None, "not valid JSON"),
]


@pytest.mark.parametrize(("text", "param", "reason"), BAD)
def test_bad_documents_give_one_located_line(tmp_path: Path, text: str, param: str | None, reason: str) -> None:
    path = tmp_path / "shard_info.json"
    path.write_text(text)
    with pytest.raises(FormatError) as info:
        ShardInfo.load(path)
    message = str(info.value)
    assert message.startswith(str(path) + ": ")
    assert reason in message
    assert "\n" not in message
    if param is not None:
        assert info.value.param == param


def test_unreadable_and_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="cannot read"):
        ShardInfo.load(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(FormatError, match="not UTF-8"):
        ShardInfo.load(tmp_path / "bin.json")


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [("num_shards", 2.0, "'num_shards' must be a JSON integer or null, not 2.0"),
     ("version", 1.0, "'version' must be the JSON integer 1, not 1.0")],
)  # fmt: skip
def test_integral_floats_are_refused_where_the_format_wants_integers(
    example_dir: Path, tmp_path: Path, field: str, value: float, said: str
) -> None:
    """JSON Schema's "integer" takes 2.0: a file saying ``"num_shards": 2.0`` passed the schema, then validate without
    -n refused it as if the user had asked for N=2.0, while validate -n 2, inspect, convert and load_rank took it
    (reviewer J); ``"version": 1.0`` was an 'unsupported version'. Both are one line naming the key, everywhere."""
    import shardload

    doc = json.loads((example_dir / "shard_info.json").read_text())
    path = tmp_path / "shard_info.json"
    path.write_text(json.dumps({**doc, "num_shards": 2, field: value}))
    with pytest.raises(FormatError) as err:
        shardload.load_rank(example_dir, 0, 2, shard_info=path)
    assert str(err.value) == f"{path}: {said}"


@pytest.mark.parametrize(
    ("text", "said", "func"),
    [('{"version": 1, "params": {"w": [["shard_funcs.shard_dim", [[2, 4], "half"], 0, "num_shards"]]}}',
      "w: step 1 (shard_funcs.shard_dim): does not match shard_info.schema.json (dtype): 'half' is not one of",
      "shard_funcs.shard_dim"),
     ('{"version": 1, "num_shards": true, "params": {}}',
      "does not match shard_info.schema.json (at ['num_shards']): true is not valid", None),
     ('{"version": 1, "params": {"": []}}',
      "does not match shard_info.schema.json (a parameter name in params): '' should be non-empty", None),
     ('{"version": true, "params": {}}', "unsupported version true (this shardload reads version 1)", None)],
)  # fmt: skip
def test_schema_messages_name_the_step_s_function_and_speak_json(
    tmp_path: Path, text: str, said: str, func: str | None
) -> None:
    """A schema error left out the step's function (``--json``'s function was null), hid the dtypes a dtype may be
    behind oneOf's 'not valid under any of the given schemas', wrote values as Python does (True, None) and gave
    no place for a bad parameter name (reviewer J)."""
    path = tmp_path / "shard_info.json"
    path.write_text(text)
    with pytest.raises(FormatError) as info:
        ShardInfo.load(path)
    assert str(info.value).startswith(f"{path}: {said}"), str(info.value)
    assert info.value.func == func
