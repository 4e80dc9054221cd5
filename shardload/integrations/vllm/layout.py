"""vLLM's ``sharded_state`` layout, planned: which vLLM tensors each rank file holds, and how each is made from the
stored tensors (:func:`plan_layout`; headers only, no tensor data). Writing the files is :mod:`.writer`'s, reading
such a directory back as a source for any N :mod:`.sharded_state`'s. Never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ...engine.writer import encode_header
from ...errors import ShardloadError
from ...format.shard_info import ShardInfo, StepSpec
from ...models.plan_source import plan_shard_info
from ...planning.plan import ModelPlan, build_plan
from ...sources.checkpoint import Checkpoint, read_config
from ...sources.dtypes import DTYPES, itemsize
from ...sources.manifest import add_seal
from ...version import __version__
from .families import VllmNames, check_layout, vllm_names, vllm_packing
from .names import SHAPE_SUFFIX, SKIPPED_SUFFIXES, STACKED_EXPERTS, Target, is_vocab, vllm_target, vocab_range

ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
"""Float32 scalars (1.0 unless a checkpoint quantizes the KV cache) each vLLM attention layer keeps in its state."""
ATTENTION_WEIGHTS = tuple(
    f".{m}.{w}" for m in ("qkv_proj", "kv_b_proj") for w in ("weight", "weight_packed", "qweight")
)
"""A vLLM parameter that marks an attention layer (multi-head, and DeepSeek's latent attention)."""
COLUMN_PACKED = ("gptq", "awq")
"""Quantization methods whose tensors keep the output dim last (``qweight``, ``qzeros``, ``scales``)."""
COLUMN_PACKED_TENSORS = (".qweight", ".qzeros", ".scales")
"""GPTQ's and AWQ's tensors: vLLM fuses their parts along dim 1, its output dim."""


@dataclass(frozen=True)
class VllmTensor:
    """One tensor of every rank file: vLLM's name, the stored tensors it is made of, its per-rank shape."""

    name: str
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    vocab: bool = False
    experts: int = 0
    """For a stacked MoE parameter: the number of experts; ``parts`` is expert-major (e0's parts, e1's, ...)."""
    local: int = 0
    """Under expert parallelism: the experts each rank holds whole (rank r: experts r*local .. (r+1)*local - 1)."""
    constant: float | None = None
    """A float32 value vLLM's model keeps in its state (its attention's default quantization scales)."""
    dim: int = 0
    """The dim a fused tensor's parts are joined along: vLLM's output dim (1 for GPTQ's and AWQ's tensors)."""
    transposed: bool = False
    """Stacked experts stored ``[experts, in, out]`` that vLLM keeps ``[experts, out, in]`` (GPT-OSS)."""
    first_rank_only: bool = False
    """A whole tensor vLLM keeps on rank 0 only, zeros on the others (GPT-OSS's expert down bias)."""


@dataclass(frozen=True)
class VllmLayout:
    """The pure plan of a ``sharded_state`` output: tensors in file order, and the shard plan that feeds them."""

    tensors: list[VllmTensor]
    plan: ModelPlan
    vocab_plan: ModelPlan
    source: str
    shard_info: ShardInfo | None = None
    """The shard_info the layout was planned from (vocabulary steps included), for the manifest's record."""
    untied: bool = False
    """The config ties the head to the embeddings, the checkpoint stores an lm_head of its own: vLLM unties them and
    serves that head, so the output holds both and its config.json says they are not tied."""

    def header(
        self,
        rank: int | None = None,
        num_shards: int | None = None,
        conversion: str | None = None,
        digest: str | None = None,
    ) -> bytes:
        """The safetensors header of a rank file (all ranks hold the same shapes); its metadata names ``rank`` of
        ``num_shards`` and the ``conversion`` when given, so a file copied, swapped or brought from another convert
        is caught, and with ``digest`` (of the manifest) carries the file's seal."""
        meta = {"format": "pt", "writer": f"shardload {__version__}"}
        if rank is not None:
            meta.update({"shardload.rank": str(rank), "shardload.num_shards": str(num_shards)})
        if conversion is not None:
            meta["shardload.conversion"] = conversion
        header: dict[str, Any] = {"__metadata__": meta}
        offset = 0
        for t in self.tensors:
            size = itemsize(t.dtype)
            for n in t.shape:
                size *= n
            span = [offset, offset + size]
            header[t.name] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": span}
            offset += size
        if digest is not None:
            add_seal(header, digest)
        return encode_header(header)


def plan_layout(
    checkpoint: Checkpoint, num_shards: int, shard_info: Any = None, *, expert_parallel: bool = False
) -> VllmLayout:
    """Plan vLLM's per-rank tensors of ``checkpoint`` for ``num_shards`` ranks (headers only, no tensor data);
    ``expert_parallel``: as vLLM lays out a model started with ``enable_expert_parallel=True`` (whole experts,
    an equal run of them per rank)."""
    where = checkpoint.name
    if not checkpoint.plain_safetensors:
        raise ShardloadError("--layout vllm converts a safetensors source checkpoint", file=where)
    config = read_config(checkpoint.root, missing_ok=True)
    check_layout(config, where)
    quantized = _quantization(config, where)
    names = vllm_names(config.get("model_type"))
    # a config that ties a model's lm_head to its embeddings over a checkpoint that stores one: vLLM unties them and
    # loads that head (ModelConfig.maybe_untie_word_embeddings), so its state holds both
    own_head = names.tied_head and any(n.endswith("lm_head.weight") for n in checkpoint.tensors)
    ties = config.get("tie_word_embeddings") is True
    tied = ties and not own_head
    info, source = plan_shard_info(checkpoint, shard_info)
    skipped = (*SKIPPED_SUFFIXES, ".g_idx") if quantized == "gptq" else SKIPPED_SUFFIXES  # no act-order: vLLM has none
    stored = [n for n in checkpoint.tensors if not n.endswith(skipped)]
    vocab_names = [n for n in stored if is_vocab(n)]
    whole_experts = {n for n in stored if expert_parallel and vllm_target(n, {}).expert is not None}
    whole_experts |= {n for n in stored if n.endswith(SHAPE_SUFFIX)}  # vLLM keeps a packed weight's stored shape
    kept = {k: v for k, v in info.params.items() if k not in vocab_names and k in stored and k not in whole_experts}
    if expert_parallel:
        kept |= _stacked_by_expert(checkpoint, stored, num_shards, where)
    body = {n: checkpoint.tensors[n] for n in stored if n not in vocab_names}
    plan = build_plan(ShardInfo(kept, info.num_shards, source=info.source), _only(checkpoint, body), num_shards)
    whole = {n: checkpoint.tensors[n] for n in vocab_names}
    vocab_plan = build_plan(ShardInfo(source="<whole>"), _only(checkpoint, whole), 1)
    tensors: list[VllmTensor] = []
    for name in vocab_names:
        info_t = checkpoint.tensors[name]
        rows = info_t.shape[0]
        _, _, per_rank = vocab_range(rows, 0, num_shards)
        if per_rank * num_shards != -(-rows // 64) * 64:
            raise ShardloadError(
                f"vLLM pads the vocabulary of {rows} rows to {-(-rows // 64) * 64}, which num_shards={num_shards} "
                "does not divide",
                file=where,
                param=name,
            )
        head = tied and names.tied_head and name.endswith("embed_tokens.weight")  # the alias vLLM's state keeps
        out_name = "lm_head.weight" if head else _state_name(Target(name), names).name
        tensors.append(VllmTensor(out_name, (name,), (per_rank, *info_t.shape[1:]), info_t.dtype, vocab=True))
    groups: dict[str, list[str | None]] = {}
    stacks: dict[str, dict[tuple[int, int], str]] = {}
    packed = _packing(vllm_packing(config.get("model_type")), names, stored)
    targets = {name: _state_name(vllm_target(name, packed), names) for name in plan.params}
    experts: dict[str, int] = {}  # stacked parameter -> experts in it (the highest stored index + 1)
    for t in targets.values():
        if t.expert is not None:
            experts[t.name] = max(experts.get(t.name, 0), t.expert + 1)
    for name, param in plan.params.items():
        target = targets[name]
        stacked = target.expert is None and ".experts." in name
        if stacked and target.name == name:
            raise ShardloadError(
                "--layout vllm writes experts stored one by one (experts.E.w1 or experts.E.gate_proj) or stacked as "
                "transformers stacks them (experts.gate_up_proj, experts.down_proj): serve this one with "
                "load_format='shardload'",
                file=where,
                param=name,
            )
        if target.expert is not None:
            if quantized in COLUMN_PACKED and name.endswith(COLUMN_PACKED_TENSORS):
                raise ShardloadError(  # vLLM's MoE keeps these [experts, in, gate + up out]: not rows stacked
                    f"--layout vllm does not write {quantized.upper()} experts (vLLM joins their parts along the "
                    "output columns); serve this one with load_format='shardload'",
                    file=where,
                    param=name,
                )
            stack = stacks.setdefault(target.name, {})
            stack[(target.expert, target.part)] = name
            if len(stack) == experts[target.name] * target.parts:
                stacked = _stacked(target.name, stack, experts[target.name], target.parts, plan, where)
                tensors.append(_expert_parallel(stacked, num_shards, where) if expert_parallel else stacked)
                del stacks[target.name]
            continue
        if not target.fused:
            turn = name.endswith(names.transposed)  # [experts, in, out] stored, [experts, out, in] in vLLM
            shape = (*param.shape[:1], param.shape[2], param.shape[1], *param.shape[3:]) if turn else param.shape
            first = not expert_parallel and name.endswith(names.first_rank_only)
            tensors.append(VllmTensor(target.name, (name,), shape, param.dtype, transposed=turn, first_rank_only=first))
            continue
        parts = groups.setdefault(target.name, [None] * target.parts)
        parts[target.part] = name
        if all(p is not None for p in parts) and target.name.endswith(SHAPE_SUFFIX):  # one vector: the last part's
            last = plan.params[parts[-1]]  # type: ignore[index]
            tensors.append(VllmTensor(target.name, (parts[-1],), last.shape, last.dtype))  # type: ignore[arg-type]
            del groups[target.name]
        elif all(p is not None for p in parts):
            dim = 1 if quantized in COLUMN_PACKED and target.name.endswith(COLUMN_PACKED_TENSORS) else 0
            tensors.append(_fused(target.name, [p for p in parts if p], plan, dim, where))
            del groups[target.name]
    for vname, parts in groups.items():
        missing = [packed[vname.split(".")[-2]][i] for i, p in enumerate(parts) if p is None]
        raise ShardloadError(f"vLLM fuses it, but {missing} are not in the checkpoint", file=where, param=vname)
    for vname in stacks:
        raise ShardloadError(f"vLLM stacks {experts[vname]} experts into it, but not all of their projections are "
                             "in the checkpoint", file=where, param=vname)  # fmt: skip
    attention = sorted({t.name.rsplit(".", 2)[0] for t in tensors if t.name.endswith(ATTENTION_WEIGHTS)})
    for prefix in attention:  # vLLM's Attention registers these persistent buffers; sharded_state needs every key
        module = f"{prefix}.{names.attention}"
        for scale in ATTENTION_SCALES:
            tensors.append(VllmTensor(f"{module}.{scale}", (), (), "float32", constant=1.0))
        if quantized == "fp8":  # FP8's KV-cache scales, at vLLM's "not in the checkpoint" value (-1)
            for kind in ("q", "k", "v", "prob"):
                tensors.append(VllmTensor(f"{module}.{kind}_scale", (), (), "float32", constant=-1.0))
        elif quantized == "compressed-tensors":  # its KV-cache placeholders, at vLLM's values for a checkpoint without
            for kind in ("k", "v", "q"):
                tensors.append(VllmTensor(f"{module}.{kind}_scale", (), (1,), "float32", constant=1.0))
                tensors.append(VllmTensor(f"{module}.{kind}_zero_point", (), (1,), "float32", constant=0.0))
    return VllmLayout(tensors, plan, vocab_plan, source, info, untied=ties and own_head)


def _fused(vname: str, parts: list[str], plan: ModelPlan, dim: int, where: str) -> VllmTensor:
    """vLLM's fused parameter ``vname``: ``parts``' rank tensors joined along ``dim``, checked to agree elsewhere."""
    shapes = [plan.params[p].shape for p in parts]
    dtypes = {plan.params[p].dtype for p in parts}
    if len(dtypes) > 1 or any(len(s) <= dim or s[:dim] + s[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :]
                              for s in shapes):  # fmt: skip
        raise ShardloadError(f"its parts have different dtypes or shapes ({shapes})", file=where, param=vname)
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    return VllmTensor(vname, tuple(parts), tuple(shape), dtypes.pop(), dim=dim)


def _packing(packed: Mapping[str, tuple[str, ...]], names: VllmNames, stored: list[str]) -> dict[str, tuple[str, ...]]:
    """vLLM's fusion for this checkpoint: a fusion vLLM makes only when every part is stored is dropped otherwise."""
    present = {piece for name in stored for piece in name.split(".")}
    return {k: v for k, v in packed.items() if k not in names.optional_packed or set(v) <= present}


def _state_name(target: Target, names: VllmNames) -> Target:
    """``target`` under the alias vLLM's ``sharded_state`` keeps for it (its state dict keeps a tensor's smallest
    name)."""
    for piece, alias in names.state_names.items():
        if piece in target.name:
            return replace(target, name=target.name.replace(piece, alias, 1))
    return target


def _quantization(config: dict[str, Any], where: str) -> str | None:
    """How the model is quantized, where ``--layout vllm`` writes it: ``"compressed-tensors"``, ``"fp8"`` (block
    quantized, dynamic activations), ``"gptq"`` (no act-order), ``"awq"`` or None; refuse the others."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8_block(quant, where)
    if method in COLUMN_PACKED:
        if quant.get("desc_act") is True:
            raise ShardloadError(
                "--layout vllm writes GPTQ checkpoints without act-order, not desc_act=true (vLLM reorders the "
                "input rows by g_idx); serve this one with load_format='shardload'",
                file=where,
            )
        return str(method)
    if method != "compressed-tensors" or quant.get("kv_cache_scheme") is not None:
        raise ShardloadError(
            f"--layout vllm writes unquantized, compressed-tensors, FP8 block-quantized, GPTQ and AWQ checkpoints, not "
            f"quant_method={method!r}{' with a kv_cache_scheme' if method == 'compressed-tensors' else ''}; serve "
            "this one with load_format='shardload'",
            file=where,
        )
    return "compressed-tensors"


def _fp8_block(quant: dict[str, Any], where: str) -> str:
    """``"fp8"`` for an FP8 checkpoint quantized per block with dynamic activations (``weight`` and
    ``weight_scale_inv``, both split like the weight); refuse per-tensor scales and static activation scales."""
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2) or quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ShardloadError(
            f"--layout vllm writes FP8 checkpoints quantized per block (weight_block_size) with dynamic activations, "
            f"not weight_block_size={block!r}, activation_scheme={quant.get('activation_scheme')!r}; serve this one "
            "with load_format='shardload'",
            file=where,
        )
    return "fp8"


def _stacked(
    vname: str, stack: dict[tuple[int, int], str], experts: int, parts: int, plan: ModelPlan, where: str
) -> VllmTensor:
    """vLLM's stacked expert parameter: ``[experts, rows of its parts, ...]``, checked for equal shapes and dtypes."""
    names = tuple(stack[(e, p)] for e in range(experts) for p in range(parts))
    shapes = {plan.params[n].shape for n in names}
    dtypes = {plan.params[n].dtype for n in names}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ShardloadError(f"its experts' projections differ in shape or dtype ({sorted(shapes)})", file=where,
                             param=vname)  # fmt: skip
    shape = shapes.pop()
    return VllmTensor(vname, names, (experts, shape[0] * parts, *shape[1:]), dtypes.pop(), experts=experts)


def _expert_parallel(stacked: VllmTensor, num_shards: int, where: str) -> VllmTensor:
    """``stacked`` as each rank holds it under vLLM's expert parallelism: a run of whole experts (linear placement)."""
    if stacked.experts % num_shards:
        raise ShardloadError(
            f"vLLM places {stacked.experts} experts on {num_shards} ranks unevenly; sharded_state rank files with "
            "expert parallelism need a rank count that divides the experts (or use load_format='shardload')",
            file=where,
            param=stacked.name,
        )
    local = stacked.experts // num_shards
    return replace(stacked, shape=(local, *stacked.shape[1:]), local=local)


def _stacked_by_expert(checkpoint: Checkpoint, stored: list[str], num_shards: int, where: str) -> dict[str, Any]:
    """Steps for experts stored stacked (``experts.gate_up_proj`` [experts, ...]) under expert parallelism: split
    along the experts into ``num_shards`` equal runs, vLLM's linear placement (rank r: experts r*E/N onward)."""
    steps = {}
    for name in stored:
        pieces = name.split(".")
        if len(pieces) >= 2 and pieces[-2] == "experts" and pieces[-1] in STACKED_EXPERTS:
            experts = checkpoint.tensors[name].shape[0]
            if experts % num_shards:
                raise ShardloadError(
                    f"vLLM places {experts} experts on {num_shards} ranks unevenly; sharded_state rank files with "
                    "expert parallelism need a rank count that divides the experts (or use load_format='shardload')",
                    file=where,
                    param=name,
                )
            steps[name] = [StepSpec("shard_funcs.shard_dim", None, None, (0, "num_shards"))]
    return steps


def _only(checkpoint: Checkpoint, tensors: dict[str, Any]) -> Checkpoint:
    return Checkpoint(checkpoint.path, checkpoint.root, checkpoint.kind, tensors, checkpoint.files)
