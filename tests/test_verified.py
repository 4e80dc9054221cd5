"""Verified loading: integrity records (``shardload hash``) and ``verify=True`` / ``verify=<root>``: every byte a
rank reads is checked, a flipped byte anywhere it reads fails it with one line, and bytes it never reads do not."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import shardload
from helpers.checkpoints import write_model
from helpers.verified import N, offset_of, tampered
from shardload.engine.hashing import hash_model
from shardload.errors import ShardloadError
from shardload.format.hash_record import LEAF_BYTES, RECORD_NAME, Tiling, parse_record, root_of, tensor_region
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import count_reads
from shardload.sources.safetensors_header import read_header


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_verified_loads_equal_plain_ones(split_model: Path, example_multi_dir: Path, tmp_path: Path) -> None:
    multi = shutil.copytree(example_multi_dir, tmp_path / "multi")
    root = hash_model(multi).root
    for model, pin in ((split_model, hash_model(split_model).root), (multi, root)):
        for rank in range(N):
            plain = shardload.load_rank(model, rank, N)
            for verify in (True, pin):
                checked = shardload.load_rank(model, rank, N, verify=verify)
                assert plain.keys() == checked.keys()
                for name, t in plain.items():
                    assert torch.equal(t, checked[name]), name
    every = shardload.load(multi, N, ["cpu"] * N, verify=root)
    for rank in range(N):
        plain = shardload.load_rank(multi, rank, N)
        assert all(torch.equal(plain[k], every[rank][k]) for k in plain)


def test_hash_is_idempotent_and_small(split_model: Path) -> None:
    first = hash_model(split_model)
    data = first.path.read_bytes()
    again = hash_model(split_model)
    assert again.root == first.root and again.path.read_bytes() == data
    assert first.record_bytes <= first.checkpoint_bytes // 1000 + (16 << 10)
    record = parse_record(data, "record")
    assert [f.name for f in record.files] == ["model.safetensors", "shard_info.json"]


@pytest.mark.parametrize("name,dim", [("row.weight", 0), ("col.weight", 1)])
def test_flip_caught_by_reader_not_by_others(split_model: Path, tmp_path: Path, name: str, dim: int) -> None:
    # a byte in rank 2's part of the tensor: rows 256..383 for the row split, bytes 2048..3071 of a row for columns
    row, col = (300, 10) if dim == 0 else (5, 2048 + 10)
    model = tampered(split_model, tmp_path / "m", offset_of(split_model, name, row, col))
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 2, N, verify=True)
    message = one_line_error(excinfo)
    assert "model.safetensors" in message and name in message and "hash mismatch" in message
    assert "bytes " in message
    for rank in (0, 1, 3):  # these ranks never read the tile: they load, exactly
        state = shardload.load_rank(model, rank, N, verify=True)
        clean = shardload.load_rank(split_model, rank, N)
        assert all(torch.equal(state[k], clean[k]) for k in clean)
    with pytest.raises(ShardloadError):
        shardload.load(model, N, ["cpu"] * N, verify=True)


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
@pytest.mark.parametrize(("row", "col_byte"), [(3, 10), (500, 1000)])
def test_column_slice_checked_a_row_block_at_once(
    split_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool, row: int, col_byte: int
) -> None:
    """A column slice's band tiles are gathered and hashed a row block at once, and cold its few hundred bytes a
    row are copied out of the file's mapping as their pages arrive: a byte flipped in the first or the last band,
    in the first or the last row block, still fails the rank, and the other ranks load exactly."""
    from shardload.sources.verified import VerifiedReader

    model = tampered(split_model, tmp_path / "m", offset_of(split_model, "col.weight", row, 2048 + col_byte))
    if cold:
        monkeypatch.setattr(VerifiedReader, "_cached", lambda *args: False)  # tiles read as from cold storage
    else:
        monkeypatch.setattr(VerifiedReader, "_cached", lambda *args: True)
    seen: dict[str, list] = {"pages": [], "blocks": []}
    request, block = VerifiedReader._request_pages, VerifiedReader._block_hashed
    monkeypatch.setattr(VerifiedReader, "_request_pages", lambda self, *a: seen["pages"].append(1) or request(self, *a))
    monkeypatch.setattr(VerifiedReader, "_block_hashed", lambda self, *a: seen["blocks"].append(block(self, *a))
                        or seen["blocks"][-1])  # fmt: skip
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 2, N, verify=True)
    assert "col.weight" in one_line_error(excinfo) and "hash mismatch" in str(excinfo.value)
    assert bool(seen["pages"]) == cold, "the cold column slice did not take the mapped path"
    for rank in (0, 3):
        state = shardload.load_rank(model, rank, N, verify=True)
        clean = shardload.load_rank(split_model, rank, N)
        assert all(torch.equal(state[k], clean[k]) for k in clean)
    assert any(seen["blocks"]), "no row block was checked at once"


def test_flip_in_header_caught(split_model: Path, tmp_path: Path) -> None:
    (n,) = struct.unpack("<Q", (split_model / "model.safetensors").read_bytes()[:8])
    header = (split_model / "model.safetensors").read_bytes()[8 : 8 + n]
    # a byte of the header that keeps it valid JSON with the same meaning: "float16"'s '1' -> a harmless key char
    at = header.index(b'"__metadata__"') + 3 if b"__metadata__" in header else header.rindex(b" ")
    model = tampered(split_model, tmp_path / "m", 8 + at)
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 0, N, verify=True)
    assert "the header" in one_line_error(excinfo) or "header" in str(excinfo.value).lower()


def test_flip_in_fused_qkv_part_caught(example_dir: Path, tmp_path: Path) -> None:
    src = shutil.copytree(example_dir, tmp_path / "src")
    hash_model(src)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    info = read_header(src / "model.safetensors")[name]
    row_bytes = info.nbytes // info.shape[0]
    # the k part starts after the 16 q heads (256 rows); a byte in the last k head
    model = tampered(src, tmp_path / "m", info.offset + (256 + 120) * row_bytes + 7)
    failed = []
    for rank in range(N):
        try:
            shardload.load_rank(model, rank, N, verify=True)
        except ShardloadError as err:
            assert name in str(err) and "\n" not in str(err)
            failed.append(rank)
    assert failed, "no rank noticed the flipped byte"


@pytest.mark.parametrize("change", ["truncate", "extend", "swap", "other record"])
def test_file_level_changes_caught(split_model: Path, example_dir: Path, tmp_path: Path, change: str) -> None:
    model = shutil.copytree(split_model, tmp_path / "m")
    data = (model / "model.safetensors").read_bytes()
    if change == "truncate":
        (model / "model.safetensors").write_bytes(data[:-100])
    elif change == "extend":
        (model / "model.safetensors").write_bytes(data + b"\0")
    elif change == "swap":  # same size, other bytes: the two tensors' data exchanged
        row = read_header(model / "model.safetensors")["row.weight"]
        col = read_header(model / "model.safetensors")["col.weight"]
        a, b = data[row.offset : row.offset + row.nbytes], data[col.offset : col.offset + col.nbytes]
        out = bytearray(data)
        out[row.offset : row.offset + row.nbytes], out[col.offset : col.offset + col.nbytes] = b, a
        (model / "model.safetensors").write_bytes(bytes(out))
    else:
        other = shutil.copytree(example_dir, tmp_path / "other")
        shutil.copy(hash_model(other).path, model / RECORD_NAME)
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 1, N, verify=True)
    one_line_error(excinfo)


def test_pinned_root_refuses_a_tampered_record(split_model: Path, tmp_path: Path) -> None:
    root = hash_model(split_model).root
    model = tampered(split_model, tmp_path / "m", offset_of(split_model, "row.weight", 0, 0))
    rehashed = hash_model(model)  # an attacker re-hashes the altered file: verify=True now passes...
    assert rehashed.root != root
    shardload.load_rank(model, 0, N, verify=True)
    with pytest.raises(ShardloadError) as excinfo:  # ...but the pinned root does not
        shardload.load_rank(model, 0, N, verify=root)
    assert "pinned root" in one_line_error(excinfo)
    record = bytearray((split_model / RECORD_NAME).read_bytes())
    record[-1] ^= 1  # a leaf hash altered by hand
    (model / RECORD_NAME).write_bytes(bytes(record))
    with pytest.raises(ShardloadError):
        shardload.load_rank(model, 0, N, verify=root)


def test_metadata_beside_the_weights_is_checked(split_model: Path, tmp_path: Path) -> None:
    model = shutil.copytree(split_model, tmp_path / "m")
    info = json.loads((model / "shard_info.json").read_text())
    info["params"]["col.weight"] = info["params"]["row.weight"]  # a plan that splits the other dim: still valid
    (model / "shard_info.json").write_text(json.dumps(info))
    shardload.load_rank(model, 0, N)
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 0, N, verify=True)
    assert "shard_info.json" in one_line_error(excinfo) and "differs from the integrity record" in str(excinfo.value)


def test_missing_record_says_how_to_make_one(example_dir: Path, tmp_path: Path) -> None:
    model = shutil.copytree(example_dir, tmp_path / "m")
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 0, N, verify=True)
    assert "shardload hash" in one_line_error(excinfo)
    with pytest.raises(ShardloadError):
        shardload.load_rank(model, 0, N, verify="not-a-root")


def test_rank_reads_only_the_tiles_it_needs(split_model: Path) -> None:
    for rank in range(N):
        with count_reads() as plain:
            shardload.load_rank(split_model, rank, N)
        with count_reads() as checked:
            shardload.load_rank(split_model, rank, N, verify=True)
        header = (split_model / "model.safetensors").stat().st_size - sum(
            t.nbytes for t in read_header(split_model / "model.safetensors").values()
        )
        assert checked.bytes <= plain.bytes + header, (rank, checked.bytes, plain.bytes)
        # every byte the rank uses was hashed, in whole tiles, and nothing was hashed that was not read
        assert plain.checked == plain.tiles == 0
        assert plain.bytes <= checked.checked <= checked.moved, (rank, plain.bytes, checked.checked, checked.moved)
        assert checked.tiles >= checked.checked // LEAF_BYTES


@pytest.mark.parametrize("junk", [b"", b"SLHASH1\n", b"SLHASH1\n" + struct.pack("<Q", 1 << 40), b"x" * 64])
def test_malformed_records_refused(split_model: Path, tmp_path: Path, junk: bytes) -> None:
    model = shutil.copytree(split_model, tmp_path / "m")
    (model / RECORD_NAME).write_bytes(junk)
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 0, N, verify=True)
    one_line_error(excinfo)


def test_needed_tiles_are_those_any_run_touches() -> None:
    from shardload.sources.verified import _needed

    rng = np.random.default_rng(7)
    for rows, row_bytes, tile_rows, tile_bytes in ((64, 1024, 8, 256), (100, 96, 7, 40), (33, 4096, 1, 4096)):
        tiling = Tiling(rows, row_bytes, tile_rows, tile_bytes)
        size = rows * row_bytes
        for _ in range(50):
            starts = np.sort(rng.integers(0, size, size=int(rng.integers(1, 12))))
            ends = np.minimum(starts + rng.integers(1, 3 * row_bytes, size=len(starts)), size) - 1  # inclusive
            want = np.zeros((tiling.row_blocks, tiling.bands), dtype=bool)
            for o, e in zip(starts.tolist(), ends.tolist(), strict=True):
                if o // row_bytes == e // row_bytes:  # within a row: byte by byte, the tile each falls in
                    for at in range(o, e + 1):
                        want[(at // row_bytes) // tile_rows, (at % row_bytes) // tile_bytes] = True
                else:  # over several rows: every band of the row blocks it spans
                    want[(o // row_bytes) // tile_rows : (e // row_bytes) // tile_rows + 1] = True
            assert np.array_equal(_needed(tiling, starts, ends), want), (tiling, starts, ends)


def test_tiles_fall_on_power_of_two_splits() -> None:
    # the shapes of a Llama-like model's weights (fused qkv and gate_up, GQA, vocabulary 32000)
    for rows, cols in ((2048, 2048), (3072, 2048), (512, 2048), (11264, 2048), (2048, 5632), (32000, 2048)):
        region = tensor_region(0, rows, cols * 2, 2)
        by_rows = region.tiling(0)
        assert by_rows.tile_bytes == cols * 2 and by_rows.tile_rows * by_rows.tile_bytes <= LEAF_BYTES
        for n in (2, 4, 8):
            for part in (rows, rows // 3, rows // 2):  # fused parts (q of qkv is 2/3, gate and up are halves)
                if part % (n * 64) == 0:
                    assert (part // n) % by_rows.tile_rows == 0, (rows, cols, n, region)
        by_cols = region.tiling(1)
        assert by_cols.tile_rows * by_cols.tile_bytes <= LEAF_BYTES
        for n in (2, 4, 8):
            assert (cols * 2 // n) % by_cols.tile_bytes == 0, (rows, cols, n, region)


def test_convert_verify_refuses_a_flipped_source_and_writes_nothing(split_model: Path, tmp_path: Path) -> None:
    model = tampered(split_model, tmp_path / "m", offset_of(split_model, "col.weight", 7, 3000))
    with pytest.raises(ShardloadError) as excinfo:
        shardload.convert(model, N, tmp_path / "out", verify=True)
    assert "col.weight" in one_line_error(excinfo)
    assert not (tmp_path / "out").exists()
    shardload.convert(split_model, N, tmp_path / "ok", verify=hash_model(split_model).root)


def test_converted_output_carries_a_record(split_model: Path, tmp_path: Path) -> None:
    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    manifest = json.loads((out / "shard_manifest.json").read_text())
    root = manifest["integrity"]["root"]
    assert root == root_of((out / RECORD_NAME).read_bytes())
    assert any(f["path"] == RECORD_NAME and f["sha256"] == root for f in manifest["files"])
    assert shardload.verify_dir(out).ok
    for rank in range(N):
        checked = shardload.load_rank(out, rank, N, verify=root)
        plain = shardload.load_rank(split_model, rank, N)
        assert all(torch.equal(checked[k], plain[k]) for k in plain)
    rank_file = out / "rank-00002-of-00004.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-5] ^= 1
    rank_file.write_bytes(bytes(data))
    shardload.load_rank(out, 1, N, verify=True)  # another rank's file
    for verify, reason in ((True, "does not match its leaves"), (root, "hash mismatch")):
        with pytest.raises(ShardloadError) as excinfo:
            shardload.load_rank(out, 2, N, verify=verify)
        assert "rank-00002-of-00004.safetensors" in one_line_error(excinfo) and reason in str(excinfo.value)


def test_cli_hash_and_convert_verify(split_model: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from shardload.cli.main import main

    model = shutil.copytree(split_model, tmp_path / "m")
    (model / RECORD_NAME).unlink()
    result = CliRunner().invoke(main, ["hash", "-q", str(model)])
    assert result.exit_code == 0, result.output
    root = result.output.strip()
    assert root == root_of((model / RECORD_NAME).read_bytes())
    result = CliRunner().invoke(main, ["convert", str(model), "-n", "2", "-o", str(tmp_path / "o"), "--verify", root])
    assert result.exit_code == 0, result.output
    other = "0" * 64
    result = CliRunner().invoke(main, ["convert", str(model), "-n", "2", "-o", str(tmp_path / "x"), "--verify", other])
    assert result.exit_code == 1 and "pinned root" in result.output and "Traceback" not in result.output


def _dim0(shape: list[int], dtype: str) -> list:
    out: list = ["num_shards", *shape]
    out[1] = f"{shape[0]} // num_shards"
    return ["shard_funcs.shard_dim", [out, dtype], 0, "num_shards"]


def test_gguf_block_flip_caught(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from helpers.quantized import save_gguf
    from shardload.sources.checkpoint import open_checkpoint

    rng = np.random.default_rng(3)
    qtype = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(rng.standard_normal((256, 1024)).astype(np.float32), qtype)
    directory = tmp_path / "g"
    directory.mkdir()
    save_gguf(
        directory / "model.gguf",
        {"q.weight": (blocks, qtype), "w.weight": (rng.standard_normal((256, 512)).astype(np.float16), None)},
    )
    ckpt = open_checkpoint(directory / "model.gguf")
    q, w = ckpt.tensors["q.weight"], ckpt.tensors["w.weight"]
    info = {"version": 1, "num_shards": None, "params": {
        "q.weight": [_dim0(list(q.shape), q.dtype)], "w.weight": [_dim0(list(w.shape), w.dtype)]}}  # fmt: skip
    (directory / "shard_info.json").write_text(json.dumps(info))
    hash_model(directory / "model.gguf")
    assert (directory / "model.gguf.hashes").is_file()
    clean = [shardload.load_rank(directory / "model.gguf", r, N) for r in range(N)]
    assert all(
        torch.equal(clean[1][k], t) for k, t in shardload.load_rank(directory / "model.gguf", 1, N, verify=True).items()
    )
    row_bytes = q.nbytes // q.shape[0]
    data = bytearray((directory / "model.gguf").read_bytes())
    data[q.offset + 200 * row_bytes + 5] ^= 0x10  # a block of row 200: rank 3's rows (192..255)
    (directory / "model.gguf").write_bytes(bytes(data))
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(directory / "model.gguf", 3, N, verify=True)
    assert "q.weight" in one_line_error(excinfo)
    state = shardload.load_rank(directory / "model.gguf", 0, N, verify=True)
    assert all(torch.equal(clean[0][k], t) for k, t in state.items())


def test_tvm_record_flip_caught(tmp_path: Path) -> None:
    from helpers.tvm_cache import dump

    rng = np.random.default_rng(4)
    params = {"param_0": rng.standard_normal((512, 256)).astype("float16"), "norm": np.ones(256, dtype="float16")}
    path = dump(params, tmp_path / "cache")
    info = {"version": 1, "num_shards": None, "params": {"param_0": [_dim0([512, 256], "float16")]}}
    hash_model(path)
    clean = [shardload.load_rank(path, r, N, shard_info=info) for r in range(N)]
    ckpt = open_checkpoint(path)
    t = ckpt.tensors["param_0"]
    data = bytearray(Path(t.file).read_bytes())
    data[t.offset + 500 * 512 + 3] ^= 1  # row 500: rank 3's rows
    Path(t.file).write_bytes(bytes(data))
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(path, 3, N, shard_info=info, verify=True)
    assert "param_0" in one_line_error(excinfo)
    state = shardload.load_rank(path, 1, N, shard_info=info, verify=True)
    assert all(torch.equal(clean[1][k], v) for k, v in state.items())


def test_quantized_scale_flip_caught(example_dir: Path, tmp_path: Path) -> None:
    quantized = shardload.quantize(example_dir, tmp_path / "q", "int4-g32").out_dir
    hash_model(quantized)
    clean = [shardload.load_rank(quantized, r, N) for r in range(N)]
    name = "model.layers.1.mlp.gate_up_proj.weight_scale"
    info = read_header(quantized / "model.safetensors")[name]
    assert info.nbytes <= LEAF_BYTES  # one tile: every rank that reads a scale of it checks all of it
    model = tampered(quantized, tmp_path / "m", info.offset + info.nbytes - 3)
    failed = []
    for rank in range(N):
        try:
            state = shardload.load_rank(model, rank, N, verify=True)
        except ShardloadError as err:
            assert name in str(err) and "\n" not in str(err)
            failed.append(rank)
            continue
        assert all(torch.equal(clean[rank][k], t) for k, t in state.items())
    assert failed == list(range(N)), failed


def test_received_bytes_are_checked(split_model: Path) -> None:
    """What share_reads does after the exchange, without the exchange: a rank's tensors as a peer sent them."""
    from shardload.engine.integrity import load_record, verified_reader
    from shardload.engine.routes import check_received
    from shardload.sources.reader import Reader

    ckpt = open_checkpoint(split_model)
    record = load_record(ckpt, True)
    plan = shardload.plan_model(split_model, N)
    for rank in range(N):
        state = shardload.load_rank(split_model, rank, N)
        with verified_reader(Reader(), ckpt, record) as reader, count_reads() as seen:
            check_received(plan.params.values(), rank, state, reader)
        assert seen.bytes <= 8 << 10, seen.bytes  # tiles aligned with the rank's runs: only headers from storage
        for name in ("row.weight", "col.weight", "norm.weight"):
            altered = dict(state)
            altered[name] = state[name].clone()
            altered[name].view(-1)[7] += 1
            with verified_reader(Reader(), ckpt, record) as reader, pytest.raises(ShardloadError) as excinfo:
                check_received(plan.params.values(), rank, altered, reader)
            message = one_line_error(excinfo)
            assert name in message and "peer" in message


@pytest.mark.parametrize(("evil", "converted", "pinned"), [(-1, False, False), (0, False, False), (0, True, True),
                                                         (0, True, False)])  # fmt: skip
def test_share_reads_receivers_check_what_peers_send(
    split_model: Path, tmp_path: Path, evil: int, converted: bool, pinned: bool
) -> None:
    """A peer that alters what it sends fails the receiver, and with it every rank of the group (the sender returned
    its tensors, and a server's next collective hung on the receiver); on a converted directory with the pinned root
    too, and with ``verify=True``, which checked only the rank's own file, not the bytes peers sent for it (wrong
    tensors returned)."""
    import os
    import subprocess
    import sys

    model, pin = split_model, []
    if converted:
        model = tmp_path / "tp2"
        shardload.convert(split_model, 2, model)
        if pinned:
            pin = [json.loads((model / "shard_manifest.json").read_text())["integrity"]["root"]]
    worker = Path(__file__).parent / "verified_shared_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
               str(model), str(evil), *pin]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("OK ", "FAILED ", "WRONG "))]
    if evil < 0:
        assert sorted(lines) == ["OK 0", "OK 1"], done.stdout[-3000:] + done.stderr[-3000:]
        return
    failed = [line for line in lines if line.startswith("FAILED 1:")]
    assert failed, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a peer of the group sharing reads sent bytes" in failed[0]
    assert sorted(line.split(":")[0] for line in lines) == ["FAILED 0", "FAILED 1"], lines


def test_record_parser_never_fails_other_than_one_line(split_model: Path) -> None:
    """Every truncation of a record, and single-byte changes all over its JSON part, are RecordErrors or parse."""
    from shardload.format.hash_record import RecordError

    data = (split_model / RECORD_NAME).read_bytes()
    (n,) = struct.unpack("<Q", data[8:16])
    for cut in range(0, 16 + n + 64):
        with pytest.raises(RecordError):
            parse_record(data[:cut], "record")
    rng = np.random.default_rng(0)
    for at in rng.integers(0, 16 + n, size=400).tolist():
        for value in (0, 0x22, 0x31, 0x5D, 0xFF):
            changed = bytearray(data)
            changed[at] = value
            try:
                parse_record(bytes(changed), "record")
            except RecordError as err:
                assert "\n" not in str(err)


def test_swapped_files_of_an_index_caught(example_multi_dir: Path, tmp_path: Path) -> None:
    model = shutil.copytree(example_multi_dir, tmp_path / "m")
    hash_model(model)
    first, second = sorted(model.glob("*.safetensors"))
    first.rename(tmp_path / "tmp")
    second.rename(first)
    (tmp_path / "tmp").rename(second)
    index = json.loads((model / "model.safetensors.index.json").read_text())  # rewritten to match: loads plainly
    swap = {first.name: second.name, second.name: first.name}
    index["weight_map"] = {k: swap[v] for k, v in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    shardload.load_rank(model, 0, N)
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 0, N, verify=True)
    one_line_error(excinfo)


def test_vllm_layout_carries_a_record_and_verifies_its_source(split_model: Path, tmp_path: Path) -> None:
    from shardload.integrations.vllm.writer import convert_vllm

    root = hash_model(split_model).root
    out = tmp_path / "vllm"
    convert_vllm(split_model, 2, out, verify=root)
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert manifest["integrity"]["root"] == root_of((out / RECORD_NAME).read_bytes())
    assert shardload.verify_dir(out).ok
    model = tampered(split_model, tmp_path / "m", offset_of(split_model, "row.weight", 3, 3))
    with pytest.raises(ShardloadError) as excinfo:
        convert_vllm(model, 2, tmp_path / "bad", verify=True)
    assert "row.weight" in one_line_error(excinfo) and not (tmp_path / "bad").exists()


def test_reader_threads_cap_verifying_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ReadOptions(threads=1)`` caps a verified cold load's hashing jobs at one thread at a time (seen running
    them on five planned-read threads before the cap), and the tensors are those of a plain load."""
    import os
    import threading
    import time

    from helpers.checkpoints import random_array, write_model
    from shardload.sources import verified

    rng = np.random.default_rng(0)
    tensors = {f"t{k}": random_array(rng, (2048, 2048), "float32") for k in range(6)}
    steps = {k: [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]] for k in tensors}
    write_model(tmp_path, tensors, {"version": 1, "params": steps})
    hash_model(tmp_path)
    active, most = [0], [0]
    lock = threading.Lock()
    original = verified.VerifiedReader.read_runs

    def recorded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.002)  # long enough for another thread, were one allowed, to start a job beside this one
            return original(self, *args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(verified.VerifiedReader, "read_runs", recorded)
    fd = os.open(tmp_path / "model.safetensors", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    got = shardload.load_rank(tmp_path, 1, 4, verify=True, read_options=shardload.ReadOptions(threads=1))
    assert most[0] == 1  # never two verifying reads at once: one thread hashes, whichever it is
    want = shardload.load_rank(tmp_path, 1, 4)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_warm_verified_jobs_run_on_the_reader_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified load of a cached file runs its copy-and-hash jobs on the reader threads (one a core), not on the
    deeper pool of planned cold reads (seen running them on ``shardload-io`` threads before the change)."""
    import threading

    from helpers.checkpoints import random_array, write_model
    from shardload.sources import verified

    rng = np.random.default_rng(0)
    tensors = {f"t{k}": random_array(rng, (1024, 1024), "float32") for k in range(4)}
    steps = {k: [["shard_funcs.shard_dim", [None, None], i % 2, "num_shards"]] for i, k in enumerate(tensors)}
    write_model(tmp_path, tensors, {"version": 1, "params": steps})
    hash_model(tmp_path)
    (tmp_path / "model.safetensors").read_bytes()  # cached
    names: set[str] = set()
    original = verified.VerifiedReader.read_runs

    def recorded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        names.add(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(verified.VerifiedReader, "read_runs", recorded)
    got = shardload.load_rank(tmp_path, 1, 4, verify=True)
    assert names and not any(n.startswith("shardload-io") for n in names), names
    want = shardload.load_rank(tmp_path, 1, 4)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(("name", "row", "col"), [("t0", 300, 8), ("t1", 7, 1024 + 8)])
def test_warm_verified_jobs_on_the_reader_pool_catch_a_flip(tmp_path: Path, name: str, row: int, col: int) -> None:
    """A byte flipped in rank 1's part of a row-split (t0) or column-split (t1) tensor of a cached file fails the
    warm load, whose jobs run on the reader threads, with one line naming the tensor (seen loading the flipped
    bytes with the tile comparison taken out)."""
    from helpers.checkpoints import random_array, write_model

    rng = np.random.default_rng(0)
    tensors = {f"t{k}": random_array(rng, (1024, 1024), "float32") for k in range(2)}
    steps = {k: [["shard_funcs.shard_dim", [None, None], i, "num_shards"]] for i, k in enumerate(tensors)}
    write_model(tmp_path / "m", tensors, {"version": 1, "params": steps})
    hash_model(tmp_path / "m")
    model = tampered(tmp_path / "m", tmp_path / "bad", offset_of(tmp_path / "m", name, row, col))
    (model / "model.safetensors").read_bytes()  # cached
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(model, 1, 4, verify=True)
    assert name in one_line_error(excinfo) and "hash mismatch" in one_line_error(excinfo)


def _tiling_model(directory: Path) -> Path:
    """Tensors whose tiles take every shape a record has, several write chunks long: rows wider than a leaf, column
    bands (an uneven last one), row counts that are not powers of two, int8, float32, a 1-D tensor."""

    def split(shape: list[int], dim: int, dtype: str) -> list:
        out: list = ["num_shards", *shape]
        out[dim + 1] = f"{shape[dim]} // num_shards"
        return ["shard_funcs.shard_dim", [out, dtype], dim, "num_shards"]

    rng = np.random.default_rng(5)
    tensors = {
        "wide.weight": rng.standard_normal((6, 100_000)).astype(np.float16),
        "col.weight": rng.standard_normal((1000, 1536)).astype(np.float16),
        "row.weight": rng.standard_normal((2048, 1024)).astype(np.float16),
        "odd.weight": rng.standard_normal((700, 1499)).astype(np.float16),
        "int8.weight": rng.integers(-100, 100, (512, 5000), dtype=np.int8),
        "fp32.weight": rng.standard_normal((257, 640)).astype(np.float32),
        "norm.weight": rng.standard_normal(3000).astype(np.float16),
    }
    info = {
        "version": 1,
        "num_shards": None,
        "params": {
            "wide.weight": [split([6, 100_000], 1, "float16")],
            "col.weight": [split([1000, 1536], 1, "float16")],
            "row.weight": [split([2048, 1024], 0, "float16")],
            "int8.weight": [split([512, 5000], 0, "int8")],
        },
    }
    return write_model(directory, tensors, info)


@pytest.mark.parametrize("tilings", ["rank file", "both"])
def test_leaf_stream_gives_the_leaves_of_the_finished_file(tmp_path: Path, tilings: str) -> None:
    """A file's leaves hashed from its bytes as they pass, in pieces of any size (one byte, a tile and a bit, whole
    rows, the whole file), are the leaves hashing the finished file gives: the same entry, byte for byte; with a
    rank file's regions (row blocks only) and with a source file's (row blocks and column bands)."""
    from shardload.engine.hashing import hash_files, output_regions, regions_for
    from shardload.engine.leaf_stream import LeafStream

    regions_of = output_regions if tilings == "rank file" else regions_for
    model = _tiling_model(tmp_path / "m")
    path = model / "model.safetensors"
    data = path.read_bytes()
    want = hash_files(model, [path], {path: list(read_header(path).values())}, regions_of=regions_of).files[0]
    assert {len(r.tilings) for r in want.regions} == ({1} if tilings == "rank file" else {1, 2})
    assert any(r.tilings[0][0] == 1 < r.rows for r in want.regions)
    header = data[: 8 + struct.unpack("<Q", data[:8])[0]]
    rng = np.random.default_rng(0)
    for sizes in ([len(data)], [1, 7, LEAF_BYTES + 3, 4096], [3000, 1 << 20, 5000 * 3], "random"):
        stream = LeafStream(path, header, regions_of=regions_of)
        at, k = 0, 0
        while at < len(data):
            step = int(rng.integers(1, 3 << 20)) if sizes == "random" else sizes[k % len(sizes)]
            stream.update(memoryview(data)[at : at + step])
            at, k = at + step, k + 1
        got = stream.hashes()
        assert (got.size, got.regions, got.leaves) == (want.size, want.regions, want.leaves), sizes
    cut = LeafStream(path, header)
    cut.update(data[:-1])
    with pytest.raises(ShardloadError, match="cut short"):
        cut.hashes()


@pytest.mark.parametrize("n", [1, 2, 8])
def test_converts_record_is_hashed_as_written(tmp_path: Path, n: int) -> None:
    """convert hashes its rank files' leaves as it writes them (never reading one back): its record is byte for byte
    the one hashing the finished rank files gives (the same regions, leaves and order)."""
    from shardload.engine.hashing import output_record

    model = _tiling_model(tmp_path / "m")
    done = shardload.convert(model, n, tmp_path / "out")
    got = (done.out_dir / RECORD_NAME).read_bytes()
    assert got == output_record(done.out_dir, [f.path for f in done.rank_files])
    assert [f.name for f in parse_record(got, "record").files] == [f.path for f in done.rank_files]
    assert json.loads((done.out_dir / "shard_manifest.json").read_text())["integrity"]["root"] == root_of(got)


@pytest.mark.parametrize("cached", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize(
    "runs",
    [
        [((5, 100), (400, 7))],  # long, both ends inside tiles
        [((40, 8), (41, 96))],  # inside one tile
        [((30, 8), (34, 96))],  # across one tile edge, no whole tile
        [((0, 0), (40, 0)), ((40, 0), (96, 8)), ((96, 8), (128, 0))],  # runs sharing edge tiles, in one call
    ],
    ids=["long", "in-one-tile", "across-an-edge", "shared-edges"],
)
def test_runs_off_tile_edges_read_straight_into_their_destination(
    split_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool, runs: list
) -> None:
    """Runs that start or end inside row-block tiles (a device path's page-aligned span into a staging buffer)
    are read straight into their destination and their whole tiles hashed there: only the tiles a run covers in
    part go through scratch, and only the run's bytes of them are copied out (seen copying the whole run out of a
    private buffer before). The bytes are the file's; a byte flipped in an edge tile outside the runs fails them."""
    from shardload.engine.integrity import load_record, verified_reader
    from shardload.sources import verified
    from shardload.sources.reader import Reader

    monkeypatch.setattr(verified.VerifiedReader, "_cached", lambda *args: cached)
    spans = [(offset_of(split_model, "row.weight", *a), offset_of(split_model, "row.weight", *b)) for a, b in runs]
    sizes = [hi - lo for lo, hi in spans]
    copied = [0]
    original = verified.copy_runs

    def counted(source, at, outs, buf, dst, length):  # type: ignore[no-untyped-def]
        copied[0] += int(np.asarray(length).sum())
        return original(source, at, outs, buf, dst, length)

    monkeypatch.setattr(verified, "copy_runs", counted)

    def read(model: Path) -> torch.Tensor:
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        src = np.array([lo for lo, _ in spans], dtype=np.int64)
        dst = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        with verified_reader(Reader(), open_checkpoint(model), load_record(open_checkpoint(model), True)) as reader:
            reader.read_runs(model / "model.safetensors", src, np.array(sizes), np.zeros_like(src), dst, [out])
        return out

    got = read(split_model)
    data = (split_model / "model.safetensors").read_bytes()
    assert got.numpy().tobytes() == b"".join(data[lo:hi] for lo, hi in spans)
    tile, base = 32 * 4096, offset_of(split_model, "row.weight", 0, 0)  # row blocks: 32 rows of 4096 bytes
    rel = [(lo - base, hi - base) for lo, hi in spans]
    edges = {lo // tile for lo, _ in rel if lo % tile} | {hi // tile for _, hi in rel if hi % tile}
    assert copied[0] <= len(edges) * tile, f"{copied[0]} bytes copied out of scratch for runs of {sizes}"
    first, last = rel[0][0], rel[-1][1]
    outside = {first - first % tile} if first % tile else set()  # bytes of edge tiles outside the runs
    outside |= {last - last % tile + tile - 1} if last % tile else set()
    for at in outside:
        bad = tampered(split_model, tmp_path / f"bad{at}", base + at)
        with pytest.raises(ShardloadError) as excinfo:
            read(bad)
        assert "row.weight" in one_line_error(excinfo) and "hash mismatch" in one_line_error(excinfo)


def _odd_model(directory: Path) -> Path:
    """One tensor whose rows (2,998 bytes) end in a narrower column band (8 bands of 376 bytes, the last 366) and
    whose last row block is shorter (700 rows in blocks of 256), hashed."""
    rng = np.random.default_rng(7)
    model = write_model(directory, {"odd.weight": rng.standard_normal((700, 1499)).astype(np.float16)},
                        {"version": 1, "num_shards": None, "params": {}})  # fmt: skip
    hash_model(model)
    return model


@pytest.mark.parametrize("pitch", [0, 100], ids=["packed", "rows-apart"])
@pytest.mark.parametrize("bands", [(6, 8), (0, 2), (3, 4)], ids=["to-the-narrow-last", "first-two", "one"])
def test_warm_column_slice_on_band_edges_checked_a_block_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bands: tuple[int, int], pitch: int
) -> None:
    """A cached file's column slice on band edges (a narrower last band, a shorter last row block, its rows packed
    or apart in the destination) is copied out of the mapping a row block at a time and each block's tiles hashed
    there: the bytes are the file's, and a byte flipped in the slice's first or last tile fails it with one line."""
    from shardload.engine.integrity import load_record, verified_reader
    from shardload.sources import verified
    from shardload.sources.reader import Reader

    model = _odd_model(tmp_path / "m")
    B, width, rows = 2998, 376, 700
    c0, c1 = bands[0] * width, min(bands[1] * width, B)
    w = c1 - c0
    taken: list[int] = []
    band_copied = verified.VerifiedReader._band_copied
    monkeypatch.setattr(verified.VerifiedReader, "_band_copied",
                        lambda self, *a: taken.append(1) or band_copied(self, *a))  # fmt: skip

    def read(m: Path) -> np.ndarray:
        (m / "model.safetensors").read_bytes()  # cached
        out = torch.zeros(rows * (w + pitch), dtype=torch.uint8)
        src = np.array([offset_of(m, "odd.weight", r, c0) for r in range(rows)], dtype=np.int64)
        dst = np.arange(rows, dtype=np.int64) * (w + pitch)
        with verified_reader(Reader(), open_checkpoint(m), load_record(open_checkpoint(m), True)) as reader:
            reader.read_runs(m / "model.safetensors", src, np.full(rows, w), np.zeros(rows, np.int64), dst, [out])
        return out.numpy().reshape(rows, w + pitch)[:, :w]

    data = np.frombuffer((model / "model.safetensors").read_bytes(), dtype=np.uint8)
    base = offset_of(model, "odd.weight", 0, 0)
    want = data[base : base + rows * B].reshape(rows, B)[:, c0:c1]
    assert np.array_equal(read(model), want)
    assert taken, "the column slice did not take the warm band path"
    for row, col in ((0, c0), (rows - 1, c1 - 1)):
        bad = tampered(model, tmp_path / f"bad{row}", offset_of(model, "odd.weight", row, col))
        with pytest.raises(ShardloadError) as excinfo:
            read(bad)
        assert "odd.weight" in one_line_error(excinfo) and "hash mismatch" in one_line_error(excinfo)


def test_tile_box_finds_whole_row_blocks_and_band_slices() -> None:
    """The shapes a verifying reader copies and checks without per-run bookkeeping: whole row blocks (several runs,
    the last block short), one column slice on band edges (rows apart in the destination); anything off a tile
    edge, across rows or across regions is None (the general way)."""
    from shardload.sources.tile_boxes import BandBox, RowBlocks, tile_box

    region = tensor_region(1000, 700, 2998, 2)  # row blocks of 32 rows; bands of 376 bytes, 256 rows
    regions = [tensor_region(0, 1, 1000, 1), region]
    starts, bases = np.array([0, 1000]), [0, 1]
    B = 2998

    def box(src: list[int], length: list[int], dst: list[int] | None = None) -> RowBlocks | BandBox | None:
        n = len(src)
        d = np.array(dst if dst is not None else np.cumsum([0, *length[:-1]]), dtype=np.int64)
        return tile_box(starts, bases, regions, np.array(src), np.array(length), np.zeros(n, np.int64), d)

    rows = box([1000, 1000 + 64 * B], [32 * B, 700 * B - 64 * B])
    assert isinstance(rows, RowBlocks) and rows.tiling.tile_rows == 32 and rows.start == [0, 64 * B]
    slice_ = box([1000 + r * B + 2 * 376 for r in range(256)], [2 * 376] * 256, [r * 1000 for r in range(256)])
    assert slice_ == BandBox(1, region.tiling(1), 1 + region.tiling(0).leaves, 0, 256, 752, 1504, 0, 0, 1000)
    last = box([1000 + r * B + 6 * 376 for r in range(512, 700)], [B - 6 * 376] * 188)
    assert isinstance(last, BandBox) and (last.r0, last.r1, last.c1) == (512, 700, B)
    assert box([1000 + 16 * B], [32 * B]) is None  # off a row block's edge
    assert box([1000 + r * B + 100 for r in range(256)], [376] * 256) is None  # off a band's edge
    assert box([1000 + r * B for r in range(100)], [376] * 100) is None  # rows off a band tile's edge
    assert box([1000 + 2 * 376], [B]) is None  # across rows
    assert box([0, 1000], [1000, 32 * B]) is None  # across regions


@pytest.mark.parametrize("n", (1, 2))
def test_rows_wider_than_a_tile_load_verified(tmp_path: Path, n: int) -> None:
    """Rows of 160 KB (wider than a row-block tile): a read of several whole rows spans row blocks, and the later
    blocks' bytes are copied by the first block's run; a warm verified load returns the rows, and a flipped byte in
    the last row is caught."""
    rng = np.random.default_rng(3)
    t = rng.standard_normal((4, 40001)).astype(np.float32)
    info = {
        "version": 1,
        "num_shards": None,
        "params": {"w": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]},
    }
    model = write_model(tmp_path / "m", {"w": t}, info)
    hash_model(model)
    (model / "model.safetensors").read_bytes()  # warm
    for r in range(n):
        got = shardload.load_rank(model, r, n, verify=True)
        np.testing.assert_array_equal(got["w"].numpy(), np.split(t, n)[r])
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardloadError, match="feeding w: hash mismatch"):
        shardload.load_rank(model, n - 1, n, verify=True)


def test_hash_never_writes_its_record_over_another_file(example_dir: Path, tmp_path: Path) -> None:
    """``shardload hash MODEL -o PATH`` writes a record only where there is none or a record already: a weight file,
    a config or any other file at PATH is refused in one line and left as it was (it replaced the model's weights
    with the record and exited 0). A record there is replaced, a new path written."""
    from click.testing import CliRunner

    from shardload.cli.main import main

    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    runner = CliRunner()
    for target in (model / "model.safetensors", model / "config.json", notes):
        before = target.read_bytes()
        done = runner.invoke(main, ["hash", str(model), "-o", str(target), "-q"])
        assert done.exit_code == 1 and target.read_bytes() == before, (target, done.output)
        (line,) = done.output.strip().splitlines()
        assert str(target) in line and "not an integrity record" in line, line
    fifo = tmp_path / "fifo"  # read to look at it, it would wait forever; renamed over, it was gone
    os.mkfifo(fifo)
    done = runner.invoke(main, ["hash", str(model), "-o", str(fifo), "-q"])
    assert done.exit_code == 1 and "is not a regular file" in done.output and fifo.is_fifo(), done.output
    record = tmp_path / "record"
    for _ in range(2):  # new, then a record already
        done = runner.invoke(main, ["hash", str(model), "-o", str(record), "-q"])
        assert done.exit_code == 0 and record.read_bytes().startswith(b"SLHASH1\n"), done.output


def test_hash_refuses_a_metadata_file_that_is_not_a_regular_file(example_dir: Path, tmp_path: Path) -> None:
    """A ``config.json`` that is a FIFO (or a device) was skipped: the record did not hold it and ``verify`` passed,
    while ``convert`` refuses the same directory. It is refused in one line, and no record is written."""
    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    with pytest.raises(shardload.ShardloadError, match="not a regular file") as err:
        hash_model(model)
    assert "config.json" in str(err.value) and "\n" not in str(err.value)
    assert not (model / RECORD_NAME).exists()


def test_hash_into_a_directory_that_does_not_exist_is_refused(example_dir: Path, tmp_path: Path) -> None:
    """``shardload hash MODEL -o missing/`` (a directory meant, by its slash) wrote a file named ``missing`` and
    exited 0; it is refused in one line, and an existing directory gets the record inside it."""
    from click.testing import CliRunner

    from shardload.cli.main import main

    runner = CliRunner()
    done = runner.invoke(main, ["hash", str(example_dir), "-o", f"{tmp_path / 'missing'}/", "-q"])
    assert done.exit_code == 1 and not (tmp_path / "missing").exists(), done.output
    (line,) = done.output.strip().splitlines()
    assert "missing" in line and "no such directory" in line, line
    with pytest.raises(shardload.ShardloadError, match="no such directory"):
        hash_model(example_dir, f"{tmp_path / 'missing'}/")
    for bad in ("", 5):  # "" was the current directory, 5 a bare TypeError
        with pytest.raises(shardload.ShardloadError, match="must be a path"):
            shardload.hash_checkpoint(example_dir, bad)  # type: ignore[arg-type]
    (tmp_path / "there").mkdir()
    done = runner.invoke(main, ["hash", str(example_dir), "-o", f"{tmp_path / 'there'}/", "-q"])
    assert done.exit_code == 0 and (tmp_path / "there" / RECORD_NAME).is_file(), done.output


def test_a_record_of_many_small_tensors_is_read_back_by_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record holds a leaf for each tensor however small: the size a reader allows it grows with the tensors, not
    only with the bytes, so ``hash`` never writes a record ``verify`` then refuses as over its limit (old code did
    for 1.45M two-byte tensors). The fixed allowance is made small here so a few thousand tensors show it."""
    from shardload.engine import integrity

    tensors = {f"t{i}": np.full((1,), i, dtype=np.float16) for i in range(3000)}
    model = write_model(tmp_path / "m", tensors, {"version": 1, "params": {}})
    hash_model(model)
    assert (model / RECORD_NAME).stat().st_size > 64 << 10
    monkeypatch.setattr(integrity, "RECORD_SLACK", 64 << 10)
    state = shardload.load_rank(model, 0, 1, verify=True)
    assert torch.equal(state["t2999"], torch.full((1,), 2999, dtype=torch.float16))


def test_a_large_manifest_is_written_compact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted directory's manifest is indented while small, and compact past a size (its tensor list grows with
    the model): indented, 1.45M tensors made a 112 MB manifest, over the 100 MiB every reader allows; compact, 39 MB.
    The threshold is made small here."""
    from shardload.engine import output

    tensors = {f"t{i}": np.full((4,), i, dtype=np.float16) for i in range(200)}
    model = write_model(tmp_path / "m", tensors, {"version": 1, "params": {}})
    shardload.convert(model, 2, tmp_path / "small")
    assert "\n  " in (tmp_path / "small" / "shard_manifest.json").read_text()
    monkeypatch.setattr(output, "INDENTED_MANIFEST_BYTES", 1024)
    shardload.convert(model, 2, tmp_path / "large")
    text = (tmp_path / "large" / "shard_manifest.json").read_text()
    assert "\n" not in text.rstrip("\n") and json.loads(text)["num_shards"] == 2
    assert shardload.verify_dir(tmp_path / "large").ok
    assert torch.equal(
        shardload.load_rank(tmp_path / "large", 1, 2)["t199"], torch.full((4,), 199, dtype=torch.float16)
    )


def _flip_rows_step() -> None:
    """``tests.flip_rows``: a compute step (no box rule) reversing dim 0, registered once."""
    shardload.register("tests.flip_rows", shape=lambda s, d: (tuple(s), d), replace=True)(lambda x: x.flip(0))


def test_bytes_received_for_a_computed_tensor_are_compared_as_bytes(tmp_path: Path) -> None:
    """``group=`` with ``verify`` checks a tensor a compute step makes by computing it again and comparing: by value,
    so a NaN (never equal to itself) refused a correct load, and a zero received with its sign flipped passed. It is
    compared byte for byte."""
    from shardload.engine.integrity import verifier, wrapped
    from shardload.engine.routes import check_received
    from shardload.engine.transfer import reader_for_plan
    from shardload.format.shard_info import ShardInfo
    from shardload.planning.plan import build_plan
    from shardload.sources.verified import IntegrityError

    _flip_rows_step()
    values = np.arange(32, dtype=np.float16).reshape(8, 4)
    values[1, 2], values[2, 3] = np.nan, 0.0  # rank 1 of 2 holds rows 4..7 of the flipped tensor: rows 3..0
    steps = [["tests.flip_rows", [None, None]], ["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]
    info = {"version": 1, "num_shards": None, "params": {"w": steps}}
    model = write_model(tmp_path / "m", {"w": values}, info)
    hash_model(model)
    checkpoint = open_checkpoint(model)
    plan = build_plan(ShardInfo.load(model / "shard_info.json"), checkpoint, 2)
    state = shardload.load_rank(model, 1, 2)
    with wrapped(reader_for_plan(plan.params.values()), verifier(checkpoint, True, str(model))) as reader:
        check_received(plan.params.values(), 1, state, reader)  # the right bytes, NaN and all
        signed = {"w": state["w"].clone()}
        assert signed["w"][1, 3].item() == 0.0
        signed["w"][1, 3] = -0.0
        with pytest.raises(IntegrityError, match="differ from the checkpoint"):
            check_received(plan.params.values(), 1, signed, reader)
