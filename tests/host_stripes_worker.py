"""One rank of a host loading together (run by tests/test_host_stripes.py; not a test itself).

    python host_stripes_worker.py MODEL RANK N OUT [off]

Imports, prints ``ready``, waits for a line on stdin (the parent drops the page cache meanwhile), then loads rank
RANK of N (its place on the host from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; ``off``: ``local_ranks=None``) inside
``count_reads``, saves the tensors to OUT (safetensors) and prints one JSON line: the bytes it read to warm the cache
and the stripe threads still alive after ``load_rank`` returned.
"""

from __future__ import annotations

import json
import sys
import threading

from safetensors.torch import save_file

import shardload


def main() -> None:
    model, rank, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    options = shardload.ReadOptions(local_ranks=None) if sys.argv[5:] == ["off"] else None
    print("ready", flush=True)
    sys.stdin.readline()
    with shardload.count_reads() as seen:
        state = shardload.load_rank(model, rank, n, read_options=options)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("shardload-stripe")]
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    print(json.dumps({"warmed": seen.warmed, "bytes": seen.bytes, "alive": alive}), flush=True)


if __name__ == "__main__":
    main()
