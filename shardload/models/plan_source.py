"""Which shard_info a model is planned with: the one given, the model's file, or a plan made from config.json."""

from __future__ import annotations

from typing import Any

from ..format.shard_info import ShardInfo
from ..planning.plan import resolve_shard_info
from ..sources.checkpoint import Checkpoint


def plan_shard_info(checkpoint: Checkpoint, shard_info: Any) -> tuple[ShardInfo, str]:
    """The shard_info to plan ``checkpoint`` with, and a phrase naming where it came from."""
    default = checkpoint.default_shard_info()
    if shard_info is not None or default.exists() or default.is_symlink() or checkpoint.presharded is not None:
        info = resolve_shard_info(checkpoint, shard_info)
        return info, f"shard_info {info.source}"
    from .presets import generate

    generated = generate(checkpoint.path, check_up_to=0)  # the caller plans for its own N next
    info = ShardInfo.from_dict(generated.document, source=f"<planned from {checkpoint.root / 'config.json'}>")
    return info, f"no shard_info.json: planned in memory from config.json ({generated.style} style)"
