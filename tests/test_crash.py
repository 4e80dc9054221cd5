"""Crash safety of convert: SIGKILL at many points of a real conversion (in a child process), disk
full (an injected ENOSPC, and a real small tmpfs where the machine allows mounting one), failing
fsync, and leftovers of killed runs. Afterwards the target is absent or complete and verified, a
rerun succeeds, and no temporary entry is left or can be mistaken for output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers.disks import DiskFull
from shardload.cli.main import main
from shardload.errors import CheckpointError, ShardloadError
from shardload.sources.checkpoint import TMP_MARKER, open_checkpoint

WRITER = sys.modules["shardload.engine.writer"]  # every output file of a convert is created there
HERE = Path(__file__).resolve().parent
Child = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    """A helper process that forks a converting child per job and SIGKILLs it where the job says."""
    logs = tmp_path_factory.mktemp("crash-child")
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_child.py"), str(logs)], cwd=HERE,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None

    def run(job: dict[str, Any]) -> dict[str, Any]:
        proc.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the crash helper died"
        return json.loads(line)

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def reference(example_dir: Path) -> dict[int, list[dict[str, torch.Tensor]]]:
    return {n: shardload.load(example_dir, n, devices=["cpu"] * n) for n in (2, 4)}


def leftovers(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if TMP_MARKER in p.name]


def check_after_crash(out: Path, reference: dict[int, list[dict[str, torch.Tensor]]]) -> str:
    """The target is absent, or complete, verified and equal to a reference; temporaries are never loadable."""
    for entry in leftovers(out.parent):
        with pytest.raises(CheckpointError, match="temporary entry"):
            open_checkpoint(entry)
    assert {p.name for p in out.parent.iterdir()} - {out.name} == {p.name for p in leftovers(out.parent)}
    if not out.exists():
        return "absent"
    report = shardload.verify_dir(out)
    assert report.ok, [str(p) for p in report.problems]
    n = report.num_shards
    for r in range(n):
        got = shardload.load_rank(out, r, n, verify=True)
        assert got.keys() == reference[n][r].keys()
        assert all(torch.equal(got[k], reference[n][r][k]) for k in got)
    return f"complete (N={n})"


def rerun_and_check(example_dir: Path, out: Path, reference: dict[int, list[dict[str, torch.Tensor]]]) -> None:
    shardload.convert(example_dir, 2, out, overwrite=out.exists())
    assert check_after_crash(out, reference) == "complete (N=2)"
    assert leftovers(out.parent) == [], "a rerun removes what killed runs left"


def pick(events: list[list[str]], want: Callable[[list[str]], bool], which: int = 0) -> int:
    """The 1-based number of the ``which``-th event matching ``want``."""
    hits = [i + 1 for i, e in enumerate(events) if want(e)]
    return hits[which]


def test_sigkill_at_many_points(
    child: Child, example_dir: Path, tmp_path: Path, reference: dict[int, list[dict[str, torch.Tensor]]]
) -> None:
    def job(name: str, overwrite: bool, fsync: bool | None = True, **kill: Any) -> dict[str, Any]:
        """A fresh output is fsynced only on request: the kill points of a durable run are the superset."""
        out = tmp_path / name / "out"
        out.parent.mkdir()
        if overwrite:
            shardload.convert(example_dir, 4, out)  # an older complete output, for another N
        return {"model": str(example_dir), "out": str(out), "num_shards": 2, "overwrite": overwrite, "fsync": fsync,
                **kill}  # fmt: skip

    fresh = child(job("count-fresh", False))
    over = child(job("count-over", True, fsync=None))  # replacing an output fsyncs by default
    plain = child(job("count-plain", False, fsync=None))
    assert fresh["exit_code"] == 0 and over["exit_code"] == 0 and plain["exit_code"] == 0, "unkilled runs complete"
    ev, ev_over = fresh["events"], over["events"]
    assert any(e[0] == "fsync" for e in ev_over) and not any(e[0] == "fsync" for e in plain["events"])
    rank_writes = [i + 1 for i, e in enumerate(ev) if e[0] == "write" and e[1].startswith("rank-")]
    replace = pick(ev, lambda e: e[0] == "replace")
    points: dict[str, dict[str, Any]] = {
        "first write": {"kill_at": 1},
        "rank data 1/3": {"kill_at": rank_writes[len(rank_writes) // 3]},
        "rank data 2/3": {"kill_at": rank_writes[2 * len(rank_writes) // 3]},
        "rank file fsync": {"kill_at": pick(ev, lambda e: e[0] == "fsync")},
        "copying config": {"kill_at": pick(ev, lambda e: e[1:] == ["config.json"])},
        "writing manifest": {"kill_at": pick(ev, lambda e: e[1:] == ["shard_manifest.json"])},
        "fsync of temp dir": {"kill_at": replace - 1},
        "rename into place": {"kill_at": replace},
        "final fsync": {"kill_at": replace + 1},
    }
    over_points = {
        "overwrite: mid write": {"kill_at": rank_writes[len(rank_writes) // 2]},
        "overwrite: move old aside": {"kill_at": pick(ev_over, lambda e: e[0] == "replace")},
        "overwrite: rename new in": {"kill_at": pick(ev_over, lambda e: e[0] == "replace", 1)},
        "overwrite: remove old": {"kill_at": pick(ev_over, lambda e: e[0] == "rmtree")},
    }
    rng = random.Random(6)
    for i in range(3):
        points[f"random event {i}"] = {"kill_at": rng.randint(1, len(ev))}
    for frac in (0.25, 0.5, 0.75):
        points[f"timer {frac:.0%}"] = {"kill_after_s": fresh["seconds"] * frac}
    plain_ev = plain["events"]
    points["no fsync: rename into place"] = {"fsync": None, "kill_at": pick(plain_ev, lambda e: e[0] == "replace")}
    points["no fsync: writing manifest"] = {
        "fsync": None,
        "kill_at": pick(plain_ev, lambda e: e[1:] == ["shard_manifest.json"]),
    }
    outcomes = {}
    for i, (name, kill) in enumerate([*points.items(), *over_points.items()]):
        opts = dict(kill)
        fsync = opts.pop("fsync", None if name.startswith("overwrite") else True)
        result = child(job(f"kill{i}", name.startswith("overwrite"), fsync, **opts))
        out = Path(result["out"])
        if "kill_at" in kill:
            assert result["killed"], f"{name}: the child was not killed"
        state = check_after_crash(out, reference)
        outcomes[name] = (("killed" if result["killed"] else "finished"), state, len(leftovers(out.parent)))
        rerun_and_check(example_dir, out, reference)
    print(f"\n{len(outcomes)} kill points, events in a run: {len(ev)} fresh / {len(ev_over)} overwrite")
    for name, outcome in outcomes.items():
        print(f"  {name:28s} {outcome[0]:8s} target {outcome[1]:16s} temp entries left: {outcome[2]}")
    assert sum(o[0] == "killed" for o in outcomes.values()) >= 14
    assert {o[1] for o in outcomes.values()} >= {"absent", "complete (N=2)", "complete (N=4)"}


def test_a_live_convert_is_not_disturbed(example_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    lock = tmp_path / f".out{TMP_MARKER}424242-beef.lock"
    (tmp_path / f".out{TMP_MARKER}424242-beef").mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running convert holds it
    try:
        with pytest.raises(ShardloadError, match=r"another shardload run \(pid 424242\) is writing this output"):
            shardload.convert(example_dir, 2, out)
        assert not out.exists() and (tmp_path / f".out{TMP_MARKER}424242-beef").is_dir()
    finally:
        os.close(fd)  # the "other convert" dies: its lock goes with it
    shardload.convert(example_dir, 2, out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_disk_full_leaves_nothing(example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = DiskFull(1 << 60)
    monkeypatch.setattr(WRITER, "create_file", counting)
    shardload.convert(example_dir, 2, tmp_path / "probe")
    total = counting.written
    old = tmp_path / "old"
    shardload.convert(example_dir, 4, old)
    for budget in (0, 100, total // 3, total // 2, total - 2000, total - 10):
        monkeypatch.setattr(WRITER, "create_file", DiskFull(budget))
        out = tmp_path / f"full{budget}"
        with pytest.raises(ShardloadError, match=r"No space left on device \[ENOSPC\]; nothing was put in place"):
            shardload.convert(example_dir, 2, out)
        assert not out.exists()
        monkeypatch.setattr(WRITER, "create_file", DiskFull(budget))
        result = CliRunner().invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(old), "--overwrite"])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.stderr.startswith(f"error: {old}: cannot write ") and len(result.stderr.splitlines()) == 1
        assert shardload.verify_dir(old).ok and shardload.verify_dir(old).num_shards == 4, "the old output is intact"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "probe"]


def test_failing_fsync_is_a_clear_error(example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    written = r"(rank-0000[01]-of-00002\.safetensors|\.shardload-output)"
    with pytest.raises(ShardloadError, match=rf"cannot write {written}: .* \[EIO\]"):
        shardload.convert(example_dir, 2, tmp_path / "out", fsync=True)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_fsync_policy(example_dir: Path, tmp_path: Path, fsync_calls: list[int]) -> None:
    """A new output is fsynced only on request; one that replaces an existing output always is."""
    synced = fsync_calls
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), "-q"]).exit_code == 0
    assert synced == []
    args = ["convert", str(example_dir), "-n", "4", "-o", str(out), "-q", "--overwrite"]
    assert runner.invoke(main, args).exit_code == 0
    files = len(json.loads((out / "shard_manifest.json").read_text())["files"])
    # every file (the output marker among them), the manifest, the new directory, the parent
    assert len(synced) == files + 1 + 2
    synced.clear()
    assert runner.invoke(main, [*args, "--no-fsync"]).exit_code == 0
    assert synced == []
    assert runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(tmp_path / "b"), "-q", "--fsync"]
                         ).exit_code == 0  # fmt: skip
    assert len(synced) == files - 2 + 1 + 2
    assert shardload.verify_dir(out).ok and shardload.verify_dir(tmp_path / "b").ok


def _can_mount_tmpfs(path: Path) -> bool:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    except OSError:  # no mount command
        return False
    return done.returncode == 0


def test_real_disk_full_on_a_small_tmpfs(example_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        result = CliRunner().invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(disk / "out")])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert "No space left on device [ENOSPC]" in result.stderr
        assert list(disk.iterdir()) == [], "nothing left on the full disk"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_output_left_aside_by_a_killed_overwrite_is_only_replaced_durably(
    example_dir: Path, tmp_path: Path, fsync_calls: list[int]
) -> None:
    """A killed --overwrite between its two renames leaves OUT absent and the old output aside: the next plain
    convert replaces that complete output, so it flushes its own first."""
    out = tmp_path / "out"
    shardload.convert(example_dir, 4, out)
    aside = tmp_path / f".out{TMP_MARKER}999-dead.old"
    os.replace(out, aside)
    synced = fsync_calls
    synced.clear()  # only the second convert counts
    shardload.convert(example_dir, 2, out)
    files = len(json.loads((out / "shard_manifest.json").read_text())["files"])
    # every file (the output marker among them), the manifest, the new directory, the parent
    assert len(synced) == files + 1 + 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and shardload.verify_dir(out).ok


def test_output_left_aside_survives_until_a_new_one_is_in_place(example_dir: Path, tmp_path: Path) -> None:
    """The old output a killed --overwrite left aside (OUT absent) is the only complete output there is: a next run
    that fails (or is killed) before publishing keeps it; it is removed once the new output is in place. It was
    removed as the next run started, so two killed runs in a row lost both outputs."""
    out = tmp_path / "out"
    shardload.convert(example_dir, 4, out)
    aside = tmp_path / f".out{TMP_MARKER}999-dead.old"
    os.replace(out, aside)

    def fails(done: int, name: str) -> None:
        raise ShardloadError("stopped on purpose")

    with pytest.raises(ShardloadError, match="stopped on purpose"):
        shardload.convert(example_dir, 2, out, progress=fails)
    assert (aside / "shard_manifest.json").is_file(), sorted(p.name for p in tmp_path.iterdir())
    os.replace(aside, tmp_path / "kept")
    assert shardload.verify_dir(tmp_path / "kept").ok  # the old output, whole
    os.replace(tmp_path / "kept", aside)
    shardload.convert(example_dir, 2, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and shardload.verify_dir(out).ok


def test_output_that_appears_while_converting_is_not_replaced(example_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"

    def appear(done: int, name: str) -> None:
        out.mkdir(exist_ok=True)
        (out / "mine.txt").write_text("keep")

    with pytest.raises(ShardloadError, match="appeared while writing; nothing was replaced"):
        shardload.convert(example_dir, 2, out, progress=appear)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
