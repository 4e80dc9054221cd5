#!/usr/bin/env python
"""Benchmark shardload's convert and load against plain-copy baselines on a Llama-shaped float16 checkpoint.

Usage::

    python benchmarks/bench_core.py [--size-gib 1.0] [--num-shards 8] [--repeats 3] [--warmup 1] [--keep DIR]

It writes a random float16 checkpoint (Phi-3 naming: fused GQA ``qkv_proj``, fused ``gate_up_proj``,
``o_proj``, ``down_proj``, vocab-parallel embeddings and ``lm_head``, replicated norms) with an
N-agnostic shard_info.json, warms the page cache, and times (best of ``--repeats``, after ``--warmup`` untimed rounds):

* ``shardload.convert(model, N, out)`` against ``cp`` of the safetensors file (and ``cp`` + ``sync FILE``,
  since convert fsyncs what it writes);
* ``shardload.load(model, N, devices=["cpu"] * N)`` against a copy floor: every stored tensor copied once
  from a file mapping into a fresh tensor;
* peak ``RssAnon`` of convert, load, the copy floor (each in a fresh interpreter) and ``cp``, sampled every ~10 ms.

Timed repetitions run with glibc's mmap threshold fixed, so each one allocates fresh pages as a one-shot
process would (see ``fresh_pages_per_allocation``); the memory subprocesses keep the default allocator.

It prints one table and exits 0: there are no targets, it only reports.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

import shardload
from shardload.example import EXAMPLE_CONFIG, example_shard_info, example_tensors
from shardload.report import format_table, human_bytes

HEAD_DIM = 64
GQA_GROUP_MIN = 2
BASE_VOCAB = 32000
ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
MODEL_FILE = "model.safetensors"
SAMPLE_INTERVAL_S = 0.01
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


# --- the checkpoint ------------------------------------------------------------------------


def make_config(group: int, layers: int, vocab: int, num_shards: int) -> dict[str, Any]:
    """A Llama/Phi-3-shaped config whose every sharded dim divides by ``num_shards``."""
    kv = num_shards * math.ceil(8 / num_shards)
    heads = group * kv
    hidden = heads * HEAD_DIM
    unit = math.lcm(256, num_shards)
    inter = max(unit, round(hidden * 2.75 / unit) * unit)
    vocab_unit = math.lcm(64, num_shards)
    config = dict(EXAMPLE_CONFIG)
    config.update(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=max(vocab_unit, vocab // vocab_unit * vocab_unit),
        max_position_embeddings=4096,
    )
    return config


def tensor_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape, in the same order and layout as ``shardload.example.example_tensors``."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.qkv_proj.weight", ((heads + 2 * kv) * head_dim, h)),
            (p + "self_attn.o_proj.weight", (h, heads * head_dim)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_up_proj.weight", (2 * inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return specs


def checkpoint_nbytes(config: dict[str, Any]) -> int:
    """Total float16 tensor bytes of ``config``'s checkpoint."""
    return sum(2 * math.prod(shape) for _, shape in tensor_specs(config))


def choose_config(target_bytes: int, num_shards: int) -> dict[str, Any]:
    """Pick hidden size, vocab and layer count so the checkpoint is close to ``target_bytes``.

    Prefers a full 32k vocab, at least 8 layers and the widest model within 3 %; small targets fall
    back to a smaller vocab and fewer layers.
    """
    candidates = []
    for vocab in (BASE_VOCAB, BASE_VOCAB // 2, BASE_VOCAB // 4, BASE_VOCAB // 8):
        for group in range(GQA_GROUP_MIN, 33):
            fixed = checkpoint_nbytes(make_config(group, 0, vocab, num_shards))
            per_layer = checkpoint_nbytes(make_config(group, 1, vocab, num_shards)) - fixed
            layers = max(1, round((target_bytes - fixed) / per_layer))
            config = make_config(group, layers, vocab, num_shards)
            error = abs(checkpoint_nbytes(config) - target_bytes) / target_bytes
            candidates.append((vocab, group, layers, error, config))
    for _vocab, _group, layers, error, config in sorted(candidates, key=lambda c: (-c[0], -c[1])):
        if layers >= 8 and error < 0.03:
            return config
    for _vocab, _group, layers, error, config in sorted(candidates, key=lambda c: (-c[0], c[1])):
        if layers >= 2 and error < 0.1:
            return config
    return min(candidates, key=lambda c: c[3])[4]


def random_f16(rng: np.random.Generator, shape: tuple[int, ...], norm: bool) -> np.ndarray:
    """Random float16 weights (std 0.02), or norm scales around 1.0."""
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= 0.1 if norm else 0.02
    if norm:
        x += 1.0
    return x.astype(np.float16)


def write_checkpoint(model_dir: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Stream the checkpoint into ``model_dir/model.safetensors`` one tensor at a time, plus config and shard_info."""
    model_dir.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    path = model_dir / MODEL_FILE
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for _name, shape in specs:
            fh.write(random_f16(rng, shape, norm=len(shape) == 1).data)
        fh.flush()
        os.fsync(fh.fileno())  # no writeback left to overlap the timings
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / "shard_info.json").write_text(json.dumps(example_shard_info(config), indent=2) + "\n")
    return path


def check_layout_matches_example() -> None:
    """Fail loudly if ``tensor_specs`` drifts from the built-in example's names and shapes."""
    ours = [(n, tuple(s)) for n, s in tensor_specs(EXAMPLE_CONFIG)]
    theirs = [(n, tuple(a.shape)) for n, a in example_tensors(EXAMPLE_CONFIG).items()]
    if ours != theirs:
        raise SystemExit("bench_core: tensor_specs no longer matches shardload.example.example_tensors")


def check_readable(path: Path, config: dict[str, Any]) -> None:
    """Open the written file with the safetensors library and check a few tensors' shapes."""
    from safetensors import safe_open

    expected = dict(tensor_specs(config))
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if sorted(keys) != sorted(expected):
            raise SystemExit("bench_core: the written checkpoint does not list the expected tensors")
        for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
            t = f.get_tensor(name)
            if tuple(t.shape) != expected[name] or t.dtype != torch.float16 or not t.abs().sum():
                raise SystemExit(f"bench_core: {name} reads back wrong")


# --- the baselines -------------------------------------------------------------------------


def read_safetensors_header(mm: mmap.mmap) -> tuple[int, dict[str, Any]]:
    """The data start offset and the tensor entries of a mapped safetensors file."""
    (n,) = struct.unpack("<Q", mm[:8])
    header = json.loads(mm[8 : 8 + n])
    header.pop("__metadata__", None)
    return 8 + n, header


def copy_floor(path: Path) -> list[torch.Tensor]:
    """Copy every stored tensor once from a file mapping into a freshly allocated tensor."""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    base, header = read_safetensors_header(mm)
    out = []
    for entry in header.values():
        a, b = entry["data_offsets"]
        dtype, shape = ST_DTYPES[entry["dtype"]], entry["shape"]
        src = torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=base + a).view(dtype).view(shape)
        dst = torch.empty(shape, dtype=dtype)
        dst.copy_(src)
        out.append(dst)
    return out


def warm_page_cache(path: Path) -> None:
    """Read the whole file once so every timing starts from a warm page cache."""
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(16 << 20)
        while fh.readinto(buf):
            pass


def remove(path: Path) -> None:
    """Delete a file or directory tree if present, then flush pending writeback."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()


# --- timing ----------------------------------------------------------------------------------


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
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Run each named ``(fn, setup)`` once per round: ``warmup`` untimed rounds, then ``repeats`` timed ones."""
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for round_ in range(warmup + repeats):
        for name, (fn, setup) in pairs.items():
            elapsed = timed(fn, setup)
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


# --- memory ----------------------------------------------------------------------------------


def rss_anon_kib(pid: int | str = "self") -> int | None:
    """``RssAnon`` of a process in KiB, or None once it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return None


def child_main(kind: str, model_dir: Path, out_dir: Path, num_shards: int) -> None:
    """Subprocess body: report RssAnon after imports, run one operation, report RssAnon while holding its result."""
    print(f"base_kib {rss_anon_kib()}", flush=True)
    if kind == "convert":
        result: Any = shardload.convert(model_dir, num_shards, out_dir, overwrite=True)
    elif kind == "load":
        result = shardload.load(model_dir, num_shards, devices=["cpu"] * num_shards)
    else:
        result = copy_floor(model_dir / MODEL_FILE)
    print(f"end_kib {rss_anon_kib()}", flush=True)
    del result


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
        raise SystemExit(f"bench_core: {cmd[:4]} failed with exit status {proc.returncode}")
    return peak[0], stdout


def peak_rss_anon(kind: str, model_dir: Path, out_dir: Path, num_shards: int) -> dict[str, int]:
    """Run ``kind`` in a fresh interpreter (default allocator settings); return its peak/base/end RssAnon in KiB."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(model_dir), str(out_dir)]
    peak, stdout = sampled_peak([*cmd, "--num-shards", str(num_shards)])
    reported = dict(line.split(maxsplit=1) for line in stdout.splitlines() if line.startswith(("base_kib", "end_kib")))
    base, end = int(reported["base_kib"]), int(reported["end_kib"])
    return {"peak": max(peak, end), "base": base, "end": end}  # the last samples can miss the final peak


def fresh_pages_per_allocation() -> bool:
    """Fix glibc's mmap threshold at 128 KiB so every big allocation gets fresh pages, as in a one-shot process.

    Without it, glibc's dynamic threshold lets later repetitions reuse heap memory an earlier one faulted
    in, which favours whichever side allocates smaller tensors (load's per-rank shards) and adds noise.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 128 << 10))
    except (OSError, AttributeError):
        return False


# --- the run ---------------------------------------------------------------------------------


def check_outputs_agree(model_dir: Path, converted: Path, num_shards: int) -> None:
    """Loaded shards must equal the converted files' shards (ranks 0 and N-1), or the timings mean nothing."""
    shards = shardload.load(model_dir, num_shards, devices=["cpu"] * num_shards)
    for rank in sorted({0, num_shards - 1}):
        other = shardload.load_rank(converted, rank, num_shards)
        if shards[rank].keys() != other.keys() or not all(torch.equal(shards[rank][k], other[k]) for k in other):
            raise SystemExit(f"bench_core: load and convert disagree for rank {rank}")


def seconds(t: float) -> str:
    """Seconds with millisecond precision."""
    return f"{t:.3f} s"


def mib(kib: int) -> str:
    """KiB as MiB with one decimal."""
    return f"{kib / 1024:.1f} MiB"


def run(size_gib: float, num_shards: int, repeats: int, warmup: int, work: Path) -> None:
    """Build (or reuse) the checkpoint under ``work``, measure everything, print the table."""
    check_layout_matches_example()
    config = choose_config(int(size_gib * (1 << 30)), num_shards)
    model_dir = work / "model"
    path = model_dir / MODEL_FILE
    reuse = (model_dir / "config.json").is_file() and json.loads((model_dir / "config.json").read_text()) == config
    if not reuse:
        remove(model_dir)
        t0 = time.perf_counter()
        write_checkpoint(model_dir, config)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    check_readable(path, config)
    specs = tensor_specs(config)
    largest_name, largest_shape = max(specs, key=lambda s: math.prod(s[1]))
    total = checkpoint_nbytes(config)
    print(
        f"checkpoint: {human_bytes(total)} float16, hidden {config['hidden_size']}, "
        f"intermediate {config['intermediate_size']}, heads {config['num_attention_heads']}/"
        f"{config['num_key_value_heads']} kv, {config['num_hidden_layers']} layers, vocab {config['vocab_size']}, "
        f"{len(specs)} tensors; num_shards {num_shards}; torch threads {torch.get_num_threads()}",
        file=sys.stderr,
    )
    warm_page_cache(path)
    fixed = fresh_pages_per_allocation()
    print(f"glibc mmap threshold fixed at 128 KiB for the timings: {fixed}", file=sys.stderr)

    converted, copied = work / "converted", work / "copy" / MODEL_FILE
    copied.parent.mkdir(exist_ok=True)
    n = num_shards
    t_write = interleaved(
        {
            "convert": (lambda: shardload.convert(model_dir, n, converted, overwrite=True), lambda: remove(converted)),
            "cp": (lambda: subprocess.run(["cp", str(path), str(copied)], check=True), lambda: remove(copied)),
            "cp+sync": (
                lambda: (
                    subprocess.run(["cp", str(path), str(copied)], check=True),
                    subprocess.run(["sync", str(copied)], check=True),
                ),
                lambda: remove(copied),
            ),
        },
        repeats,
        warmup,
    )
    remove(copied)
    t_read = interleaved(
        {
            "load": (lambda: shardload.load(model_dir, n, devices=["cpu"] * n), None),
            "floor": (lambda: copy_floor(path), None),
        },
        repeats,
        warmup,
    )
    check_outputs_agree(model_dir, converted, n)
    mem = {kind: peak_rss_anon(kind, model_dir, work / f"mem-{kind}", n) for kind in ("convert", "load", "floor")}
    cp_peak, _ = sampled_peak(["cp", str(path), str(copied)])
    remove(copied)
    remove(work / "mem-convert")

    best = {k: min(v) for k, v in {**t_write, **t_read}.items()}
    gib = total / (1 << 30)

    def time_row(label: str, ours: str, base: str) -> list[str]:
        return [label, seconds(best[ours]), seconds(best[base]), f"{best[ours] / best[base]:.2f}x"]

    def mem_cell(kind: str) -> str:
        m = mem[kind]
        return f"{mib(m['peak'])} (+{mib(m['peak'] - m['base'])})"

    rows = [
        time_row(f"convert N={n} vs cp (best of {repeats})", "convert", "cp"),
        time_row(f"convert N={n} vs cp + sync FILE (best of {repeats})", "convert", "cp+sync"),
        time_row(f"load N={n} cpu vs copy floor (best of {repeats})", "load", "floor"),
        [
            "  throughput convert | load (GiB/s)",
            f"{gib / best['convert']:.2f} | {gib / best['load']:.2f}",
            f"{gib / best['cp']:.2f} | {gib / best['floor']:.2f}",
            "",
        ],
        ["peak RssAnon convert vs cp (+ over imports)", mem_cell("convert"), f"{mib(cp_peak)} (cp)", ""],
        [
            "peak RssAnon load vs copy floor (+ over imports)",
            mem_cell("load"),
            mem_cell("floor"),
            f"{(mem['load']['peak'] - mem['load']['base']) / max(1, mem['floor']['peak'] - mem['floor']['base']):.2f}x",
        ],
        ["checkpoint size", human_bytes(total), "", ""],
        ["largest tensor", f"{human_bytes(2 * math.prod(largest_shape))} ({largest_name})", "", ""],
    ]
    print(format_table(["measurement", "shardload", "baseline", "ratio"], rows, right=(3,)))
    print()
    print(
        "all repetitions (s): "
        + "; ".join(f"{k} " + " ".join(f"{t:.3f}" for t in v) for k, v in {**t_write, **t_read}.items())
    )
    print(
        "RssAnon after imports / at end (MiB): "
        + "; ".join(f"{k} {m['base'] / 1024:.1f} / {m['end'] / 1024:.1f}" for k, m in mem.items())
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--child`` is internal: it runs one operation for the memory sampler)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size to build (default 1.0)")
    parser.add_argument("--num-shards", type=int, default=8, help="tensor-parallel size (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per timing; the best is reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones (default 1)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep it (reused when it matches)")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "MODEL", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


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
    """Entry point: run the benchmark (or, with ``--child``, one measured operation)."""
    args = parse_args(argv)
    if args.child:
        kind, model, out = args.child
        child_main(kind, Path(model), Path(out), args.num_shards)
        return 0
    if args.num_shards < 1 or args.size_gib <= 0 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("bench_core: --num-shards, --size-gib and --repeats must be positive")
    with work_dir(args.keep) as work:
        run(args.size_gib, args.num_shards, args.repeats, args.warmup, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
