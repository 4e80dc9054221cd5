"""Padding a dim with zeros so that N ranks can split it: ``shard_funcs.pad_dim``.

A vocabulary of 50257 rows (or 32001 after one added token) cannot be split evenly by most N.
``pad_dim`` appends zero rows so that N divides the dim, and a ``shard_dim`` after it splits the
padded tensor. It is an index remap with a zero-filled region (registered ``pads=True``): a rank's
stored rows are read as any other slice, and its padding is written as zeros without a read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shard_funcs import _check_n, _norm_dim
from shardload.errors import StepArgumentError
from shardload.planning.registry import Box, Shape, register

if TYPE_CHECKING:
    import torch

__all__ = ["pad_dim", "padded_size"]


def padded_size(size: int, multiple: int, num_shards: int) -> int:
    """The size ``pad_dim`` gives a dim of ``size``: kept when ``num_shards`` divides it, else rounded up to a
    multiple of ``multiple``, which ``num_shards`` must then divide."""
    _check_n(num_shards)
    if multiple < 1:
        raise StepArgumentError(f"multiple must be >= 1, got {multiple}")
    if size % num_shards == 0:
        return size
    padded = -(-size // multiple) * multiple
    if padded % num_shards:
        raise StepArgumentError(
            f"size {size} padded to {padded} (a multiple of {multiple}) is not divisible by num_shards={num_shards}"
        )
    return padded


def _pad_shape(in_shape: Shape, dtype: str, dim: int, multiple: int, num_shards: int) -> tuple[Shape, str]:
    d = _norm_dim(dim, len(in_shape))
    out = list(in_shape)
    out[d] = padded_size(in_shape[d], multiple, num_shards)
    return tuple(out), dtype


def _pad_boxes(out_box: Box, in_shape: Shape, dim: int, multiple: int, num_shards: int) -> list[tuple[Box | None, Box]]:
    d = _norm_dim(dim, len(in_shape))
    size = in_shape[d]
    a, b = out_box[d]
    pieces: list[tuple[Box | None, Box]] = []
    if a < size:  # stored elements: the same coordinates in the input
        part = list(out_box)
        part[d] = (a, min(b, size))
        pieces.append((tuple(part), tuple(part)))
    if b > size:  # past the stored size: padding, no source
        part = list(out_box)
        part[d] = (max(a, size), b)
        pieces.append((None, tuple(part)))
    return pieces


@register("shard_funcs.pad_dim", shape=_pad_shape, boxes=_pad_boxes, pads=True)
def pad_dim(x: torch.Tensor, dim: int, multiple: int, num_shards: int) -> torch.Tensor:
    """Append zeros along ``dim`` so ``num_shards`` divides it: a size N divides is kept, any other is rounded up
    to a multiple of ``multiple`` (64: vLLM's vocabulary rule; ``num_shards``: the least padding)."""
    import torch

    d = dim % x.dim()
    size = x.shape[d]
    padded = padded_size(size, multiple, num_shards)
    if padded == size:
        return x
    shape = list(x.shape)
    shape[d] = padded - size
    return torch.cat([x, x.new_zeros(shape)], dim=d)
