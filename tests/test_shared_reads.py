"""load_rank(share_reads=True): the ranks of a process group split the reading, each stored byte read once, and
exchange over collectives. The schedule is checked in-process (every member simulated, element for element against
plain load_rank), then real processes run it on gloo: torchrun with dp x tp, pp x tp and plain tp groups, and
directly spawned groups in which a rank dies, hangs, or planned another shard_info."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers import tiny_models
from helpers.checkpoints import write_model
from helpers.rendezvous import STORE_ENV, new_store
from shardload.cli.main import main
from shardload.engine.routes import progress_for as _rank_progress
from shardload.planning.group_reads import GroupReads, choose_chunk, file_bases, slot_needs, strided
from shardload.planning.mesh import Mesh, stage_plans
from shardload.planning.plan import build_plan, resolve_shard_info
from shardload.planning.runs import Runs
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader

WORKER = Path(__file__).resolve().parent / "shared_reads_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 with one KV head (replicated on every tp rank), qkv biases, tied embeddings and a vocabulary of 250
    rows, planned with vLLM's padding (at N=4 the last rank's rows end in zeros no stored byte maps to)."""
    model_dir = tmp_path_factory.mktemp("shared") / "qwen2"
    tiny_models.build("qwen2", model_dir, num_key_value_heads=1, vocab_size=250)
    planned = CliRunner().invoke(main, ["plan", str(model_dir), "-n", "4", "--vocab-padding", "vllm"])
    assert planned.exit_code == 0, planned.output
    return model_dir


@pytest.fixture(scope="module")
def compute_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model with compute steps (shard_shape, shard_group_index: read whole, then the steps run), a column slice and
    a replicated bias."""
    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.standard_normal((8, 12)).astype("float32"),
        "a.bias": rng.standard_normal(12).astype("float32"),
        "q.weight_shape": np.array([8, 12], dtype=np.int64),
        "q.g_idx": np.array([0, 0, 0, 1, 1, 1, 1, 3, 4, 4, 5, 5, 6, 7, 7, 7], dtype=np.int32),  # ranks differ
    }
    info = {"version": 1, "num_shards": None, "params": {
        "a.weight": [["shard_funcs.shard_dim", [["num_shards", 8, "12 // num_shards"], "float32"], 1, "num_shards"]],
        "q.weight_shape": [["shard_funcs.shard_shape", [["num_shards", 2], "int64"], 1, "num_shards"]],
        "q.g_idx": [["shard_funcs.shard_group_index", [["num_shards", "16 // num_shards"], "int32"], 8, "num_shards"]],
    }}  # fmt: skip
    return write_model(tmp_path_factory.mktemp("compute") / "model", tensors, info)


def simulate(model: Path, mesh: Mesh, chunk: int, members: list[int]) -> list[dict[str, torch.Tensor]]:
    """Run the schedule of a group of ``members`` (global ranks of ``mesh``) in one process: every member reads its
    chunks, packs, the all_to_all is done by hand, every member unpacks; returns each member's tensors."""
    checkpoint = open_checkpoint(model)
    plan = build_plan(resolve_shard_info(checkpoint, None), checkpoint, mesh.tp)
    stages = [plan] if mesh.pp == 1 else stage_plans(plan, mesh)
    slots = [(mesh.coord(r).pp, mesh.coord(r).tp) for r in members]
    bases = file_bases(plan.params.values())
    needs = {s: slot_needs(list(stages[s[0]].params.values()), s[1], bases) for s in set(slots)}
    schedule = GroupReads.build(slots, needs, chunk)
    size = len(members)
    read_total = 0
    covered = np.zeros(schedule.union.total, dtype=np.int64)
    results: list[list[torch.Tensor]] = []
    for slot in slots:
        own = needs[slot]
        results.append([  # zeros: the padding no run writes
            torch.zeros(p.source.nbytes if w else p.rank_nbytes, dtype=torch.uint8)
            for p, w in zip(own.params, own.whole, strict=True)
        ])  # fmt: skip
    unpack = [schedule.unpack(s) for s in slots]
    with Reader() as reader:
        for k in range(schedule.rounds):
            sent = []
            for i in range(size):
                lo, hi = schedule.chunk_range(k, i)
                covered[lo:hi] += 1
                buf = torch.zeros(schedule.chunk, dtype=torch.uint8)
                for path, runs in schedule.reads(k, i, bases):
                    reader.read_runs(path, runs.src, runs.length, runs.buf, runs.dst, [buf])
                    read_total += runs.nbytes
                sizes, pack = schedule.pack(k, i)
                out = torch.zeros(sum(sizes), dtype=torch.uint8)
                apply(buf, pack, [out])
                sent.append(list(out.split(sizes)))
            for m, slot in enumerate(slots):
                got = torch.cat([sent[i][m] for i in range(size)])
                assert [len(sent[i][m]) for i in range(size)] == schedule.splits(k, slot)
                apply(got, unpack[m][k], results[m])
    assert read_total == schedule.union.total and bool((covered == 1).all()), "each needed byte read exactly once"
    out = []
    for m, slot in enumerate(slots):
        own = needs[slot]
        state = {}
        for p, w, raw in zip(own.params, own.whole, results[m], strict=True):
            from shardload.engine.steps import run_steps
            from shardload.sources.dtypes import to_torch

            if w:
                full = raw.view(to_torch(p.source.dtype)).view(p.source.shape)
                state[p.name] = run_steps(p, full)[slot[1]].contiguous()
            else:
                state[p.name] = raw.view(to_torch(p.dtype)).view(p.shape)
        out.append(state)
    return out


def apply(src: torch.Tensor, runs: Runs, dests: list[torch.Tensor]) -> None:
    """The copies of ``runs`` through :func:`strided`, one strided copy per group, as the executor does."""
    from shardload.engine.exchange import _copy

    _copy(src, strided(runs), dests)


@pytest.mark.parametrize(
    ("mesh", "chunk", "members"),
    [
        ("dp=2,tp=2", 4096, [0, 1, 2, 3]),
        ("pp=2,tp=2", 1000, [0, 1, 2, 3]),
        ("tp=4", 1 << 20, [0, 1, 2, 3]),
        ("tp=4", 777, [3, 1]),  # a subgroup, members out of order, an odd chunk size
        ("dp=2,pp=2,tp=2", 5000, [7, 0, 5, 2, 1]),
    ],
)
def test_schedule_rebuilds_every_member_exactly(qwen_dir: Path, mesh: str, chunk: int, members: list[int]) -> None:
    layout = Mesh.parse(mesh)
    got = simulate(qwen_dir, layout, chunk, members)
    for rank, state in zip(members, got, strict=True):
        want = shardload.load_rank(qwen_dir, rank=rank, mesh=layout)
        assert state.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(state[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_strided_copies_cover_runs_exactly() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = []
        while len(rows) < rng.integers(1, 20):
            n, s0, d0 = int(rng.integers(1, 6)), int(rng.integers(0, 64)), int(rng.integers(0, 64))
            ds, dd, length = int(rng.integers(-1, 3)) * 8, int(rng.integers(1, 3)) * 4, int(rng.integers(1, 4))
            rows += [(s0 + i * ds, length, int(rng.integers(0, 2)), d0 + i * dd) for i in range(n)]
        a = np.array([r for r in rows if r[0] >= 0], dtype=np.int64).reshape(-1, 4)
        runs = Runs(a[:, 0], a[:, 1], a[:, 2], a[:, 3])
        c = strided(runs)
        assert int(c.count.sum()) == len(runs) and bool((c.src_step >= 0).all()) and bool((c.dst_step >= 0).all())
        expanded = sorted(
            (int(c.src[k] + i * c.src_step[k]), int(c.length[k]), int(c.buf[k]), int(c.dst[k] + i * c.dst_step[k]))
            for k in range(len(c))
            for i in range(int(c.count[k]))
        )
        assert expanded == sorted(map(tuple, a.tolist()))
    column = np.arange(1000, dtype=np.int64)
    assert len(strided(Runs(column * 100, column * 0 + 10, column * 0, column * 10))) == 1, "a column slice: 1 copy"


def test_chunks_fit_the_memory_bound_and_leave_several_rounds() -> None:
    mib = 1 << 20
    assert choose_chunk(140_000 * mib, 64, (256 * mib) // 130, 8, mib) == (256 * mib) // 130 // 4096 * 4096
    assert choose_chunk(256 * mib, 4, 25 * mib, 8, mib) == 8 * mib  # 8 rounds of 4 chunks
    assert choose_chunk(3 * mib, 4, 25 * mib, 8, mib) == mib  # never below 1 MiB ...
    assert choose_chunk(3 * mib, 4, 4096, 8, mib) == 4096  # ... unless the memory bound says so


def test_share_reads_needs_a_process_group(example_dir: Path) -> None:
    with pytest.raises(shardload.ShardloadError, match=r"initialised torch\.distributed"):
        shardload.load_rank(example_dir, 0, 2, share_reads=True)


@pytest.fixture
def group_of_one(tmp_path: Path) -> Any:
    """An initialised gloo process group of this process alone, destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_read_options_are_refused_with_share_reads(example_dir: Path, group_of_one: Any) -> None:
    """share_reads reads the group's chunks as exact runs: read options of a rank reading for itself are refused."""
    with pytest.raises(shardload.ShardloadError, match="read_options applies to a rank reading for itself") as err:
        shardload.load_rank(example_dir, share_reads=group_of_one, read_options=shardload.ReadOptions(strategy="read"))
    assert "\n" not in str(err.value)


def test_read_options_at_their_defaults_are_taken_with_a_group(example_dir: Path, group_of_one: Any) -> None:
    """A server passing its default ReadOptions() with a group loads, as with none: only options that change how a
    rank reads for itself are refused."""
    state = shardload.load_rank(example_dir, group=group_of_one, read_options=shardload.ReadOptions())
    want = shardload.load_rank(example_dir, 0, 1)
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)


def test_a_group_of_one_reads_and_draws_progress(
    example_dir: Path, group_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    import shardload.engine.exchange as exchange
    from shardload.sources.reader import count_reads

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(exchange, "EXCHANGE_BYTES", 4 * 65536)  # 64 KiB chunks: many rounds
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with count_reads() as seen:
        state = shardload.load_rank(example_dir, share_reads=group_of_one, progress=True)  # rank 0 of 1: the group's
    want = shardload.load_rank(example_dir, 0, 1)
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert seen.bytes == sum(t.nbytes for t in open_checkpoint(example_dir).tensors.values())
    line = screen.getvalue()
    assert line.startswith("\rloading rank 0: 1/") and line.endswith("exchange rounds (100%)\n"), line
    with pytest.raises(shardload.ShardloadError, match="exclude each other"):
        shardload.load_rank(example_dir, share_reads=True, mmap=True)
    with pytest.raises(shardload.ShardloadError, match=r"must be True, False or a torch\.distributed ProcessGroup"):
        shardload.load_rank(example_dir, share_reads="group")


def test_progress_draws_on_the_first_rank_of_a_node(example_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    import shardload.engine.transfer as transfer

    monkeypatch.setattr(transfer, "JOB_BYTES", 4096)
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = shardload.load_rank(example_dir, 1, 2, progress=True)
    line = screen.getvalue()
    assert line.startswith("\rloading rank 1: 1/") and line.endswith("read jobs (100%)\n"), line
    want = shardload.load_rank(example_dir, 1, 2)
    assert all(torch.equal(state[k], want[k]) for k in want)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _rank_progress(True, "x", "read jobs") is None, "only the node's first rank draws"
    seen: list[tuple[int, int]] = []
    shardload.load_rank(example_dir, 0, 2, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == list(range(1, len(seen) + 1))


@pytest.mark.slow
def test_torchrun_groups_read_each_byte_once(
    example_multi_dir: Path, qwen_dir: Path, compute_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 processes on gloo: dp=2 x tp=2 (a two-file checkpoint, 4 KiB chunks: hundreds of rounds), pp=2 x tp=2 (as a
    torch DeviceMesh) and
    a plain tp=4 group (one KV head replicated on every rank), compute steps, and the dp replicas of a converted
    directory, and a checkpoint in S3. Each rank compares with plain load_rank element for element (in the worker);
    the group reads each stored byte once, where plain loads read more."""
    converted = tmp_path / "tp2"
    shardload.convert(example_multi_dir, 2, converted)
    s3 = object_store(tmp_path, monkeypatch)
    cases = [
        {"model": str(example_multi_dir), "mesh": "dp=2,tp=2", "chunk": 4096},
        {"model": str(qwen_dir), "mesh": "device:pp=2,tp=2", "chunk": 3000},
        {"model": str(qwen_dir), "mesh": None, "chunk": None},
        {"model": str(compute_dir), "mesh": "dp=2,tp=2", "chunk": None},
        {"model": str(converted), "mesh": "dp=2,tp=2", "chunk": 8192},
        {"model": str(example_multi_dir), "mesh": "dp=2,tp=2", "chunk": 4096, "groups": [[0, 2], [1, 3]]},
    ]
    if s3 is not None:  # the two-file checkpoint from S3 (moto on loopback), compared with the local copy
        cases.insert(-1, {"model": s3.upload_dir(example_multi_dir, "shared"), "reference": str(example_multi_dir),
                          "mesh": "dp=2,tp=2", "chunk": 65536})  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(WORKER), json.dumps(cases)]  # fmt: skip
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # with the S3 endpoint's settings
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    finally:
        if s3 is not None:
            s3.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["mesh"] for r in results] == [c["mesh"] for c in cases]
    *whole, pairs = results
    # subgroups of the two dp replicas of each tp rank: each pair reads its bytes once, half what both replicas read
    # (plus each rank's fingerprint of its copy of the files)
    assert 2 * (pairs["shared"] - pairs["fingerprint"]) == pairs["plain"] and pairs["shared"] > pairs["stored"], pairs
    for r in whole:
        # every stored byte read by exactly one rank (1.00x), and each rank's sampled blocks: a few KiB per tensor
        assert r["shared"] == r["stored"] + r["fingerprint"], r
        assert 0 < r["fingerprint"] <= 4 * 64 * 4096 * 2, r  # 4 ranks, at most 64 blocks of 4 KiB in each of 2 files
        assert r["plain"] > r["stored"], r  # every rank reading for itself reads replicated bytes again
    assert results[0]["plain"] >= 2 * results[0]["stored"]  # two dp replicas
    assert results[0]["rounds"] > 100 and results[2]["rounds"] == 1  # 4 KiB chunks; the default: one round


def object_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A started S3 server (moto on loopback) with this process's environment pointed at it, or None where boto3 or
    moto is missing (never in CI, whose test extra installs both)."""
    if os.environ.get("CI") != "true":
        try:
            import boto3  # noqa: F401
            import moto.server  # noqa: F401
        except ImportError:
            return None
    from helpers.s3 import S3, use_endpoint

    server = S3()
    use_endpoint(monkeypatch, server.url, tmp_path)
    return server


def spawn(cases: list[dict], env: dict[str, str], ranks: int = 4) -> list[subprocess.Popen[str]]:
    """Start ``ranks`` worker processes of one gloo group directly (no torchrun, which would kill the others as soon
    as one fails)."""
    path = new_store()
    procs = []
    for r in range(ranks):
        rank_env = {**ENV, **env, STORE_ENV: path, "RANK": str(r), "WORLD_SIZE": str(ranks),
                    "LOCAL_RANK": str(r)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(cases)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return procs


LIVES_ON = {"SHARDLOAD_TEST_LIVE_ON": "20", "SHARDLOAD_TEST_TIMEOUT": "60"}
"""A rank whose load fails lives on for 20 s (a server that caught the error); the others' timeout is 60 s."""


@pytest.fixture(scope="module")
def failed_groups(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str]]]:
    """Three groups of 4 processes run at once (they mostly wait): in one rank 1 dies after its first chunk, in one
    it stops for 14 s (the others' timeout is 6 s: a healthy rank on a loaded 2-core machine is well within it), in
    one rank 3 loads another shard_info. Each process's exit code and output, by group."""
    other = tmp_path_factory.mktemp("other") / "model"
    shutil.copytree(example_dir, other)
    (other / "shard_info.json").write_text(json.dumps({"version": 1, "num_shards": None, "params": {}}))
    case = {"model": str(example_dir), "mesh": "dp=2,tp=2", "chunk": 4096}
    converted = tmp_path_factory.mktemp("converted") / "tp2"
    shardload.convert(example_dir, 2, converted)
    missing = shutil.copytree(converted, converted.parent / "missing")
    (missing / "rank-00000-of-00002.safetensors").unlink()  # rank 1's copy: it cannot plan rank 0's part
    partly = {"model": str(converted), "mesh": "dp=2,tp=2", "chunk": 4096, "model_of_rank": {"1": str(missing)}}
    unplannable = tmp_path_factory.mktemp("unplannable") / "model"  # rank 1's copy: its plan fails before any exchange
    shutil.copytree(example_dir, unplannable)
    info = json.loads((unplannable / "shard_info.json").read_text())
    info["params"]["no.such.weight"] = next(iter(info["params"].values()))
    (unplannable / "shard_info.json").write_text(json.dumps(info))
    groups = {
        "dies": spawn([case], {"SHARDLOAD_TEST_DIE": "1:1", "SHARDLOAD_TEST_TIMEOUT": "60"}),
        "raises": spawn([case], {"SHARDLOAD_TEST_FAIL": "raises:1:1", **LIVES_ON}),
        "unplanned": spawn([partly], {"SHARDLOAD_TEST_FAIL": "1", **LIVES_ON}),
        "progress": spawn([case], {"SHARDLOAD_TEST_FAIL": "progress:1", **LIVES_ON}),
        "argument": spawn([case], {"SHARDLOAD_TEST_FAIL": "device:1", **LIVES_ON}),
        "prefails": spawn(
            [{**case, "model_of_rank": {"1": str(unplannable)}}], {"SHARDLOAD_TEST_FAIL": "1", **LIVES_ON}
        ),
        "hangs": spawn([case], {"SHARDLOAD_TEST_HANG": "1:1", "SHARDLOAD_TEST_TIMEOUT": "6"}),
        "differs": spawn([{**case, "model_of_rank": {"3": str(other)}}], {"SHARDLOAD_TEST_FAIL": "1"}),
    }
    deadline = time.monotonic() + 120
    out: dict[str, list[tuple[int, str]]] = {}
    try:
        for name, procs in groups.items():
            out[name] = []
            for p in procs:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out[name].append((p.returncode, text))
    finally:
        for procs in groups.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return out


def failure_line(text: str) -> str:
    """The one ``FAILED rank R after S s: MESSAGE`` line a worker printed."""
    return next(ln for ln in text.splitlines() if ln.startswith("FAILED"))


def seconds(line: str) -> float:
    """How long the failed load took, from its ``FAILED`` line."""
    return float(line.split(" after ")[1].split(" s:")[0])


@pytest.mark.slow
def test_a_rank_that_dies_mid_exchange_fails_the_others_at_once(failed_groups: dict) -> None:
    results = failed_groups["dies"]
    assert results[1][0] == 3, results[1][1]
    for rc, text in (results[0], results[2], results[3]):
        assert rc == 1, text
        line = failure_line(text)
        # rank 1 dies while it reads round 2's chunk (during round 1's exchange, or just after it)
        assert re.search(r"shared reads: the exchange failed in exchange round [12] of \d+: another rank of the "
                         r"group died or failed \(.+\)$", line), line  # fmt: skip
        assert seconds(line) < 30, "noticed at once, well before the 60 s timeout"


def test_a_rank_that_hangs_fails_the_others_after_the_timeout(failed_groups: dict) -> None:
    """Rank 1 stops for 14 s after its first chunk; the others give up after the 6 s timeout (under gloo their
    processes then exit once the hung rank is gone)."""
    for rank in (0, 2, 3):
        rc, text = failed_groups["hangs"][rank]
        line = failure_line(text)
        assert rc == 1 and "no answer from the group within 6 s in exchange round 2 of" in line, line
        assert 5.5 < seconds(line) < 13.5, line  # the timeout, not rank 1 coming back


@pytest.mark.parametrize(
    ("group", "own"),
    [("raises", "cannot read: Input/output error"), ("unplanned", "rank-00000-of-00002.safetensors: is missing"),
     ("progress", "the caller's progress callback failed"), ("prefails", "no.such.weight"),
     ("argument", "device 'nodevice' is not a device torch knows")],
)  # fmt: skip
def test_a_rank_that_fails_but_lives_on_fails_the_others_at_once(failed_groups: dict, group: str, own: str) -> None:
    """Rank 1 fails with an error of its own (a read of round 2's chunk; a rank file its copy lacks, while it plans
    the group's reads; a shard_info its copy holds that does not plan, before it joins the group) and its process
    lives on, as a server's that catches the error: it left the exchange (or never joined it), and the others
    waited out the whole timeout, then blamed a dead or hung rank, naming no model."""
    rc, text = failed_groups[group][1]
    assert rc == 1 and own in failure_line(text), text
    for rank in (0, 2, 3):
        rc, text = failed_groups[group][rank]
        line = failure_line(text)
        assert rc == 1 and "shared reads: rank 1 failed" in line and "its own error says why" in line, line
        assert line.split(": ", 1)[1].startswith("/"), line  # the model comes first
        assert seconds(line) < 15, "at once, before the failed rank's process is gone (20 s) or the timeout (60 s)"


def test_ranks_that_planned_differently_are_refused_up_front(failed_groups: dict) -> None:
    for rc, text in failed_groups["differs"]:
        line = failure_line(text)
        assert rc == 1 and "rank 3 planned a different checkpoint, shard_info or mesh than rank 0" in line, text


def fine_tune(source: Path, copy: Path, name: str) -> Path:
    """A copy of checkpoint ``source`` at ``copy`` in which tensor ``name`` holds other values (every element's sign
    flipped in place): the same files, names, shapes, dtypes and offsets, so every header is byte for byte the
    same, as with two fine-tunes of one base model that change only some tensors."""
    shutil.copytree(source, copy)
    info = open_checkpoint(copy).tensors[name]
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        data = np.frombuffer(f.read(info.nbytes), dtype=np.uint8).copy()
        data[1::2] ^= 0x80  # float16, little endian: the sign bit of each element
        f.seek(info.offset)
        f.write(data.tobytes())
    original = open_checkpoint(source).tensors[name].file.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    assert info.file.read_bytes()[:header] == original[:header]  # the same header, byte for byte
    return copy


def test_ranks_holding_other_weights_under_the_same_headers_are_refused(
    example_multi_dir: Path, tmp_path: Path
) -> None:
    """Two ranks, two dp replicas: rank 1 holds a fine-tune of rank 0's model (one tensor of the second file changed,
    every header the same). Each would read half of the bytes and receive the other half from a different model;
    instead both fail with one line naming the file, the tensor and why, and return nothing."""
    changed = "model.layers.1.self_attn.o_proj.weight"
    other = fine_tune(example_multi_dir, tmp_path / "finetune", changed)
    case = {"model": str(example_multi_dir), "mesh": "dp=2", "chunk": 4096, "model_of_rank": {"1": str(other)}}
    procs = spawn([case], {"SHARDLOAD_TEST_FAIL": "1"}, ranks=2)
    results = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=120)
            results.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (rc, text) in enumerate(results):
        assert rc == 1 and "FAILED" in text, f"rank {rank} loaded a mix of two models: {text}"
        line = failure_line(text)
        own = (other if rank == 1 else example_multi_dir) / "model-00002-of-00002.safetensors"
        assert f": {own}: {changed}: " in line, line
        assert "shared reads refused: rank 1's copy of this file holds other bytes than rank 0's in this tensor" in line
        assert line.endswith("nothing was exchanged"), line
        assert "RESULT" not in text and "finished without error" not in text, text


def test_a_rank_that_cannot_read_its_copy_fails_the_group_at_once(example_multi_dir: Path) -> None:
    """Rank 1's reads fail while it fingerprints its files: it fails with its own error, rank 0 at once (not after
    the exchange timeout) with one line saying which rank could not read."""
    case = {"model": str(example_multi_dir), "mesh": "dp=2", "chunk": 4096}
    procs = spawn([case], {"SHARDLOAD_TEST_FAIL": "unreadable:1", "SHARDLOAD_TEST_TIMEOUT": "60"}, ranks=2)
    results = [p.communicate(timeout=120)[0] for p in procs]
    zero, one = (failure_line(text) for text in results)
    said = f"{example_multi_dir}: shared reads refused: rank 1 could not fingerprint its copy of the checkpoint "
    assert zero.endswith(said + "(its own error says why: a file it cannot read, or bytes its integrity record "
                         "refuses); nothing was exchanged"), zero  # fmt: skip
    assert "model-0000" in one and one.endswith(".safetensors: cannot read: Input/output error"), one
    assert seconds(zero) < 30 and all(p.returncode == 1 for p in procs)


def test_a_copy_rewritten_during_the_exchange_fails_every_rank(example_multi_dir: Path, tmp_path: Path) -> None:
    """Rank 0 rewrites its copy of a weight file in place after the first exchange round (rank 1 has a copy of its
    own, which does not change): rank 0 has read and sent a mix of old and new bytes, so it fails naming the file,
    and rank 1 fails with it, though its own copy is intact (returned, its state dict held the mix)."""
    mine, copy = tmp_path / "mine", tmp_path / "copy"  # never the session's fixture: rank 0 rewrites its copy
    shutil.copytree(example_multi_dir, mine)
    shutil.copytree(example_multi_dir, copy)
    case = {"model": str(mine), "mesh": "dp=2", "chunk": 4096, "model_of_rank": {"1": str(copy)}}
    procs = spawn([case], {"SHARDLOAD_TEST_FAIL": "rewrite:0", "SHARDLOAD_TEST_TIMEOUT": "60"}, ranks=2)
    results = [p.communicate(timeout=120)[0] for p in procs]
    zero, one = (failure_line(text) for text in results)
    said = "model-00001-of-00002.safetensors: changed while it was being read (rewritten in place, or its modification"
    assert said in zero, zero
    assert one.endswith(f"{copy}: shared reads: rank 0 read a file that changed during the exchange (its own error "
                        "names it); nothing was returned"), one  # fmt: skip
    assert all(p.returncode == 1 for p in procs)


def test_a_group_of_one_refuses_a_file_rewritten_during_its_rounds(
    example_dir: Path, tmp_path: Path, group_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardload.engine.exchange as exchange

    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    monkeypatch.setattr(exchange, "EXCHANGE_BYTES", 4 * 65536)  # 64 KiB chunks: many rounds
    done: list[int] = []

    def progress(k: int, total: int) -> None:
        if not done:
            data = bytearray((model / "model.safetensors").read_bytes())
            (n,) = struct.unpack("<Q", data[:8])
            with open(model / "model.safetensors", "r+b") as f:
                f.seek(8 + n)
                f.write(bytes(b ^ 0x5A for b in data[8 + n :]))
        done.append(k)

    with pytest.raises(shardload.ShardloadError) as err:
        shardload.load_rank(model, group=group_of_one, progress=progress)
    assert done and "changed while it was being read (rewritten in place" in str(err.value), err.value


def test_a_file_replaced_after_its_header_was_parsed_is_refused(
    example_dir: Path, tmp_path: Path, group_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model file is replaced (by a rename) with one whose header is longer, after the plan was made from the old
    header and before the first read: read at the old offsets, every tensor would be shifted garbage."""
    import shardload.engine.exchange as exchange

    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    from safetensors.numpy import load_file, save_file

    save_file(load_file(model / "model.safetensors"), tmp_path / "new", metadata={"format": "pt", "note": "x" * 99})
    real = exchange.choose_chunk

    def replaced_then_chosen(*args: Any) -> int:
        os.replace(tmp_path / "new", model / "model.safetensors")
        return real(*args)

    monkeypatch.setattr(exchange, "choose_chunk", replaced_then_chosen)
    with pytest.raises(shardload.ShardloadError) as err:
        shardload.load_rank(model, group=group_of_one)
    assert "model.safetensors: changed while it was being read (replaced)" in str(err.value), err.value


def test_identical_copies_at_other_paths_and_mtimes_load(example_multi_dir: Path, tmp_path: Path) -> None:
    """Two ranks under torchrun, each with its own copy of the model (another directory, other modification times,
    as on two nodes): the content check passes and each rank's shard equals plain load_rank of the original."""
    copy = tmp_path / "node2" / "model"
    shutil.copytree(example_multi_dir, copy)
    for f in copy.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))  # 2001: unlike the original's
    assert all(f.stat().st_mtime != (example_multi_dir / f.name).stat().st_mtime for f in copy.iterdir())
    case = {"model": str(example_multi_dir), "model_of_rank": {"1": str(copy)}, "reference": str(example_multi_dir),
            "mesh": "dp=2", "chunk": 4096}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), json.dumps([case])]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(ln.split(" ", 1)[1]) for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(results) == 1 and results[0]["rounds"] > 1, results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_groups_exchange_on_the_device(example_multi_dir: Path, qwen_dir: Path) -> None:
    """NCCL with one rank per GPU (the exchange's buffers on the rank's GPU), and gloo carrying CPU buffers for 4 ranks
    whose tensors live on the GPUs; both element for element against plain load_rank onto the same device."""
    gpus = torch.cuda.device_count()
    env = {**ENV, "SHARDLOAD_TEST_DEVICE": "cuda"}
    env.pop("CUDA_VISIBLE_DEVICES")
    runs = [
        ("nccl", gpus, [{"model": str(example_multi_dir), "mesh": f"tp={gpus}", "chunk": 4096},
                        {"model": str(qwen_dir), "mesh": f"dp={gpus}", "chunk": 3000}]),
        ("gloo", 4, [{"model": str(example_multi_dir), "mesh": "dp=2,tp=2", "chunk": 4096}]),
    ]  # fmt: skip
    for backend, ranks, cases in runs:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   str(WORKER), json.dumps(cases)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                              env={**env, "SHARDLOAD_TEST_BACKEND": backend})  # fmt: skip
        assert done.returncode == 0, backend + done.stdout[-3000:] + done.stderr[-3000:]
        results = [json.loads(ln.split(" ", 1)[1]) for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        assert len(results) == len(cases), (backend, results)
        assert all(r["shared"] == r["stored"] + r["fingerprint"] for r in results), (backend, results)
