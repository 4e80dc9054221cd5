"""One rank of a group that loads with ``load_rank(share_reads=True)`` (run under torch.distributed by
tests/test_shared_reads.py; not a test itself).

    python -m torch.distributed.run --standalone --nproc_per_node 4 shared_reads_worker.py CASES_JSON

CASES_JSON is a list of ``{"model": DIR, "mesh": "dp=2,tp=2" | null, "chunk": BYTES | null}``, optionally with
``"groups": [[0, 2], [1, 3]]`` (share within these subgroups instead of the whole world); a mesh
``"device:dp=2,tp=2"`` is passed as a torch ``DeviceMesh`` with those named axes; ``"reference": DIR`` makes the
plain load read that local copy (of a model in object storage, or another rank's copy) instead;
``"model_of_rank": {"1": DIR}`` gives rank 1 its own copy of the model. For each case
the rank loads its shard plainly and with shared reads, each inside ``count_reads``, compares the two element
for element, and rank 0 prints one ``RESULT {json}`` line: bytes read by the whole group both ways, the
tensor bytes of the checkpoint, and the bytes the group's ranks read to fingerprint their copies of its files.

Environment: ``SHARDLOAD_TEST_BACKEND`` (gloo) names the backend; ``SHARDLOAD_TEST_DEVICE=cuda`` loads onto
``cuda:LOCAL_RANK`` (modulo the GPUs); ``SHARDLOAD_TEST_DIE=RANK:ROUND`` makes that rank exit hard
(``os._exit(3)``) after reading its chunk of that exchange round (``SHARDLOAD_TEST_HANG``: after stopping for
14 s); ``SHARDLOAD_TEST_FAIL``: the shared load is expected to fail (``model_of_rank`` gives some rank another
model; ``SHARDLOAD_TEST_FAIL=unreadable:RANK``: that rank's reads to fingerprint the files fail);
``SHARDLOAD_TEST_FAIL=raises:RANK:ROUND``: that rank's read of its chunk of round ROUND + 1 raises an I/O error;
``SHARDLOAD_TEST_FAIL=progress:RANK``: that rank's progress callback raises at round 2;
``SHARDLOAD_TEST_FAIL=device:RANK``: that rank names a device torch does not know (refused before anything else);
``SHARDLOAD_TEST_FAIL=rewrite:RANK``: that rank rewrites its copy's first weight file in place (every tensor byte
flipped) after the first exchange round; ``SHARDLOAD_TEST_LIVE_ON``: seconds a rank whose load failed lives on
before it exits (a server that caught the error); ``SHARDLOAD_TEST_TIMEOUT`` sets the exchange timeout in seconds.
A load meant to fail prints one ``FAILED rank R after S s: MESSAGE`` line and exits 1.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import shardload
import shardload.engine.exchange as exchange
import shardload.engine.routes as load
import shardload.engine.transfer as transfer
from helpers.rendezvous import store
from shardload.engine.fingerprint import plan_samples
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader, count_reads
from shardload.sources.safetensors_header import read_header


class DyingReader(Reader):
    """A reader whose process exits hard (with ``hang``, after stopping for 14 s) once it has read its chunk of
    round ``after`` (counted per call; the reads that fingerprint the files before the exchange do not count)."""

    def __init__(self, after: int, hang: bool) -> None:
        super().__init__()
        self.after = after
        self.hang = hang
        self.rounds = 0

    def read_runs(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().read_runs(*args, **kwargs)
        if threading.current_thread().name.startswith("shardload-fingerprint"):
            return
        self.rounds += 1
        if self.rounds > self.after:
            if self.hang:
                time.sleep(14)
            time.sleep(0.2)  # let the others start the exchange of this round
            os._exit(3)


class FailingReader(Reader):
    """A reader whose read of its chunk of exchange round ``after + 1`` fails with an I/O error (the process lives
    on, as a server's that catches the error would)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.rounds = 0

    def read_runs(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not threading.current_thread().name.startswith("shardload-fingerprint"):
            self.rounds += 1
            if self.rounds > self.after:
                raise shardload.CheckpointError("cannot read: Input/output error", file=str(path))
        super().read_runs(path, *args, **kwargs)


class UnreadableReader(Reader):
    """A reader whose reads fail (an I/O error) while the files are fingerprinted, and succeed otherwise."""

    def read_runs(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("shardload-fingerprint"):
            raise shardload.CheckpointError("cannot read: Input/output error", file=str(path))
        super().read_runs(path, *args, **kwargs)


def rewrite(model: str) -> None:
    """Flip every tensor byte of ``model``'s first weight file in place (same size, same inode)."""
    path = sorted(p for p in os.listdir(model) if p.endswith(".safetensors"))[0]
    with open(os.path.join(model, path), "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        body = f.read()
        f.seek(8 + n)
        f.write(bytes(b ^ 0x5A for b in body))


def failing_progress(done: int, total: int) -> None:
    """A caller's progress callback that fails at the second round."""
    if done == 2:
        raise RuntimeError("the caller's progress callback failed")


def rounds_seen(seen: list[tuple[int, int]]) -> Callable[[int, int], None]:
    """A progress callback that records ``(done, total)`` in ``seen``."""
    return lambda done, total: seen.append((done, total))


def main() -> None:
    cases = json.loads(sys.argv[1])
    backend = os.environ.get("SHARDLOAD_TEST_BACKEND", "gloo")
    device = "cpu"
    if os.environ.get("SHARDLOAD_TEST_DEVICE") == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, **store())
    rank = dist.get_rank()
    die = os.environ.get("SHARDLOAD_TEST_DIE") or os.environ.get("SHARDLOAD_TEST_HANG")
    if "SHARDLOAD_TEST_TIMEOUT" in os.environ:
        exchange.EXCHANGE_TIMEOUT = float(os.environ["SHARDLOAD_TEST_TIMEOUT"])
    if die or "SHARDLOAD_TEST_FAIL" in os.environ:  # one shared load that is meant to fail: print its error
        if die:
            who, after = (int(x) for x in die.split(":"))
            if who == rank:
                dying = lambda path=None, cost=None: DyingReader(after, "SHARDLOAD_TEST_HANG" in os.environ)  # noqa: E731
                load.reader_for = transfer.reader_for = dying  # type: ignore[assignment]  (paths, and plans' files)
        unreadable = os.environ.get("SHARDLOAD_TEST_FAIL", "").split(":")
        if unreadable[0] == "unreadable" and int(unreadable[1]) == rank:
            load.reader_for = transfer.reader_for = lambda path=None, cost=None: UnreadableReader()  # type: ignore[assignment]
        if unreadable[0] == "raises" and int(unreadable[1]) == rank:
            failing = lambda path=None, cost=None: FailingReader(int(unreadable[2]))  # noqa: E731
            load.reader_for = transfer.reader_for = failing  # type: ignore[assignment]
        case = cases[0]
        exchange.EXCHANGE_BYTES = case["chunk"] * (2 * dist.get_world_size() + 2)
        model = case.get("model_of_rank", {}).get(str(rank), case["model"])
        progress = None
        if unreadable[0] == "rewrite" and int(unreadable[1]) == rank:
            progress = lambda done, total: done == 1 and rewrite(model)  # noqa: E731
        if unreadable[0] == "progress" and int(unreadable[1]) == rank:
            progress = failing_progress
        device = "nodevice" if unreadable[0] == "device" and int(unreadable[1]) == rank else "cpu"
        dist.barrier()  # every process has started: slow imports on a busy machine do not count against the timeout
        started = time.monotonic()
        try:
            shardload.load_rank(model, mesh=case.get("mesh"), share_reads=True, progress=progress, device=device)
        except (shardload.ShardloadError, RuntimeError) as err:
            print(f"FAILED rank {rank} after {time.monotonic() - started:.1f} s: {err}", flush=True)
            time.sleep(float(os.environ.get("SHARDLOAD_TEST_LIVE_ON", "0")))  # a server that caught the error
            # skip interpreter teardown: gloo's process group, torn down after its peers have gone, may abort
            # (SIGABRT) in its destructor, which says nothing about the load that failed here
            os._exit(1)
        print(f"rank {rank} finished without error", flush=True)
        return
    default = exchange.EXCHANGE_BYTES
    for case in cases:
        # chunks of about case["chunk"] bytes: many rounds even on a tiny model (else the default buffer size)
        exchange.EXCHANGE_BYTES = case["chunk"] * (2 * dist.get_world_size() + 2) if case.get("chunk") else default
        model, mesh = case.get("model_of_rank", {}).get(str(rank), case["model"]), case.get("mesh")
        if isinstance(mesh, str) and mesh.startswith("device:"):  # a torch DeviceMesh with named axes
            from torch.distributed.device_mesh import init_device_mesh

            sizes = dict(part.split("=") for part in mesh[len("device:") :].split(","))
            mesh = init_device_mesh("cpu", tuple(int(v) for v in sizes.values()), mesh_dim_names=tuple(sizes))
        share: Any = True
        for members in case.get("groups") or []:  # subgroups: every rank creates every group, joins its own
            group = dist.new_group(members)
            if rank in members:
                share = group
        with count_reads() as plain_count:  # the same model, or its local copy ("reference")
            plain = shardload.load_rank(case.get("reference", model), mesh=mesh, device=device)
        started = time.monotonic()
        rounds: list[tuple[int, int]] = []
        with count_reads() as shared_count:
            report_round = rounds_seen(rounds)
            shared = shardload.load_rank(model, mesh=mesh, device=device, share_reads=share, progress=report_round)
        seconds = time.monotonic() - started
        assert plain.keys() == shared.keys(), (rank, sorted(plain.keys() ^ shared.keys()))
        assert rounds and rounds == [(k, rounds[-1][1]) for k in range(1, rounds[-1][1] + 1)], rounds
        for name, want in plain.items():
            got = shared[name]
            assert got.shape == want.shape and got.dtype == want.dtype, (rank, name, got.shape, want.shape)
            assert got.device == torch.device(device) and got.is_contiguous(), (rank, name, got.device)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (rank, name)
        counts = torch.tensor([plain_count.bytes, shared_count.bytes], dtype=torch.int64)
        counts = counts.to(device) if backend == "nccl" else counts
        dist.all_reduce(counts)
        if rank == 0:
            checkpoint = open_checkpoint(model)
            if checkpoint.kind == "converted":  # every rank file's tensors
                files = [f["path"] for f in (checkpoint.manifest or {})["files"] if f["path"].endswith(".safetensors")]
                infos = [t for f in files for t in read_header(checkpoint.root / f).values()]
            else:
                infos = list(checkpoint.tensors.values())
            stored = sum(t.nbytes for t in infos)
            # every rank of a group of several samples its own copy of every file its group reads (here: all)
            world = dist.get_world_size()
            sampled = plan_samples(infos).nbytes * world if world > 1 else 0
            report = {"mesh": case.get("mesh"), "plain": int(counts[0]), "shared": int(counts[1]), "stored": stored,
                      "fingerprint": sampled, "seconds": seconds, "rounds": rounds[-1][1]}  # fmt: skip
            print("RESULT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
