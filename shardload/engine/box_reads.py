"""Boxes of an old rank tensor read into a new rank's tensor: ``preadv`` runs, one read per contiguous stretch,
or, for many short rows, copies out of a read-only mapping of the old file (used by :mod:`.reshard`)."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING, Any

from ..sources.reader import count_mapped

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..planning.reshard import OldPart
    from ..sources.reader import FileMaps, RunReader
    from ..sources.tensor_info import TensorInfo

SHORT_RUN = 16 << 10
"""Parts whose rows average less than this are copied out of a mapping of the old file, not read row by row."""


def read_parts(
    reader: RunReader,
    info: TensorInfo,
    parts: Sequence[OldPart],
    dest: torch.Tensor,
    maps: FileMaps | None,
    populate: dict[str, bool],
) -> None:
    """Read ``parts`` (boxes of old rank tensor ``info``) into ``dest`` (a contiguous CPU tensor) as one run list,
    or copy them out of ``maps`` when they are many short rows."""
    import numpy as np

    from ..planning.runs import box_runs

    size = dest.element_size()
    if maps is not None and _copy_mapped(maps, info, parts, dest):  # many short runs: copies from a map
        return
    srcs, dsts, lengths = [], [], []
    for part in parts:
        src, dst, run = box_runs(info.shape, part.src, tuple(dest.shape), part.dst)
        if len(src) > 1 and _contiguous(info.shape, part.src):  # one run in the file, many in dest
            _gather(reader, info, part, dest, **populate)
            continue
        srcs.append(src * size + info.offset)
        dsts.append(dst * size)
        lengths.append(np.full(len(src), run * size, dtype=np.int64))
    if not srcs:
        return
    src, dst, length = (np.concatenate(x) for x in (srcs, dsts, lengths))
    order = np.argsort(src, kind="stable")
    buf = np.zeros(len(src), dtype=np.int64)
    reader.read_runs(info.file, src[order], length[order], buf, dst[order], [dest], **populate)


def _copy_mapped(maps: FileMaps, info: TensorInfo, parts: Sequence[OldPart], dest: torch.Tensor) -> bool:
    """Copy ``parts`` of old tensor ``info`` into ``dest`` out of a read-only mapping of its file, counted as read,
    when they are many short rows (a column slice: one ``preadv`` iovec per row costs more); False otherwise, or
    when the file cannot be mapped."""
    import numpy as np

    from ..planning.runs import contiguous_run

    size = dest.element_size()
    rows = sum(prod(b - a for a, b in p.src) // max(1, contiguous_run(info.shape, p.src)) for p in parts)
    nbytes = sum(prod(b - a for a, b in p.src) for p in parts) * size
    if rows < 2 or nbytes >= SHORT_RUN * rows:
        return False
    raw = maps.array(info.file)
    if raw is None or info.offset % size or info.offset + info.nbytes > len(raw):
        return False
    maps.intact(info.file, info.offset + info.nbytes)
    old = raw[info.offset : info.offset + info.nbytes].view(_words(dest).dtype).reshape(info.shape)
    out = _words(dest)
    for part in parts:
        target = out[tuple(slice(a, b) for a, b in part.dst)]
        np.copyto(target, old[tuple(slice(a, b) for a, b in part.src)].reshape(target.shape))
    maps.intact(info.file, info.offset + info.nbytes)  # cut during the copy: zeros were read, never returned
    count_mapped(info.file, nbytes)
    return True


def _contiguous(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``box`` is one contiguous stretch of a row-major tensor of ``shape``."""
    inner = False  # once a dim is cut, every dim before it must have extent 1
    for (a, b), n in zip(reversed(box), reversed(shape), strict=True):
        if inner and b - a != 1:
            return False
        if b - a != n:
            inner = True
    return True


def _gather(reader: RunReader, info: TensorInfo, part: OldPart, dest: torch.Tensor, populate: bool = False) -> None:
    """Read ``part`` (one contiguous stretch of old tensor ``info``) with one read, then copy it into its strided
    place in ``dest`` (one system call instead of one per row)."""
    import numpy as np
    import torch

    target = dest[tuple(slice(a, b) for a, b in part.dst)]
    scratch = torch.empty(target.numel(), dtype=dest.dtype)
    start = (
        info.offset
        + sum(a * st for (a, _), st in zip(part.src, _strides(info.shape), strict=True)) * dest.element_size()
    )
    reader.read_tensor(info.file, start, scratch)
    np.copyto(_words(target), _words(scratch).reshape(target.shape))


def _words(t: torch.Tensor) -> np.ndarray:
    """``t``'s elements as a numpy array of same-size integers (no copy; numpy has no bfloat16): numpy's strided
    copies beat torch's here, whose intra-op threads contend with the readers."""
    return t.view(_int_dtype(t.element_size())).numpy()


def _int_dtype(size: int) -> Any:
    """The torch integer dtype of ``size`` bytes."""
    import torch

    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]
