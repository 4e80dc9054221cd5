"""The ``shardload`` load format for vLLM: each worker reads only its own bytes and fills vLLM's parameters in place.

Each worker takes its rank and N from vLLM's tensor-parallel group, plans the checkpoint with shardload
(its ``shard_info.json``, ``model_loader_extra_config={"shard_info": PATH}``, or a plan made in memory from
config.json when there is none), and reads this rank's bytes straight into vLLM's parameters wherever a
slice is one contiguous stretch of one (else into a scratch tensor, then copied): fused parameters
(``qkv_proj``, ``gate_up_proj``) assembled from their parts along the output dim, MoE experts into their
stacked parameters, padded vocabularies filled row for row with zeros after the stored rows. A parameter
left unfilled, a stored tensor with no place in vLLM's model, or a shape that differs is a
:class:`~shardload.errors.ShardloadError` naming it: a model is never served half loaded. What is vLLM's is here
(its names, its model's attributes, its placement of experts); copying a rank into the parameters is the
server-neutral :mod:`shardload.integrations.fill`. Uses the public API and :mod:`shardload.integrations.api` only.
Imports vLLM (only this module of shardload does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ... import (
    Checkpoint,
    Destination,
    Mesh,
    ModelPlan,
    ReadOptions,
    ShardInfo,
    ShardloadError,
    StepSpec,
    Verify,
    load_rank,
)
from ..api import (
    ConvertedBoxes,
    RankFiles,
    SavedBoxes,
    build_plan,
    check_options,
    check_recorded,
    open_source,
    plan_shard_info,
    records_inputs,
    same_checkpoint,
)
from ..fill import (
    SHAPE_SUFFIX,
    FillReport,
    KeptWhole,
    Target,
    copy_into,
    expert_maps,
    place_slots,
    vocab_mismatches,
    vocab_ranges,
)
from ..fill import rows as _rows
from . import split_format
from .families import check_served, vllm_names
from .names import DEFAULT_PACKED, EXPERTS_MODULE, OPTIONAL_SUFFIXES, SKIPPED_SUFFIXES, padded_vocab, vllm_target

if TYPE_CHECKING:
    import torch
    from torch import nn


LOAD_FORMAT = "shardload"
EXTRA_KEYS = ("shard_info", "verify", "read_options", "compare_ranks")
"""Keys accepted in ``model_loader_extra_config``."""

log = logging.getLogger("vllm.shardload")  # under vLLM's logger, so its handlers print it


_registered: list[type] = []
"""The loader class this process registered (vLLM's public API has no lookup of a load format's class)."""


def register_loader() -> None:
    """Add ``load_format="shardload"`` to vLLM's loaders with vLLM's public ``register_model_loader`` (idempotent)."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if _registered:
        return

    class ShardloadModelLoader(BaseModelLoader):
        """vLLM loader reading each tensor-parallel rank's own bytes through shardload."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            unknown = sorted(set(extra) - set(EXTRA_KEYS))
            if unknown:
                raise ShardloadError(
                    f"unknown model_loader_extra_config key(s) {unknown} for load_format={LOAD_FORMAT!r}; "
                    f"accepted: {list(EXTRA_KEYS)}"
                )
            self.shard_info = extra.get("shard_info")
            verify = extra.get("verify", False)
            self.verify = verify if isinstance(verify, str) else bool(verify)  # True, or a pinned root hash
            self.compare_ranks = extra.get("compare_ranks", True)  # the ranks compare the files they read
            if not isinstance(self.compare_ranks, bool):
                raise ShardloadError("model_loader_extra_config.compare_ranks: expected true or false, got "
                                     f"{self.compare_ranks!r}")  # fmt: skip
            options = extra.get("read_options")
            self.read_options = (
                None if options is None else ReadOptions.from_config(options, "model_loader_extra_config.read_options")
            )  # checked when vLLM makes the loader, before any model is built

        def download_model(self, model_config: Any) -> None:
            _model_dir(model_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            started = time.perf_counter()
            rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            text = getattr(model_config, "hf_text_config", None)  # a multimodal model says it of its language model
            tied = any(bool(getattr(c, "tie_word_embeddings", False)) for c in (model_config.hf_config, text) if c)
            # vLLM unties a model whose config ties it when the checkpoint holds an lm_head (then compares them)
            untied = bool(getattr(model_config, "word_embeddings_untied_by_checkpoint", False))
            model_dir = _model_dir(model_config)
            compare = size > 1 and self.compare_ranks  # every rank calls this at once, as vLLM does
            together = same_checkpoint(_tp_cpu_group(), model_dir) if compare else contextlib.nullcontext()
            with together:  # the tensor-parallel ranks read one version of the checkpoint
                report = fill_model(
                    model,
                    model_dir,
                    rank,
                    size,
                    shard_info=self.shard_info,
                    verify=self.verify,
                    tied=tied,
                    config_ties=tied or untied,
                    read_options=self.read_options,
                )
            log.info(
                "shardload: rank %d of %d filled %d parameters from %d stored tensors in %.2f s (%s)",
                rank, size, report.filled, report.tensors, time.perf_counter() - started, report.source,
            )  # fmt: skip

    _registered.append(model_loader.register_model_loader(LOAD_FORMAT)(ShardloadModelLoader))


def _tp_cpu_group() -> Any:
    """vLLM's tensor-parallel group over gloo (its ``cpu_group``), where the ranks compare what they read."""
    from vllm.distributed import get_tp_group

    return get_tp_group().cpu_group


def renamed(mapper: Any, name: str) -> str | None:
    """``name`` through a model's ``hf_to_vllm_mapper`` (vLLM's ``WeightsMapper``; None: the name is dropped)."""
    if mapper is None:
        return name
    if hasattr(mapper, "map_name"):  # vLLM's public name
        return mapper.map_name(name)
    return mapper._map_name(name) if hasattr(mapper, "_map_name") else name  # a vLLM with only the private name


def _model_dir(model_config: Any) -> str:
    path = getattr(model_config, "model_weights", None) or model_config.model
    if not os.path.exists(path):
        raise ShardloadError(
            f"load_format={LOAD_FORMAT!r} reads a local checkpoint directory; {path!r} is not one "
            "(download it first, e.g. with `huggingface-cli download`)"
        )
    return str(path)


@records_inputs
def fill_model(
    model: nn.Module,
    model_dir: str | os.PathLike[str],
    rank: int,
    num_shards: int,
    *,
    shard_info: Any = None,
    verify: bool | str = False,
    tied: bool = False,
    config_ties: bool | None = None,
    read_options: ReadOptions | None = None,
) -> FillReport:
    """Fill every parameter of vLLM's ``model`` with rank ``rank`` of ``num_shards``, read through shardload
    (``read_options``: how the rank reads, as in :func:`~shardload.load_rank`; ``tied``: vLLM's model ties its head
    to the embeddings; ``config_ties``: the config says so, though vLLM untied them, default ``tied``)."""
    from vllm.model_executor.models.utils import is_pp_missing_parameter

    where = str(model_dir)
    check_served(type(model).__name__, where)
    targets = dict(model.named_parameters())
    packed = {k: tuple(v) for k, v in (getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED).items()}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "get_rename_mapper"):
        mapper = mapper.get_rename_mapper()  # renames only: fusion is ours, part by part
    split_format.register()  # read vLLM's sharded_state whether or not shardload's entry points are installed
    source = open_source(model_dir, Mesh(tp=num_shards))
    sharded = isinstance(source, SavedBoxes)  # vLLM's sharded_state (ours or save_model's): read as converted
    checkpoint = None if sharded else source.checkpoint
    report = FillReport()

    def route(name: str) -> Target | None:
        mapped = renamed(mapper, name)
        if mapped is None or name.endswith(SKIPPED_SUFFIXES):
            return None
        target = vllm_target(mapped, packed)
        if target.fused and target.name not in targets:  # a fusion vLLM makes only when every part is stored
            plain = vllm_target(mapped, {})
            target = plain if plain.name in targets else target
        if target.expert is None and target.name in experts:
            stacked_ep.add(name)  # this rank's run of experts, read as a slice of the stacked tensor
        if target.expert is not None and target.name in experts:
            local = experts[target.name][target.expert] if target.expert < len(experts[target.name]) else -1
            return replace(target, expert=local) if local >= 0 else None  # another rank's expert: not read
        if target.name in targets:
            return replace(target, every_slot=True) if per_part_scale(targets[target.name], target) else target
        newer = replace(target, name=target.name.replace(".experts.", f".experts.{EXPERTS_MODULE}.", 1))
        if target.expert is None and ".experts." in target.name and newer.name in targets:
            return newer  # a stacked expert parameter the model's own mapper named (GPT-OSS's w13_weight)
        if target.expert is not None:  # vLLM before 0.32 keeps the stacked experts one module up
            older = replace(target, name=target.name.replace(f".{EXPERTS_MODULE}.", ".", 1))
            if older.name in targets:
                return older
        if mapped.endswith(KV_SCALES):  # an attention layer's KV-cache scale: where vLLM's own loader puts it
            from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

            remapped = maybe_remap_kv_scale_name(mapped, targets)
            if remapped is None:
                return None  # a scale this model has no parameter for: vLLM's loader drops it too
            if remapped in targets:
                return vllm_target(remapped, {})
        if tied and target.name.endswith("lm_head.weight"):
            return None
        if name.endswith(".g_idx"):
            return None  # GPTQ without act-order: vLLM makes no g_idx parameter and its own loader drops the tensor
        if is_pp_missing_parameter(target.name, model):
            return None  # another pipeline stage's parameter
        raise ShardloadError(
            f"no parameter {target.name!r} in vLLM's {type(model).__name__} to take it", file=where, param=name
        )

    vocab = vocab_ranges(model, targets, _vocab_parallel_embedding())
    experts = expert_maps(model, _expert_map)
    stacked_ep: set[str] = set()
    adjust = (
        _adjustments(checkpoint, rank, expert_parallel=bool(experts))
        if checkpoint is not None
        else (lambda name: None)  # a sharded_state directory's tensors are read back under the source's names
    )
    views = False
    if isinstance(source, (SavedBoxes, RankFiles, ConvertedBoxes)):
        if experts:
            what = "a sharded_state directory is read as" if sharded else "a converted directory holds"
            raise ShardloadError(
                f"{what} rank tensors that split every expert by tensor parallelism; with expert parallelism "
                "(enable_expert_parallel) load the source checkpoint",
                file=where,
            )
        check_options(source, {"shard_info": shard_info is not None}, None)
        report.source = (
            "sharded_state directory, boxes of its rank files" if sharded else f"converted directory, rank file {rank}"
        )
        views = isinstance(source, RankFiles) and not verify  # its own file, mapped: views, no copy (boxes are read,
        if views:  # never mapped; a verified load's bytes are those it hashed, so read, not views paged in later)
            read_options = replace(read_options or ReadOptions(), strategy="view")
        stored = load_rank(model_dir, rank, num_shards, verify=_verify(verify), read_options=read_options)
        embed = next((n for n in stored if n.endswith("embed_tokens.weight")), None)
        ties = tied if config_ties is None else config_ties  # the config's word, though vLLM untied the head
        if sharded and ties and embed and "lm_head.weight" in targets and "lm_head.weight" not in stored:
            stored = {**stored, "lm_head.weight": stored[embed]}  # vLLM unties the tied head its files hold
        routes = {name: route(name) for name in stored}
        narrow = _converted_vocab(stored, routes, vocab, rank, where)
        tensors: Mapping[str, torch.Tensor] = stored
        direct: set[str] = set()
    else:
        assert checkpoint is not None
        info, report.source = plan_shard_info(checkpoint, shard_info)
        for name in checkpoint.tensors:  # route every stored name now: stacked experts change the plan
            route(name)
        info = _stacked_experts_by_rank(info, stacked_ep, _routes_of(stacked_ep, route), experts, rank, num_shards,
                                        where)  # fmt: skip
        tensors, direct, narrow, routes = _read_planned(checkpoint, info, rank, num_shards, route, targets, vocab,
                                                        report, verify, whole=set(experts), split=stacked_ep,
                                                        adjust=adjust, read_options=read_options)  # fmt: skip
    for note in report.notes:
        log.warning("shardload: %s", note)
    report.tensors = len(tensors)
    filled = copy_into(targets, tensors, routes, vocab, narrow, where, direct, adjust, server="vLLM")
    if views:  # the copies read the files' pages just now: a file rewritten since the load is refused
        check_recorded()
    report.filled = len(filled)
    missing = [
        n for n in targets
        if n not in filled and not is_pp_missing_parameter(n, model) and not n.endswith(OPTIONAL_SUFFIXES)
    ]  # fmt: skip
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ShardloadError(
            f"vLLM parameter {missing[0]!r}{more} has no tensor in the checkpoint; the model would run with "
            "uninitialised weights",
            file=where,
        )
    return report


def per_part_scale(param: Any, target: Target) -> bool:
    """``param`` is vLLM's per-tensor scale with a slot for each part of a fused module that ``target``'s stored
    tensor holds whole (Phi-3's ``gate_up_proj``): vLLM's loader puts the one stored value in every slot."""
    from vllm.model_executor.parameter import PerTensorScaleParameter

    return isinstance(param, PerTensorScaleParameter) and not target.fused and param.numel() > 1


KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")
"""A checkpoint's attention scales (``self_attn.k_scale``, ModelOpt's ``k_proj.k_scale``), which vLLM keeps on its
attention layer (``self_attn.attn.k_scale``)."""


def _converted_vocab(
    stored: Mapping[str, torch.Tensor],
    routes: Mapping[str, Target | None],
    vocab: Mapping[str, tuple[int, int, int, int]],
    rank: int,
    where: str,
) -> set[str]:
    """Check that a converted directory's vocabulary tensors are split as vLLM splits them: vLLM's padded rows per
    rank (stored rows, then zeros), the stored rows alone, or the whole vocabulary (returned: to narrow)."""
    spans = {n: vocab[t.name] for n, t in routes.items() if t is not None and t.name in vocab}
    narrow = {n for n, span in spans.items() if stored[n].shape[0] == span[2] != _rows(span)}
    for name in set(spans) - narrow:
        if stored[name].shape[0] in (_rows(spans[name]), spans[name][3]):
            continue
        start, stop, rows, per_rank = spans[name]
        num_shards = padded_vocab(rows) // per_rank
        plan = (
            ""
            if rows % num_shards == 0
            else "a plan made with `shardload plan --vocab-padding vllm` (the default), or "
        )
        raise ShardloadError(
            f"this directory splits the vocabulary into {stored[name].shape[0]} rows per rank; vLLM's padded "
            f"vocabulary needs {per_rank} rows per rank (stored rows {start}..{stop} on rank {rank}, then zeros): "
            f"load the source checkpoint with load_format='shardload', or convert with {plan}--layout vllm",
            file=where,
            param=name,
        )
    return narrow


def _read_planned(
    checkpoint: Checkpoint,
    info: ShardInfo,
    rank: int,
    num_shards: int,
    route: Callable[[str], Target | None],
    targets: Mapping[str, Any],
    vocab: Mapping[str, tuple[int, int, int, int]],
    report: FillReport,
    verify: bool | str = False,
    whole: set[str] = frozenset(),  # type: ignore[assignment]
    split: set[str] = frozenset(),  # type: ignore[assignment]
    adjust: Callable[[str], Callable[[torch.Tensor], torch.Tensor] | None] = lambda name: None,
    read_options: ReadOptions | None = None,
) -> tuple[dict[str, torch.Tensor], set[str], set[str], dict[str, Target | None]]:
    """Plan ``checkpoint`` with ``info`` and read rank ``rank``'s tensors (in place where they fit). A vocabulary
    whose planned split is not vLLM's is read whole instead (noted in ``report``), and so is every expert of a vLLM
    parameter in ``whole`` (expert parallelism: this rank's experts, unsplit), but for the names in ``split`` (stacked
    experts, already planned by rank). Returns the tensors, the names read in place, the names read whole (to
    narrow) and each stored name's vLLM target; names ``adjust`` changes are never read in place."""
    plan = build_plan(info, checkpoint, num_shards)
    routes = {name: route(name) for name in plan.params}
    shape_names = {n for n in plan.params if n.endswith(SHAPE_SUFFIX)}  # vLLM keeps the stored value
    unsplit, read_whole = set(shape_names), set()
    if whole:
        read_whole |= {n for n in plan.params if (t := vllm_target(n)).expert is not None and t.name in whole}
        read_whole |= {n for n, t in routes.items() if t is not None and t.name in whole}
        unsplit |= read_whole
        unsplit -= split
    # what the plan's steps check in a kept weight_shape still holds, for those this rank reads and the plan splits
    checked = {n for n in shape_names & unsplit if routes[n] is not None and n not in read_whole}
    shapes = KeptWhole({n: plan.params[n] for n in checked if plan.params[n].steps and num_shards > 1})
    if unsplit & set(info.params):
        kept = {k: v for k, v in info.params.items() if k not in unsplit}
        info = ShardInfo(kept, info.num_shards, info.version, info.form, info.source)
        plan = build_plan(info, checkpoint, num_shards)
    mismatched = vocab_mismatches(plan, routes, vocab, rank)
    if mismatched:
        kept = {k: v for k, v in info.params.items() if k not in mismatched}
        info = ShardInfo(kept, info.num_shards, info.version, info.form, info.source)
        plan = build_plan(info, checkpoint, num_shards)
        report.notes.append(
            f"{', '.join(sorted(mismatched))}: the plan's split is not vLLM's padded vocabulary "
            f"({num_shards} ranks); read whole and narrowed"
        )
    narrow = {n for n, p in plan.params.items() if (t := routes[n]) and t.name in vocab and p.replicated}
    needed = ModelPlan(plan.num_shards, plan.shard_info, plan.checkpoint,
                       {n: p for n, p in plan.params.items() if routes[n] is not None})  # fmt: skip
    # read through the public API, as any user would: straight into vLLM's parameter memory where a slot is one
    # contiguous stretch of the plan's shape (no second copy, no extra memory), into fresh tensors otherwise;
    # verify checks every byte against the integrity record; names ``adjust`` changes are read, then changed, so
    # never read in place
    kept_routes = {n: (None if adjust(n) else t) for n, t in routes.items()}
    slots = place_slots(needed, targets, kept_routes, vocab, narrow)
    tensors = load_rank(checkpoint.path, rank, num_shards, shard_info=info, verify=_verify(verify),
                        into=Destination(slots, only=needed.params), read_options=read_options)  # fmt: skip
    for name in shapes.plans:
        shapes.check(name, tensors[name])
    return tensors, set(slots), narrow, routes


def _adjustments(
    checkpoint: Checkpoint, rank: int, expert_parallel: bool = False
) -> Callable[[str], Callable[[torch.Tensor], torch.Tensor] | None]:
    """What a stored tensor's rank slice needs before it is vLLM's, by its family's :class:`VllmNames`: experts
    vLLM keeps transposed (``[experts, out, in]``), and whole tensors vLLM keeps on rank 0 only (zeros elsewhere;
    under expert parallelism each rank holds its own experts' instead)."""
    try:
        names = vllm_names(checkpoint.model_config().get("model_type"))
    except ShardloadError:  # no config to say: Llama's names
        return lambda name: None

    def transpose(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2)

    def zeros(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(t.shape)

    def change(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if name.endswith(names.transposed):
            return transpose
        if rank and not expert_parallel and name.endswith(names.first_rank_only):
            return zeros
        return None

    return change


def _routes_of(names: set[str], route: Callable[[str], Target | None]) -> dict[str, Target]:
    """Each of ``names``' vLLM target (every one routed)."""
    out = {}
    for name in names:
        target = route(name)
        assert target is not None
        out[name] = target
    return out


def _stacked_experts_by_rank(
    info: ShardInfo,
    names: set[str],
    targets: Mapping[str, Target],
    experts: Mapping[str, list[int]],
    rank: int,
    num_shards: int,
    where: str,
) -> ShardInfo:
    """``info`` with each stacked expert tensor in ``names`` (``experts.gate_up_proj`` [experts, ...]) split along
    its experts into ``num_shards`` equal runs, so this rank reads only its own experts' slice: what vLLM's
    expert parallelism holds when it places the experts linearly (rank r: experts r*E/N onward), the one placement
    a slice of the stacked tensor serves; any other is refused."""
    if not names:
        return info
    params = dict(info.params)
    for name in sorted(names):
        table = experts[targets[name].name]
        total, mine = len(table), [g for g, slot in enumerate(table) if slot >= 0]
        local = total // num_shards
        linear = total % num_shards == 0 and mine == list(range(rank * local, (rank + 1) * local))
        if not linear or any(table[g] != g - rank * local for g in mine):
            raise ShardloadError(
                f"experts stored stacked under expert parallelism: vLLM placed experts {mine[:4]}... of {total} on "
                f"rank {rank} of {num_shards}; load_format='shardload' reads a stacked tensor's experts as one "
                "even run per rank (vLLM's linear placement, experts divisible by the ranks)",
                file=where,
                param=name,
            )
        params[name] = [StepSpec("shard_funcs.shard_dim", None, None, (0, "num_shards"))]
    return ShardInfo(params, info.num_shards, info.version, info.form, info.source)


def _vocab_parallel_embedding() -> type:
    """vLLM's vocabulary-parallel embedding class (its LM head is one too): it pads the vocabulary to a multiple of
    64, then splits it evenly."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return VocabParallelEmbedding


def _expert_map(module: Any) -> Any:
    """A vLLM MoE layer's map of global expert -> this rank's slot (None: the module keeps none)."""
    manager = getattr(module, "expert_map_manager", None)
    return getattr(manager, "expert_map", None) if manager is not None else None


def _verify(verify: bool | str) -> bool | Verify:
    """The loader's ``verify`` setting (True, False, or a pinned root from the server's config) as ``load_rank``
    takes it."""
    return Verify(root=verify) if isinstance(verify, str) else verify
