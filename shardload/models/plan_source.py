"""Which shard_info a model is planned with: the one given, the model's file, or a plan made from config.json.

Every entry point that plans a source checkpoint (``load``, ``load_rank``, ``convert``, ``plan_model``, the
``inspect`` command, a server integration's loader) asks :func:`plan_shard_info`. A shard_info given by the caller
wins, then a ``shard_info.json`` beside the weights; without either, the model is planned in memory from its config.json
(or a GGUF file's metadata) exactly as ``shardload plan`` would write it, and :func:`shard_info_for` logs one
INFO line on the ``shardload.plan`` logger naming that source (the command line prints it as a note).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..errors import PlanError, ShardloadError
from ..format.shard_info import ShardInfo
from ..planning.plan import ModelPlan, resolve_shard_info
from ..planning.presharded import plan_as_loaded
from ..sources.checkpoint import Checkpoint

if TYPE_CHECKING:
    import os

log = logging.getLogger("shardload.plan")
"""Where a plan made on the fly is announced, at INFO: a server's logging configuration decides whether it shows."""


def plan_shard_info(checkpoint: Checkpoint, shard_info: Any) -> tuple[ShardInfo, str]:
    """The shard_info to plan ``checkpoint`` with, and a phrase naming where it came from.

    Raises PlanError when none is given, none lies beside the weights and none can be planned from the config
    (no config.json, or an architecture no plan source knows), saying how to proceed.
    """
    default = checkpoint.default_shard_info()
    if shard_info is not None or default.exists() or default.is_symlink() or checkpoint.split_for is not None:
        info = resolve_shard_info(checkpoint, shard_info)
        return info, f"shard_info {info.source}"
    config = checkpoint.config_file()
    if not (config.exists() or config.is_symlink()):  # `shardload plan` needs it too
        raise PlanError(
            f"no shard_info given and {default} does not exist; write one (docs/format.md) or pass one with "
            f"--shard-info (shard_info= in Python): there is no {config.name} to plan one from",
            file=checkpoint.name,
        )
    from .generated import generate

    try:
        read, key = _config_and_key(checkpoint)
        with _lock:
            kept = None if key is None else _generated.get(key)
            if kept is not None:
                _generated.move_to_end(key)
        if kept is None:
            generated = generate(checkpoint, check_up_to=0, config=read)  # the caller plans for its own N next
            kept = (json.dumps(generated.document), generated.source)  # text: no caller can change what is kept
            if key is not None:
                with _lock:
                    _generated[key] = kept
                    while len(_generated) > KEPT_PLANS:
                        _generated.popitem(last=False)
    except ShardloadError as err:  # the same kind of error, saying first that no file was found
        raise type(err)(
            f"no {default.name} beside the weights, and planning one from {config.name} failed: {err.message}; "
            "or pass one with --shard-info (shard_info= in Python)",
            file=checkpoint.name,
        ) from None
    document, made_from = kept
    info = ShardInfo.from_dict(json.loads(document), source=f"<planned from {config}>")
    return info, f"no {default.name}: planned in memory from {config} ({made_from})"


KEPT_PLANS = 8
"""Shard_infos made from a config that a process keeps: loading the same model again (a server reloading its weights,
another rank in the same process) skips making it (milliseconds a load)."""
_generated: OrderedDict[tuple[Any, ...], tuple[str, str]] = OrderedDict()
_lock = threading.Lock()


def _config_and_key(checkpoint: Checkpoint) -> tuple[dict[str, Any] | None, tuple[Any, ...] | None]:
    """The model config read from config.json, and the key of what a plan made from it depends on: the config's
    content, the checkpoint's kind, every stored tensor's name, dtype and shape, and the registered model families
    (a new one may cover this model type). (None, None) for a format that keeps its config in the weights' own
    metadata (GGUF: reading it costs about what planning does, so such plans are not kept)."""
    from .families import FAMILIES

    fmt = checkpoint.source_format
    if fmt is not None and fmt.read_config is not None:
        return None, None
    config = checkpoint.model_config()
    tensors = tuple((name, t.dtype, t.shape, t.decode) for name, t in checkpoint.tensors.items())
    text = json.dumps(config, sort_keys=True, default=repr)
    return config, (str(checkpoint.config_file()), checkpoint.kind, text, tensors, tuple(map(id, FAMILIES)))


def shard_info_for(checkpoint: Checkpoint, shard_info: Any) -> ShardInfo:
    """:func:`plan_shard_info`'s shard_info; a plan made from the config is announced on :data:`log` at INFO."""
    info, source = plan_shard_info(checkpoint, shard_info)
    if info.source.startswith("<planned from "):
        log.info("%s: %s", checkpoint.name, source)
    return info


def plan_model(
    model: str | os.PathLike[str], num_shards: int, shard_info: ShardInfo | dict[str, Any] | str | Any | None = None
) -> ModelPlan:
    """Plan ``model`` for ``num_shards`` ranks without reading tensor data; raises the first problem.

    Without ``shard_info`` and without a shard_info.json beside the weights, the model is planned from its
    config.json (see :func:`plan_shard_info`).

    Example::

        p = shardload.plan_model("llama-dir", 8)
        print(p.params["model.embed_tokens.weight"].shape)   # per-rank shape
    """
    from ..sources.source_types import open_source

    source = open_source(model)
    if source.derived:
        raise PlanError(f"this is {source.what}; plan the source checkpoint instead", file=source.checkpoint.name)
    checkpoint = source.checkpoint
    return plan_as_loaded(shard_info_for(checkpoint, shard_info), checkpoint, num_shards)
