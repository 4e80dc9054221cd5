"""Every command that writes (convert, quantize, example) goes through one guard: OUT never destroys a user's
files or a source, never leaks files from outside the model directory, is cleaned up after failures, signals
and killed runs, and is never published from a source that changed while it was read."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import shardload
from helpers.disks import DiskFull
from shardload.cli.example import write_example
from shardload.cli.main import main
from shardload.engine import quantize as quantize_module
from shardload.errors import CheckpointError, FormatError, ShardloadError
from shardload.sources.checkpoint import read_config


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links as their targets) with its sha256: to show nothing was touched."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(*args: str) -> tuple[int, str]:
    """Run the CLI; the exit code and stderr (which must be one line when the command fails)."""
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output, result.output
    if result.exit_code:
        assert len(result.stderr.splitlines()) == 1, result.stderr
    return result.exit_code, result.stderr


WRITERS: dict[str, Callable[[Path, Path], list[str]]] = {
    "convert": lambda model, out: ["convert", str(model), "-n", "2", "-o", str(out), "-q"],
    "quantize": lambda model, out: ["quantize", str(model), "-o", str(out), "--scheme", "int8"],
    "example": lambda model, out: ["example", str(out)],
}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_example(tmp_path / "models" / "m")


@pytest.mark.parametrize("command", list(WRITERS))
def test_overwrite_replaces_only_empty_dirs_and_earlier_outputs(command: str, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = WRITERS[command](model, out)
    code, err = run(*argv)
    assert code == 1 and "output directory exists" in err
    code, err = run(*argv, "--overwrite")
    assert code == 1 and "is not an output of shardload" in err and "nothing here was deleted" in err
    assert snapshot(out) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    (out / "notes.txt").unlink()
    assert run(*argv, "--overwrite")[0] == 0  # an empty directory
    first = snapshot(out)
    assert ".shardload-output" in first
    assert run(*argv, "--overwrite")[0] == 0  # an earlier output of the same command
    for other in WRITERS:  # and one of any other command
        assert run(*WRITERS[other](model, out), "--overwrite")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"], "no temporary entries left"
    (tmp_path / "file").write_text("x")
    code, err = run(*WRITERS[command](model, tmp_path / "file"), "--overwrite")
    assert code == 1 and "is not a directory shardload wrote" in err and (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_out_may_not_touch_a_source(command: str, model: Path, tmp_path: Path) -> None:
    before = snapshot(tmp_path / "models")
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    cases = {
        model: "is the source",
        model.parent: "contains the source",
        tmp_path: "contains the source",
        model / "sub" / "out": "lies inside the source directory",
        link: "is the source",
    }
    if command == "convert":
        cases[model / "model.safetensors"] = "is the source"  # a single-file input's own file
    for out, reason in cases.items():
        for extra in ([], ["--overwrite"]):
            code, err = run(*WRITERS[command](model, out), *extra)
            assert code == 1 and reason in err, (out, err)
    assert snapshot(tmp_path / "models") == before
    code, err = run("convert", str(model / "model.safetensors"), "-n", "2", "-o", str(model / "model.safetensors"))
    assert code == 1 and "is the source" in err and snapshot(tmp_path / "models") == before


def _hf_cache(tmp_path: Path, model: Path) -> Path:
    """A Hugging Face hub cache layout: snapshots/REV/* are links into blobs/."""
    repo = tmp_path / "hub" / "models--org--m"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.startswith("."):
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            (blobs / digest).write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(Path("../../blobs") / digest)
    return snap


def test_out_may_not_hold_a_hugging_face_cache_blob(model: Path, tmp_path: Path) -> None:
    snap = _hf_cache(tmp_path, model)
    before = snapshot(tmp_path / "hub")
    repo = snap.parent.parent
    for out in (repo / "blobs", repo, tmp_path / "hub"):
        for command in ("convert", "quantize"):
            code, err = run(*WRITERS[command](snap, out), "--overwrite")
            assert code == 1 and "contains the source" in err, (command, out, err)
    assert snapshot(tmp_path / "hub") == before
    assert run(*WRITERS["convert"](snap, tmp_path / "ok"))[0] == 0  # loading from the cache still works
    assert shardload.verify_dir(tmp_path / "ok", source=snap).ok


def test_only_companion_files_travel(model: Path, tmp_path: Path) -> None:
    companions = ["README.md", "LICENSE", "tokenizer.json", "chat_template.jinja", "qwen.tiktoken"]
    strangers = ["pytorch_model.bin", "model.pt", "flax_model.msgpack", "tf_model.h5", "notes.txt", "secrets.env"]
    for name in companions + strangers:
        (model / name).write_text(name)
    shardload.convert(model, 2, tmp_path / "c")
    shardload.quantize(model, tmp_path / "q", "int8")
    for out in (tmp_path / "c", tmp_path / "q"):
        names = {p.name for p in out.iterdir()}
        assert set(companions) <= names and not set(strangers) & names, names
        assert all((out / n).read_text() == n for n in companions)
    single = tmp_path / "single"
    single.mkdir()
    (single / "w.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    (single / "diary.txt").write_text("private")
    shardload.convert(single / "w.safetensors", 1, tmp_path / "s", shard_info=model / "shard_info.json")
    assert "diary.txt" not in {p.name for p in (tmp_path / "s").iterdir()}


@pytest.mark.parametrize("command", ["convert", "quantize"])
@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_no_link_out_of_the_model_directory_is_read(command: str, name: str, model: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text('{"token": "hunter2"}')
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(secret)
    code, err = run(*WRITERS[command](model, tmp_path / "out"))
    assert code == 1 and "resolves outside the model directory" in err and name in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_a_fifo_companion_is_refused_not_waited_on(command: str, model: Path, tmp_path: Path) -> None:
    os.mkfifo(model / "tokenizer.json")
    code, err = run(*WRITERS[command](model, tmp_path / "out"))
    assert code == 1 and "is not a regular file" in err and not (tmp_path / "out").exists()


def test_small_json_files_are_regular_and_capped(model: Path, tmp_path: Path) -> None:
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json: .*not a regular file"):
        read_config(model)
    (model / "config.json").unlink()
    with open(model / "config.json", "wb") as fh:
        fh.truncate(17 << 20)
    with pytest.raises(CheckpointError, match="over the 16777216 byte limit"):
        read_config(model)
    os.mkfifo(tmp_path / "shard_info.json")
    with pytest.raises(FormatError, match="shard_info is not a regular file"):
        shardload.ShardInfo.load(tmp_path / "shard_info.json")


def test_quantize_refuses_a_stored_tensor_with_a_computed_name(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    model = tmp_path / "m"
    model.mkdir()
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    save_file({"a.weight": w, "a.weight_scale": np.ones((64, 1), np.float16)}, str(model / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"stored tensor 'a\.weight_scale' has the name quantize gives"):
        shardload.quantize(model, tmp_path / "q", "int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_quantize_shares_converts_staging(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    for token in ("111-dead", "222-dead"):  # leftovers of killed runs of either command
        (tmp_path / f".out.shardload-tmp-{token}").mkdir()
        (tmp_path / f".out.shardload-tmp-{token}.lock").touch()
    shardload.quantize(model, out, "int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]
    live = tmp_path / ".out.shardload-tmp-333-live.lock"
    fd = os.open(live, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for write in (lambda: shardload.quantize(model, out, "int8", overwrite=True),
                      lambda: shardload.convert(model, 2, out, overwrite=True)):  # fmt: skip
            with pytest.raises(ShardloadError, match=r"another shardload run \(pid 333\) is writing this output"):
                write()
    finally:
        os.close(fd)
        live.unlink()

    monkeypatch.setattr(shardload.engine.writer, "create_file", DiskFull(1000))
    before = snapshot(out)
    code, err = run(*WRITERS["quantize"](model, out), "--overwrite")
    assert code == 1 and "cannot write model.safetensors: No space left on device [ENOSPC]" in err
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_sigterm_and_sighup_clean_up(
    command: str, signum: int, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    real = quantize_module._finite if command == "quantize" else shardload.engine.convert.write_rank_files

    def hit(*args: object, **kwargs: object) -> object:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        os.kill(os.getpid(), signum)  # delivered to this (main) thread before the next bytecode
        return real(*args, **kwargs)

    if command == "quantize":
        monkeypatch.setattr(quantize_module, "_finite", hit)
    else:
        monkeypatch.setattr(shardload.engine.convert, "write_rank_files", hit)
    before = signal.getsignal(signum)
    result = CliRunner().invoke(main, WRITERS[command](model, tmp_path / "out"))
    removed = "was not written (the partial output was removed)"
    said = f"terminated by {signal.Signals(signum).name}: {tmp_path / 'out'} {removed}\n"
    assert result.exit_code == 128 + signum and result.stderr == said, result.stderr
    assert any(n.startswith(".out.shardload-tmp-") for n in seen[0]), "the signal came mid-write"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
    assert signal.getsignal(signum) == before, "the previous handler is restored"


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_a_signal_after_the_output_is_in_place_says_it_is_complete(
    command: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop signal that came after OUT was put in place (while the table or the plan hint was printed) said 'OUT
    was not written (the partial output was removed)', of a complete output that verifies."""
    from shardload.engine import output

    real = output.StagingDir.publish

    def publish_then_stop(self: output.StagingDir) -> None:
        real(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(output.StagingDir, "publish", publish_then_stop)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, WRITERS[command](model, out))
    said = f"terminated by SIGTERM: {out} was written and is complete (stopped after it was put in place)\n"
    assert result.exit_code == 143 and result.stderr == said, result.stderr
    assert (out / "model.safetensors").exists() if command == "quantize" else shardload.verify_dir(out).ok


STOP_WHILE_IMPORTING = """
import builtins, os, signal, sys
real, stop = builtins.__import__, getattr(signal, sys.argv[1])
def hook(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 1 and name == "main":  # the script imports the command line: the first fifth of a second
        os.kill(os.getpid(), stop)
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = hook
sys.argv = ["shardload", *sys.argv[2:]]
from shardload.cli.entry import run
run()
"""

STOP_AT_EXIT = """
import atexit, os, signal, sys
stop = getattr(signal, sys.argv[1])
atexit.register(lambda: os.kill(os.getpid(), stop))  # while the interpreter shuts down
sys.argv = ["shardload", *sys.argv[2:]]
from shardload.cli.entry import run
run()
"""


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_the_script_answers_a_stop_before_and_after_its_command(example_dir: Path, signame: str) -> None:
    """A stop signal while the script still imported its command line printed a KeyboardInterrupt traceback (or
    nothing, for SIGTERM) and no ``--json`` document; one after the command had printed its result, while the
    interpreter shut down, ended the process by the signal though stdout said ``"ok": true``. Before: one line, the
    failure document, exit 128 + the signal; after: the command's own status."""
    args = [sys.executable, "-c", STOP_WHILE_IMPORTING, signame, "validate", str(example_dir / "shard_info.json"),
            "--json"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    code = 128 + getattr(signal, signame)
    assert done.returncode == code, (done.returncode, done.stderr)
    doc = json.loads(done.stdout)
    assert doc["ok"] is False and doc["exit_code"] == code and "nothing was done" in doc["error"]["message"], doc
    (line,) = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and "nothing was done" in line, done.stderr
    args = [sys.executable, "-c", STOP_AT_EXIT, signame, "validate", str(example_dir / "shard_info.json"), "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True, (done.returncode, done.stderr)


def test_a_signal_while_the_old_output_is_removed_says_the_new_one_is_complete(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --overwrite the old output's tree is removed after the new one is in place (seconds for a large model);
    a signal then said the new output 'was not written'."""
    from shardload.engine import output

    out = tmp_path / "out"
    assert CliRunner().invoke(main, WRITERS["convert"](model, out)).exit_code == 0
    real = output.remove

    def remove_then_stop(path: Path) -> None:
        real(path)
        if path.name.endswith(".old"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(output, "remove", remove_then_stop)
    result = CliRunner().invoke(main, [*WRITERS["convert"](model, out), "--overwrite"])
    assert result.exit_code == 143 and "was written and is complete" in result.stderr, result.stderr
    assert shardload.verify_dir(out).ok


def test_weights_on_a_file_system_without_modes_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without modes (vfat, exfat) refuses chmod: the weights, written whole, were a write error."""

    from shardload.engine import writer

    def refused(path: object, mode: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(writer.os, "chmod", refused)
    assert CliRunner().invoke(main, ["example", str(tmp_path / "m")]).exit_code == 0
    assert shardload.load_rank(tmp_path / "m", 0, 2)


def test_a_source_that_changes_while_read_is_not_published(model: Path, tmp_path: Path) -> None:
    weights = model / "model.safetensors"

    def touch(done: int, name: str) -> None:
        os.utime(weights, ns=(1, 1))

    with pytest.raises(CheckpointError, match=r"model\.safetensors: changed while it was being read"):
        shardload.convert(model, 2, tmp_path / "out", progress=touch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


@pytest.mark.parametrize("with_source", [False, True])
def test_verify_dir_reports_progress_to_the_end(model: Path, tmp_path: Path, with_source: bool) -> None:
    """``verify_dir(progress=)`` is told the bytes checked after each file (and, with a source, after each rank
    compared), rising to its total: the output's bytes, twice over with a source. The command draws it on a
    terminal (old code showed nothing while it hashed or reloaded every rank)."""
    out = tmp_path / "out"
    shardload.convert(model, 4, out)
    nbytes = sum(f.stat().st_size for f in out.iterdir() if f.name != "shard_manifest.json")
    seen: list[tuple[int, int]] = []
    report = shardload.verify_dir(out, source=model if with_source else None, progress=lambda d, t: seen.append((d, t)))
    assert report.ok, report.problems
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and len(seen) >= 4 + 4 * with_source
    listed = sum(e["size"] for e in json.loads((out / "shard_manifest.json").read_text())["files"])
    assert listed <= nbytes and seen[-1] == (listed * (1 + with_source),) * 2


def test_verify_against_the_source(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardload.convert(model, 4, out)
    code = CliRunner().invoke(main, ["verify", str(out), "--source", str(model)])
    assert code.exit_code == 0 and "every rank equals" in code.output
    weights = model / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as fh:  # change one byte of the first tensor, in place
        fh.seek(header)
        byte = fh.read(1)
        fh.seek(header)
        fh.write(bytes([byte[0] ^ 0xFF]))
    result = CliRunner().invoke(main, ["verify", str(out), "--source", str(model)])
    assert result.exit_code == 1 and "differs from the source's bytes" in result.output
    report = shardload.verify_dir(out, source=model)
    assert not report.ok and shardload.verify_dir(out).ok  # the output itself is intact
    json.dumps([p.message for p in report.problems])


@pytest.mark.parametrize("command", ["example", "example-multi", "quantize"])
def test_weights_written_by_safetensors_get_the_mode_a_file_gets(tmp_path: Path, command: str) -> None:
    """safetensors creates its files 0600: the weights `example` and `quantize` wrote were unreadable to a server
    running as another user, beside companions and convert's rank files of 0644 (under umask 022)."""
    import os
    import stat

    from click.testing import CliRunner

    from shardload.cli.main import main

    old = os.umask(0o022)
    try:
        model = tmp_path / "model"
        args = ["example", str(model)] + (["--multi-file"] if command == "example-multi" else [])
        assert CliRunner().invoke(main, args).exit_code == 0
        out = model
        if command == "quantize":
            out = tmp_path / "q"
            result = CliRunner().invoke(main, ["quantize", str(model), "-o", str(out), "--scheme", "int8"])
            assert result.exit_code == 0, result.output
        weights = sorted(out.glob("*.safetensors"))
        assert weights and all(stat.S_IMODE(w.stat().st_mode) == 0o644 for w in weights), [
            (w.name, oct(w.stat().st_mode)) for w in weights
        ]
    finally:
        os.umask(old)


def test_example_over_its_file_size_limit_is_one_write_error(tmp_path: Path) -> None:
    """`shardload example` past RLIMIT_FSIZE (a full disk alike) printed an internal-error line naming
    safetensors' SafetensorError; convert and quantize print the write error."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from shardload.cli.main import main\n"
        f"sys.argv = ['shardload', 'example', {str(tmp_path / 'm')!r}]\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "cannot write" in line and "internal error" not in line, line
    assert not (tmp_path / "m").exists()


def test_a_process_that_converts_again_and_again_keeps_a_bounded_record(model: Path, tmp_path: Path) -> None:
    """Every convert in a process appended its output to a list only the command line cleared: a server calling
    the API grew it for ever (reviewer L). The last few are kept; the newest is still known."""
    from shardload.engine import output

    for i in range(40):
        shardload.convert(model, 2, tmp_path / f"out{i}")
    assert len(output.published) <= 16 and output.published[-1] == tmp_path / "out39"
