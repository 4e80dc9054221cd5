"""Independent numpy references for quantized formats that have no reference package, from their definitions.

MLC-LLM ``q4f16_1``: ``q_weight`` uint32 ``[out, in/8]`` holds 8 unsigned 4-bit values per word,
value j in bits 4j..4j+3; ``w = (q - 7) * q_scale[:, i // group]``.
GPTQ (v1 checkpoints): ``qweight`` int32 ``[in/8, out]`` packed along the input dim, ``qzeros``
``[groups, out/8]`` packed along the output dim, stored minus one; ``scales`` ``[groups, out]``;
``w[o, i] = (q[i, o] - (z[g_idx[i], o] + 1)) * scales[g_idx[i], o]``.
AWQ (GEMM): ``qweight`` ``[in, out/8]`` and ``qzeros`` ``[groups, out/8]`` with the 8 values of a
word in the order 0, 2, 4, 6, 1, 3, 5, 7; ``w[o, i] = (q[i, o] - z[i // group, o]) * scales[i // group, o]``.
FP8: ``w = weight * scale`` with the scale per tensor, per output row, or per 128x128 block
(ceil division: the last block of a dim may be partial).
"""

from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack(words: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Unsigned ``bits``-bit values from 32-bit words along ``axis``; slot j of a word is value ``order[j]``."""
    per = 32 // bits
    u = np.moveaxis(words.view(np.uint32), axis, -1).astype(np.int64)
    slots = np.stack([(u >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], axis=-1)
    if order is not None:
        values = np.empty_like(slots)
        values[..., list(order)] = slots
        slots = values
    out = slots.reshape(*u.shape[:-1], u.shape[-1] * per)
    return np.moveaxis(out, -1, axis)


def mlc_dequant(q_weight: np.ndarray, q_scale: np.ndarray) -> np.ndarray:
    """MLC q4f16_1: ``[out, in]`` float32."""
    q = unpack(q_weight, 4, axis=1)
    group = q.shape[1] // q_scale.shape[1]
    return (q - 7).astype(np.float32) * np.repeat(q_scale.astype(np.float32), group, axis=1)


def gptq_dequant(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """GPTQ 4-bit: ``[out, in]`` float32."""
    q = unpack(qweight, 4, axis=0)  # [in, out]
    z = unpack(qzeros, 4, axis=1) + 1  # [groups, out]
    w = (q - z[g_idx]).astype(np.float32) * scales.astype(np.float32)[g_idx]
    return w.T


def awq_dequant(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """AWQ GEMM 4-bit: ``[out, in]`` float32."""
    q = unpack(qweight, 4, axis=1, order=AWQ_ORDER)  # [in, out]
    z = unpack(qzeros, 4, axis=1, order=AWQ_ORDER)  # [groups, out]
    group = q.shape[0] // z.shape[0]
    g = np.arange(q.shape[0]) // group
    w = (q - z[g]).astype(np.float32) * scales.astype(np.float32)[g]
    return w.T


def fp8_dequant(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """FP8 weight ``[out, in]`` (as float32 values) times its scale: per tensor, per row, or per block (ceil)."""
    rows, cols = weight.shape
    s = scale.astype(np.float32)
    if s.size == 1:
        full = np.full((rows, cols), s.reshape(()))
    elif s.ndim == 1 or s.shape == (rows, 1):
        full = np.repeat(s.reshape(rows, 1), cols, axis=1)
    else:
        full = np.repeat(np.repeat(s, block[0], axis=0)[:rows], block[1], axis=1)[:, :cols]
    return weight.astype(np.float32) * full
