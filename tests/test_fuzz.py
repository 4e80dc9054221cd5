"""Fuzzing with hypothesis: thousands of generated shard_info documents (and safetensors headers) go
through the parser and the planner; nothing but a ShardloadError may escape.

Documents range from random JSON to near-valid files built from the real step names with bad
arguments, shapes, dtypes and expressions, so the planner and the box rules are reached often.
"""

from __future__ import annotations

import json
import struct
import tempfile
from math import prod
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardload.errors import CheckpointError, ShardloadError
from shardload.format.shard_info import ShardInfo
from shardload.planning.plan import build_plan
from shardload.sources.checkpoint import Checkpoint
from shardload.sources.dtypes import DTYPES, itemsize
from shardload.sources.safetensors_header import read_header
from shardload.sources.tensor_info import TensorInfo

DOC_EXAMPLES = 2500
RANDOM_EXAMPLES = 500
TEXT_EXAMPLES = 500
HEADER_EXAMPLES = 500
FUZZ_EXAMPLES = DOC_EXAMPLES + RANDOM_EXAMPLES + TEXT_EXAMPLES + HEADER_EXAMPLES

TENSORS = {
    "a": ((64, 32), "float16"),
    "b": ((48,), "float32"),
    "c": ((24, 16, 8), "int8"),
    "d": ((0, 4), "bfloat16"),
    "e": ((6, 10), "uint8"),
}


def fake_checkpoint() -> Checkpoint:
    """A header-only checkpoint: planning never reads data, so no file is needed."""
    tensors, offset = {}, 0
    for name, (shape, dtype) in TENSORS.items():
        nbytes = prod(shape) * itemsize(dtype)
        tensors[name] = TensorInfo(name, dtype, shape, Path("fuzz.safetensors"), offset, nbytes)
        offset += nbytes
    return Checkpoint(Path("fuzz-model"), Path("fuzz-model"), "safetensors", tensors, [Path("fuzz.safetensors")])


CHECKPOINT = fake_checkpoint()

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=10)
any_json = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)  # fmt: skip
atoms = st.sampled_from(["num_shards", "0", "1", "2", "3", "8", "64", "-1", "99999999999999999999", "x", "()"])
expressions = st.recursive(
    atoms,
    lambda e: (
        st.builds(lambda a, op, b: f"{a} {op} {b}", e, st.sampled_from(["+", "-", "*", "//", "/", "**", "%"]), e)
        | e.map(lambda x: f"({x})")
        | e.map(lambda x: f"-{x}")
    ),
    max_leaves=6,
) | st.text(max_size=12)
small_ints = st.integers(-3, 70) | st.sampled_from([2**62, 2**63, 10**30, -(2**70)])
dims = small_ints | expressions | st.just("num_shards")
shapes = st.none() | st.lists(dims, max_size=4) | st.lists(st.integers(0, 80), min_size=1, max_size=3)
dtypes = st.none() | st.sampled_from([*DTYPES, "float17", "F16"])
n_args = st.just("num_shards") | dims


other_names = st.sampled_from(["os.system", "builtins.eval", "__import__", "shard_funcs", ""]) | st.text(max_size=8)
function_names = st.sampled_from(["shard_funcs.shard_dim", "shard_funcs.reorder_segments", "shard_funcs.replicate"])
arg_values = dims | st.lists(dims, max_size=4) | scalars


@st.composite
def near_valid_documents(draw: Any) -> dict[str, Any]:
    """A valid document for TENSORS (shard, reorder-then-shard, or replicate per tensor), then 0-3 mutations."""
    params: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from([*TENSORS, "zz"]), unique=True, min_size=1, max_size=4)):
        shape, dtype = TENSORS.get(name, ((8, 8), "float16"))
        d = draw(st.integers(0, len(shape) - 1))
        kind = draw(st.sampled_from(["shard", "reorder", "replicate"]))
        split = ["num_shards", *shape]
        split[d + 1] = f"{shape[d]} // num_shards"
        shard = ["shard_funcs.shard_dim", [draw(st.sampled_from([None, split])), dtype], d, "num_shards"]
        if kind == "shard":
            steps = [shard]
        elif kind == "reorder":
            unit = draw(st.sampled_from([1, 1, 2, 4]))
            total = shape[d] // unit
            cut = draw(st.integers(0, total))
            segments = [s for s in (cut, total - cut) if s] or [1]
            tail = [unit] if unit != 1 or draw(st.booleans()) else []
            steps = [["shard_funcs.reorder_segments", [list(shape), dtype], d, segments, "num_shards", *tail], shard]
        else:
            steps = [["shard_funcs.replicate", [["num_shards", *shape], None], "num_shards"]]
        for _ in range(draw(st.integers(0, 3))):
            step = draw(st.sampled_from(steps))
            pos = draw(st.integers(0, len(step)))
            if pos == 0:
                step[0] = draw(function_names | other_names)
            elif pos == 1:
                step[1] = [draw(shapes), draw(dtypes)]
            elif pos == len(step):
                step.append(draw(arg_values))
            else:
                step[pos] = draw(arg_values)
        params[name] = steps
    return {"version": 1, "num_shards": draw(st.sampled_from([None, None, None, None, 2, 4])), "params": params}


other_step = st.builds(
    lambda f, h, args: [f, h, *args], other_names, st.tuples(shapes, dtypes).map(list), st.lists(any_json, max_size=3)
)
param_names = st.sampled_from([*TENSORS, "zz", "model.a"]) | st.text(max_size=5)
random_documents = st.one_of(
    st.fixed_dictionaries(
        {
            "version": st.sampled_from([1, 1, 2, "1", None]),
            "params": st.dictionaries(param_names, st.lists(other_step | any_json, max_size=2) | any_json, max_size=4),
        },
        optional={"num_shards": st.none() | st.integers(-1, 9) | st.just("4"), "$schema": st.text(max_size=4)},
    ),
    st.dictionaries(param_names, st.lists(other_step | any_json, max_size=2) | any_json, max_size=4),
    any_json,
)
num_shards = st.sampled_from([1, 2, 2, 4, 4, 8, 8, 3, 16, 64, 0, -1, 65536])


def plan_everything(info: ShardInfo, n: int) -> None:
    """Plan with and without the checkpoint, then trace every planned parameter's read boxes."""
    for checkpoint in (CHECKPOINT, None):
        plan = build_plan(info, checkpoint, n, strict=False)  # collects problems: must not raise at all
        for p in plan.params.values():
            for rank in {0, n - 1}:
                try:
                    p.read_nbytes(rank)
                    p.pieces(rank)
                except ShardloadError:
                    pass
    try:
        build_plan(info, CHECKPOINT, n)
    except ShardloadError:
        pass


@pytest.mark.slow
@settings(max_examples=DOC_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(doc=near_valid_documents(), n=num_shards)
def test_near_valid_documents_raise_only_shardload_errors(doc: Any, n: int) -> None:
    check_document(doc, n)


@settings(max_examples=RANDOM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(doc=random_documents, n=num_shards)
def test_random_documents_raise_only_shardload_errors(doc: Any, n: int) -> None:
    check_document(doc, n)


def check_document(doc: Any, n: int) -> None:
    try:
        info = ShardInfo.from_json(json.dumps(doc))
    except ShardloadError:
        return
    plan_everything(info, n)
    again = ShardInfo.from_dict(info.to_dict())  # what was read can be written and read back
    assert again.params == info.params


@settings(max_examples=TEXT_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(text=st.text(max_size=80) | st.sampled_from(['{"version": 1, "params": {"a": [', '{"a": [["', "[" * 5000]))
def test_text_raises_only_shardload_errors(text: str) -> None:
    try:
        info = ShardInfo.from_json(text)
    except ShardloadError:
        return
    plan_everything(info, 2)


def header_bytes(header: Any, data_len: int, claimed: int | None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw + b"\x01" * data_len


entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F16", "F32", "I8", "BOOL", "F17", ""]) | any_json,
        "shape": st.lists(st.integers(-2, 9), max_size=3) | any_json,
        "data_offsets": st.lists(st.integers(-4, 120), min_size=2, max_size=2) | any_json,
    },
)
headers = st.dictionaries(st.text(max_size=4) | st.just("__metadata__"), entries | any_json, max_size=4) | any_json


@settings(max_examples=HEADER_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(header=headers, data_len=st.integers(0, 120), claimed=st.none() | st.integers(0, 2**64 - 1))
def test_safetensors_headers_raise_only_checkpoint_errors(header: Any, data_len: int, claimed: int | None) -> None:
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as fh:
        fh.write(header_bytes(header, data_len, claimed))
        fh.flush()
        try:
            tensors = read_header(Path(fh.name))
        except CheckpointError:
            return
    assert sum(t.nbytes for t in tensors.values()) == data_len  # a header that passes tiles the data exactly


GGUF_EXAMPLES = 300
PLAN_EXAMPLES = 200


def _gguf_bytes() -> st.SearchStrategy[bytes]:
    """A GGUF magic and version, then counts and bytes that are often forged (huge, or pointing past the end)."""
    counts = st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1))
    return st.builds(
        lambda t, k, tail: b"GGUF" + struct.pack("<IQQ", 3, t, k) + tail,
        counts, counts, st.binary(max_size=200),
    )  # fmt: skip


@settings(max_examples=GGUF_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=_gguf_bytes())
def test_forged_gguf_headers_raise_only_checkpoint_errors(data: bytes) -> None:
    import pytest

    pytest.importorskip("gguf")
    from shardload.sources.checkpoint import open_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        path.write_bytes(data)
        try:
            open_checkpoint(path)
        except CheckpointError:
            pass


CONFIG_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(-3, 70), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)  # fmt: skip
CONFIG_KEYS = st.sampled_from([
    "model_type", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim", "intermediate_size",
    "num_hidden_layers", "vocab_size", "tie_word_embeddings", "num_local_experts", "quantization_config",
    "architectures", "base_model_tp_plan",
])  # fmt: skip


@settings(max_examples=PLAN_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(changes=st.dictionaries(CONFIG_KEYS, CONFIG_VALUES, max_size=4))
def test_plan_from_odd_configs_raises_only_shardload_errors(changes: dict[str, Any]) -> None:
    """`shardload plan` on the example model with config.json values of any type and size."""
    from shardload.cli.example import EXAMPLE_CONFIG, write_example
    from shardload.models.generated import generate

    with tempfile.TemporaryDirectory() as tmp:
        model = write_example(Path(tmp) / "m")
        (model / "config.json").write_text(json.dumps({**EXAMPLE_CONFIG, **changes}))
        try:
            generate(model)
        except ShardloadError:
            pass
