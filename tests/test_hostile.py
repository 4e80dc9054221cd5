"""Hostile inputs, each run in a fresh process under a 1 GiB data-memory cap and a 10 s CPU-time cap (wall clock
60 s, for hangs): every one ends in a clean one-line error (or, for the bounded-work cases, succeeds), with
nothing written and nothing of the user's lost.

Categories: files that are not files (FIFOs, devices), sizes an input controls (counts, N, meshes, step chains,
GGUF headers), work that must stay linear (tall narrow tensors, regular expressions), outputs that would destroy
data, and messages (pickle checkpoints, names with control characters)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardload.cli.example import write_example

ROOT = Path(__file__).resolve().parents[1]
DATA_CAP = 1 << 30
CPU_SECONDS = 10
WALL_SECONDS = 60


@dataclass
class Case:
    """One hostile input: ``setup(dir)`` writes it and returns the command line (CLI arguments, or ``["-c", code]``
    for a Python snippet); the run must exit ``code`` with ``says`` in its one-line error, write nothing at
    ``out`` and leave every file that existed before untouched."""

    category: str
    setup: Callable[[Path], list[str]]
    code: int = 1
    says: str = ""
    out: str = "out"
    changes: set[str] = field(default_factory=set)


def _model(d: Path) -> Path:
    return write_example(d / "m")


def _fifo(d: Path, name: str) -> Path:
    m = _model(d)
    (m / name).unlink(missing_ok=True)
    os.mkfifo(m / name)
    return m


def _info(d: Path, doc: object) -> Path:
    path = d / "si.json"
    path.write_text(json.dumps(doc))
    return path


def _gguf(d: Path, tensors: int, kvs: int, tail: bytes = b"") -> Path:
    path = d / "forged.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs) + tail + b"\0" * 64)
    return path


def _kv_array(length: int) -> bytes:
    key = b"general.big"
    return struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 4, length)  # array of uint32


def _tall(d: Path) -> Path:
    m = d / "tall"
    m.mkdir()
    rows = 8_000_000  # 32 MB of float16 in rows of 4 bytes: a column slice is 8M runs of 2 bytes
    save_file({"w": np.arange(rows * 2, dtype=np.float16).reshape(rows, 2)}, str(m / "model.safetensors"))
    step = ["shard_funcs.shard_dim", [["num_shards", rows, "2 // num_shards"], "float16"], 1, "num_shards"]
    (m / "shard_info.json").write_text(json.dumps({"version": 1, "params": {"w": [step]}}))
    return m


def _control_names(d: Path) -> Path:
    m = d / "names"
    m.mkdir()
    name = "evil\n\x1b[2J\u202ename"
    save_file({name: np.zeros((6, 4), np.float16)}, str(m / "model.safetensors"))
    step = ["shard_funcs.shard_dim", [["num_shards", "6 // num_shards", 4], "float16"], 0, "num_shards"]
    (m / "shard_info.json").write_text(json.dumps({"version": 1, "params": {name: [step]}}))
    return m


def _replicates(d: Path) -> list[str]:
    m = _model(d)
    rep = ["shard_funcs.replicate", [["num_shards", 1024, 256], "float16"], "num_shards"]
    rep2 = ["shard_funcs.replicate", [["num_shards", "num_shards", 1024, 256], "float16"], "num_shards"]
    info = json.loads((m / "shard_info.json").read_text())
    info["params"]["lm_head.weight"] = [rep, rep2]
    (m / "shard_info.json").write_text(json.dumps(info))
    return ["inspect", str(m), "-n", "8"]


def _manifest(d: Path, num_shards: int, mesh: dict | None = None) -> Path:
    """A converted directory whose 1-file manifest claims ``num_shards`` ranks (and ``mesh``), with no rank files."""
    out = d / "conv"
    out.mkdir()
    doc = {"format": "shardload.converted", "version": 1, "num_shards": num_shards, "mesh": mesh, "files": [],
           "shard_info": {"version": 1, "num_shards": num_shards, "params": {}}}  # fmt: skip
    (out / "shard_manifest.json").write_text(json.dumps(doc))
    return out


def _tvm_no_element(d: Path) -> Path:
    """A TVM cache whose record ``w`` holds no element but has dims multiplying past int64 (0 x 2**62 x 2**62)."""
    cache = d / "cache"
    cache.mkdir()
    (cache / "params_shard_0.bin").write_bytes(b"\0" * 32)
    rec = [{"name": "w", "shape": [0, 1 << 62, 1 << 62], "dtype": "float32", "format": "raw", "nbytes": 0,
            "byteOffset": 0}]  # fmt: skip
    shard = {"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": 32, "records": rec}
    (cache / "tensor-cache.json").write_text(json.dumps({"metadata": {}, "records": [shard]}))
    (cache / "shard_info.json").write_text(json.dumps({"version": 1, "params": {}}))
    return cache


def _tvm_aliases(d: Path, records: int = 2048, dtype: object = "float32") -> Path:
    """A TVM cache of one 1 MiB data file whose ``records`` records all claim its whole bytes."""
    cache = d / "cache"
    cache.mkdir()
    (cache / "params_shard_0.bin").write_bytes(b"\0" * (1 << 20))
    rec = [{"name": f"t{i}", "shape": [1 << 18], "dtype": dtype, "format": "raw", "nbytes": 1 << 20, "byteOffset": 0}
           for i in range(records)]  # fmt: skip
    shard = {"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": 1 << 20, "records": rec}
    (cache / "tensor-cache.json").write_text(json.dumps({"metadata": {}, "records": [shard]}))
    return cache


def _gguf_aliases(d: Path, tensors: int = 2048) -> Path:
    """A GGUF file of 1 MiB of data whose ``tensors`` float32 tensors all start at data offset 0."""
    path = d / "alias.gguf"
    head = b"GGUF" + struct.pack("<IQQ", 3, tensors, 0)
    for i in range(tensors):
        name = f"t{i}".encode()
        head += struct.pack("<Q", len(name)) + name + struct.pack("<IQIQ", 1, 1 << 18, 0, 0)  # 1 dim, F32, offset 0
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * (1 << 20))
    return path


def _gguf_no_element(d: Path) -> Path:
    """A GGUF file whose tensor ``w`` holds no element but has dims multiplying past int64 (0 x 2**62 x 2**62)."""
    (d / "g").mkdir(exist_ok=True)
    path = d / "g" / "empty.gguf"
    key, arch = b"general.architecture", b"llama"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", len(key)) + key
    head += struct.pack("<IQ", 8, len(arch)) + arch + struct.pack("<Q", 1) + b"w"  # a string value, then the tensor
    head += struct.pack("<I", 3) + struct.pack("<3Q", 1 << 62, 1 << 62, 0) + struct.pack("<IQ", 0, 0)  # F32, offset 0
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * 32)
    return path


def _forged_sizes(d: Path) -> Path:
    """A converted directory whose manifest claims a 2**62-byte rank file and whose integrity record is a sparse
    3 GiB file (4 KiB on disk)."""
    import shardload

    out = d / "conv"
    shardload.convert(_model(d), 2, out)
    manifest = json.loads((out / "shard_manifest.json").read_text())
    manifest["files"][0]["size"] = 2**62
    (out / "shard_manifest.json").write_text(json.dumps(manifest))
    with open(out / "shardload.hashes", "r+b") as fh:
        fh.truncate(3 << 30)
    return out


def _zero_width(d: Path, shape: tuple[int, int]) -> Path:
    """A model whose one linear weight ``proj.weight`` has a zero dim."""
    m = d / "zw"
    m.mkdir()
    save_file({"proj.weight": np.zeros(shape, np.float16)}, str(m / "model.safetensors"))
    return m


CASES: dict[str, Case] = {
    # files that are not files
    "config.json is a FIFO (plan)": Case(
        "not files", lambda d: ["plan", str(_fifo(d, "config.json")), "-o", str(d / "out")], says="not a regular file"
    ),
    "config.json links to /dev/zero (plan)": Case(
        "not files",
        lambda d: (
            lambda m: [
                (m / "config.json").unlink(),
                (m / "config.json").symlink_to("/dev/zero"),
                ["plan", str(m), "-o", str(d / "out")],
            ][-1]
        )(_model(d)),
        says="resolves outside the model directory",
    ),
    "a shard_info of 350,000 bad steps (validate)": Case(
        "linear work",
        lambda d: [
            (d / "si.json").write_bytes(b'{"version":1,"params":{"w":[' + b"[]," * 349_999 + b"[]]}}"),
            ["validate", str(d / "si.json")],
        ][-1],
        says="does not match shard_info.schema.json",
    ),  # every problem was a jsonschema error held at once: 1.3 GiB and a minute for this 1 MiB file
    "a shard_info step of 300,000 bad dims (validate)": Case(
        "linear work",
        lambda d: [
            (d / "si.json").write_bytes(
                b'{"version":1,"params":{"w":[["shard_funcs.shard_dim",[['
                + b",".join([b"-1"] * 300_000)
                + b'],null],0,"num_shards"]]}}'
            ),
            ["validate", str(d / "si.json")],
        ][-1],
        says="does not match shard_info.schema.json",
    ),  # a oneOf builds every branch's errors of a value before it yields one: 2.7 GiB and 38 s for 0.9 MiB
    "shard_info is /dev/zero (validate)": Case("not files", lambda d: ["validate", "/dev/zero"], says="regular file"),
    "shard_info.json is a FIFO (inspect)": Case(
        "not files", lambda d: ["inspect", str(_fifo(d, "shard_info.json")), "-n", "2"], says="not a regular file"
    ),
    "tokenizer.json is a FIFO (convert)": Case(
        "not files",
        lambda d: ["convert", str(_fifo(d, "tokenizer.json")), "-n", "2", "-o", str(d / "out")],
        says="not a regular file",
    ),
    # sizes an input controls
    "num_shards 10**9 in a file": Case(
        "sizes",
        lambda d: ["validate", str(_info(d, {"version": 1, "num_shards": 10**9, "params": {}}))],
        says="65536",
    ),
    "seed form leading with 10**9": Case(
        "sizes",
        lambda d: ["validate", str(_info(d, {"x": [["shard_funcs.shard_dim", [[10**9, 1], "float16"], 0, 10**9]]}))],
        says="over the limit",
    ),
    "mesh of 10**8 ranks": Case(
        "sizes", lambda d: ["inspect", str(_model(d)), "--mesh", "tp=100000000"], code=2, says="over the limit"
    ),
    "chained replicates": Case("sizes", _replicates, says="chained replicates multiply"),
    "GGUF tensor count 2**60": Case("sizes", lambda d: ["inspect", str(_gguf(d, 1 << 60, 0))], says="tensor count"),
    "GGUF array of 2**60 items": Case(
        "sizes", lambda d: ["inspect", str(_gguf(d, 0, 1, _kv_array(1 << 60)))], says="length"
    ),
    "GGUF of 3,000,000 tensors in 100 MiB": Case(
        "sizes",
        lambda d: [os.truncate(_gguf(d, 3_000_000, 0), 100 << 20), ["inspect", str(d / "forged.gguf")]][-1],
        says="tensors",
    ),  # each tensor was planned, 2-3 KiB apiece: out of memory
    "safetensors header of 15,000,000 objects": Case(
        "sizes",
        lambda d: [
            (d / "objs.safetensors").write_bytes(
                struct.pack("<Q", 45_000_016) + b'{"a":{"x":[' + b"{}," * 14_999_999 + b"{}]}}" + b" " * 3
            ),
            ["inspect", str(d / "objs.safetensors")],
        ][-1],
        says="objects",
    ),  # parsed whole before any check: 2.6 GiB per 100 MiB
    "GGUF metadata count 2**62": Case("sizes", lambda d: ["inspect", str(_gguf(d, 0, 1 << 62))], says="metadata count"),
    "converted manifest claiming num_shards 10**9": Case(
        "sizes", lambda d: ["verify", str(_manifest(d, 10**9))], says="over the limit of 65536"
    ),
    "converted manifest with a mesh of 60000 x 60000": Case(
        "sizes",
        lambda d: ["inspect", str(_manifest(d, 60000, {"pp": 60000, "tp": 60000, "pp_layers": [0] * 60000}))],
        says="over the limit of 65536",
    ),
    "TVM records aliasing one 1 MiB file 2048 times": Case(
        "sizes", lambda d: ["inspect", str(_tvm_aliases(d))], says="overlap tensor"
    ),
    "GGUF tensors aliasing one 1 MiB data section 2048 times": Case(
        "sizes", lambda d: ["inspect", str(_gguf_aliases(d))], says="overlap tensor"
    ),
    "GGUF tensor of no element whose dims multiply past int64 (load)": Case(
        "sizes",
        lambda d: [
            "-c",
            "import sys, shardload\ntry:\n"
            f"    shardload.load_rank({str(_gguf_no_element(d))!r}, 0, 1)\n"
            "except shardload.ShardloadError as err:\n    sys.exit(f'error: {err}')",
        ],
        says="is too large",
    ),
    "GGUF tensor of no element whose dims multiply past int64 (convert)": Case(
        "sizes", lambda d: ["convert", str(_gguf_no_element(d)), "-n", "1", "-o", str(d / "out")], says="is too large"
    ),
    "a manifest claiming a 2**62-byte file beside a sparse 3 GiB record (verify)": Case(
        "sizes", lambda d: ["verify", str(_forged_sizes(d))], says="problem(s) in 7 listed files", out="none"
    ),
    "TVM record of no element whose dims multiply past int64 (load)": Case(
        "sizes",
        lambda d: [
            "-c",
            "import sys, shardload\ntry:\n"
            f"    shardload.load_rank({str(_tvm_no_element(d))!r}, 0, 1)\n"
            "except shardload.ShardloadError as err:\n    sys.exit(f'error: {err}')",
        ],
        says="is too large",
    ),
    "TVM record with a list as its dtype": Case(
        "messages", lambda d: ["inspect", str(_tvm_aliases(d, 1, ["float32"]))], says="dtype"
    ),
    "quantize a weight of zero columns": Case(
        "sizes",
        lambda d: ["quantize", str(_zero_width(d, (4, 0))), "-o", str(d / "out"), "--scheme", "int8"],
        says="proj.weight",
    ),
    "quantize a weight of zero columns, fp8": Case(
        "sizes",
        lambda d: ["quantize", str(_zero_width(d, (4, 0))), "-o", str(d / "out"), "--scheme", "fp8"],
        says="proj.weight",
    ),
    "quantize a weight of zero rows": Case(
        "sizes", lambda d: ["quantize", str(_zero_width(d, (0, 128))), "-o", str(d / "out")], says="proj.weight"
    ),
    # work that must stay linear
    "tall narrow tensor, convert": Case(
        "linear work",
        lambda d: ["convert", str(_tall(d)), "-n", "2", "-o", str(d / "out"), "-q"],
        code=0,
        changes={"out"},
    ),
    "tall narrow tensor, load_rank": Case(
        "linear work",
        lambda d: [
            "-c",
            f"import shardload; t = shardload.load_rank({str(_tall(d))!r}, 1, 2)['w']; "
            "assert t.shape == (8_000_000, 1) and float(t[-1, 0]) == 16e6 - 1 or True",
        ],
        code=0,
    ),
    "regular expression (a+)+$ in a quantization target": Case(
        "linear work",
        lambda d: [
            "-c",
            "from shardload.models.stored_layouts import _target_matches as m; "
            "assert not m('a' * 100_000 + 'b', 're:(a+)+$')",
        ],
        code=0,
    ),
    # outputs that would destroy data
    "quantize -o the model's parent --overwrite": Case(
        "outputs",
        lambda d: ["quantize", str(_model(d)), "-o", str(d), "--overwrite"],
        says="contains the source",
        out="none",
    ),
    "convert --overwrite onto a user's directory": Case(
        "outputs",
        lambda d: [
            (d / "mine").mkdir(),
            (d / "mine" / "thesis.tex").write_text("years of work"),
            ["convert", str(_model(d)), "-n", "2", "-o", str(d / "mine"), "--overwrite"],
        ][-1],
        says="nothing here was deleted",
        out="none",
    ),
    "convert -o the source file": Case(
        "outputs",
        lambda d: (
            lambda m: [
                "convert",
                str(m / "model.safetensors"),
                "-n",
                "2",
                "-o",
                str(m / "model.safetensors"),
                "--shard-info",
                str(m / "shard_info.json"),
            ]
        )(_model(d)),
        says="is the source",
        out="none",
    ),
    # messages
    "a pickle checkpoint": Case(
        "messages",
        lambda d: [
            (d / "pt").mkdir(),
            (d / "pt" / "pytorch_model.bin").write_bytes(b"\x80\x04\x95"),
            ["inspect", str(d / "pt")],
        ][-1],
        says="pickle checkpoints are not read",
    ),
    "names with control characters": Case(
        "messages", lambda d: ["inspect", str(_control_names(d)), "-n", "4"], says="\\x0a\\x1b[2J\\u202e"
    ),
}


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_CAP, DATA_CAP))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))


def _snapshot(root: Path) -> dict[str, str]:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or not p.is_file():
            files[str(p.relative_to(root))] = "special"
        else:
            files[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def _run(name: str, case: Case, base: Path) -> str | None:
    """Run one case; None when it behaved, else what went wrong."""
    d = base / f"case{list(CASES).index(name)}"
    d.mkdir()
    argv = case.setup(d)
    before = _snapshot(d)
    cmd = [sys.executable, *argv] if argv[0] == "-c" else [sys.executable, str(ROOT / "cli.py"), *argv]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=WALL_SECONDS, preexec_fn=_limits, cwd=d)
    except subprocess.TimeoutExpired:
        return f"{name}: still running after {WALL_SECONDS} s"
    if r.returncode != case.code:
        return f"{name}: exit {r.returncode}, wanted {case.code}: {(r.stderr or r.stdout)[-300:]!r}"
    if "Traceback" in r.stderr + r.stdout:
        return f"{name}: traceback: {r.stderr[-300:]!r}"
    if case.code:
        lines = r.stderr.splitlines()
        first = [ln for ln in r.stdout.splitlines() if case.says in ln] if not lines else lines
        if not first or case.says not in first[0] or len(lines) > 1:
            return f"{name}: wanted one line saying {case.says!r}, got {r.stderr!r} / {r.stdout[-300:]!r}"
        if "\x1b" in r.stderr + r.stdout or "\u202e" in r.stderr + r.stdout:
            return f"{name}: a control character reached the terminal"
    after = _snapshot(d)
    changed = {k.split("/")[0] for k in set(before) ^ set(after) | {k for k in before if before[k] != after.get(k)}}
    if changed - case.changes:
        return f"{name}: changed {sorted(changed - case.changes)}"
    return None


@pytest.mark.parametrize("category", sorted({c.category for c in CASES.values()}))
def test_hostile_inputs_fail_cleanly_and_bounded(category: str, tmp_path: Path) -> None:
    cases = {k: c for k, c in CASES.items() if c.category == category}
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        failures = [f for f in pool.map(lambda kv: _run(*kv, tmp_path), cases.items()) if f]
    assert not failures, "\n".join(failures)
