"""One rank of tests/test_equivalence.py's ``share_reads`` cells (run under torchrun; not a test itself).

    python -m torch.distributed.run --standalone --nproc_per_node N matrix_worker.py CASES_JSON

CASES_JSON is a list of ``{"id": NAME, "model": PATH_OR_URI, "threads": K, "out": DIR}`` (and ``"verify"``: True or a
root, optional). For each case every rank calls ``load_rank(model, share_reads=True, verify=...)`` (rank and N from
the gloo group) with ``K`` concurrent object-store requests (``objects.CONCURRENCY``: share_reads reads its chunks
in one thread, whatever the reader threads) and writes
what it got to ``DIR/rank-R.safetensors``, or its error to ``DIR/rank-R.error``; the test compares the files with
its reference. Exchange chunks are small (16 KiB), so even the tiny models take many exchange rounds.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

import shardload
import shardload.engine.exchange as exchange
from shardload.sources import objects


def main() -> None:
    cases = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    exchange.EXCHANGE_BYTES = 16384 * (2 * dist.get_world_size() + 2)
    for case in cases:
        objects.CONCURRENCY = case["threads"]
        out = Path(case["out"])
        out.mkdir(parents=True, exist_ok=True)
        try:
            state = shardload.load_rank(case["model"], share_reads=True, verify=case.get("verify", False))
            save_file({k: t.contiguous() for k, t in state.items()}, str(out / f"rank-{rank}.safetensors"))
        except Exception as err:  # reported by the test cell of this case
            (out / f"rank-{rank}.error").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
