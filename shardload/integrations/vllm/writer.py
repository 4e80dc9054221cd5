"""``shardload convert --layout vllm``: write vLLM's ``sharded_state`` layout, which stock vLLM serves with
``load_format="sharded_state"`` and no plugin.

One file per tensor-parallel rank, ``model-rank-{r}-part-0.safetensors``, holding vLLM's parameter names and its
per-rank layout: ``qkv_proj`` = [this rank's q rows; its k rows; its v rows], ``gate_up_proj`` = [gate; up]
(GPTQ's and AWQ's tensors, which keep the output dim last, joined along their columns), row-parallel weights split
by columns, embeddings and the LM head padded with zero rows to a multiple of 64 and
split by rows (a tied LM head is stored once, under ``lm_head.weight``, the key vLLM keeps). The rank tensors come
from the model's shard_info (or a plan made in memory from config.json), streamed one parameter at a time; the
output is staged and published like :func:`shardload.convert`'s, with a manifest so ``shardload verify`` checks
it. The source is any :func:`~shardload.sources.source_types.open_source` opens: a checkpoint, a converted directory,
or a ``sharded_state`` directory (:mod:`.sharded_state`). Never imports vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...engine.integrity import verifier, wrapped
from ...engine.load_options import Verify, verify_value
from ...engine.output import (
    StagingDir,
    check_output,
    integrity_entry,
    publish_with_manifest,
    source_paths,
    stamp_sources,
    write_error,
)
from ...engine.reshard import (
    RECORD_KEY,
    VALUE_BYTES,
    ShardsSource,
    record_of,
    source_record,
)
from ...engine.routes import boxes_to_write
from ...engine.run import iter_shards, materialize
from ...engine.transfer import reader_for_plan
from ...engine.writer import FileWriter, WrittenFile, new_conversion, write_output_record, written_record
from ...errors import ShardloadError
from ...format.input_log import records_inputs
from ...planning.plan import ParamPlan
from ...sources.checkpoint import Checkpoint, local_output, read_config
from ...sources.manifest import (
    CONVERSION_KEY,
    LEAVES_MANIFEST_VERSION,
    MANIFEST_VERSION,
    VLLM_MANIFEST_FORMAT,
    digest_to_write,
)
from ...sources.object_reader import reader_for
from ...sources.source_types import ConvertedBoxes, SavedBoxes, as_boxes, open_source
from ...version import __version__
from ..fill import KeptWhole
from . import split_format
from .layout import VllmLayout, VllmTensor, plan_layout
from .names import SHAPE_SUFFIX, vocab_range
from .sharded_state import FILE_PATTERN

if TYPE_CHECKING:
    import torch

CONFIG_NAME = "config.json"
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""Stored dtypes vLLM's GPTQ counts as unquantized when it lists a checkpoint's quantized modules."""


def _as_vllm(t: VllmTensor, shard: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor as vLLM keeps it: transposed, or zeros off rank 0, where ``t`` says so."""
    if t.first_rank_only and rank:
        return shard.new_zeros(shard.shape)
    return shard.transpose(1, 2) if t.transposed else shard


def rank_tensors(
    layout: VllmLayout,
    num_shards: int,
    shards: ShardsSource | None = None,
    wrap: Callable[[Any], Any] | None = None,
) -> Iterator[tuple[VllmTensor, list[torch.Tensor]]]:
    """Each output tensor of ``layout`` for every rank, in file order, one parameter's worth in memory at a time;
    with ``shards`` (a converted directory planned over its recorded stored tensors) read out of its rank files;
    ``wrap``: a verifying reader of the source checkpoint."""
    import torch

    raw = reader_for_plan(layout.plan.params.values()) if shards is None else reader_for(shards.checkpoint.path)
    with wrapped(raw, wrap) as reader:
        for t in layout.tensors:
            if not t.vocab:
                break
            vocab = layout.vocab_plan.params[t.parts[0]]
            whole = materialize(vocab, reader, [0])[0] if shards is None else shards.tensor(vocab, 0, reader)
            rows = []
            for r in range(num_shards):
                start, stop, per_rank = vocab_range(whole.shape[0], r, num_shards)
                shard = torch.zeros((per_rank, *whole.shape[1:]), dtype=whole.dtype)
                shard[: stop - start].copy_(whole[start:stop])
                rows.append(shard)
            yield t, rows
    pending: dict[str, list[torch.Tensor]] = {}
    order = iter(t for t in layout.tensors if not t.vocab and t.constant is None)
    want = next(order, None)
    kept = [n for n in layout.plan.params if n.endswith(SHAPE_SUFFIX)]  # vLLM keeps weight_shape whole
    shapes = KeptWhole.of(layout.plan.checkpoint, layout.shard_info, kept, num_shards)
    for param, per_rank in _body(layout, num_shards, shards, wrap):
        shapes.check(param.name, per_rank[0])  # what the plan's steps check in the value still holds
        pending[param.name] = per_rank
        while want is not None and all(p in pending for p in want.parts):
            pieces = [pending.pop(p) for p in want.parts]
            if want.experts:
                per = len(pieces) // want.experts
                groups = [pieces[e * per : (e + 1) * per] for e in range(want.experts)]
                mine = [
                    groups[r * want.local : (r + 1) * want.local] if want.local else groups for r in range(num_shards)
                ]
                yield want, [torch.stack([torch.cat([p[r] for p in g]) for g in mine[r]]) for r in range(num_shards)]
            elif len(pieces) == 1:  # as it is (a torch.cat of one piece would copy it for nothing)
                yield want, [_as_vllm(want, pieces[0][r], r) for r in range(num_shards)]
            else:
                yield want, [torch.cat([p[r] for p in pieces], dim=want.dim) for r in range(num_shards)]
            want = next(order, None)
    for t in layout.tensors:
        if t.constant is not None:
            yield t, [torch.full(t.shape, t.constant, dtype=torch.float32) for _ in range(num_shards)]


def _body(
    layout: VllmLayout, num_shards: int, shards: ShardsSource | None, wrap: Callable[[Any], Any] | None = None
) -> Iterator[tuple[ParamPlan, list[torch.Tensor]]]:
    """Every body parameter's tensors for all ranks, from the source checkpoint (``wrap``: a verifying reader) or
    out of ``shards``."""
    if shards is None:
        yield from iter_shards(layout.plan, range(num_shards), wrap)
        return
    with reader_for(shards.checkpoint.path) as reader:
        for param in layout.plan.params.values():
            yield param, [shards.tensor(param, r, reader) for r in range(num_shards)]


@records_inputs
def convert_vllm(
    model: str | os.PathLike[str],
    num_shards: int,
    out_dir: str | os.PathLike[str],
    shard_info: Any = None,
    *,
    overwrite: bool = False,
    fsync: bool | None = None,
    verify: bool | Verify = False,
    expert_parallel: bool = False,
    sha256: bool = False,
) -> list[WrittenFile]:
    """Write ``model`` in vLLM's ``sharded_state`` layout for ``num_shards`` ranks into ``out_dir``; return the files.
    ``verify`` checks every source byte against its integrity record, as :func:`shardload.convert` does; the
    output gets its own record (``shardload.hashes``, its root in the manifest's ``integrity``), hashed as it is
    written, and a version-2 manifest lists each rank file by the sha256 of its leaves there (``sha256=True``: by
    the sha256 of its bytes too, in a version-1 manifest, at the cost of a sha256 pass over every byte written).
    ``expert_parallel`` writes each rank's experts whole, for vLLM started with ``enable_expert_parallel=True``.

    Example::

        convert_vllm("llama-dir", 2, "llama-vllm-tp2")
        # vllm serve llama-vllm-tp2 --load-format sharded_state --tensor-parallel-size 2
    """
    out = local_output(out_dir, "out_dir")
    verify = verify_value(verify, str(model))
    if type(num_shards) is not int or num_shards < 1:
        raise ShardloadError(f"num_shards must be a positive integer, got {num_shards!r}", file=str(model))
    split_format.register()  # this integration's own source format, whether or not its entry points are installed
    source = as_boxes(open_source(model))
    shards: ShardsSource | None = None
    checkpoint = source.checkpoint
    if isinstance(source, (SavedBoxes, ConvertedBoxes)):  # stored split: each rank read out of its files
        shards = boxes_to_write(source, verify, shard_info, None)
        checkpoint, shard_info = shards.stored, shards.shard_info
        checkpoint.files = sorted(set(shards.files.values()))
    stamps = stamp_sources(checkpoint.files)
    layout = plan_layout(checkpoint, num_shards, shard_info, expert_parallel=expert_parallel)
    wrap = verifier(checkpoint, verify, checkpoint.name) if shards is None else None  # shards: checked when opened
    sources = source_paths(checkpoint.root, checkpoint.files)
    if Path(layout.plan.shard_info.source).exists():  # a shard_info file named outside the model, as convert does
        sources.append(Path(layout.plan.shard_info.source))
    exists = check_output(out, sources, overwrite=overwrite)
    durable = exists if fsync is None else fsync
    conversion = new_conversion()
    try:
        with StagingDir(out, fsync, synced=durable, overwrite=overwrite) as staging:
            files = [
                FileWriter(staging.dir / FILE_PATTERN.format(rank=r), durable=durable, leaves=True, sha256=sha256)
                for r in range(num_shards)
            ]
            manifest = {
                "format": VLLM_MANIFEST_FORMAT,
                "version": MANIFEST_VERSION if sha256 else LEAVES_MANIFEST_VERSION,
                "shardload_version": __version__,
                "num_shards": num_shards,
                CONVERSION_KEY: conversion,
                "plan": plan_origin(layout, checkpoint.root),
                "shard_info": layout.plan.resolved_shard_info(),
                **({"expert_parallel": True} if expert_parallel else {}),
                "source": {"files": [{"path": f.name, "size": st[2]} for f, st in stamps]},
                RECORD_KEY: _record(layout, shards, wrap),
            }
            digest = digest_to_write(manifest)  # each rank file's seal: this plan
            try:
                for r, f in enumerate(files):
                    f.write_header(layout.header(r, num_shards, conversion, digest))
                for _, tensors in rank_tensors(layout, num_shards, shards, wrap):
                    for f, shard in zip(files, tensors, strict=True):
                        f.write(memoryview(shard.contiguous().reshape(-1).view(_u8()).numpy()))
                written = [f.finish() for f in files]
            finally:
                for f in files:
                    f.close()
            record = write_output_record(staging.dir, written_record(written), durable)  # hashed as written
            manifest["integrity"] = integrity_entry(record)
            config = _output_config(checkpoint, layout)
            own = [_write_file(staging.dir / CONFIG_NAME, config, durable)] if config is not None else []
            replaced = frozenset({CONFIG_NAME} if config is not None else ())
            publish_with_manifest(staging, checkpoint.root, stamps, [*written, record, *own], manifest, durable,
                                  replaced)  # fmt: skip
    except OSError as err:
        raise write_error(err, out) from None
    return written


def _output_config(checkpoint: Checkpoint, layout: VllmLayout) -> bytes | None:
    """The config.json of a ``sharded_state`` output where it cannot be the source's (None: it is copied).

    A GPTQ model that names no ``modules_in_block_to_quantize`` gets that list as vLLM makes it from the source's
    files (every module holding a tensor that is not floating point): vLLM would otherwise derive it from the rank
    files, whose fused names (``qkv_proj``) match no stored module, and build those layers unquantized. A config
    that ties the head to the embeddings over a checkpoint storing its own head says they are not tied: vLLM serves
    that head from the checkpoint, but ties a ``sharded_state`` model by its config alone."""
    config = read_config(checkpoint.root, missing_ok=True)
    changed = False
    quant = config.get("quantization_config")
    gptq = isinstance(quant, dict) and quant.get("quant_method") == "gptq"
    if gptq and not quant.get("modules_in_block_to_quantize"):
        modules = sorted({n.rsplit(".", 1)[0] for n, t in checkpoint.tensors.items() if t.dtype not in FLOAT_DTYPES})
        config["quantization_config"] = {**quant, "modules_in_block_to_quantize": modules}
        changed = True
    if layout.untied:
        for part in (config, config.get("text_config")):
            if isinstance(part, dict) and "tie_word_embeddings" in part:
                part["tie_word_embeddings"] = False
        changed = True
    return (json.dumps(config, indent=2) + "\n").encode() if changed else None


def _write_file(path: Path, data: bytes, durable: bool) -> WrittenFile:
    out = FileWriter(path, durable=durable)
    try:
        out.write(data)
        return out.finish()
    finally:
        out.close()


def plan_origin(layout: VllmLayout, root: Path) -> str:
    """Where ``layout``'s plan came from, every file named by its name alone: a manifest travels with its output
    and stores no absolute path (the plain layout's manifest names files relative to the output too)."""
    origin = layout.source
    given = layout.plan.shard_info.source
    if not given.startswith("<"):  # a shard_info file, beside the weights or named to convert
        origin = origin.replace(given, Path(given).name)
    for prefix in (f"{root}{os.sep}", str(root)):
        origin = origin.replace(prefix, "" if prefix.endswith(os.sep) else ".")
    return origin


def _u8() -> Any:
    import torch

    return torch.uint8


def _record(layout: VllmLayout, shards: ShardsSource | None, wrap: Any = None) -> dict[str, Any] | None:
    """The manifest's ``source_plan``: how the layout was planned, so the directory serves another N later (values
    read through ``wrap``, the verifying reader when asked for)."""
    if shards is not None:
        return record_of(shards)
    if layout.shard_info is None or layout.plan.checkpoint is None or layout.vocab_plan.checkpoint is None:
        return None
    held = {part for t in layout.tensors for part in t.parts}
    with wrapped(reader_for_plan(layout.plan.params.values()), wrap) as reader:
        record = source_record(layout.plan, layout.shard_info, reader)
        for name, p in layout.plan.params.items() if record is not None else ():  # vLLM keeps no such tensor
            if name not in held and p.source.nbytes <= VALUE_BYTES and p.source.decode is None:
                record["values"][name] = bytes(reader.tensor(p.source).view(-1).view(_u8()).numpy()).hex()
    if record is not None:
        for name, p in layout.vocab_plan.params.items():
            record["tensors"][name] = [p.source.logical_dtype, list(p.source.shape)]
    return record
