"""One rank of a host loading together (run by tests/test_host_stripes.py; not a test itself).

    python host_stripes_worker.py MODEL RANK N OUT [off]

Imports, prints ``ready``, waits for a line on stdin (the parent drops the page cache meanwhile), looks at whether
each file is cold and prints ``checked``, waits for a second line (every rank has looked), then loads rank RANK of N
(its place on the host from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; ``off``: ``local_ranks=None``) inside
``count_reads`` with that answer, saves the tensors to OUT (safetensors) and prints one JSON line: the bytes it read
to warm the cache and the stripe threads still alive after ``load_rank`` returned. Every rank answers "cold?" before
any reads: on 2 cores a rank started late would otherwise find the file read by the others' stripes (and
readahead) and rightly skip its own, which the test's count of each stripe read once cannot tell from a bug.
"""

from __future__ import annotations

import json
import sys
import threading

from safetensors.torch import save_file

import shardload
import shardload.engine.host_stripes as host_stripes
from shardload.engine.host_stripes import data_regions
from shardload.sources.checkpoint import open_checkpoint


def main() -> None:
    model, rank, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    options = shardload.ReadOptions(local_ranks=None) if sys.argv[5:] == ["off"] else None
    print("ready", flush=True)
    sys.stdin.readline()
    cold = {path: host_stripes._cold(path, region) for path, region in data_regions(open_checkpoint(model)).items()}
    host_stripes._cold = lambda path, region: cold[path]
    print("checked", flush=True)
    sys.stdin.readline()
    with shardload.count_reads() as seen:
        state = shardload.load_rank(model, rank, n, read_options=options)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("shardload-stripe")]
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    print(json.dumps({"warmed": seen.warmed, "bytes": seen.bytes, "alive": alive}), flush=True)


if __name__ == "__main__":
    main()
