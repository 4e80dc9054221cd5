"""``quantize``'s memory and time on a Llama-shaped float16 checkpoint, each run in a fresh process.

Prints per scheme: wall and CPU seconds, the peak anonymous resident memory (sampled every 2 ms; pages of the mapped
checkpoint are not counted), and that peak less a process that only imports shardload and torch, as a multiple of
the model's bytes and of its largest tensor. With ``--base-tree`` the same
runs use another checkout's shardload too (side by side, one run). Usage:

    python benchmarks/quantize.py [--size-gib 1] [--work DIR] [--base-tree PATH] [--schemes int4-g128,fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import MODEL_FILE, ensure_checkpoint

CHILD = r"""
import json, sys, threading, time
import shardload, torch

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

peak = [anon()]
def watch():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
threading.Thread(target=watch, daemon=True).start()
start, cpu = time.perf_counter(), time.process_time()
if sys.argv[1] != "-":
    shardload.quantize(sys.argv[1], sys.argv[2], sys.argv[3])
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
peak[0] = max(peak[0], anon())
print(json.dumps({"wall": wall, "cpu": cpu, "peak": peak[0], "module": shardload.__file__}))
"""


def run(tree: Path | None, model: Path, out: Path, scheme: str) -> dict[str, float]:
    """One quantize (or, with model ``-``, only the imports) in a fresh process using ``tree``'s shardload."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    done = subprocess.run(  # run outside any checkout: python -c puts the working directory first on sys.path
        [sys.executable, "-c", CHILD, str(model), str(out), scheme], env=env, capture_output=True, text=True,
        cwd=out.parent,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"quantize failed: {done.stderr.strip().splitlines()[-1:]}")
    shutil.rmtree(out, ignore_errors=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if tree is not None and not Path(got["module"]).is_relative_to(tree):
        raise SystemExit(f"the run for {tree} imported {got['module']}")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardload-bench")
    parser.add_argument("--base-tree", type=Path, default=None, help="another checkout to compare with")
    parser.add_argument("--schemes", default="int4-g128,fp8")
    args = parser.parse_args()
    model = args.work / "model"
    ensure_checkpoint(model, args.size_gib, 8)
    from safetensors import safe_open

    with safe_open(model / MODEL_FILE, "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F16"}, dtypes
    nbytes = [2 * max(1, math.prod(s)) for s in sizes]
    total, largest = sum(nbytes), max(nbytes)
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.base_tree is not None:
        trees.insert(0, ("base", args.base_tree.resolve()))
    print(f"model: {total / 2**30:.2f} GiB, {len(sizes)} tensors, largest {largest / 2**20:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| tree | scheme | wall s | CPU s | peak anon MiB | (peak - imports) / model | / largest tensor |")
    print("|---|---|---|---|---|---|---|")
    for label, tree in trees:
        floor = run(tree, Path("-"), args.work / "q", "-")["peak"]
        for scheme in args.schemes.split(","):
            got = run(tree, model, args.work / "q", scheme)
            extra = got["peak"] - floor
            print(f"| {label} | {scheme} | {got['wall']:.2f} | {got['cpu']:.2f} | {got['peak'] / 2**20:.0f} | "
                  f"{extra / total:.2f} | {extra / largest:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
