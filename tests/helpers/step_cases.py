"""Cases of built-in steps and chains of them: a stored shape and dtype, the document-form steps for N and the
numpy reference's steps for N, and whether a case can be planned for N."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Case = tuple[tuple[int, ...], str, Callable[[int], tuple[list[Any], list[tuple]]]]


def step(name: str, *args: Any) -> list[Any]:
    """A document-form step with the output shape left for the shape rule to infer."""
    return [f"shard_funcs.{name}", [None, None], *args]


CASES: dict[str, Case] = {
    "shard_dim0": ((24, 10), "float16", lambda n: ([step("shard_dim", 0, "num_shards")], [("shard_dim", 0, n)])),
    "shard_dim1": ((6, 48), "float32", lambda n: ([step("shard_dim", 1, "num_shards")], [("shard_dim", 1, n)])),
    "shard_dim2_3d": ((4, 6, 24), "int32", lambda n: ([step("shard_dim", 2, "num_shards")], [("shard_dim", 2, n)])),
    "shard_dim_neg": ((5, 24), "int8", lambda n: ([step("shard_dim", -1, "num_shards")], [("shard_dim", 1, n)])),
    "shard_dim_1d": ((48,), "float16", lambda n: ([step("shard_dim", 0, "num_shards")], [("shard_dim", 0, n)])),
    "replicate": ((7, 3), "uint8", lambda n: ([step("replicate", "num_shards")], [("replicate", n)])),
    "qkv_gqa_units": (
        ((8 + 4 + 4) * 3, 5),
        "float16",
        lambda n: (
            [step("reorder_segments", 0, [8, 4, 4], "num_shards", 3), step("shard_dim", 0, "num_shards")],
            [("reorder_segments", 0, [8, 4, 4], n, 3), ("shard_dim", 0, n)],
        ),
    ),
    "gate_up": (
        (48, 7),
        "float32",
        lambda n: (
            [step("reorder_segments", 0, [24, 24], "num_shards"), step("shard_dim", 0, "num_shards")],
            [("reorder_segments", 0, [24, 24], n), ("shard_dim", 0, n)],
        ),
    ),
    "segments_dim1": (
        (5, 48),
        "int32",
        lambda n: (
            [step("reorder_segments", 1, [24, 8, 16], "num_shards"), step("shard_dim", 1, "num_shards")],
            [("reorder_segments", 1, [24, 8, 16], n), ("shard_dim", 1, n)],
        ),
    ),
    "shard_then_reorder": (
        (24, 48),
        "float16",
        lambda n: (
            [step("shard_dim", 0, "num_shards"), step("reorder_segments", 2, [16, 32], 1)],
            [("shard_dim", 0, n), ("reorder_segments", 2, [16, 32], 1)],
        ),
    ),
    "two_reorders": (
        (48, 3),
        "float32",
        lambda n: (
            [
                step("reorder_segments", 0, [24, 24], "num_shards"),
                step("reorder_segments", 0, [24, 24], "num_shards"),
                step("shard_dim", 0, "num_shards"),
            ],
            [("reorder_segments", 0, [24, 24], n), ("reorder_segments", 0, [24, 24], n), ("shard_dim", 0, n)],
        ),
    ),
    "qkv_heads": (
        ((8 + 2 + 2) * 3, 5),
        "float16",
        lambda n: (
            [step("shard_segments", 0, [8, 2, 2], [0, 1, 1], "num_shards", 3)],
            [("shard_segments", 0, [8, 2, 2], [0, 1, 1], n, 3)],
        ),
    ),
    "kv_heads_dim1": (
        (3, 2 * 4),
        "float32",
        lambda n: ([step("shard_segments", 1, [2], [1], "num_shards", 4)], [("shard_segments", 1, [2], [1], n, 4)]),
    ),
    "pad_vocab_vllm": (
        (250, 6),
        "float16",
        lambda n: (
            [step("pad_dim", 0, 64, "num_shards"), step("shard_dim", 0, "num_shards")],
            [("pad_dim", 0, 64, n), ("shard_dim", 0, n)],
        ),
    ),
    "pad_plain_dim1_3d": (
        (2, 3, 23),
        "int32",
        lambda n: (
            [step("pad_dim", -1, "num_shards", "num_shards"), step("shard_dim", 2, "num_shards")],
            [("pad_dim", 2, n, n), ("shard_dim", 2, n)],
        ),
    ),
    "pad_bias_then_replicate": (
        (7,),
        "float32",
        lambda n: (
            [step("pad_dim", 0, 4, "num_shards"), step("replicate", "num_shards")],
            [("pad_dim", 0, 4, n), ("replicate", n)],
        ),
    ),
    "reorder_then_replicate": (
        (24, 2),
        "float16",
        lambda n: (
            [step("reorder_segments", 0, [12, 12], "num_shards"), step("replicate", "num_shards")],
            [("reorder_segments", 0, [12, 12], n), ("replicate", n)],
        ),
    ),
}


def valid(shape: tuple[int, ...], name: str, n: int) -> bool:
    """Whether the case can be planned for n, decided from the case's own sizes (not the library)."""
    needs = {
        "shard_dim0": [24],
        "shard_dim1": [48],
        "shard_dim2_3d": [24],
        "shard_dim_neg": [24],
        "shard_dim_1d": [48],
        "replicate": [],
        "qkv_gqa_units": [8, 4, 4],
        "gate_up": [24, 24],
        "segments_dim1": [24, 8, 16],
        "shard_then_reorder": [24],
        "two_reorders": [24, 24],
        "reorder_then_replicate": [12, 12],
        "qkv_heads": [8],
        "kv_heads_dim1": [],
        "pad_vocab_vllm": [] if 250 % n == 0 else [256],
        "pad_plain_dim1_3d": [],
        "pad_bias_then_replicate": [] if 7 % n == 0 else [8],
    }[name]
    kv_heads = {"qkv_heads": [2, 2], "kv_heads_dim1": [2]}.get(name, [])
    return all(k % n == 0 for k in needs) and all(k % n == 0 or n % k == 0 for k in kv_heads)
