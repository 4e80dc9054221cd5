#!/usr/bin/env python
"""shardload's performance targets, each measured against its baseline in the same run.

Usage::

    python benchmarks/run.py [--size-gib 1.0] [--num-shards 8] [--repeats 3] [--warmup 1] [--keep DIR] [--no-peer]
                             [--only load,bytes,convert,peer,gpu,rank]

On a random ~``--size-gib`` float16 Llama-shaped checkpoint (fused GQA qkv, gate_up, o, down, embeddings)
with its shard_info, warm page cache, N = ``--num-shards``:

1. ``load()`` (all N ranks, one process, CPU) against the copy floor (every stored tensor copied once from
   a file mapping into a fresh tensor; target <= 1.2x) and a naive loader (per rank, per tensor: full view,
   narrow, contiguous copy, a mapping per rank as in one process per rank; target < 1x); bytes read = the
   checkpoint's tensor bytes (target 1x).
2. ``load_rank()`` in a fresh process for each rank: bytes read (shardload's reader count) against the
   rank's shard + replicated bytes (target <= 1.05x), cross-checked with ``/proc/self/io`` rchar.
3. ``convert --num-shards N`` to a new directory against ``cp`` of the checkpoint (target <= 1.5x), and
   ``convert --fsync`` against ``cp`` + ``sync`` (shown); its peak RssAnon above imports against 256 MiB + the
   largest tensor (target <= 1x).
4. ``load_rank(mmap=True)`` against HF transformers ``from_pretrained(..., tp_plan="auto")``, both under
   ``torchrun --nproc_per_node 2`` (gloo, CPU) on the same saved Llama: time until every rank holds its shard
   and until every page of it was touched. Like transformers, ``mmap=True`` keeps dim-0 shards as views of
   the file mapping and copies the rest; the default ``load_rank`` puts every tensor in fresh memory. All
   three have the target <= 0.5x. The shards are compared with transformers' element for element.
5. With CUDA: ``load()`` onto ``cuda:0..G-1`` against the pinned host-to-device bandwidth (target >= 0.8x);
   the whole model onto ``cuda:0`` against ``safe_open(..., device="cuda:0")``, and one rank of N against
   safetensors' ``get_slice`` on the same device (``--only gpu`` measures this row alone).
6. One rank (rank 3 of N) in a fresh process, page cache warm (the file evicted, then read once sequentially, so
   every run copies out of the same kind of cache), every page of the result touched, imports excluded:
   the default ``load_rank`` (owned contiguous memory) against the fresh-memory floor (each of the rank's pieces
   copied once by torch out of a mapping into a new tensor, the plan given; target <= 1.1x) and against
   ``safe_open(...).get_slice(name)[...]`` narrowing the same boxes with every tensor cloned into fresh memory
   (target <= 1x); ``load_rank(mmap=True)`` against the mmap floor (views of a mapping where a piece is contiguous,
   one copy otherwise; target <= 1.1x); both against get_slice's bare views (shown, no target: views are never
   copied); the whole model against ``load_file``
   (views) and ``load_file`` + clone (shown); the same rank after dropping the file's pages
   (``posix_fadvise(DONTNEED)``): bytes fetched from storage (``/proc/self/io`` read_bytes) against the pages holding
   the rank's bytes (target <= 1.05x) and time against get_slice (target <= 1x). ``--only rank`` measures this row.

Times are the best of ``--repeats`` interleaved rounds after ``--warmup`` untimed ones, each started from a warm
page cache (the source is read just before). It prints one table
and exits 1 if a ratio misses its target (it is a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from checkpoints import (
    MODEL_FILE,
    checkpoint_nbytes,
    covering_chunks,
    drop,
    ensure_checkpoint,
    ensure_hf_llama,
    fresh_pages_per_allocation,
    remove,
    tensor_specs,
    warm_page_cache,
)

import shardload
from shardload.cli.report import format_table, human_bytes
from shardload.sources.reader import count_reads

ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
SAMPLE_INTERVAL_S = 0.01
PEER_RANKS = 2
VIEWS = shardload.ReadOptions(strategy="view")
"""``load_rank``'s views of the file (what ``mmap=True`` was), the rows labelled mmap."""
GROUPS = {"load": 1, "bytes": 2, "convert": 3, "peer": 4, "gpu": 5, "rank": 6}
"""``--only`` row groups and the rows they measure."""
HERE = Path(__file__).resolve()


# --- baselines -------------------------------------------------------------------------------------


def _mapped(path: Path) -> tuple[mmap.mmap, int, dict[str, Any]]:
    """A private mapping of a safetensors file, its data start and its tensor entries."""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    (n,) = struct.unpack("<Q", mm[:8])
    header = json.loads(mm[8 : 8 + n])
    header.pop("__metadata__", None)
    return mm, 8 + n, header


def _view(mm: mmap.mmap, base: int, entry: dict[str, Any]) -> torch.Tensor:
    a, b = entry["data_offsets"]
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=base + a)
    return raw.view(ST_DTYPES[entry["dtype"]]).view(entry["shape"])


def copy_floor(path: Path) -> list[torch.Tensor]:
    """Copy every stored tensor once from a file mapping into a freshly allocated tensor."""
    mm, base, header = _mapped(path)
    out = []
    for entry in header.values():
        src = _view(mm, base, entry)
        dst = torch.empty(src.shape, dtype=src.dtype)
        dst.copy_(src)
        out.append(dst)
    return out


def naive_load(path: Path, shard_info: dict[str, Any], num_shards: int) -> list[dict[str, torch.Tensor]]:
    """What vLLM-style loaders do: per rank (each with its own mapping of the file, as each rank's process
    has), per tensor, a full-tensor view, ``narrow`` and a contiguous copy.

    Fused tensors (``reorder_segments`` then ``shard_dim``) narrow each segment and concatenate. The copy
    is ``.clone()``, not ``.contiguous()``: for a dim-0 slice ``.contiguous()`` returns the view of the
    mapping itself and would read nothing (vLLM copies it into the parameter).
    """
    params = shard_info["params"]
    result: list[dict[str, torch.Tensor]] = []
    for rank in range(num_shards):
        mm, base, header = _mapped(path)
        out = {}
        for name, entry in header.items():
            full = _view(mm, base, entry)
            steps = params.get(name, [])
            if not steps:
                out[name] = full.clone()
            elif len(steps) == 1:
                dim = steps[0][2]
                size = full.shape[dim] // num_shards
                out[name] = full.narrow(dim, rank * size, size).clone(memory_format=torch.contiguous_format)
            else:
                dim, segments = steps[0][2], steps[0][3]
                unit = steps[0][5] if len(steps[0]) > 5 else 1
                parts, start = [], 0
                for seg in segments:
                    length = seg * unit
                    part = length // num_shards
                    parts.append(full.narrow(dim, start + rank * part, part))
                    start += length
                out[name] = torch.cat(parts, dim)
        result.append(out)
    return result


def run_cp(src: Path, dst: Path, sync: bool = False) -> None:
    """``cp SRC DST`` (then ``sync DST``)."""
    subprocess.run(["cp", str(src), str(dst)], check=True)
    if sync:
        subprocess.run(["sync", str(dst)], check=True)


# --- timing and memory -------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], setup: Callable[[], None] | None = None) -> float:
    """Seconds ``fn()`` takes; its result is released only after the clock stops."""
    if setup is not None:
        setup()
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t0
    del result
    gc.collect()
    return elapsed


def interleaved(
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]], repeats: int, warmup: int, warm: Path
) -> dict[str, list[float]]:
    """Run each named ``(fn, setup)`` once per round: ``warmup`` untimed rounds, then ``repeats`` timed ones.

    ``warm`` is read just before every run: machines that reclaim cold page cache (DAMON, balloons) would
    otherwise start some runs from storage.
    """
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for round_ in range(warmup + repeats):
        for name, (fn, setup) in pairs.items():

            def prepare(setup: Callable[[], None] | None = setup) -> None:
                if setup is not None:
                    setup()
                warm_page_cache(warm)

            elapsed = timed(fn, prepare)
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def rss_anon_kib(pid: int | str = "self") -> int | None:
    """``RssAnon`` of a process in KiB, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return None


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (empty where there is none)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def sampled_peak(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` while a thread samples its RssAnon every ~10 ms; return (peak KiB, stdout)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            kib = rss_anon_kib(proc.pid)
            if kib is not None:
                peak[0] = max(peak[0], kib)
            time.sleep(SAMPLE_INTERVAL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"run.py: {cmd[2:5]} failed with exit status {proc.returncode}")
    return peak[0], stdout


def child(kind: str, *args: str) -> list[str]:
    """The command line that runs ``kind`` in a fresh interpreter."""
    return [sys.executable, str(HERE), "--child", kind, *args]


def json_line(stdout: str) -> dict[str, Any]:
    """The last line of a child's output that is a JSON object."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"run.py: a child printed no result:\n{stdout}")


# --- children ----------------------------------------------------------------------------------------


def child_convert(model: str, out: str, num_shards: str) -> None:
    """RssAnon after imports, convert, RssAnon after."""
    print(json.dumps({"base_kib": rss_anon_kib()}), flush=True)
    shardload.convert(model, int(num_shards), out, overwrite=True)
    print(json.dumps({"end_kib": rss_anon_kib()}), flush=True)


def child_load(model: str, num_shards: str, kind: str) -> None:
    """RssAnon after imports, ``load()`` (or the copy floor), RssAnon while holding the result."""
    print(json.dumps({"base_kib": rss_anon_kib()}), flush=True)
    n = int(num_shards)
    held = shardload.load(model, n, devices=["cpu"] * n) if kind == "load" else copy_floor(Path(model) / MODEL_FILE)
    print(json.dumps({"end_kib": rss_anon_kib()}), flush=True)
    del held


def peak_above_imports(cmd: list[str]) -> int:
    """Peak RssAnon of a child above its RssAnon after imports, in bytes (its first and last lines report them)."""
    peak, stdout = sampled_peak(cmd)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return (max(peak, lines[-1]["end_kib"]) - lines[0]["base_kib"]) * 1024


def child_load_rank(model: str, rank: str, num_shards: str) -> None:
    """One rank's load in a fresh process: bytes counted by the reader, /proc/self/io deltas, seconds.

    Planning once first imports what loading imports lazily, so rchar counts tensor bytes, headers and JSON.
    """
    shardload.plan_model(model, int(num_shards))
    before = proc_io()
    t0 = time.perf_counter()
    with count_reads() as seen:
        state = shardload.load_rank(model, int(rank), int(num_shards))
    elapsed = time.perf_counter() - t0
    after = proc_io()
    delta = {k: after[k] - before[k] for k in after}
    held = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"counted": seen.bytes, "calls": seen.calls, "io": delta, "seconds": elapsed, "held": held}))


def child_tp(kind: str, model: str, check: str) -> None:
    """Under torchrun: barrier, load this rank's shard (HF tp_plan="auto" or shardload), barrier; then touch every
    page of every local weight (HF keeps dim-0 shards as views of its file mapping, read when first touched),
    barrier. Rank 0 prints both times."""
    import torch.distributed as dist

    if kind == "hf":
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        loaded: Any = AutoModelForCausalLM.from_pretrained(model, tp_plan="auto", dtype=torch.float16)
    else:
        loaded = shardload.load_rank(model, read_options=VIEWS if kind == "shardload-mmap" else None)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    local = loaded.state_dict().values() if kind == "hf" else loaded.values()
    for t in local:
        t = (t.to_local() if hasattr(t, "to_local") else t).detach().contiguous()
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())  # one byte of every page
    dist.barrier()
    result: dict[str, Any] = {"seconds": elapsed, "touched": time.perf_counter() - t0}
    if kind == "hf" and check == "check":
        theirs = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in loaded.state_dict().items()}
        bad = []
        for mapped in (False, True):
            ours = shardload.load_rank(model, read_options=VIEWS if mapped else None)
            bad += [k for k in ours if k not in theirs or not torch.equal(ours[k], theirs[k].detach())]
        result["compared"] = len(ours)
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bad)
        result["mismatch"] = sorted({k for b in flags for k in b})
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def torchrun(kind: str, model: Path, check: bool = False) -> dict[str, Any]:
    """Launch ``child_tp`` on ``PEER_RANKS`` CPU processes; return rank 0's result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(PEER_RANKS)]
    cmd += [str(HERE), "--child", "tp", kind, str(model), "check" if check else "time"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(tail[-1] if tail else f"exit status {done.returncode}")
    return json_line(done.stdout)


# --- the rows -----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: a figure, ours, the baseline, their ratio and the target it must meet."""

    figure: str
    ours: str
    baseline: str
    ratio: float | None
    target: str
    ok: bool | None  # None: informational or skipped

    def cells(self) -> list[str]:
        ratio = "" if self.ratio is None else f"{self.ratio:.2f}x"
        met = {True: "yes", False: "NO", None: ""}[self.ok]
        return [self.figure, self.ours, self.baseline, ratio, self.target, met]


def _touch(state: dict[str, torch.Tensor]) -> None:
    """Read one element of every page of every tensor, so lazily mapped pages count too."""
    for t in state.values():
        if t.numel():
            flat = t.reshape(-1)
            float(flat[:: max(1, 4096 // t.element_size())].float().sum())


def child_slice(kind: str, model: str, rank: str, num_shards: str, cold: str) -> None:
    """One rank (or the whole model) by ``kind`` in a fresh process, every page touched: seconds, bytes read.

    ``safetensors`` narrows the same boxes with ``safe_open(...).get_slice(name)[...]`` over its mapping.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    import shardload.planning.runs  # what loading imports lazily: not timed

    with contextlib.suppress(ImportError):
        import jsonschema_rs  # noqa: F401  (shard_info's schema check imports it on first use)

    path = Path(model) / MODEL_FILE
    r, n = int(rank), int(num_shards)
    plan = shardload.plan_model(model, n)  # not timed: the load itself is compared, imports excluded
    if cold == "cold":
        drop(path)
    gc.collect()  # the full collection torch's import owes falls here, not inside the clock of one kind
    before = proc_io()
    t0 = time.perf_counter()
    with count_reads() as seen:
        if kind in ("safetensors", "safetensors-fresh"):
            state = {}
            with safe_open(str(path), framework="pt") as f:
                for name, p in plan.params.items():
                    pieces, part = p.pieces(r) or [], f.get_slice(name)
                    whole = len(pieces) == 1 and [b - a for a, b in pieces[0].dst] == list(p.shape)
                    if whole:
                        state[name] = part[tuple(slice(a, b) for a, b in pieces[0].src)].reshape(p.shape)
                        continue
                    dest = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
                    for pc in pieces:
                        box = [b - a for a, b in pc.dst]
                        dest[tuple(slice(a, b) for a, b in pc.dst)] = part[
                            tuple(slice(a, b) for a, b in pc.src)
                        ].reshape(box)
                    state[name] = dest
            if kind == "safetensors-fresh":  # every tensor in fresh memory, as the default load_rank gives
                state = {k: v.clone(memory_format=torch.contiguous_format) for k, v in state.items()}
        elif kind == "copy-floor":  # the least a fresh-memory load does: each piece copied once out of a mapping
            mm, base, header = _mapped(path)
            state = {}
            for name, p in plan.params.items():
                src = _view(mm, base, header[name])
                dest = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
                for pc in p.pieces(r) or []:
                    box = dest[tuple(slice(a, b) for a, b in pc.dst)]
                    box.copy_(src[tuple(slice(a, b) for a, b in pc.src)].reshape(box.shape))
                state[name] = dest
        elif kind == "mmap-floor":  # the least mmap=True does: views where a piece is contiguous, else one copy
            mm, base, header = _mapped(path)
            state = {}
            for name, p in plan.params.items():
                src = _view(mm, base, header[name])
                pieces = p.pieces(r) or []
                if len(pieces) == 1 and [b - a for a, b in pieces[0].dst] == list(p.shape):
                    part = src[tuple(slice(a, b) for a, b in pieces[0].src)]
                    if part.is_contiguous():
                        state[name] = part.view(p.shape)
                        continue
                dest = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
                for pc in pieces:
                    box = dest[tuple(slice(a, b) for a, b in pc.dst)]
                    box.copy_(src[tuple(slice(a, b) for a, b in pc.src)].reshape(box.shape))
                state[name] = dest
        elif kind in ("shardload", "shardload-mmap"):
            state = shardload.load_rank(model, r, n, read_options=VIEWS if kind == "shardload-mmap" else None)
        elif kind == "whole-shardload-mmap":
            state = shardload.load_rank(model, 0, 1, read_options=VIEWS)
        elif kind == "whole-shardload":
            state = shardload.load(model, 1, devices=["cpu"])[0]
        elif kind == "whole-load-file":
            state = load_file(str(path))
        else:
            assert kind == "whole-load-file-clone"
            state = {k: v.clone() for k, v in load_file(str(path)).items()}
        _touch(state)
    elapsed = time.perf_counter() - t0
    after = proc_io()
    held = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"seconds": elapsed, "read_bytes": after.get("read_bytes", 0) - before.get("read_bytes", 0),
                      "counted": seen.bytes, "held": held}))  # fmt: skip


def _pages_touched(plan: Any, rank: int) -> int:
    """How many file pages hold at least one byte ``rank`` needs: the least a cold read can fetch from storage
    (a page shared with another rank's bytes is read whole)."""
    return len(covering_chunks(plan, rank, mmap.PAGESIZE)[1])


def rows_slices(model: Path, n: int, repeats: int) -> tuple[list[Row], dict[str, list[float]]]:
    """Row 6: a rank's load against safetensors' own mmap slicing, warm and cold; the whole model against
    ``load_file``. Fresh process per run, best of ``repeats``."""
    rank = min(3, n - 1)
    path = model / MODEL_FILE

    def best(kind: str, cold: bool = False) -> dict[str, Any]:
        runs = []
        for _ in range(repeats):
            if not cold:
                warm_page_cache(path)
            cmd = child("slice", kind, str(model), str(rank), str(n), "cold" if cold else "warm")
            runs.append(json_line(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
        return min(runs, key=lambda x: x["seconds"]) | {"all": [x["seconds"] for x in runs]}

    # the warm runs copy out of the page cache a sequential read leaves (large folios, as after a download), not
    # whatever an earlier run's cold reads left: how the cache was filled moves copies out of it by up to 2x
    # (benchmarks/page_cache.py), and moved this row's ratios between runs
    drop(path)
    warm_page_cache(path)
    got = {k: best(k) for k in ("shardload", "shardload-mmap", "safetensors", "safetensors-fresh", "copy-floor",
                                "mmap-floor",
                                "whole-shardload-mmap", "whole-load-file", "whole-shardload",
                                "whole-load-file-clone")}  # fmt: skip
    cold = {k: best(k, cold=True) for k in ("shardload", "safetensors")}
    plan = shardload.plan_model(model, n)
    own = plan.rank_nbytes(rank)
    own_pages = _pages_touched(plan, rank) * mmap.PAGESIZE
    t = {k: v["seconds"] for k, v in got.items()}
    rows = [
        at_most(t["shardload"] / t["copy-floor"], 1.1,
                f"6. load_rank(rank {rank} of {n}) (fresh memory) vs its pieces copied once (fresh-memory floor)",
                seconds(t["shardload"]), seconds(t["copy-floor"])),
        at_most(t["shardload"] / t["safetensors-fresh"], 1.0, "6. load_rank (fresh memory) vs get_slice + clone",
                seconds(t["shardload"]), seconds(t["safetensors-fresh"])),
        at_most(t["shardload-mmap"] / t["mmap-floor"], 1.1,
                "6. load_rank(mmap=True) vs mmap floor (views where contiguous, else one copy)",
                seconds(t["shardload-mmap"]), seconds(t["mmap-floor"])),
        Row("6. load_rank vs safetensors get_slice (bare views)", seconds(t["shardload"]),
            seconds(t["safetensors"]), t["shardload"] / t["safetensors"], "", None),
        Row("6. load_rank(mmap=True) vs safetensors get_slice (bare views)", seconds(t["shardload-mmap"]),
            seconds(t["safetensors"]), t["shardload-mmap"] / t["safetensors"], "", None),
        Row("6. fresh-memory floor vs safetensors get_slice (views)", seconds(t["copy-floor"]),
            seconds(t["safetensors"]), t["copy-floor"] / t["safetensors"], "", None),
        Row("6. whole model: load_rank(m, 0, 1, mmap=True) vs load_file (views)", seconds(t["whole-shardload-mmap"]),
            seconds(t["whole-load-file"]), t["whole-shardload-mmap"] / t["whole-load-file"], "", None),
        Row("6. whole model: load(m, 1) vs load_file + clone (fresh memory)", seconds(t["whole-shardload"]),
            seconds(t["whole-load-file-clone"]), t["whole-shardload"] / t["whole-load-file-clone"], "", None),
        at_most(cold["shardload"]["read_bytes"] / own_pages, 1.05,
                f"6. cold cache, rank {rank}: bytes from storage vs the pages holding its bytes",
                human_bytes(cold["shardload"]["read_bytes"]), human_bytes(own_pages)),
        Row(f"6. cold cache, rank {rank}: pages holding its bytes vs its bytes (pages shared between ranks)",
            human_bytes(own_pages), human_bytes(own), own_pages / own, "", None),
        at_most(cold["shardload"]["seconds"] / cold["safetensors"]["seconds"], 1.0,
                "6. cold cache: load_rank vs safetensors get_slice", seconds(cold["shardload"]["seconds"]),
                seconds(cold["safetensors"]["seconds"])),
        Row("6. cold cache: safetensors get_slice bytes from storage vs own",
            human_bytes(cold["safetensors"]["read_bytes"]), human_bytes(own),
            cold["safetensors"]["read_bytes"] / own, "", None),
    ]  # fmt: skip
    times = {f"slice {k}": v["all"] for k, v in got.items()} | {f"cold {k}": v["all"] for k, v in cold.items()}
    return rows, times


def load_average() -> str:
    """The 1-minute load average (other work on a shared machine makes every timing noisier)."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown"


def seconds(t: float) -> str:
    """Seconds with millisecond precision."""
    return f"{t:.3f} s"


def at_most(ratio: float, limit: float, figure: str, ours: str, base: str) -> Row:
    """A row whose ratio must be at most ``limit``."""
    return Row(figure, ours, base, ratio, f"<= {limit:g}x", ratio <= limit)


def rows_load(model: Path, n: int, total: int, repeats: int, warmup: int) -> tuple[list[Row], dict[str, list[float]]]:
    """Row 1: load() against the copy floor and the naive loader; bytes read."""
    path = model / MODEL_FILE
    info = json.loads((model / "shard_info.json").read_text())
    times = interleaved(
        {
            "load": (lambda: shardload.load(model, n, devices=["cpu"] * n), None),
            "floor": (lambda: copy_floor(path), None),
            "naive": (lambda: naive_load(path, info, n), None),
        },
        repeats,
        warmup,
        path,
    )
    best = {k: min(v) for k, v in times.items()}
    with count_reads() as seen:
        shardload.load(model, n, devices=["cpu"] * n)
    mem = {kind: peak_above_imports(child("load", str(model), str(n), kind)) for kind in ("load", "floor")}
    rows = [
        at_most(best["load"] / best["floor"], 1.2, f"1. load() N={n} CPU vs copy floor", *_s(best, "load", "floor")),
        Row(
            f"1. load() N={n} CPU vs naive loader",
            *_s(best, "load", "naive"),
            best["load"] / best["naive"],
            "< 1x",
            best["load"] < best["naive"],
        ),
        at_most(
            seen.bytes / total, 1.0, "1. load() bytes read vs checkpoint", human_bytes(seen.bytes), human_bytes(total)
        ),
        Row(
            "1. load() peak RssAnon above imports vs copy floor",
            human_bytes(mem["load"]),
            human_bytes(mem["floor"]),
            mem["load"] / mem["floor"],
            "",
            None,
        ),
    ]
    return rows, times


def _s(best: dict[str, float], a: str, b: str) -> tuple[str, str]:
    return seconds(best[a]), seconds(best[b])


def rows_load_rank(model: Path, n: int) -> tuple[list[Row], list[str]]:
    """Row 2: load_rank in a fresh process per rank, bytes read against its own bytes (the worst rank)."""
    plan = shardload.plan_model(model, n)
    replicated = plan.replicated_nbytes
    worst: tuple[float, int, int] = (0.0, 0, 0)
    notes = []
    for rank in range(n):
        own = plan.rank_nbytes(rank)
        got = json_line(subprocess.run(child("load-rank", str(model), str(rank), str(n)), capture_output=True,
                                       text=True, check=True).stdout)  # fmt: skip
        if got["held"] != own:
            raise SystemExit(f"run.py: rank {rank} holds {got['held']} bytes, its plan says {own}")
        worst = max(worst, (got["counted"] / own, got["counted"], own))
        rchar = got["io"].get("rchar")
        cross = f"rchar {rchar} (+{rchar - got['counted']})" if rchar is not None else "no /proc/self/io"
        notes.append(
            f"rank {rank}: read {got['counted']} B in {got['calls']} calls, own {own} B "
            f"(shard {own - replicated} + replicated {replicated}); {cross}; {got['seconds']:.3f} s"
        )
    figure = f"2. load_rank() fresh process, worst of {n} ranks: bytes read vs own"
    return [at_most(worst[0], 1.05, figure, human_bytes(worst[1]), human_bytes(worst[2]))], notes


def rows_convert(
    model: Path, work: Path, n: int, largest: int, repeats: int, warmup: int
) -> tuple[list[Row], dict[str, list[float]]]:
    """Row 3: convert against cp (and cp + sync), and convert's peak RssAnon."""
    path = model / MODEL_FILE
    out, copied = work / "converted", work / "copy" / MODEL_FILE
    copied.parent.mkdir(exist_ok=True)

    def clear() -> None:
        """Remove both outputs, so no run shares the machine with the previous run's dirty pages."""
        remove(out)
        remove(copied)

    times = interleaved(
        {
            "convert": (lambda: shardload.convert(model, n, out), clear),
            "cp": (lambda: run_cp(path, copied), clear),
            "convert --fsync": (lambda: shardload.convert(model, n, out, fsync=True), clear),
            "cp+sync": (lambda: run_cp(path, copied, sync=True), clear),
        },
        repeats,
        warmup,
        path,
    )
    clear()
    shardload.convert(model, n, out)  # the timed runs cleared up after themselves
    check_agree(model, out, n)
    remove(out)
    above = peak_above_imports(child("convert", str(model), str(out), str(n)))
    remove(out)
    budget = (256 << 20) + largest
    best = {k: min(v) for k, v in times.items()}
    rows = [
        at_most(best["convert"] / best["cp"], 1.5, f"3. convert N={n} vs cp", *_s(best, "convert", "cp")),
        Row(
            f"3. convert N={n} --fsync vs cp + sync",
            *_s(best, "convert --fsync", "cp+sync"),
            best["convert --fsync"] / best["cp+sync"],
            "",
            None,
        ),
        at_most(
            above / budget,
            1.0,
            "3. convert peak RssAnon above imports vs 256 MiB + largest",
            human_bytes(above),
            human_bytes(budget),
        ),
    ]
    return rows, times


def check_agree(model: Path, converted: Path, n: int) -> None:
    """load() and the converted files must hold the same shards, or the timings mean nothing."""
    shards = shardload.load(model, n, devices=["cpu"] * n)
    for rank in sorted({0, n - 1}):
        other = shardload.load_rank(converted, rank, n, verify=True)
        if shards[rank].keys() != other.keys() or not all(torch.equal(shards[rank][k], other[k]) for k in other):
            raise SystemExit(f"run.py: load and convert disagree for rank {rank}")


def rows_peer(hf_dir: Path, repeats: int, warmup: int) -> tuple[list[Row], dict[str, list[float]], str]:
    """Row 4: shardload load_rank against HF tp_plan="auto", both under torchrun (gloo, CPU)."""
    figure = f"4. load_rank(mmap=True) vs HF tp_plan=auto, torchrun x{PEER_RANKS} gloo CPU"
    try:
        checked = torchrun("hf", hf_dir, check=True)
    except (RuntimeError, OSError) as err:
        return [Row(figure, "skipped (transformers failed)", "", None, "<= 0.5x", None)], {}, f"row 4: {err}"
    if checked.get("mismatch"):
        raise SystemExit(f"run.py: shardload and HF disagree on {checked['mismatch'][:3]}")
    kinds = ("shardload", "shardload-mmap", "hf")
    times: dict[str, list[float]] = {f"{k} tp{s}": [] for k in kinds for s in ("", "+sum")}
    for round_ in range(warmup + repeats):
        for kind in kinds:
            warm_page_cache(hf_dir / MODEL_FILE)
            got = torchrun(kind, hf_dir)
            if round_ >= warmup:
                times[f"{kind} tp"].append(got["seconds"])
                times[f"{kind} tp+sum"].append(got["touched"])
    best = {k: min(v) for k, v in times.items()}
    rows = [
        at_most(best["shardload-mmap tp"] / best["hf tp"], 0.5, figure, *_s(best, "shardload-mmap tp", "hf tp")),
        at_most(
            best["shardload-mmap tp+sum"] / best["hf tp+sum"],
            0.5,
            "4. same, until every page of every local weight was touched",
            *_s(best, "shardload-mmap tp+sum", "hf tp+sum"),
        ),
        at_most(
            best["shardload tp"] / best["hf tp"],
            0.5,
            "4. same, default load_rank (every tensor in fresh memory)",
            *_s(best, "shardload tp", "hf tp"),
        ),
    ]
    return (
        rows,
        times,
        f"row 4: both hold the same {checked['compared']} tensors per rank, compared element for element",
    )


def _safetensors_rank(path: Path, plan: Any, rank: int, device: str) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors by safetensors' own slicing, ``safe_open(..., device=...).get_slice(name)[...]``,
    narrowing the boxes the plan gives (the peer of ``load_rank``)."""
    from safetensors import safe_open

    state = {}
    with safe_open(str(path), framework="pt", device=device) as f:
        for name, p in plan.params.items():
            pieces, part = p.pieces(rank) or [], f.get_slice(name)
            if len(pieces) == 1 and [b - a for a, b in pieces[0].dst] == list(p.shape):
                state[name] = part[tuple(slice(a, b) for a, b in pieces[0].src)].reshape(p.shape)
                continue
            dest = torch.empty(p.shape, dtype=getattr(torch, p.dtype), device=device)
            for pc in pieces:
                box = [b - a for a, b in pc.dst]
                dest[tuple(slice(a, b) for a, b in pc.dst)] = part[tuple(slice(a, b) for a, b in pc.src)].reshape(box)
            state[name] = dest
    return state


def rows_gpu(model: Path, total: int, n: int, repeats: int) -> tuple[list[Row], dict[str, list[float]]]:
    """Row 5: onto CUDA (page cache warm, best of ``repeats`` after one warm-up, each run ended by a device
    synchronize): ``load()`` against the pinned host-to-device bandwidth, and the whole checkpoint and one rank
    against safetensors' own loading onto the same GPU. Skipped rows without CUDA."""
    figure = "5. load() to CUDA vs pinned host-to-device bandwidth"
    if not torch.cuda.is_available():
        return [Row(figure, "skipped (no CUDA)", "", None, ">= 0.8x", None)], {}
    from safetensors import safe_open

    count = torch.cuda.device_count()
    g = 1 << int(math.log2(min(count, 8)))
    devices = [f"cuda:{i}" for i in range(g)]
    path = model / MODEL_FILE
    pinned = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    h2d = []
    for _ in range(repeats + 1):
        dests = [torch.empty(pinned.shape, dtype=torch.uint8, device=d) for d in devices]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d in dests:
            d.copy_(pinned, non_blocking=True)
        for d in devices:
            torch.cuda.synchronize(d)
        h2d.append(pinned.numel() * g / (time.perf_counter() - t0))
        del dests
    del pinned

    def best(fn: Callable[[], Any]) -> list[float]:
        runs = []
        for _ in range(repeats + 1):
            warm_page_cache(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            state = fn()
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
            del state
            torch.cuda.empty_cache()
        return runs[1:]

    def st_whole() -> dict[str, torch.Tensor]:
        with safe_open(str(path), framework="pt", device="cuda:0") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    rank = min(3, n - 1)
    plan = shardload.plan_model(model, n)
    times = {
        "gpu load()": best(lambda: shardload.load(model, g, devices=devices)),
        "gpu whole shardload": best(lambda: shardload.load(model, 1, devices=["cuda:0"])),
        "gpu whole safetensors": best(st_whole),
        "gpu rank shardload": best(lambda: shardload.load_rank(model, rank, n, device="cuda:0")),
        "gpu rank safetensors": best(lambda: _safetensors_rank(path, plan, rank, "cuda:0")),
    }
    t = {k: min(v) for k, v in times.items()}
    bw_load, bw_h2d = total / t["gpu load()"], max(h2d[1:])
    own = plan.rank_nbytes(rank)
    rows = [
        Row(f"{figure} ({g} GPU)", f"{bw_load / 1e9:.1f} GB/s", f"{bw_h2d / 1e9:.1f} GB/s", bw_load / bw_h2d,
            ">= 0.8x", bw_load / bw_h2d >= 0.8),
        Row("5. whole model to cuda:0: load(m, 1) vs safe_open(device='cuda:0')", seconds(t["gpu whole shardload"]),
            seconds(t["gpu whole safetensors"]), t["gpu whole shardload"] / t["gpu whole safetensors"], "", None),
        Row(f"5. rank {rank} of {n} to cuda:0: load_rank vs safetensors get_slice", seconds(t["gpu rank shardload"]),
            seconds(t["gpu rank safetensors"]), t["gpu rank shardload"] / t["gpu rank safetensors"], "", None),
        Row(f"5. rank {rank} of {n}: load_rank bandwidth vs pinned host-to-device",
            f"{own / t['gpu rank shardload'] / 1e9:.1f} GB/s", f"{bw_h2d / 1e9:.1f} GB/s",
            own / t["gpu rank shardload"] / bw_h2d, "", None),
    ]  # fmt: skip
    return rows, times


# --- the run -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path) -> int:
    """Build (or reuse) the checkpoints under ``work``, measure every row, print the table; 1 if a target fails."""
    n = args.num_shards
    model = work / "model"
    config = ensure_checkpoint(model, args.size_gib, n)
    specs = tensor_specs(config)
    total = checkpoint_nbytes(config)
    largest_name, largest_shape = max(specs, key=lambda s: math.prod(s[1]))
    largest = 2 * math.prod(largest_shape)
    print(
        f"checkpoint: {human_bytes(total)} float16, hidden {config['hidden_size']}, intermediate "
        f"{config['intermediate_size']}, heads {config['num_attention_heads']}/{config['num_key_value_heads']} kv, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}, {len(specs)} tensors, largest "
        f"{human_bytes(largest)} ({largest_name}); N = {n}; {os.cpu_count()} CPUs; torch {torch.__version__}",
        file=sys.stderr,
    )
    warm_page_cache(model / MODEL_FILE)
    fresh_pages_per_allocation()
    load_start = load_average()

    rows: list[Row] = []
    times: dict[str, list[float]] = {}
    notes: list[str] = []
    only = set(args.only)
    if "load" in only:
        r, t = rows_load(model, n, total, args.repeats, args.warmup)
        rows += r
        times.update(t)
    if "bytes" in only:
        r, notes = rows_load_rank(model, n)
        rows += r
    if "convert" in only:
        r, t = rows_convert(model, work, n, largest, args.repeats, args.warmup)
        rows += r
        times.update(t)
    if "peer" not in only:
        pass
    elif args.no_peer:
        rows.append(Row("4. load_rank vs HF tp_plan=auto", "skipped (--no-peer)", "", None, "<= 0.5x", None))
    else:
        try:
            hf_dir = ensure_hf_llama(work / "hf-llama", config)
        except ImportError as err:
            rows.append(Row(f"4. load_rank vs HF: skipped ({err})", "", "", None, "<= 0.5x", None))
        else:
            warm_page_cache(hf_dir / MODEL_FILE)
            r, t, note = rows_peer(hf_dir, args.repeats, args.warmup)
            rows += r
            times.update(t)
            notes.append(note)
    if "gpu" in only:
        r, t = rows_gpu(model, total, n, args.repeats)
        rows += r
        times.update(t)
    if "rank" in only:
        r, t = rows_slices(model, n, max(3, args.repeats))
        rows += r
        times.update(t)

    print(format_table(["figure", "shardload", "baseline", "ratio", "target", "met"], [x.cells() for x in rows]))
    print()
    if notes:
        print("row 2, bytes read per rank (fresh process each):")
    for note in notes:
        print(("  " if note.startswith("rank") else "") + note)
    print("all repetitions (s): " + "; ".join(f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in times.items()))
    print(f"load average at the start and the end (1 min): {load_start} and {load_average()}")
    missed = [x.figure for x in rows if x.ok is False]
    print(f"targets missed: {len(missed)}" + (": " + "; ".join(missed) if missed else ""))
    return 1 if missed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--child`` is internal: it runs one measured operation)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size to build (default 1.0)")
    parser.add_argument("--num-shards", type=int, default=8, help="tensor-parallel size (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the best is reported (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones (default 1)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep it (reused when it matches)")
    parser.add_argument("--no-peer", action="store_true", help="skip the HF transformers comparison (row 4)")
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=list(GROUPS),
        metavar="ROWS",
        help=f"comma-separated row groups to measure, of {','.join(GROUPS)} (rows 1 to 6; default all)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(GROUPS)
    if unknown:
        parser.error(f"--only: unknown row group(s) {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}")
    return args


@contextmanager
def work_dir(keep: Path | None) -> Iterator[Path]:
    """Provide the work directory: ``keep`` (left in place) or a temporary one (removed afterwards)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    tmp = Path(tempfile.mkdtemp(prefix="shardload-bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the benchmark, or with ``--child`` one measured operation in a fresh interpreter."""
    args = parse_args(argv)
    if args.child:
        kind, *rest = args.child
        children = {"convert": child_convert, "load": child_load, "load-rank": child_load_rank, "tp": child_tp,
                    "slice": child_slice}  # fmt: skip
        children[kind](*rest)
        return 0
    if args.num_shards < 1 or args.size_gib <= 0 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("run.py: --num-shards, --size-gib and --repeats must be positive")
    with work_dir(args.keep) as work:
        return run(args, work)


if __name__ == "__main__":
    sys.exit(main())
