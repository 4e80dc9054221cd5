"""How a load's held read jobs run (``Transfer.wait``): every job exactly once, on the reader threads and the
calling thread together, and a failure stops the rest and is raised once every running job has finished."""

from __future__ import annotations

import threading
import time

import pytest

import shardload
from shardload.engine.transfer import Transfer
from shardload.sources.reader import Reader


def _transfer(threads: int) -> Transfer:
    return Transfer(Reader(), read_options=shardload.ReadOptions(threads=threads), defer=True)


def test_held_jobs_run_once_each_on_the_readers_and_the_caller() -> None:
    ran: list[tuple[int, str]] = []
    with _transfer(3) as transfer:
        for k in range(60):
            transfer._submit(lambda k=k: (time.sleep(0.001), ran.append((k, threading.current_thread().name))))
        assert ran == []  # held until wait
        transfer.wait()
    assert sorted(k for k, _ in ran) == list(range(60))
    names = {name for _, name in ran}
    assert threading.current_thread().name in names  # the caller works instead of only waiting
    assert 2 <= len(names) <= 3  # and reader threads beside it: at most three threads in all, as asked


@pytest.mark.parametrize("where", ["reader", "caller"])
def test_a_failing_job_stops_the_others_and_is_raised_after_they_finish(where: str) -> None:
    started: list[int] = []
    finished: list[int] = []
    caller = threading.current_thread()

    def job(k: int) -> None:
        started.append(k)
        if k >= 2 and (threading.current_thread() is caller) == (where == "caller"):
            raise ValueError(f"job {k} failed")
        time.sleep(0.005)
        finished.append(k)

    transfer = _transfer(2)
    with pytest.raises(RuntimeError, match="failed at the end of a load"), transfer:
        for k in range(200):
            transfer._submit(lambda k=k: job(k))
        with pytest.raises(ValueError, match="failed"):
            transfer.wait()
        done = len(finished)
        time.sleep(0.05)
        assert len(finished) == done  # nothing was still running when wait raised
        with pytest.raises(ValueError, match="failed"):
            transfer.wait()  # the transfer stays failed: its tensors are incomplete
        assert len(finished) == done  # and no job that was left runs
    assert len(started) < 200  # the threads stopped taking jobs


def test_replica_copies_are_dropped_after_a_failed_wait() -> None:
    import torch

    from shardload.engine.transfer import ReplicaCopies

    transfer = _transfer(2)
    with pytest.raises(RuntimeError, match="failed at the end of a load"), transfer:
        transfer.copies.append(ReplicaCopies(copies=None, dests=[torch.zeros(1)]))  # type: ignore[arg-type]
        transfer._submit(lambda: (_ for _ in ()).throw(OSError("read failed")))
        with pytest.raises(OSError, match="read failed"):
            transfer.wait()
        assert transfer.copies == []  # nothing is copied out of a tensor whose reads failed
        with pytest.raises(OSError, match="read failed"):
            transfer.wait()


@pytest.mark.parametrize("threads", [0, 2])
def test_held_jobs_run_once_each_with_a_progress_callback(threads: int) -> None:
    ran: list[int] = []
    seen: list[tuple[int, int]] = []
    transfer = Transfer(Reader(), read_options=shardload.ReadOptions(threads=threads), defer=True,
                        progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    with transfer:
        for k in range(20):
            transfer._submit(lambda k=k: ran.append(k))
        transfer.wait()
        assert sorted(ran) == list(range(20))  # every job ran, none held back again
        transfer.wait()  # nothing left to run
    assert sorted(ran) == list(range(20))
    if threads:
        assert seen[-1] == (20, 20)


def test_a_load_that_leaves_jobs_unrun_raises() -> None:
    ran: list[int] = []
    with pytest.raises(RuntimeError, match="unfinished"):
        with _transfer(2) as transfer:
            transfer._submit(lambda: ran.append(1))  # held, and wait() never called
    assert ran == []
