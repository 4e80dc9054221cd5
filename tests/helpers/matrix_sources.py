"""One model written as every kind of source shardload reads, each by its format's own writer (safetensors,
TVM's ``dump_tensor_cache``, gguf's ``GGUFWriter``), for tests/test_equivalence.py (the Hub cache: helpers/hub.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def read_state(model: Path) -> dict[str, torch.Tensor]:
    """The full tensors of a single-file checkpoint, read by safetensors itself."""
    return load_file(str(model / "model.safetensors"))


def write_index(single: Path, out: Path, files: int = 3) -> Path:
    """``single``'s tensors spread over ``files`` safetensors files with an HF ``model.safetensors.index.json``."""
    out.mkdir(parents=True)
    state = read_state(single)
    names = sorted(state)
    weight_map = {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = {name: state[name] for name in names[k::files]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy(single / "config.json", out / "config.json")
    return out


def write_tvm(single: Path, out: Path, shard_info: Path) -> Path:
    """``single``'s tensors as a TVM tensor cache (raw records, one data file each) with ``shard_info``."""
    from tvm.contrib import tvmjs

    params = {name: t.numpy() for name, t in read_state(single).items()}
    tvmjs.dump_tensor_cache(params, str(out), encode_format="raw", shard_cap_mb=0, show_progress=False)
    shutil.copy(shard_info, out / "shard_info.json")
    return out


def write_gguf(single: Path, out: Path, shard_info: Path) -> Path:
    """``single``'s tensors (float32, the checkpoint's names) as ``out/model.gguf``, with ``shard_info`` beside it."""
    import gguf

    out.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), "llama")
    for name, t in read_state(single).items():
        writer.add_tensor(name, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copy(shard_info, out / "shard_info.json")
    return out / "model.gguf"


def write_tvm_presharded(single: Path, out: Path, shard_info: Path, ranks: list[dict[str, torch.Tensor]]) -> Path:
    """``single`` as a TVM cache pre-sharded for ``len(ranks)`` ranks as MLC-LLM writes one (TVM's own writer):
    ``NAME_shard-K-of-N`` records holding ``ranks[K-1][NAME]`` for every tensor the ranks hold differently, the
    others stored whole; ``shard_info`` beside it says how each whole parameter splits."""
    from tvm.contrib import tvmjs

    n = len(ranks)
    records = {}
    for name, full in read_state(single).items():
        if all(rank[name].shape == full.shape and rank[name].equal(full) for rank in ranks):
            records[name] = full.numpy()
        else:
            records.update({f"{name}_shard-{k + 1}-of-{n}": ranks[k][name].numpy() for k in range(n)})
    tvmjs.dump_tensor_cache(records, str(out), encode_format="raw", shard_cap_mb=0, show_progress=False)
    shutil.copy(shard_info, out / "shard_info.json")
    return out
