"""A source file that changes while a load reads it (rewritten in place, truncated, replaced) is one clear error:
never a tensor of mixed old and new bytes, never a SIGBUS. The change is made from the load's own progress callback,
so it lands between read jobs, as a concurrent writer's would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardload
from helpers.checkpoints import write_model
from helpers.verified import shard
from shardload.engine.hashing import hash_model
from shardload.errors import ShardloadError
from shardload.format.input_log import REWRITTEN


def _model(directory: Path) -> Path:
    """Many row- and column-split tensors (many read jobs), hashed."""
    rng = np.random.default_rng(3)
    tensors, params = {}, {}
    for i in range(16):
        tensors[f"w{i}.weight"] = rng.standard_normal((256, 1024)).astype(np.float16)
        params[f"w{i}.weight"] = [shard([256, 1024], i % 2)]
    model = write_model(directory, tensors, {"version": 1, "num_shards": None, "params": params})
    hash_model(model)
    return model


def _rewrite(path: Path) -> None:
    """Every byte after the header flipped, in place: same size, same inode."""
    data = bytearray(path.read_bytes())
    (n,) = np.frombuffer(bytes(data[:8]), dtype="<u8")
    body = np.frombuffer(data, dtype=np.uint8, offset=8 + int(n))
    with open(path, "r+b") as f:
        f.seek(8 + int(n))
        f.write((body ^ 0x5A).tobytes())


def _once(change: Callable[[], object]) -> tuple[Callable[[int, int], None], list[int]]:
    """A progress callback that makes ``change`` at its first call (between read jobs), and the calls it saw."""
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        if not calls:
            change()
        calls.append(done)

    return progress, calls


def _refused_as_changed(err: pytest.ExceptionInfo, calls: list[int]) -> None:
    text = str(err.value)
    assert "model.safetensors" in text and "changed while" in text and "\n" not in text, text
    assert calls, "the change was never made"


@pytest.mark.parametrize("strategy", ["auto", "map", "read"])
def test_a_file_rewritten_in_place_during_a_load_is_an_error(tmp_path: Path, strategy: str) -> None:
    model = _model(tmp_path / "m")
    progress, calls = _once(lambda: _rewrite(model / "model.safetensors"))
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 1, 2, progress=progress, read_options=shardload.ReadOptions(strategy=strategy))
    _refused_as_changed(err, calls)
    assert shardload.load_rank(model, 1, 2)  # the file as it is now loads


SCRIPT = textwrap.dedent(
    """
    import os, sys, shardload
    from shardload.errors import ShardloadError
    model, strategy, verify = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    path = os.path.join(model, "model.safetensors")
    size = os.path.getsize(path)
    done = []
    def progress(d, t):
        if not done:
            os.truncate(path, size // 3)
        done.append(d)
    try:
        shardload.load_rank(model, 1, 2, progress=progress, verify=verify,
                            read_options=shardload.ReadOptions(strategy=strategy))
    except ShardloadError as err:
        print("ERROR", err)
        sys.exit(3)
    print("LOADED", len(done))
    """
)


@pytest.mark.parametrize(("strategy", "verify"), [("auto", False), ("map", False), ("auto", True), ("map", True),
                                                  ("read", True)])  # fmt: skip
def test_a_file_truncated_during_a_load_is_an_error_not_a_sigbus(tmp_path: Path, strategy: str, verify: bool) -> None:
    model = _model(tmp_path / "m")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), strategy, "1" if verify else "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-2000:])
    line = done.stdout.strip()
    assert line.startswith("ERROR") and "model.safetensors" in line and "\n" not in line, line


def test_a_file_replaced_during_a_load_is_an_error(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    other = _model(tmp_path / "o")
    _rewrite(other / "model.safetensors")
    calls = []

    def progress(done: int, total: int) -> None:
        if not calls:
            os.replace(other / "model.safetensors", model / "model.safetensors")
        calls.append(done)

    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 0, 2, progress=progress)
    assert "replaced" in str(err.value), err.value
    info = json.loads((model / "shard_info.json").read_text())
    assert info["params"]  # the model is intact apart from its replaced weights


GUARD = textwrap.dedent(
    """
    import mmap, os, sys
    import numpy as np
    from shardload.sources import fault_guard
    from shardload.sources.reader import FileMaps
    path, which = sys.argv[1], sys.argv[2]
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 4096 * 4)  # 4 MiB
    maps = FileMaps()
    guarded = maps.array(path)
    assert guarded is not None and fault_guard.install()
    os.truncate(path, 4096)
    if which == "guarded":
        copy = np.array(guarded[: 1 << 20])  # past the cut: zeros, no signal
        cut = fault_guard.cut(maps._guards[path])
        print("CUT" if cut else "NOT CUT", int(copy[8192:].max()), int(copy[:4096].sum() > 0))
    else:  # a mapping of someone else's: its SIGBUS is not swallowed
        with open(path, "rb") as f:
            other = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate(path, 0)
        print("TOUCH", flush=True)
        print(other[100])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is for Linux")
def test_the_fault_guard_zeroes_its_own_mappings_and_leaves_other_faults_alone(tmp_path: Path) -> None:
    ours = subprocess.run([sys.executable, "-c", GUARD, str(tmp_path / "f"), "guarded"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert ours.returncode == 0 and ours.stdout.split() == ["CUT", "0", "1"], (ours.returncode, ours.stdout,
                                                                              ours.stderr[-1000:])  # fmt: skip
    other = subprocess.run([sys.executable, "-c", GUARD, str(tmp_path / "g"), "other"], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert other.returncode == -7 and other.stdout.strip() == "TOUCH", (other.returncode, other.stdout)  # SIGBUS


RESHARD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import numpy as np
    import shardload
    from shardload.engine import box_reads
    from shardload.errors import ShardloadError
    out = Path(sys.argv[1])
    real = box_reads._copy_mapped
    def cut_then_copy(maps, info, parts, dest):
        if info.name == "col.weight" and not getattr(cut_then_copy, "done", False):
            maps.array(info.file)  # mapped before the cut, as a load in flight holds it
            cut_then_copy.done = True
            os.truncate(info.file, (info.offset + 4095) // 4096 * 4096)
        return real(maps, info, parts, dest)
    box_reads._copy_mapped = cut_then_copy
    try:
        shardload.load_rank(out, 0, 4)
    except ShardloadError as err:
        print("ERROR", err)
        sys.exit(3)
    print("LOADED", getattr(cut_then_copy, "done", False))
    """
)


def test_a_rank_file_cut_while_a_load_reshards_it_is_an_error(tmp_path: Path) -> None:
    """Reading a converted directory for another N copies column slices out of the rank files' mappings: a rank
    file cut meanwhile is an error, never a tensor of zeros (the guard's zero pages) nor a SIGBUS."""
    rng = np.random.default_rng(5)
    tensors = {"col.weight": rng.standard_normal((96, 1024)).astype(np.float16)}  # the last (only) bytes read
    info = {"version": 1, "num_shards": None, "params": {"col.weight": [shard([96, 1024], 1)]}}
    model = write_model(tmp_path / "m", tensors, info)
    shardload.convert(model, 2, tmp_path / "c2")
    done = subprocess.run([sys.executable, "-c", RESHARD, str(tmp_path / "c2")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "changed while it was being read" in done.stdout and "rank-00000-of-00002" in done.stdout, done.stdout


def test_a_file_another_process_has_open_for_writing_is_refused(tmp_path: Path) -> None:
    """A write already under way when the load reads the header changes no stamp after it (the kernel updates the
    times once, as the write starts), so the end-of-load check cannot see it: a file some process holds open for
    writing is refused before any tensor byte is read (the kernel's read lease test), and loads once it is closed."""
    model = _model(tmp_path / "m")
    path = model / "model.safetensors"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import os, sys; fd = os.open({str(path)!r}, os.O_WRONLY); print('open', flush=True); "
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        for verify in (False, True):
            with pytest.raises(ShardloadError) as err:
                shardload.load_rank(model, 1, 2, verify=verify)
            text = str(err.value)
            assert text.startswith(str(path)) and "open for writing" in text and "\n" not in text, text
        with pytest.raises(ShardloadError) as err:  # quantize too (it read such a file to the end before)
            shardload.quantize(model, tmp_path / "q", "int8")
        assert str(err.value).startswith(str(path)) and "open for writing" in str(err.value), err.value
    finally:
        holder.communicate("")
    got = shardload.load_rank(model, 1, 2)
    assert got.keys() == shardload.load_rank(model, 0, 2).keys()
    assert not (tmp_path / "q").exists()
    shardload.quantize(model, tmp_path / "q", "int8")  # once the writer has closed it


def test_a_writer_opening_the_file_during_the_lease_test_does_not_end_the_process(tmp_path: Path) -> None:
    """The lease test holds a read lease for an instant; a writer opening the file in that instant breaks it, and
    the kernel signals the holder (SIGIO by default, which ends a process). The test makes that happen every time,
    in a child: the load goes on (the signal is one ignored by default) and the child lives."""
    model = _model(tmp_path / "m")
    script = textwrap.dedent(f"""
        import errno, fcntl, os
        import shardload
        from shardload.format import input_log
        real = fcntl.fcntl
        def breaking(fd, cmd, arg=0):
            out = real(fd, cmd, arg)
            if cmd == input_log.F_SETLEASE and arg == fcntl.F_RDLCK:  # a writer opens now: the lease breaks
                try:
                    os.close(os.open({str(model / "model.safetensors")!r}, os.O_WRONLY | os.O_NONBLOCK))
                except OSError as err:
                    assert err.errno == errno.EWOULDBLOCK, err
            return out
        fcntl.fcntl = breaking
        try:
            shardload.load_rank({str(model)!r}, 0, 2)
        except shardload.ShardloadError as err:  # on tmpfs the lease is held for the load: the writer is seen
            assert "opened for writing while it was read" in str(err), err
        print("alive")
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "alive", (child.returncode, child.stderr[-2000:])


@pytest.mark.parametrize("kind", ["tvm", "gguf"])
def test_a_data_file_of_another_format_rewritten_during_a_load_is_an_error(tmp_path: Path, kind: str) -> None:
    """The same promise for the files whose headers are not safetensors headers: a TVM cache's record files and a
    GGUF file, rewritten in place (same size) between read jobs, are an error, not a mix of old and new bytes."""
    from helpers import matrix_sources

    single = _model(tmp_path / "m")
    if kind == "tvm":
        pytest.importorskip("tvm")
        model = matrix_sources.write_tvm(single, tmp_path / "t", single / "shard_info.json")
        data = sorted(model.glob("*.bin"))
    else:
        pytest.importorskip("gguf")
        model = matrix_sources.write_gguf(single, tmp_path / "g", single / "shard_info.json").parent
        data = [model / "model.gguf"]
    assert data
    calls = []

    def progress(done: int, total: int) -> None:
        if not calls:
            _flip_after_header(data)  # the last 90% of each file flipped in place
        calls.append(done)

    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 1, 2, progress=progress, read_options=shardload.ReadOptions(threads=1))
    text = str(err.value)
    assert "changed while" in text and "\n" not in text and any(str(p) in text for p in data), text
    assert calls, "the change was never made"


def _flip_after_header(paths: list[Path]) -> None:
    """Every byte after each file's first tenth flipped, in place: same size, same inode."""
    for path in paths:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size // 10)
            body = np.frombuffer(f.read(), dtype=np.uint8)
            f.seek(size // 10)
            f.write((body ^ 0x5A).tobytes())


@pytest.mark.parametrize("kind", ["tvm-presharded", "vllm-save-parts"])
def test_a_split_source_rewritten_while_its_boxes_are_read_is_an_error(tmp_path: Path, kind: str) -> None:
    """A source read as boxes at another N checks every file it read at the end, not only the first of each rank:
    a TVM cache pre-sharded for 2 (no record file was checked) and a vLLM save whose ranks have two parts (only part
    0 was), rewritten in place once every tensor was read, loaded with no error."""
    from helpers import matrix_sources

    shard_info = None
    if kind == "tvm-presharded":
        pytest.importorskip("tvm")
        single = _model(tmp_path / "m")
        shard_info = single / "shard_info.json"
        ranks = [shardload.load_rank(single, r, 2) for r in range(2)]
        model = matrix_sources.write_tvm_presharded(single, tmp_path / "t", shard_info, ranks)
        data = sorted(model.glob("*.bin"))
    else:
        from safetensors.torch import load_file, save_file

        from helpers import tiny_models
        from helpers.vllm_saved import fake_vllm_save

        tiny_models.build("llama_gqa", tmp_path / "m")
        model = fake_vllm_save(tmp_path / "m", 2, tmp_path / "save")
        for r in range(2):  # each rank in two parts, as save_model writes a rank past its max_size
            first = model / f"model-rank-{r}-part-0.safetensors"
            state = load_file(first)
            names = list(state)
            save_file({k: state[k] for k in names[: len(names) // 2]}, first, metadata={"format": "pt"})
            save_file({k: state[k] for k in names[len(names) // 2 :]},
                      model / f"model-rank-{r}-part-1.safetensors", metadata={"format": "pt"})  # fmt: skip
        data = sorted(model.glob("*part-1.safetensors"))
    assert data
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        if done == total:  # every file opened and read: only the end-of-load check can see it
            _flip_after_header(data)
            calls.append(done)

    with pytest.raises(ShardloadError) as err:
        rank, n = (1, 4) if kind == "tvm-presharded" else (0, 1)
        shardload.load_rank(model, rank, n, progress=progress, shard_info=shard_info)
    text = str(err.value)
    assert "changed while" in text and "\n" not in text and any(str(p) in text for p in data), text
    assert calls, "the change was never made"


def test_views_of_a_file_replaced_before_it_is_mapped_are_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view strategy maps each file by its path: one that names another file when it is mapped (a sync tool
    flipping the directory to another copy and back) gave views of that copy's bytes, and the end-of-load check by
    path passed. The mapped file must be the one whose header the load parsed, as for every other read."""
    from shardload.sources import reader as reader_mod

    model = _model(tmp_path / "m")
    other = tmp_path / "other"
    shutil.copytree(model, other)
    _rewrite(other / "model.safetensors")  # same header, other bytes
    original = reader_mod.Mappings._map

    def flipped(self: Any, path: Path) -> Any:
        os.rename(model, tmp_path / "aside")
        os.rename(other, model)
        try:
            return original(self, path)
        finally:
            os.rename(model, other)
            os.rename(tmp_path / "aside", model)

    monkeypatch.setattr(reader_mod.Mappings, "_map", flipped)
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 0, 2, read_options=shardload.ReadOptions(strategy="view"))
    assert "changed while" in str(err.value) and "model.safetensors" in str(err.value), err.value


def _tmpfs_dir(tmp_path: Path) -> Path:
    """A fresh directory on tmpfs (/dev/shm), removed with ``tmp_path``'s test; skips where there is none."""
    from shardload.format import input_log

    shm = Path("/dev/shm")
    if not shm.is_dir() or input_log.file_system(shm.stat().st_dev) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    import tempfile

    return Path(tempfile.mkdtemp(dir=shm, prefix=f"shardload-{tmp_path.name[:40]}-"))


def _mapped_writer(path: Path) -> None:
    """Open ``path`` for writing and flip its bytes after the first tenth through a shared mapping, reading each page
    first: on tmpfs no timestamp changes."""
    size = path.stat().st_size
    data = np.memmap(path, mode="r+", dtype=np.uint8)
    data[size // 10 :] ^= 0x5A
    data.flush()
    del data


@pytest.mark.parametrize("strategy", ["auto", "read"])
def test_a_tmpfs_file_rewritten_through_a_mapping_during_a_load_is_an_error(tmp_path: Path, strategy: str) -> None:
    """On tmpfs a write through a shared mapping changes no time, so a writer that opened the file after the load's
    lease test mixed new bytes into what the load returned, with no error. The load now holds its lease until it
    ends: the writer's open breaks it (and waits), and the load refuses the file."""
    import threading

    shm = _tmpfs_dir(tmp_path)
    try:
        model = _model(shm / "m")
        target = model / "model.safetensors"
        writer = threading.Thread(target=_mapped_writer, args=(target,))
        calls: list[int] = []

        def progress(done: int, total: int) -> None:
            if not calls:
                writer.start()
                deadline = time.monotonic() + 10
                while writer.is_alive() and "BREAKER" not in Path("/proc/locks").read_text():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)  # the writer has written (no lease), or waits on the load's lease
            calls.append(done)

        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(model, 1, 2, progress=progress,
                                read_options=shardload.ReadOptions(strategy=strategy, threads=1))  # fmt: skip
        writer.join(60)
        assert not writer.is_alive()
        text = str(err.value)
        assert "changed while" in text and str(target) in text and "\n" not in text, text
        assert shardload.load_rank(model, 1, 2)  # the file as it is now loads
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_writer_on_tmpfs_never_waits_for_the_load(tmp_path: Path) -> None:
    """The lease a load holds on a tmpfs file made a writer's open wait for the load to end, or 45 s: forever for a
    writer in the load's own thread (a progress callback), and for a child forked during the load after it ended.
    The writer goes on at once, the load refuses the file, and SIGURG is as it was."""
    import signal

    shm = _tmpfs_dir(tmp_path)
    children: list[int] = []
    try:
        model = _model(shm / "m")
        target = model / "model.safetensors"
        took: list[float] = []

        def progress(done: int, total: int) -> None:
            if not took:
                pid = os.fork()
                if pid == 0:  # a child forked mid-load (a worker pool), alive after the load
                    time.sleep(60)
                    os._exit(0)
                children.append(pid)
                start = time.monotonic()
                with open(target, "r+b"):  # the load's own thread opens its file for writing
                    pass
                took.append(time.monotonic() - start)

        before = signal.getsignal(signal.SIGURG)
        with pytest.raises(ShardloadError, match="opened for writing while it was read"):
            shardload.load_rank(model, 1, 2, progress=progress, read_options=shardload.ReadOptions(threads=1))
        assert took and took[0] < 2, took  # not the child's 60 s, nor the kernel's 45
        assert signal.getsignal(signal.SIGURG) == before
        shardload.load_rank(model, 1, 2, progress=progress)  # a clean load: its lease let go at its end
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)  # a lease still held somewhere: EAGAIN
        os.close(fd)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(shm, ignore_errors=True)


def test_a_gguf_header_rewritten_on_tmpfs_is_read_again_by_the_next_load(tmp_path: Path) -> None:
    """GGUF headers are kept for the process by the file's identity, which a write through a mapping on tmpfs does
    not change: a second load returned tensors under the names the file had before (two names swapped)."""
    import mmap

    gguf = pytest.importorskip("gguf")
    shm = _tmpfs_dir(tmp_path)
    try:
        path = shm / "model.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tensor("a.weight", np.full((64, 64), 1.0, np.float32))
        writer.add_tensor("b.weight", np.full((64, 64), 2.0, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        info = {"version": 1, "num_shards": None, "params": {}}
        first = shardload.load_rank(path, 0, 1, shard_info=info)
        assert first["a.weight"][0, 0].item() == 1.0
        fd = os.open(path, os.O_RDWR)
        mapped = mmap.mmap(fd, 0)
        os.close(fd)
        head = mapped[:4096]
        a, b = head.index(b"a.weight"), head.index(b"b.weight")
        mapped[a : a + 1], mapped[b : b + 1] = b"b", b"a"
        mapped.close()
        second = shardload.load_rank(path, 0, 1, shard_info=info)
        assert second["a.weight"][0, 0].item() == 2.0 and second["b.weight"][0, 0].item() == 1.0
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("fstype", ["nfs4", "cifs", "ext4"])
def test_the_lease_test_is_trusted_only_on_local_file_systems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str
) -> None:
    """NFSv4 without a read delegation and SMB without an oplock refuse every read lease (EAGAIN) whether or not a
    writer exists: there the lease test cannot tell, and a file nobody writes loads. On a local file system the same
    answer means a writer holds the file open, and the load is refused."""
    import errno
    import fcntl

    from shardload.format import input_log

    model = _model(tmp_path / "m")
    real = fcntl.fcntl

    def no_lease(fd: int, cmd: int, arg: int = 0) -> object:
        if cmd == input_log.F_SETLEASE and arg == fcntl.F_RDLCK:  # what nfs4_add_lease / cifs_setlease answer
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", no_lease)
    monkeypatch.setattr(input_log, "file_system", lambda dev: fstype)
    if fstype == "ext4":
        with pytest.raises(ShardloadError, match="open for writing"):
            shardload.load_rank(model, 0, 2)
    else:
        assert shardload.load_rank(model, 0, 2).keys()


def test_the_file_system_of_a_file_is_read_from_the_mount_table(tmp_path: Path) -> None:
    from shardload.format import input_log

    path = tmp_path / "f"
    path.write_bytes(b"x")
    kind = input_log.file_system(path.stat().st_dev)
    assert kind is not None and kind in open("/proc/self/mountinfo").read(), kind


@pytest.mark.parametrize("change", ["rewritten", "replaced"])
def test_a_file_changed_while_it_is_hashed_is_an_error_and_no_record_is_written(tmp_path: Path, change: str) -> None:
    """``shardload hash`` of a file that changes while it is hashed (rewritten in place, or replaced by a new file of
    the same size) refuses in one line and writes no record: a record of old and new bytes would match neither, and
    every verified load of either would then fail against it."""
    model = _model(tmp_path / "m")
    target = model / "model.safetensors"
    record = tmp_path / "record"

    def replace() -> None:
        new = tmp_path / "new.safetensors"
        new.write_bytes(target.read_bytes())
        _rewrite(new)
        os.replace(new, target)

    progress, calls = _once((lambda: _rewrite(target)) if change == "rewritten" else replace)
    with pytest.raises(ShardloadError) as err:
        hash_model(model, record, threads=1, progress=progress)
    _refused_as_changed(err, calls)
    assert not record.exists()
    assert hash_model(model, record).path == record  # the file as it is now hashes


def test_a_file_changed_while_it_is_verified_is_an_error(tmp_path: Path) -> None:
    """``shardload verify MODEL`` of a file rewritten while it is checked refuses in one line (its verdict would be
    about neither version)."""
    from shardload.engine.verify_source import verify_source

    model = _model(tmp_path / "m")
    progress, calls = _once(lambda: _rewrite(model / "model.safetensors"))
    with pytest.raises(ShardloadError) as err:
        verify_source(model, threads=1, progress=progress)
    _refused_as_changed(err, calls)


@pytest.mark.parametrize("change", ["touch", "chmod"])
def test_a_file_only_touched_is_refused_without_claiming_a_rewrite(tmp_path: Path, change: str) -> None:
    """Times or permissions changed during a load, no byte written: still refused (a write and a touch look alike to
    the identity check), but the line says what was seen, not "rewritten in place"."""
    model = _model(tmp_path / "m")
    path = model / "model.safetensors"
    calls = []

    def progress(done: int, total: int) -> None:
        if not calls:
            if change == "touch":
                st = path.stat()
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            else:
                path.chmod(0o600)
        calls.append(done)

    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 1, 2, progress=progress)
    want = (
        "rewritten in place, or its modification time set, or replaced by a file given the same inode number"
        if change == "touch"
        else "its change time moved"
    )
    assert f"changed while it was being read ({want}" in str(err.value), err.value


@pytest.mark.parametrize("opener", ["read", "map"])
def test_a_reader_opens_only_the_file_whose_header_the_load_parsed(tmp_path: Path, opener: str) -> None:
    """A file replaced (by a rename) between its header's parse and the reader's first open is refused as that open
    happens, before a byte is read or mapped (the end-of-load check would see it too, after reading at the old
    offsets)."""
    from shardload.format import input_log
    from shardload.sources.reader import FileMaps, Reader

    path = tmp_path / "w.safetensors"
    path.write_bytes(b"old bytes")
    with input_log.recording():
        input_log.stamp(path)  # as a header parse records it
        (tmp_path / "new").write_bytes(b"new bytes")
        os.replace(tmp_path / "new", path)
        with pytest.raises(ShardloadError) as err:
            if opener == "read":
                Reader()._fd(path)
            else:
                FileMaps().bytes(path)
    assert "changed while it was being read (replaced)" in str(err.value), err.value


def _rewrite_keeping_mtime(path: Path) -> None:
    """:func:`_rewrite`, then the old modification time put back (as ``touch -r``, ``rsync -t`` or ``tar x`` leave a
    file): only the change time tells."""
    st = path.stat()
    _rewrite(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _writers(tmp_path: Path) -> dict[str, Callable[..., object]]:
    """Every command that reads a local source to write an output, as a callable of (model, out)."""
    from shardload.integrations.vllm.writer import convert_vllm

    return {
        "convert": lambda model, out: shardload.convert(model, 2, out),
        "convert-vllm": lambda model, out: convert_vllm(model, 2, out),
        "quantize": lambda model, out: shardload.quantize(model, out, "int8"),
    }


@pytest.mark.parametrize("writer", ["convert", "convert-vllm", "quantize"])
def test_a_source_rewritten_with_its_mtime_put_back_is_never_published(
    tmp_path: Path, writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writing command whose source is rewritten in place while it reads (its modification time then put back)
    refuses in one line and publishes nothing: the change time, which no tool sets back, tells, as it does for a
    load. Old code published ranks of old and new bytes (convert) and weights quantized from both (quantize)."""
    from shardload.sources.reader import Reader

    model = _model(tmp_path / "m")
    path = model / "model.safetensors"
    out = tmp_path / "out"
    calls: list[int] = []
    real = Reader.read_runs

    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:  # every read the writers make, quantize's included
        if len(calls) == 3:
            _rewrite_keeping_mtime(path)
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Reader, "read_runs", hooked)
    with pytest.raises(ShardloadError) as err:
        _writers(tmp_path)[writer](model, out)
    assert len(calls) > 3, "the change was never made"
    text = str(err.value)
    assert str(path) in text and "changed while" in text and "\n" not in text, text
    assert not out.exists()  # (another writer thread may see the file before its mtime is put back: either line)


def test_a_change_of_the_change_time_alone_is_named_for_what_it_can_be() -> None:
    """Only the change time moved (a write with its modification time put back, or chmod, chown, a link): the line
    says both (old code claimed only the permissions, owner or links changed)."""
    from shardload.format.input_log import _how_changed

    before = (1, 2, 3, 4, 5)
    how = _how_changed(before, (1, 2, 3, 4, 6))
    assert "modification time put back" in how and "permissions, owner or links" in how, how
    assert _how_changed(before, (1, 2, 3, 9, 6)) == REWRITTEN


def test_a_header_read_twice_says_what_changed_between_the_reads(tmp_path: Path) -> None:
    """A file whose header a load parses twice (a converted directory's rank file: once when checked, once when
    read) and that was only touched in between is refused for what was seen, not as "different bytes"; one whose
    bytes differ is refused as that."""
    from shardload.format import input_log

    path = tmp_path / "rank.safetensors"
    path.write_bytes(b"header")
    first = path.stat()
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns + 10**9))
    with input_log.recording(), pytest.raises(ShardloadError) as err:
        input_log.note(path, b"header", first)
        input_log.note(path, b"header", path.stat())
    assert (
        "(rewritten in place, or its modification time set, or replaced by a file given the same inode number)"
        in str(err.value)
    ), err.value
    with input_log.recording(), pytest.raises(ShardloadError, match="read twice, with different bytes"):
        input_log.note(path, b"header", first)
        input_log.note(path, b"HEADER", first)


@pytest.mark.parametrize("left", [0, 3])
def test_a_file_cut_before_its_first_8_bytes_are_read_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left: int
) -> None:
    """A writer cutting the file between the header reader's size check and its read of the first 8 bytes made the
    load raise a bare ``struct.error``; it is one error naming the file."""
    from shardload.format import input_log

    model = _model(tmp_path / "m")
    path = model / "model.safetensors"
    real = input_log.no_writer

    def cut(at: Path, fd: int) -> None:  # runs between the fstat and the first read
        real(at, fd)
        os.truncate(path, left)

    monkeypatch.setattr(input_log, "no_writer", cut)
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 0, 2)
    text = str(err.value)
    assert str(path) in text and "shrank" in text and "\n" not in text, text


def test_the_gguf_header_cache_is_safe_from_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads loading GGUF files evicted the same header from the process's cache at once: a bare KeyError or
    'dictionary changed size during iteration' out of load_rank (reviewer L, 4 threads on tmpfs). Every thread now
    gets its file's header; eviction on every call and a tiny switch interval make the old race near certain."""
    import threading

    gguf = pytest.importorskip("gguf")
    from shardload.sources import gguf as gguf_source

    paths = []
    for i in range(3):
        path = tmp_path / f"m{i}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tensor(f"t{i}.weight", np.full((4, 4), float(i), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    monkeypatch.setattr(gguf_source, "_HEADERS_KEPT", 1)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for j in range(400):
                i = (j + k) % 3
                assert [e.name for e in gguf_source._header(paths[i]).tensors] == [f"t{i}.weight"]
        except BaseException as err:  # any escape is the finding
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, [repr(e) for e in errors[:3]]
