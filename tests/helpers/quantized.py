"""Random quantized modules, one builder per format (its stored tensors and their dequantizer), the rank's part of
a dequantized weight, and a GGUF writer: what the quantized-format tests build their checkpoints from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from helpers import quant_reference as qref
from helpers import reference as ref
from shardload.models.placement import Placement

Tensors = dict[str, torch.Tensor]
Dequant = Callable[[Tensors], np.ndarray]
Builder = Callable[[np.random.Generator, str, int, int], tuple[Tensors, Dequant]]
"""``build(rng, prefix, out, in)``: one module's stored tensors (full names) and its dequantizer."""


def local_tensors(state: Tensors, prefix: str) -> Tensors:
    """The tensors of module ``prefix`` in ``state``, by suffix."""
    return {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}


def rank_reference(full: np.ndarray, split: Placement, n: int, r: int) -> np.ndarray:
    """Rank r's part of a dequantized weight under ``split``, from the dense reference."""
    kv = tuple(int(f) for f in split.kv)
    return ref.rank_part(full, split.dim, n, r, split.segments, kv, split.unit)


def _random_words(rng: np.random.Generator, shape: tuple[int, ...], dtype: str = "int32") -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(dtype))


def _scales(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy((rng.random(shape) * 0.1 + 0.01).astype(np.float16))


def mlc_module(rng: np.random.Generator, prefix: str, out: int, inp: int, group: int = 32) -> tuple[Tensors, Dequant]:
    """MLC-LLM q4f16_1: q_weight uint32 [out, in/8], q_scale [out, in/group]."""
    tensors = {
        f"{prefix}.q_weight": _random_words(rng, (out, inp // 8), "uint32"),
        f"{prefix}.q_scale": _scales(rng, (out, inp // group)),
    }

    def dequant(local: Tensors) -> np.ndarray:
        return qref.mlc_dequant(local["q_weight"].numpy(), local["q_scale"].numpy())

    return tensors, dequant


def gptq_module(
    rng: np.random.Generator, prefix: str, out: int, inp: int, group: int = 32, desc_act: bool = False
) -> tuple[Tensors, Dequant]:
    """GPTQ 4-bit: qweight [in/8, out], qzeros [groups, out/8], scales [groups, out], g_idx [in]."""
    groups = inp // group
    g_idx = np.arange(inp) // group
    if desc_act:  # act-order: inputs visit groups in a data-dependent order
        g_idx = rng.permutation(g_idx)
    tensors = {
        f"{prefix}.qweight": _random_words(rng, (inp // 8, out)),
        f"{prefix}.qzeros": _random_words(rng, (groups, out // 8)),
        f"{prefix}.scales": _scales(rng, (groups, out)),
        f"{prefix}.g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }

    def dequant(local: Tensors) -> np.ndarray:
        return qref.gptq_dequant(*(local[k].numpy() for k in ("qweight", "qzeros", "scales", "g_idx")))

    return tensors, dequant


def awq_module(rng: np.random.Generator, prefix: str, out: int, inp: int, group: int = 32) -> tuple[Tensors, Dequant]:
    """AWQ GEMM 4-bit: qweight [in, out/8], qzeros [groups, out/8], scales [groups, out]."""
    tensors = {
        f"{prefix}.qweight": _random_words(rng, (inp, out // 8)),
        f"{prefix}.qzeros": _random_words(rng, (inp // group, out // 8)),
        f"{prefix}.scales": _scales(rng, (inp // group, out)),
    }

    def dequant(local: Tensors) -> np.ndarray:
        return qref.awq_dequant(*(local[k].numpy() for k in ("qweight", "qzeros", "scales")))

    return tensors, dequant


def fp8_module(
    rng: np.random.Generator, prefix: str, out: int, inp: int, kind: str = "channel"
) -> tuple[Tensors, Dequant]:
    """FP8 ``float8_e4m3fn`` weight with a per-tensor, per-channel or 128x128-block scale."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    weight = (torch.randn((out, inp), generator=gen) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
    if kind == "tensor":
        name, scale = "weight_scale", torch.rand(1, generator=gen) + 0.1
    elif kind == "channel":
        name, scale = "weight_scale", torch.rand(out, 1, generator=gen) + 0.1
    else:  # 128x128 blocks, ceil division; DeepSeek/Qwen FP8 call the multiplier weight_scale_inv
        name, scale = "weight_scale_inv", torch.rand(-(-out // 128), -(-inp // 128), generator=gen) + 0.1

    def dequant(local: Tensors) -> np.ndarray:
        return qref.fp8_dequant(local["weight"].float().numpy(), local[name].numpy())

    return {f"{prefix}.weight": weight, f"{prefix}.{name}": scale}, dequant


def save_gguf(path: Path, data: dict[str, tuple[np.ndarray, Any]], **metadata: int) -> None:
    """Write ``name -> (array, GGML type or None for a plain one)`` as a llama GGUF file; ``metadata`` names
    GGUFWriter ``add_*`` calls (``head_count=4``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)  # test-side: keys are the callers' own literals
    for name, (value, qtype) in data.items():
        writer.add_tensor(name, value, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
