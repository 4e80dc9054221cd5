#!/usr/bin/env python
"""One rank's shard from an S3 server: ``load_rank("s3://...")`` against Run:ai's model streamer, side by side.

Usage::

    pip install -e ".[bench]"     # boto3, moto[server], runai-model-streamer, runai-model-streamer-s3
    python benchmarks/object_storage.py [--size-mib 64] [--files 4] [--num-shards 4] [--rank 1] [--repeats 2]

A random float16 Llama-shaped checkpoint (separate q/k/v/o, gate/up/down, embeddings and lm_head) of about
``--size-mib``, stored as an HF multi-file checkpoint of ``--files`` files with its shard_info, is put on a local
S3 server (moto's, in its own process, on 127.0.0.1). Each round times, in turn:

- ``load_rank`` with the default request limits (only the rank's bytes: column slices are read row by row);
- ``load_rank`` with ``MAX_WASTE = inf`` (runs merged through the gaps between them: fewer, larger requests,
  more bytes; the setting for stores where a request costs more than the bytes it saves);
- Run:ai's ``SafetensorsStreamer`` streaming every file of the same checkpoint from the same server, keeping the
  rank's part of each tensor (what a loader built on it must do: it reads whole tensors).

Each time runs from the start of the call until the rank's tensors are in memory (the streamer's includes taking
the rank's slices); shardload's results are checked equal to the streamer's, element for element. Times are the
best of ``--repeats`` interleaved rounds. The server is moto (Python): its per-request cost and its copy of the
whole object for a ranged GET weigh on every client; the machine's load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

import shardload
from shardload.sources import objects
from shardload.sources.location import forget_stores

BUCKET = "shardload-bench"


def make_model(directory: Path, size_mib: int, files: int) -> Path:
    """A random Llama-shaped float16 checkpoint of about ``size_mib`` MiB over ``files`` files, with shard_info."""
    hidden, heads, kv, vocab = 1024, 16, 4, 16384
    inter = 2816
    head = hidden // heads
    per_layer = 2 * (hidden * hidden + 2 * hidden * kv * head + hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, (size_mib << 20) // per_layer - 2)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, hidden)}
    tensors["model.norm.weight"] = rand(hidden)
    for i in range(layers):
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
    weight_map = {}
    for f in range(files):
        part = names[f * len(names) // files : (f + 1) * len(names) // files]
        file_name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file_name))
        weight_map |= {n: file_name for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "num_hidden_layers": layers, "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "float16",
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    from shardload.models.generated import generate

    generate(directory).save(directory / "shard_info.json")
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process (so it does not share this process's GIL), on 127.0.0.1."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", f"from moto.server import main; main(['-H', '127.0.0.1', '-p', '{port}'])"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto's server did not start")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--num-shards", type=int, default=4)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import boto3

    work = Path(tempfile.mkdtemp(prefix="shardload-s3-bench-"))
    local = make_model(work / "model", args.size_mib, args.files)
    server, url = start_server()
    try:
        os.environ.update({
            "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url,
            "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "RUNAI_STREAMER_LOG_LEVEL": "ERROR",
        })  # fmt: skip
        client = boto3.client("s3", endpoint_url=url)
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

        def ours(max_waste: float) -> dict[str, torch.Tensor]:
            objects.MAX_WASTE = max_waste
            forget_stores()
            return shardload.load_rank(uri, args.rank, args.num_shards)

        runs = {
            "load_rank, default limits (exact bytes)": lambda: ours(0.05),
            "load_rank, MAX_WASTE=inf (merged runs)": lambda: ours(float("inf")),
            "Run:ai streamer, whole tensors + slicing": lambda: runai_rank(uri, weights, plan, args.rank),
        }
        best: dict[str, float] = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for label, fn in runs.items():
                t = time.perf_counter()
                got = fn()
                best[label] = min(best[label], time.perf_counter() - t)
                assert got.keys() == want.keys()
                for name in want:
                    assert torch.equal(got[name], want[name]), (label, name)
                del got
    finally:
        server.kill()
        server.wait()
    peer = best["Run:ai streamer, whole tensors + slicing"]
    print(
        f"checkpoint {total / 2**20:.0f} MiB in {len(weights)} files; rank {args.rank} of {args.num_shards} holds "
        f"{own / 2**20:.1f} MiB; best of {args.repeats}; moto server on 127.0.0.1"
    )
    print(f"{'run':44} {'seconds':>8} {'MiB/s of rank':>14} {'vs Run:ai':>10}")
    for label, seconds in best.items():
        print(f"{label:44} {seconds:8.3f} {own / 2**20 / seconds:14.1f} {seconds / peer:9.2f}x")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores (shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
