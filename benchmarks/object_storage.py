#!/usr/bin/env python
"""One rank's shard from an S3 server: ``load_rank("s3://...")`` by request cost against Run:ai's model streamer.

Usage::

    pip install -e ".[bench]"     # boto3, moto[server], runai-model-streamer, runai-model-streamer-s3
    python benchmarks/object_storage.py [--hidden 2048] [--intermediate 5632] [--vocab 1024] [--layers 1]
        [--files 1] [--num-shards 8] [--rank 3] [--repeats 2] [--latency-ms 0 5]

A random float16 Llama-shaped checkpoint (separate q/k/v/o, gate/up/down, embeddings and lm_head; by default one
TinyLlama-sized layer with a 1024-token vocabulary, about 96 MB) with its shard_info is put on moto's S3 server (in
its own process, on 127.0.0.1), reached through a proxy in a third process (benchmarks/latency_proxy.py) that adds
``--latency-ms`` before forwarding each request (0: none) and counts the GETs and the bytes they carried. For each
added latency, each round times, in turn:

- ``load_rank`` with the default request cost (``ObjectCost()``, read_options left out);
- ``load_rank`` with ``ObjectCost.exact()`` (exactly the rank's bytes: a column slice is one GET per row; being
  the slow one on moto by far, it runs in the first round only, and ``--skip-exact`` leaves it out);
- ``load_rank`` with ``ObjectCost.merged()`` (runs merged through every gap that fits a request);
- ``load_rank`` with ``object_cost="measure"`` (a fresh store each time: the probe's GETs are in its time and bytes);
- Run:ai's ``SafetensorsStreamer`` streaming every file of the same checkpoint through the same proxy, keeping the
  rank's part of each tensor (what a loader built on it must do: it reads whole tensors).

Each time runs from the start of the call until the rank's tensors are in memory (the streamer's includes taking
the rank's slices); every result is checked equal to the local load, element for element. Times are the best of
``--repeats`` interleaved rounds, with this process's CPU time and the server's and proxy's beside them; bytes are
the bodies of the GETs the proxy served (headers and listings included). moto is a Python server that copies the
object for each ranged GET, so a request costs it tens of milliseconds on a 100 MB object; the machine's load
average is printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

import shardload
from shardload.sources.location import forget_stores, object_path
from shardload.sources.objects import COST_ENV, ObjectCost

BUCKET = "shardload-bench"


def make_model(directory: Path, args: argparse.Namespace) -> Path:
    """A random Llama-shaped float16 checkpoint with its shard_info, over ``args.files`` files."""
    hidden, inter, heads, kv, vocab = args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab
    head = hidden // heads
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, hidden)}
    tensors["model.norm.weight"] = rand(hidden)
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(hidden, hidden),
            p + "self_attn.k_proj.weight": rand(kv * head, hidden),
            p + "self_attn.v_proj.weight": rand(kv * head, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": rand(hidden),
            p + "post_attention_layernorm.weight": rand(hidden),
        }
    tensors["lm_head.weight"] = rand(vocab, hidden)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    files = args.files
    weight_map = {}
    for f in range(files):
        part = names[f * len(names) // files : (f + 1) * len(names) // files]
        file_name = "model.safetensors" if files == 1 else f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file_name))
        weight_map |= {n: file_name for n in part}
    if files > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "num_hidden_layers": args.layers, "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "float16",
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    from shardload.models.generated import generate

    generate(directory).save(directory / "shard_info.json")
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"{what} did not start")


def start_server() -> tuple[subprocess.Popen[bytes], int]:
    """moto's S3 server in its own process (so it does not share this process's GIL), on 127.0.0.1."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", f"from moto.server import main; main(['-H', '127.0.0.1', '-p', '{port}'])"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(port, "moto's server", server)
    return server, port


def start_proxy(upstream: int, work: Path) -> tuple[subprocess.Popen[bytes], int]:
    """benchmarks/latency_proxy.py in its own process, in front of the server."""
    port_file = work / "proxy-port"
    proxy = subprocess.Popen([sys.executable, str(Path(__file__).with_name("latency_proxy.py")), str(upstream),
                              str(port_file)])  # fmt: skip
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    port = int(port_file.read_text())
    wait_for(port, "the proxy", proxy)
    return proxy, port


def proxy_call(url: str, path: str, method: str = "GET") -> dict[str, Any]:
    with urllib.request.urlopen(urllib.request.Request(url + path, method=method)) as answer:
        return json.loads(answer.read())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    """The best round of one run: wall seconds, this process's and the server's (moto + proxy) CPU seconds, GETs
    and the bytes their bodies carried."""

    seconds: float = float("inf")
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    gets: int = 0
    nbytes: int = 0


def rank_part(plan: Any, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's part of a whole tensor, by the same plan (what a loader over whole tensors has to do)."""
    param = plan.params[name]
    pieces = param.pieces(rank)
    assert pieces is not None, name
    out = torch.empty(param.shape, dtype=full.dtype)
    for piece in pieces:
        d = out[tuple(slice(a, b) for a, b in piece.dst)]
        d.copy_(full[tuple(slice(a, b) for a, b in piece.src)].reshape(d.shape))
    return out


def runai_rank(uri: str, files: list[str], plan: Any, rank: int) -> dict[str, torch.Tensor]:
    from runai_model_streamer import SafetensorsStreamer

    out: dict[str, torch.Tensor] = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"{uri}/{f}" for f in files])
        for name, tensor in streamer.get_tensors():
            out[name] = rank_part(plan, name, tensor, rank)
    return out


def print_table(latency_ms: float, best: dict[str, Result], cost: ObjectCost | None) -> None:
    """One added latency's table (markdown), ratios to Run:ai and to the better of exact and merged."""
    peer = best["Run:ai streamer, whole tensors + slicing"]
    floor = min(
        best[k].seconds for k in ("load_rank, ObjectCost.exact()", "load_rank, ObjectCost.merged()") if k in best
    )
    measured = (
        f" (measured: latency {cost.latency * 1000:.1f} ms, bandwidth {cost.bandwidth / 1e6:.0f} MB/s over "
        f"{cost.concurrency} requests, break-even gap {cost.merge_gap / 1e3:.0f} kB)"
    )
    load = os.getloadavg()
    print(f"\nadded latency {latency_ms:g} ms per request{measured if cost else ''}; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    against = "exact, merged" if "load_rank, ObjectCost.exact()" in best else "merged"
    print("| run | s | client CPU s | server CPU s | GETs | MB moved | time vs Run:ai | bytes vs Run:ai "
          f"| time vs best of {against} |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in best.items():
        print(
            f"| {label} | {r.seconds:.2f} | {r.client_cpu:.2f} | {r.server_cpu:.2f} | {r.gets} | "
            f"{r.nbytes / 1e6:.1f} | {r.seconds / peer.seconds:.2f}x | {r.nbytes / peer.nbytes:.2f}x | "
            f"{r.seconds / floor:.2f}x |",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--num-shards", type=int, default=8)
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 5.0])
    ap.add_argument("--skip-exact", action="store_true", help="leave ObjectCost.exact() out (minutes on moto)")
    args = ap.parse_args()

    import boto3

    work = Path(tempfile.mkdtemp(prefix="shardload-s3-bench-"))
    local = make_model(work / "model", args)
    server, port = start_server()
    proxy, proxy_port = start_proxy(port, work)
    url = f"http://127.0.0.1:{proxy_port}"
    results: dict[float, dict[str, Result]] = {}
    measured: dict[float, ObjectCost] = {}
    try:
        os.environ.update({
            "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url,
            "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "RUNAI_STREAMER_LOG_LEVEL": "ERROR",
        })  # fmt: skip
        os.environ.pop(COST_ENV, None)
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")  # uploads go to moto directly
        client.create_bucket(Bucket=BUCKET)
        files = sorted(p.name for p in local.iterdir() if p.is_file())
        for f in files:
            client.upload_file(str(local / f), BUCKET, f"model/{f}")
        uri = f"s3://{BUCKET}/model"
        weights = sorted(f for f in files if f.endswith(".safetensors"))
        total = sum((local / f).stat().st_size for f in weights)
        plan = shardload.plan_model(local, args.num_shards)
        want = shardload.load_rank(local, args.rank, args.num_shards)
        own = sum(t.numel() * t.element_size() for t in want.values())

        def ours(cost: Any) -> Callable[[], dict[str, torch.Tensor]]:
            options = None if cost is None else shardload.ReadOptions(object_cost=cost)
            return lambda: shardload.load_rank(uri, args.rank, args.num_shards, read_options=options)

        runs: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
            "load_rank, default cost": ours(None),
            "load_rank, ObjectCost.exact()": ours(ObjectCost.exact()),
            "load_rank, ObjectCost.merged()": ours(ObjectCost.merged()),
            'load_rank, object_cost="measure"': ours("measure"),
            "Run:ai streamer, whole tensors + slicing": lambda: runai_rank(uri, weights, plan, args.rank),
        }
        if args.skip_exact:
            del runs["load_rank, ObjectCost.exact()"]
        rounds = f"best of {args.repeats}" + ("" if args.skip_exact else " (exact: 1)")
        print(
            f"checkpoint {total / 1e6:.1f} MB in {len(weights)} file(s); rank {args.rank} of {args.num_shards} holds "
            f"{own / 1e6:.1f} MB; {rounds}; moto server on 127.0.0.1 behind a counting proxy",
            flush=True,
        )
        for latency_ms in args.latency_ms:
            proxy_call(url, f"/__delay?seconds={latency_ms / 1000}", "POST")
            best = results[latency_ms] = {label: Result() for label in runs}
            for round_ in range(args.repeats):
                for label, fn in runs.items():
                    if round_ and "exact" in label:
                        continue
                    forget_stores()  # every run starts from a fresh store (its client, its measured cost)
                    proxy_call(url, "/__reset", "POST")
                    cpu, served = time.process_time(), cpu_seconds(server.pid) + cpu_seconds(proxy.pid)
                    t = time.perf_counter()
                    got = fn()
                    seconds = time.perf_counter() - t
                    cpu, served = time.process_time() - cpu, cpu_seconds(server.pid) + cpu_seconds(proxy.pid) - served
                    stats = proxy_call(url, "/__stats")
                    if "measure" in label:
                        measured[latency_ms] = object_path(uri).store.measured_cost("model/" + weights[0])
                    if seconds < best[label].seconds:
                        best[label] = Result(seconds, cpu, served, stats["gets"], stats["get_bytes"])
                    assert got.keys() == want.keys()
                    for name in want:
                        assert torch.equal(got[name], want[name]), (label, name)
                    del got
            print_table(latency_ms, best, measured.get(latency_ms))
    finally:
        for process in (proxy, server):
            process.kill()
            process.wait()
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores (shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
