"""Benchmark checkpoints: a random Llama-shaped float16 checkpoint (Phi-3 naming) with its N-agnostic
shard_info, sized to a target, and the same model as an HF ``LlamaForCausalLM`` (separate q/k/v and
gate/up) with a shard_info that matches transformers' own tensor-parallel plan.

Both are written once under a work directory and reused while their config is unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardload.cli.example import EXAMPLE_CONFIG, example_shard_info, example_tensors

HEAD_DIM = 64
GQA_GROUP_MIN = 2
BASE_VOCAB = 32000
MODEL_FILE = "model.safetensors"


# --- the checkpoint ------------------------------------------------------------------------


def drop(path: Path) -> None:
    """Evict ``path`` from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: Path) -> None:
    """Read the whole file once, sequentially (16 MiB reads, readahead on): every page cached, in the large folios
    a download or ``cat`` leaves."""
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(16 << 20)
        while fh.readinto(buf):
            pass


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def fresh_pages_per_allocation() -> bool:
    """Fix glibc's mmap threshold at 128 KiB so every big allocation gets fresh pages, as in a one-shot process.

    Without it, glibc's dynamic threshold lets later allocations reuse heap memory an earlier one faulted in,
    which favours whichever side allocates smaller tensors and adds noise.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 128 << 10))
    except (OSError, AttributeError):
        return False


def read_io() -> int:
    """Bytes this process has fetched from storage."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def covering_chunks(plan: Any, rank: int, unit: int) -> tuple[int, set[int]]:
    """Rank ``rank``'s bytes under ``plan`` (a tensor without byte runs, one a compute step needs whole, counts
    whole), and the indices of the ``unit``-byte chunks of the file holding them: with ``unit`` the page size,
    its page floor (a page shared with another rank's bytes is read whole)."""
    from shardload.planning.runs import param_runs

    own, chunks = 0, set()
    for p in plan.params.values():
        runs = param_runs(p, [rank])
        if runs is None:
            first, last = np.array([p.source.offset]), np.array([p.source.offset + p.source.nbytes - 1])
            own += p.source.nbytes
        else:
            first, last = runs.src, runs.src + runs.length - 1
            own += int(runs.length.sum())
        for a, b in zip((first // unit).tolist(), (last // unit).tolist(), strict=True):
            chunks.update(range(a, b + 1))
    return own, chunks


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
    """Every tensor's name and shape, in the same order and layout as ``shardload.cli.example.example_tensors``."""
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
        raise SystemExit("checkpoints: tensor_specs no longer matches shardload.cli.example.example_tensors")


def check_readable(path: Path, config: dict[str, Any]) -> None:
    """Open the written file with the safetensors library and check a few tensors' shapes."""
    from safetensors import safe_open

    expected = dict(tensor_specs(config))
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if sorted(keys) != sorted(expected):
            raise SystemExit("checkpoints: the written checkpoint does not list the expected tensors")
        for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
            t = f.get_tensor(name)
            if tuple(t.shape) != expected[name] or t.dtype != torch.float16 or not t.abs().sum():
                raise SystemExit(f"checkpoints: {name} reads back wrong")


def remove(path: Path) -> None:
    """Delete a file or directory tree if present, then flush pending writeback."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()


def ensure_checkpoint(model_dir: Path, size_gib: float, num_shards: int) -> dict[str, Any]:
    """Write (or reuse, when its config matches) the ~``size_gib`` checkpoint in ``model_dir``; return its config."""
    check_layout_matches_example()
    config = choose_config(int(size_gib * (1 << 30)), num_shards)
    config_file = model_dir / "config.json"
    if not (config_file.is_file() and json.loads(config_file.read_text()) == config):
        remove(model_dir)
        t0 = time.perf_counter()
        write_checkpoint(model_dir, config)
        print(f"wrote {model_dir / MODEL_FILE} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    check_readable(model_dir / MODEL_FILE, config)
    return config


# --- the same model for HF transformers ------------------------------------------------------------


def hf_llama_config(config: dict[str, Any]) -> dict[str, Any]:
    """The LlamaConfig keywords for ``config``'s dimensions (untied embeddings, float16)."""
    return {
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "num_hidden_layers": config["num_hidden_layers"],
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }


def hf_shard_info(config: dict[str, Any]) -> dict[str, Any]:
    """shard_info for an HF Llama, matching transformers' tp_plan: colwise = dim 0, rowwise = dim 1, vocab dim 0."""

    def shard(dim: int) -> list[list[Any]]:
        return [["shard_funcs.shard_dim", [None, None], dim, "num_shards"]]

    params: dict[str, Any] = {"model.embed_tokens.weight": shard(0), "lm_head.weight": shard(0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            params[f"{p}{name}.weight"] = shard(0)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            params[f"{p}{name}.weight"] = shard(1)
    return {"version": 1, "num_shards": None, "params": params}


def ensure_hf_llama(model_dir: Path, config: dict[str, Any]) -> Path:
    """Write (or reuse) a random-weight HF Llama of ``config``'s dimensions with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    wanted = hf_llama_config(config)
    stamp = model_dir / "bench_config.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return model_dir
    remove(model_dir)
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        model = LlamaForCausalLM(LlamaConfig(**wanted))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(model_dir)
    del model
    (model_dir / "shard_info.json").write_text(json.dumps(hf_shard_info(config), indent=2) + "\n")
    stamp.write_text(json.dumps(wanted))
    os.sync()
    print(f"wrote HF Llama {model_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model_dir
