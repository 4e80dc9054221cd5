"""Concurrency: 8 threads calling load_rank for different ranks of one model in one process give the
same tensors as sequential calls, for a source checkpoint and for a converted directory."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import shardload

N = 8


def _in_threads(model: Path, verify: bool) -> list[dict[str, torch.Tensor]]:
    start = threading.Barrier(N)

    def one(rank: int) -> dict[str, torch.Tensor]:
        start.wait()  # all threads start loading at the same moment
        return shardload.load_rank(model, rank, N, verify=verify)

    with ThreadPoolExecutor(N) as pool:
        return list(pool.map(one, range(N)))


@pytest.mark.parametrize("kind", ["source", "source-multi-file", "converted"])
def test_threads_equal_sequential(example_dir: Path, example_multi_dir: Path, tmp_path: Path, kind: str) -> None:
    model = {"source": example_dir, "source-multi-file": example_multi_dir, "converted": tmp_path / "tp8"}[kind]
    if kind == "converted":
        shardload.convert(example_dir, N, model)
    sequential = [shardload.load_rank(model, r, N) for r in range(N)]
    for _ in range(3):
        threaded = _in_threads(model, verify=kind == "converted")
        for r in range(N):
            assert threaded[r].keys() == sequential[r].keys()
            for name, t in sequential[r].items():
                assert torch.equal(threaded[r][name], t), (kind, r, name)
    assert any(not torch.equal(sequential[0][k], sequential[1][k]) for k in sequential[0]), "ranks must differ"


def test_writer_and_hash_threads_follow_the_cores_this_process_may_use(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container or ``taskset`` that allows 1 of a machine's 64 cores gets 1 writer thread and a pool of 2 hashing
    threads (one hashing while the other waits for storage), not one per core of the machine (``os.cpu_count``)."""
    from concurrent.futures import ThreadPoolExecutor

    from shardload.engine import hashing, writer

    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    writers: set[str] = set()
    pools: list[int] = []
    write_group = writer._write_group

    def seen_writing(*args: object, **kwargs: object) -> object:
        writers.add(threading.current_thread().name)
        return write_group(*args, **kwargs)

    class Pool(ThreadPoolExecutor):
        def __init__(self, max_workers: int, **kwargs: object) -> None:
            pools.append(max_workers)  # the pool's size (its threads start lazily, as jobs find none idle)
            super().__init__(max_workers, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "_write_group", seen_writing)
    monkeypatch.setattr(hashing, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(hashing, "WORK_BYTES", 4096)  # many small jobs: room for more threads than cores
    shardload.convert(example_dir, N, tmp_path / "tp8")
    shardload.hash_checkpoint(example_dir, tmp_path / "record")  # not beside the shared example
    assert len(writers) == 1, writers
    assert pools == [2], pools
