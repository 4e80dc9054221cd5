"""Box rules applied piece by piece, and random sub-boxes of an output shape (hypothesis), for the box-rule
property tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from shardload.planning.registry import lookup


def apply_pieces(fn_name: str, x: np.ndarray, out_box: tuple, args: tuple) -> np.ndarray:
    """Step ``fn_name``'s output on ``out_box``, copied from ``x`` piece by piece as its box rule says."""
    func = lookup(fn_name)
    assert func.boxes is not None
    out = np.full([b - a for a, b in out_box], -1, dtype=x.dtype)
    covered = np.zeros(out.shape, dtype=np.int64)
    for in_box, part in func.boxes(out_box, x.shape, *args):
        rel = tuple(slice(a - o[0], b - o[0]) for (a, b), o in zip(part, out_box, strict=True))
        if in_box is None:  # padding: no source, zeros (only a step registered with pads=True may say so)
            assert func.pads
            out[rel] = 0
        else:
            src = x[tuple(slice(a, b) for a, b in in_box)]
            out[rel] = src.reshape(out[rel].shape)
        covered[rel] += 1
    assert (covered == 1).all(), "pieces must tile the output box exactly once"
    return out


@st.composite
def sub_box(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A random non-empty box inside ``shape``: ``(start, stop)`` per dim."""
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        box.append((a, b))
    return tuple(box)
