"""One rank of a group loading with ``load_rank(share_reads=True, verify=True)`` (run under torch.distributed by
tests/test_verified.py; not a test itself).

    python -m torch.distributed.run --standalone --nproc_per_node 2 verified_shared_worker.py MODEL EVIL [ROOT]

Rank ``EVIL`` (-1: none) alters every 4096th byte of what it sends the next rank (its own bytes stay true); the load
passes ``verify=ROOT`` (a pinned root) when given, else ``verify=True``. Each rank prints ``OK R`` when its tensors
equal a plain load's, or ``FAILED R: MESSAGE`` when the load fails, and leaves through ``os._exit``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import shardload


def main() -> None:
    model, evil = sys.argv[1], int(sys.argv[2])
    verify: bool | str = sys.argv[3] if len(sys.argv) > 3 else True
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == evil:
        exchange_bytes = dist.all_to_all_single

        def altered(out, send, out_splits=None, in_splits=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
            peer = (rank + 1) % size  # what goes to the next rank only: the evil rank's own bytes stay true
            start = sum(in_splits[:peer]) if in_splits else 0
            send[start : start + (in_splits[peer] if in_splits else 0)][::4096] ^= 1
            return exchange_bytes(out, send, out_splits, in_splits, group=group, async_op=async_op)

        dist.all_to_all_single = altered
    plain = shardload.load_rank(model, rank, size)
    try:
        state = shardload.load_rank(model, rank, size, share_reads=True, verify=verify)
    except shardload.ShardloadError as err:
        os.write(1, f"FAILED {rank}: {err}\n".encode())  # one write: the ranks share the pipe
        os._exit(1)
    same = state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in plain)
    os.write(1, f"{'OK' if same else 'WRONG'} {rank}\n".encode())
    dist.barrier()
    os._exit(0 if same else 2)


if __name__ == "__main__":
    main()
