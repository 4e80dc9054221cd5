"""One rank of a two-process gloo group that loads a model inside ``same_checkpoint`` (run by
tests/test_agreement.py; not a test itself).

    python agreement_worker.py MODEL CASE

CASE says what happens between the two ranks' loads: rank 0 loads first, then (both ranks waiting at a barrier) rank
0 changes the model, then rank 1 loads. ``none`` changes nothing; ``replace`` replaces model.safetensors by a rename
with a file of the same header and other tensor bytes; ``reheader`` with the same tensors under another header (one
more metadata entry); ``rewrite-keep-mtime`` rewrites its tensor bytes in place and puts its modification time
back; ``touch`` only moves its modification time; ``touch-hosts``
does the same with each rank told it is on a host of its own; ``own-copy`` has rank 1 load its own copy
(MODEL-copy, made by the test); ``shared`` loads with ``group=True`` inside the block; ``slow`` has rank 1 start
its load 3 s after rank 0 ends its own, with the shared-reads exchange timeout at 1 s; ``fail`` makes rank 1's load
fail (a shard_info for a parameter the model lacks). Each rank prints ``OK <sum of its tensors>`` or
``ERROR <message>`` and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch.distributed as dist

import shardload
from helpers.rendezvous import store
from shardload.engine import agreement, exchange
from shardload.errors import ShardloadError
from shardload.integrations.api import same_checkpoint


def change(model: str, case: str) -> None:
    path = os.path.join(model, "model.safetensors")
    if case == "replace":
        data = bytearray(open(path, "rb").read())
        (n,) = np.frombuffer(bytes(data[:8]), dtype="<u8")
        data[8 + int(n) :] = bytes(b ^ 0x01 for b in data[8 + int(n) :])
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)
    elif case == "reheader":
        from safetensors.numpy import load_file, save_file

        save_file(load_file(path), path + ".new", metadata={"format": "pt", "version": "2"})
        os.replace(path + ".new", path)
    elif case == "rewrite-keep-mtime":  # its tensor bytes rewritten in place, its modification time put back
        st = os.stat(path)
        with open(path, "r+b") as f:
            (n,) = np.frombuffer(f.read(8), dtype="<u8")
            f.seek(8 + int(n))
            data = f.read()
            f.seek(8 + int(n))
            f.write(bytes(b ^ 0x01 for b in data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif case.startswith("touch"):
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def in_turn(model: str, rank: int, case: str, shard_info: dict | None) -> dict:
    """Rank 0 loads, then rank 0 changes the model, then rank 1 loads; barriers (which no rank fails before)
    keep the turns."""
    state = shardload.load_rank(model, rank, 2) if rank == 0 else {}
    dist.barrier()
    if rank == 0:
        change(model, case)
    dist.barrier()
    if case == "slow" and rank == 1:
        time.sleep(3)
    return shardload.load_rank(model, rank, 2, shard_info=shard_info) if rank == 1 else state


def main() -> None:
    model, case = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", **store())
    rank = dist.get_rank()
    if case == "touch-hosts":
        agreement.host_key = lambda: bytes([rank]) * 8  # each rank on a host of its own
    shard_info = None
    if case == "fail" and rank == 1:
        shard_info = {"version": 1, "num_shards": None, "params": {"no.such.weight": [["shard_funcs.shard",
                      [[2, 4], "float16"], 0, "num_shards"]]}}  # fmt: skip
    if case == "own-copy" and rank == 1:
        model += "-copy"
    if case == "slow":
        exchange.EXCHANGE_TIMEOUT = 1.0
    try:
        with same_checkpoint(None, model):
            if case == "shared":  # a load whose ranks exchange bytes: refused on every rank, before any collective
                state = shardload.load_rank(model, group=True)
            else:
                state = in_turn(model, rank, case, shard_info)
        print("OK", json.dumps(float(sum(t.double().sum() for t in state.values()))), flush=True)
    except ShardloadError as err:
        print("ERROR", err, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
