"""A ``sharded_state`` directory vLLM's own ``ShardedStateLoader.save_model`` wrote, read back as the checkpoint it
was loaded from.

Such a directory holds ``model-rank-{rank}-part-{part}.safetensors`` files and nothing else: vLLM's names, its
fused ``qkv_proj``/``gate_up_proj``, stacked experts and padded vocabulary, no manifest. From the model's
config.json (copied beside the files) and rank 0's headers this module rebuilds the original checkpoint's header:
Hugging Face names, whole shapes and dtypes. :func:`~.sharded_state.open_vllm_shards` then plans it
for the directory's own N exactly as ``convert --layout vllm`` would have and checks every rank file against that
plan (names, shapes, dtypes), so a wrong guess of the header is one located line there. The files' contents are
only sampled (:func:`check_contents`): vLLM writes no checksums, so two rank files of one save swapped by name are
not caught; docs/reshard.md says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ShardloadError
from ...format.shard_info import MAX_RANKS, ShardInfo
from ...planning.presharded import STORED, stored_shape
from ...sources.checkpoint import CONFIG_NAME, Checkpoint, read_config
from ...sources.dtypes import itemsize
from ...sources.safetensors_header import read_header_and_metadata
from ...sources.tensor_info import TensorInfo
from .families import vllm_names, vllm_packing
from .names import EXPERTS_MODULE, is_vocab

SAVED_FILE_RE = re.compile(r"model-rank-(0|[1-9][0-9]{0,8})-part-(0|[1-9][0-9]{0,8})\.safetensors")
"""vLLM's default ``save_model`` file name at tensor parallelism only (its ``TP_ONLY_PATTERN``)."""
PP_FILE_RE = re.compile(r"model-pp-[0-9]+-tp-[0-9]+-part-[0-9]+\.safetensors")
"""Its name under pipeline parallelism (``PP_AND_TP_PATTERN``): not read as a source yet."""
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
"""Families whose vLLM state is inverted here (Llama's names; qkv and gate_up fused; Mixtral's stacked experts)."""
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
"""Attention scalars vLLM keeps in its state (constants for these models; ``convert --layout vllm`` writes them)."""
FLOATS = ("float32", "float16", "bfloat16")
"""Dtypes of an unquantized save's tensors."""
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
"""Per-expert projection names (gate, up, down) by model type; others use gate_proj, up_proj, down_proj."""


@dataclass(frozen=True)
class VllmSave:
    """A ``save_model`` directory read back: its N, the original checkpoint's header (no file behind it) and every
    rank's tensors (all its part files merged)."""

    num_shards: int
    stored: Checkpoint
    headers: dict[int, dict[str, TensorInfo]]
    files: dict[int, list[Path]]


def saved_rank_files(root: Path) -> dict[int, list[Path]] | None:
    """The rank files of a ``save_model`` directory by rank, parts in order (None: ``root`` holds none); a rank or
    a part missing, or pipeline-parallel files, is one line naming the file."""
    found: dict[int, dict[int, Path]] = {}
    for path in sorted(root.iterdir()):
        if PP_FILE_RE.fullmatch(path.name):
            raise CheckpointError(
                "is vLLM's sharded_state of a pipeline-parallel engine: not a source for another N yet; serve it "
                "with load_format='sharded_state' at its own parallel sizes, or convert the original checkpoint",
                file=str(path),
            )
        match = SAVED_FILE_RE.fullmatch(path.name)
        if match and path.is_file():
            found.setdefault(int(match[1]), {})[int(match[2])] = path
    if not found:
        return None
    n = max(found) + 1
    if n > MAX_RANKS:
        raise CheckpointError(f"holds a rank file of rank {n - 1}, over the limit of {MAX_RANKS} ranks",
                              file=str(root))  # fmt: skip
    files: dict[int, list[Path]] = {}
    for r in range(n):
        parts = found.get(r, {})
        for p in range(max(parts, default=0) + 1):
            if p not in parts:
                seen = ", ".join(str(k) for k in sorted(found))
                raise CheckpointError(
                    f"is missing (vLLM's sharded_state of num_shards={n}: rank files found for ranks {seen})",
                    file=str(root / f"model-rank-{r}-part-{p}.safetensors"),
                )
        files[r] = [parts[p] for p in sorted(parts)]
    return files


def read_vllm_save(root: Path) -> VllmSave | None:
    """``root`` as a directory vLLM's ``save_model`` wrote (None: it holds no such rank file): every rank's headers
    merged over its parts, and the original checkpoint's header rebuilt from config.json and rank 0's tensors."""
    files = saved_rank_files(root)
    if files is None:
        return None
    n = len(files)
    if not (root / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"is vLLM's sharded_state for num_shards={n} without the model's {CONFIG_NAME}: vLLM's save_model does "
            f"not write one; copy the model's {CONFIG_NAME} into this directory",
            file=str(root),
        )
    headers: dict[int, dict[str, TensorInfo]] = {}
    conversions: dict[str, Path] = {}
    for r, paths in files.items():
        merged: dict[str, TensorInfo] = {}
        for path in paths:
            header, metadata = read_header_and_metadata(path)
            _check_written_for(path, metadata, r, n, conversions)
            for name, info in header.items():
                if name in merged:
                    raise CheckpointError(f"is also in {merged[name].file.name}: each tensor is saved once per rank",
                                          file=str(path), param=name)  # fmt: skip
                merged[name] = info
        headers[r] = merged
    config = read_config(root)
    stored = _stored_header(root, config, headers[0], n)
    return VllmSave(n, stored, headers, files)


def _check_written_for(path: Path, metadata: dict[str, str], rank: int, n: int, seen: dict[str, Path]) -> None:
    """A file ``convert --layout vllm`` wrote names its rank, N and conversion in its metadata: refuse one at another
    rank's name (copied or swapped) or from another conversion than the other files (``seen`` collects them).
    vLLM's own saves carry none of this, and are sampled by :func:`check_contents` instead."""
    said = metadata.get("shardload.rank"), metadata.get("shardload.num_shards")
    if said != (None, None) and said != (str(rank), str(n)):
        raise CheckpointError(f"its header says rank {said[0]} of {said[1]}, not rank {rank} of {n} (a rank file "
                              "copied or swapped under another rank's name)", file=str(path))  # fmt: skip
    conversion = metadata.get("shardload.conversion", "")  # "": none (vLLM's own save, an older shardload)
    other = next((p for c, p in seen.items() if c != conversion), None)
    if other is not None:
        raise CheckpointError(f"was written by another conversion than {other.name} (a rank file copied in from "
                              "another convert or save)", file=str(path))  # fmt: skip
    seen.setdefault(conversion, path)


def _stored_header(root: Path, config: dict[str, Any], rank0: dict[str, TensorInfo], n: int) -> Checkpoint:
    """The original checkpoint's tensors (names, whole shapes, dtypes) behind vLLM's rank tensors ``rank0``."""
    where = str(root / CONFIG_NAME)
    model_type = config.get("model_type")
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        method = quant.get("quant_method")
        first = _quantized_tensor(rank0)
        raise ShardloadError(
            f"is quantized (quant_method={method!r}): vLLM's save_model writes the weights as vLLM repacked them at "
            "load, which cannot be turned back into the checkpoint; convert the original checkpoint",
            file=str(root),
            param=first,
        )
    if model_type not in MODEL_TYPES:
        raise ShardloadError(
            f"model_type {model_type!r}: reading vLLM's own sharded_state back is supported for "
            f"{', '.join(MODEL_TYPES)}; convert the original checkpoint",
            file=where,
        )
    names = vllm_names(model_type)
    packing = vllm_packing(model_type)
    tied = config.get("tie_word_embeddings") is True and names.tied_head
    heads, hidden = _int(config, "num_attention_heads", where), _int(config, "hidden_size", where)
    kv_heads = heads if config.get("num_key_value_heads") is None else _int(config, "num_key_value_heads", where)
    head_dim = config.get("head_dim") or hidden // heads
    vocab = _int(config, "vocab_size", where)
    gate, up, down = EXPERT_NAMES.get(str(model_type), ("gate_proj", "up_proj", "down_proj"))
    _check_complete(root, rank0, config)
    whole: dict[str, tuple[str, tuple[int, ...]]] = {}  # shapes known whole
    per_rank: dict[str, tuple[str, tuple[int, ...]]] = {}  # shapes of one rank's part, resolved below
    for vname, info in rank0.items():
        if vname.rsplit(".", 1)[-1] in SCALES:
            continue  # vLLM's constants: the layout writes them, the rank file check compares their shapes
        name = vname
        for piece, alias in names.state_names.items():
            name = name.replace(alias, piece, 1)
        pieces = name.split(".")
        shape = info.shape
        if is_vocab(name):
            hf = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            whole[hf] = (info.dtype, (vocab, *shape[1:]))
        elif len(pieces) >= 3 and pieces[-2] == EXPERTS_MODULE and pieces[-1] in ("w13_weight", "w2_weight"):
            base = ".".join(pieces[:-2])
            experts = shape[0]
            total = config.get("num_local_experts", config.get("num_experts"))
            if type(total) is int and experts != total:  # expert parallelism: each rank holds a slice of experts
                raise ShardloadError(
                    f"holds {experts} of the model's {total} experts per rank (saved with expert parallelism): "
                    "reading such a save back is not supported; convert the original checkpoint",
                    file=str(info.file),
                    param=vname,
                )
            projections = (gate, up) if pieces[-1] == "w13_weight" else (down,)
            rows = shape[1] // len(projections)
            for e in range(experts):
                for proj in projections:
                    per_rank[f"{base}.{e}.{proj}.weight"] = (info.dtype, (rows, *shape[2:]))
        elif len(pieces) >= 2 and pieces[-2] in packing:
            parts = packing[pieces[-2]]
            if parts == ("q_proj", "k_proj", "v_proj"):
                rows = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
                for part, count in zip(parts, rows, strict=True):
                    whole[".".join([*pieces[:-2], part, pieces[-1]])] = (info.dtype, (count, *shape[1:]))
            else:
                for part in parts:
                    per_rank[".".join([*pieces[:-2], part, pieces[-1]])] = (info.dtype, (shape[0] // len(parts),
                                                                                         *shape[1:]))  # fmt: skip
        else:
            per_rank[name] = (info.dtype, shape)
    nowhere = root / STORED

    def tensor(name: str, dtype: str, shape: tuple[int, ...]) -> TensorInfo:
        return TensorInfo(name, dtype, shape, nowhere, 0, prod(shape) * itemsize(dtype))

    guessed = {k: tensor(k, d, _guess(k, s, n)) for k, (d, s) in per_rank.items()}
    known = {**guessed, **{k: tensor(k, *v) for k, v in whole.items()}}
    checkpoint = Checkpoint(root, root, "safetensors", dict(sorted(known.items())))  # a safetensors file's order
    info = saved_shard_info(checkpoint, n)  # placements by name and config (the guess only lets it plan)
    for name, (dtype, shape) in per_rank.items():
        if n == 1 or not info.params.get(name):  # replicated: whole on every rank
            checkpoint.tensors[name] = tensor(name, dtype, shape)
        else:  # split: the one whole shape whose plan for n gives this rank shape
            checkpoint.tensors[name] = stored_shape(name, info, tensor(name, dtype, shape), n, checkpoint)
    return checkpoint


def saved_shard_info(stored: Checkpoint, n: int) -> ShardInfo:
    """The shard_info planned from config.json for the rebuilt checkpoint ``stored`` of a save for ``n`` ranks."""
    from ...models.generated import generate

    try:
        generated = generate(stored, check_up_to=0)
    except ShardloadError as err:
        raise type(err)(f"its rank files for num_shards={n} do not fit config.json: {err.message} (N is the highest "
                        "rank whose file is here, plus one: is the file of a higher rank missing, or are files of a "
                        "save for another N left here?)", file=str(stored.root)) from None  # fmt: skip
    return ShardInfo.from_dict(generated.document, source=f"<planned from {stored.root / CONFIG_NAME}>")


def _guess(name: str, shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """A first guess at the whole shape of rank tensor ``name`` (row-parallel weights split by columns, other
    matrices by rows, vectors and routers replicated), for planning only: each shape is then found from the plan."""
    if len(shape) != 2 or name.endswith(".gate.weight"):
        return shape
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return (shape[0], shape[1] * n)
    return (shape[0] * n, shape[1])


def _quantized_tensor(rank0: dict[str, TensorInfo]) -> str:
    """The tensor to name when refusing a quantized save: its first packed or integer tensor, else a projection."""
    for name, info in rank0.items():
        scale = name.rsplit(".", 1)[-1] in SCALES
        if not scale and (info.dtype not in FLOATS or name.endswith(("_scale", "qweight", "weight_packed"))):
            return name
    return next((name for name in rank0 if name.endswith("proj.weight")), "quantization_config")


def _int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"needs a positive integer {key!r} to read vLLM's sharded_state back", file=where)
    return value


def _check_complete(root: Path, rank0: dict[str, TensorInfo], config: dict[str, Any]) -> None:
    """Refuse a save that lacks what a model of ``config`` has: a layer, an attention layer's projection, a bias's
    weight (vLLM on the CPU drops each linear weight it packs for oneDNN, so its save_model writes none)."""
    where = str(root / "model-rank-0-part-0.safetensors")
    layers = config.get("num_hidden_layers")
    for i in range(layers if type(layers) is int else 0):
        prefix = f"model.layers.{i}."
        if not any(name.startswith(prefix) for name in rank0):
            raise CheckpointError(f"holds no tensor of layer {i} of the {layers} config.json gives", file=where)
        for kind in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight"):
            if prefix + kind not in rank0:
                cpu = " (vLLM on the CPU drops every linear weight it packs for oneDNN: save on a GPU)"
                raise CheckpointError(f"is missing: this save has no such projection{cpu}", file=where,
                                      param=prefix + kind)  # fmt: skip
    for name in rank0:
        if name.endswith(".bias") and name.removesuffix("bias") + "weight" not in rank0:
            raise CheckpointError("is saved without its weight", file=where, param=name)


SAMPLE_BYTES = 4096
"""Bytes of one split tensor compared across ranks to catch a rank file copied over another's name."""
REPLICATED_CAP = 1 << 20
"""Replicated tensors up to this size are compared across ranks (norms, routers): equal in any one save."""


def check_contents(save: VllmSave, replicated: list[str], split: str | None) -> None:
    """What shapes cannot tell, from a few bytes of each rank file: every replicated tensor in ``replicated`` equal
    on all ranks (else the files are of two saves), and the first bytes of tensor ``split`` differing between ranks
    (else one file is a copy of another's)."""
    import torch

    from ...sources.object_reader import reader_for
    from ...sources.reader import Reader

    def read(reader: Reader, info: TensorInfo, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        reader.read_tensor(info.file, info.offset, out)
        return out

    with reader_for(save.stored.root) as reader:
        for name in replicated:
            first = save.headers[0][name]
            if first.nbytes > REPLICATED_CAP:
                continue
            want = read(reader, first, first.nbytes)
            for r in range(1, save.num_shards):
                got = save.headers[r][name]
                if not torch.equal(read(reader, got, got.nbytes), want):
                    raise CheckpointError(
                        "differs from rank 0's: rank files of two different saves (a replicated tensor is equal on "
                        "every rank of one save)",
                        file=str(got.file), param=name,
                    )  # fmt: skip
        if split is None:
            return
        seen: list[torch.Tensor] = []
        for r in range(save.num_shards):
            info = save.headers[r][split]
            sample = read(reader, info, min(SAMPLE_BYTES, info.nbytes))
            same = next((k for k, s in enumerate(seen) if torch.equal(s, sample)), None)
            if same is not None:
                raise CheckpointError(f"holds the same bytes as rank {same}'s file: a copy of another rank's file, "
                                      f"not rank {r}'s", file=str(info.file), param=split)  # fmt: skip
            seen.append(sample)
