"""Planning: shard_info + checkpoint header + N -> a pure per-parameter plan (no tensor data read).

For every stored tensor the plan holds the resolved steps with each intermediate shape and
dtype, the per-rank shape, and, when every step is an index remap, the source boxes each
rank reads (:meth:`ParamPlan.pieces`) and the boxes of padding it fills with zeros without a
read (:meth:`ParamPlan.zeros`). Validation is building a plan and listing what could
not be planned.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..errors import PlanError, ShardloadError, StepArgumentError
from ..format import expr
from ..format.shard_info import MAX_FILE_BYTES, MAX_RANKS, ShardInfo, StepSpec
from ..sources.checkpoint import Checkpoint, as_path, resolve_inside
from ..sources.dtypes import DTYPES, itemsize
from ..sources.objects import ObjectPath
from ..sources.tensor_info import TensorInfo
from .registry import Box, Shape, StepFunction, lookup


@dataclass(frozen=True)
class PlannedStep:
    """One step with its arguments evaluated for N and its input/output shapes and dtypes."""

    index: int
    func: StepFunction
    args: tuple[Any, ...]
    in_shape: Shape
    in_dtype: str
    out_shape: Shape
    out_dtype: str

    @property
    def name(self) -> str:
        return self.func.name


@dataclass(frozen=True)
class Piece:
    """Copy source box ``src`` (stored-tensor coordinates) into ``dst`` (rank-tensor coordinates)."""

    src: Box
    dst: Box

    @property
    def numel(self) -> int:
        return prod(b - a for a, b in self.src)


@dataclass
class ParamPlan:
    """How one stored tensor becomes N per-rank tensors."""

    name: str
    source: TensorInfo
    steps: tuple[PlannedStep, ...]
    num_shards: int
    shape: Shape
    dtype: str
    _pieces: dict[int, tuple[list[Piece], list[Box]]] = field(default_factory=dict, repr=False, compare=False)
    where: str | None = field(default=None, compare=False)
    """The shard_info file its steps came from, which a step's failure names (None for a plan of no steps)."""

    @property
    def replicated(self) -> bool:
        """True when the parameter has no steps: every rank gets the whole tensor."""
        return not self.steps

    @property
    def remap(self) -> bool:
        """True when every step is an index remap, so ranks can read just their boxes.

        A stored tensor that needs decoding (a TVM ``f32-to-bf16`` record) is read whole instead.
        """
        if self.source.decode is not None:
            return False
        return not self.steps or all(s.func.remap for s in self.steps)

    @property
    def rank_nbytes(self) -> int:
        """Bytes of this parameter held by each rank."""
        return prod(self.shape) * itemsize(self.dtype)

    def read_nbytes(self, rank: int) -> int:
        """Bytes of the stored tensor that ``rank`` has to read."""
        pieces = self.pieces(rank)
        if pieces is None:
            return self.source.nbytes
        return sum(p.numel for p in pieces) * itemsize(self.source.dtype)

    def pieces(self, rank: int) -> list[Piece] | None:
        """The source boxes ``rank`` reads and where each lands, or None if a compute step needs the whole tensor."""
        if not 0 <= rank < self.num_shards:
            raise PlanError(f"rank {rank} is out of range for num_shards={self.num_shards}", param=self.name)
        if not self.remap:
            return None
        if rank not in self._pieces:
            self._pieces[rank] = _trace_pieces(self, rank)
        return self._pieces[rank][0]

    @property
    def pads(self) -> bool:
        """True when a step may leave padding (zeros no stored byte maps to) in the rank tensors."""
        return bool(self.steps) and any(s.func.pads for s in self.steps)

    def zeros(self, rank: int) -> list[Box]:
        """The boxes of ``rank``'s tensor that are padding: zeros, written without reading anything.

        Empty unless a step pads (``register(..., pads=True)``), and for a plan with a compute step, whose
        functions produce the zeros themselves.
        """
        if not self.pads or self.pieces(rank) is None:
            return []
        return self._pieces[rank][1]


def _full(shape: Shape) -> Box:
    return tuple((0, n) for n in shape)


def _trace_pieces(plan: ParamPlan, rank: int) -> tuple[list[Piece], list[Box]]:
    """Walk the remap steps backwards from ``output[rank]`` to boxes of the stored tensor.

    Returns the pieces to copy and the boxes of the rank's tensor that no stored element maps to (padding a
    ``pads`` step declares: zeros); a part left without a source stops there and is not traced further.
    """
    if plan.replicated:
        return [Piece(_full(plan.source.shape), _full(plan.shape))], []
    last = plan.steps[-1].out_shape
    current: list[tuple[Box, Box]] = [(((rank, rank + 1), *_full(last[1:])), _full(plan.shape))]
    zeros: list[Box] = []
    for step in reversed(plan.steps):
        traced: list[tuple[Box, Box]] = []
        for out_box, dst in current:
            assert step.func.boxes is not None
            for in_box, part in step.func.boxes(out_box, step.in_shape, *step.args):
                mapped = _map_part(out_box, dst, tuple(part), plan, step)
                if in_box is None:
                    if not step.func.pads:
                        raise PlanError(
                            "box rule returned a part with no source, but the step was not registered with pads=True",
                            param=plan.name, step=step.index, func=step.name,
                        )  # fmt: skip
                    if all(b > a for a, b in mapped):
                        zeros.append(mapped)
                    continue
                traced.append((tuple(in_box), mapped))
        current = traced
    return [Piece(src, dst) for src, dst in current if all(b > a for a, b in src)], zeros


def _map_part(out_box: Box, dst: Box, part: Box, plan: ParamPlan, step: PlannedStep) -> Box:
    """Translate ``part`` (a sub-box of ``out_box``) into the matching sub-box of ``dst``."""
    big_out = [i for i, (a, b) in enumerate(out_box) if b - a != 1]
    big_dst = [j for j, (a, b) in enumerate(dst) if b - a != 1]
    sizes_out = [out_box[i][1] - out_box[i][0] for i in big_out]
    sizes_dst = [dst[j][1] - dst[j][0] for j in big_dst]
    if sizes_out != sizes_dst:
        raise PlanError(
            f"box rule returned a piece whose shape does not match its output part ({out_box} vs {dst})",
            param=plan.name, step=step.index, func=step.name,
        )  # fmt: skip
    mapped = list(dst)
    for i, j in zip(big_out, big_dst, strict=True):
        lo = part[i][0] - out_box[i][0]
        hi = part[i][1] - out_box[i][0]
        mapped[j] = (dst[j][0] + lo, dst[j][0] + hi)
    return tuple(mapped)


@dataclass
class ModelPlan:
    """The plan for a whole checkpoint at one N, plus every problem met while building it."""

    num_shards: int
    shard_info: ShardInfo
    checkpoint: Checkpoint | None
    params: dict[str, ParamPlan] = field(default_factory=dict)
    problems: list[ShardloadError] = field(default_factory=list)
    layers: range | None = None
    """For one pipeline stage of a mesh: the decoder layers it holds (None: the whole model)."""

    def rank_nbytes(self, rank: int) -> int:
        """Bytes held by ``rank`` (every shard is the same size, so this is rank independent)."""
        return sum(p.rank_nbytes for p in self.params.values())

    @property
    def replicated_nbytes(self) -> int:
        """Bytes every rank holds in full (parameters with no steps)."""
        return sum(p.rank_nbytes for p in self.params.values() if p.replicated)

    def resolved_shard_info(self) -> dict[str, Any]:
        """The document form for exactly this N: every shape, dtype and argument made concrete."""
        params = {
            name: [[s.name, [list(s.out_shape), s.out_dtype], *s.args] for s in p.steps]
            for name, p in self.params.items()
            if p.steps
        }
        return {"version": 1, "num_shards": self.num_shards, "params": params}


MAX_HINTS = 20
"""Unknown parameter names that get a "did you mean" hint; the rest are listed without one."""
MAX_UNKNOWN_LISTED = 100
"""Unknown parameter names a plan reports one by one; the rest are one problem counting them (a file can hold a
million, and every N checked would list each)."""
MAX_GROWTH = 2
"""A rank's tensor may hold at most this many times the stored tensor's bytes (plus :data:`GROWTH_SLACK`): padding
and replication fit, a chain of replicates that multiplies the bytes per rank does not."""
GROWTH_SLACK = 64 << 10


def build_plan(
    shard_info: ShardInfo, checkpoint: Checkpoint | None, num_shards: int, *, strict: bool = True
) -> ModelPlan:
    """Plan ``checkpoint`` (or, when None, just the file's own declarations) for ``num_shards`` ranks.

    With ``strict`` the first problem is raised as a PlanError; otherwise all are collected in
    ``ModelPlan.problems``.
    """
    plan = ModelPlan(num_shards, shard_info, checkpoint)
    src = shard_info.source
    if type(num_shards) is not int or num_shards < 1:
        plan.problems.append(PlanError(f"num_shards must be a positive integer, got {num_shards!r}", file=src))
    elif num_shards > MAX_RANKS:
        plan.problems.append(PlanError(f"num_shards={num_shards} is over the limit of {MAX_RANKS}", file=src))
    elif shard_info.num_shards is not None and shard_info.num_shards != num_shards:
        plan.problems.append(
            PlanError(
                f"this file is for num_shards={shard_info.num_shards} only ({shard_info.form} form); "
                f"cannot plan for num_shards={num_shards}",
                file=src,
            )
        )
    if checkpoint is not None and checkpoint.split_for is not None:
        presharded = checkpoint.split_for
        if num_shards != presharded:
            plan.problems.append(
                PlanError(
                    f"is pre-sharded for num_shards={presharded} (records NAME_shard-K-of-{presharded}); "
                    f"it cannot be loaded with num_shards={num_shards}",
                    file=checkpoint.name,
                )
            )
        for key in shard_info.params:
            if shard_info.params[key]:
                plan.problems.append(
                    PlanError("lists steps, but the checkpoint is already pre-sharded", file=src, param=key)
                )
    if plan.problems:
        return _finish(plan, strict)

    stored = checkpoint.tensors if checkpoint is not None else {}
    if checkpoint is not None:
        unknown = [key for key in shard_info.params if key not in stored]
        more = len(unknown) - MAX_UNKNOWN_LISTED  # one problem each for the first few, then one for the rest
        for k, key in enumerate(unknown[:MAX_UNKNOWN_LISTED]):
            if k < MAX_HINTS:  # a hint costs a comparison with every stored name: only for the first few
                close = difflib.get_close_matches(key, stored.keys(), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
            else:
                hint = ""
            plan.problems.append(
                PlanError(
                    f"names no parameter of {checkpoint.name}{hint}; TVM's loader would ignore this key, "
                    "shardload refuses it so a misspelt name cannot leave a parameter unsplit",
                    file=src,
                    param=key,
                )
            )
        if more > 0:
            plan.problems.append(PlanError(f"and {more} more keys that name no parameter of {checkpoint.name}",
                                           file=src))  # fmt: skip
        plan.problems.extend(shard_info.alias_problems(checkpoint.tied_weights()))
    names = list(stored) if checkpoint is not None else list(shard_info.params)
    structures: dict[object, tuple[tuple[PlannedStep, ...], dict[int, tuple[list[Piece], list[Box]]]]] = {}
    failed: dict[object, ShardloadError] = {}  # structures that cannot plan, and why (the reason names no parameter)
    for name in names:
        source = stored.get(name)
        specs = shard_info.params.get(name, [])
        key = structure_key(specs, source, num_shards) if STRUCTURE_CACHE and source is not None else None
        known = structures.get(key) if key is not None else None
        if key is not None and key in failed:  # shaped like an earlier parameter that failed: the same failure
            why = failed[key]
            plan.problems.append(type(why)(why.reason, file=src, param=name, step=why.step, func=why.func))
            continue
        if known is not None:  # a parameter shaped like an earlier one (the same in every layer): same steps
            steps, traced = known
        else:
            try:
                steps = tuple(_plan_steps(name, specs, source, num_shards))
            except ShardloadError as err:
                plan.problems.append(err.located(file=src, param=name))
                if key is not None:
                    failed[key] = err
                continue
            traced = {}
            if key is not None:
                structures[key] = (steps, traced)
        if source is None:
            continue  # planned without a checkpoint: checks only, nothing to execute
        last = (steps[-1].out_shape[1:], steps[-1].out_dtype) if steps else (source.shape, source.logical_dtype)
        shape, dtype = last
        param = ParamPlan(name, source, steps, num_shards, shape, dtype, traced, where=src if steps else None)
        if param.rank_nbytes > MAX_GROWTH * source.nbytes + GROWTH_SLACK:
            plan.problems.append(
                PlanError(
                    f"the steps give each rank {param.rank_nbytes} bytes from a stored tensor of {source.nbytes}; "
                    f"more than {MAX_GROWTH}x is refused (chained replicates multiply)",
                    file=src,
                    param=name,
                )
            )
            continue
        plan.params[name] = param
    return _finish(plan, strict)


STRUCTURE_CACHE = True
"""Plan each parameter *structure* once per :func:`build_plan` (tests turn it off to compare with a plain build)."""
_PLAIN = frozenset({str, int, float, bool, type(None)})


def structure_key(specs: list[StepSpec], source: TensorInfo, n: int) -> tuple[object, ...] | None:
    """What a parameter's resolved steps and traced boxes depend on, besides ``n``: its step specs, the stored
    shape and the dtype the steps see. Parameters with equal keys (every layer of a model) get the same steps and
    share the boxes traced for them. None (no sharing) when an argument is not a plain JSON value, whose ``repr``
    might not tell two different values apart."""
    parts: list[object] = []
    for spec in specs:
        if not (isinstance(spec.func, str) and _plain(spec.args) and _plain(spec.shape)):
            return None
        parts.append((spec.func, repr(spec.shape), spec.dtype, repr(spec.args)))
    return (tuple(parts), source.shape, source.logical_dtype, n)


def _plain(value: object, depth: int = 0) -> bool:
    """Whether ``value`` is built of JSON scalars, lists, tuples and string-keyed dicts only (exact types: a
    subclass may repr like its base and behave otherwise)."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if depth > 32:
        return False
    if kind is list or kind is tuple:
        return all(_plain(v, depth + 1) for v in value)  # type: ignore[attr-defined]
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())  # type: ignore[attr-defined]
    return False


HEAD_STEPS = frozenset({"shard_funcs.shard_segments", "shard_funcs.reorder_segments"})
"""Steps that split whole heads: their problems are the model's own head counts, which no option changes."""


def _blocking_rank(problem: ShardloadError) -> int:
    """Which problem a failed plan reports first: one of the file or of a head split (as ``shardload plan -n N``
    says, from config.json's head counts), then the rest, and last a padding step's (a choice: --vocab-padding)."""
    if problem.step is None or problem.func in HEAD_STEPS:
        return 0
    try:
        pads = isinstance(problem.func, str) and lookup(problem.func).pads
    except StepArgumentError:
        pads = False
    return 2 if pads else 1


def _finish(plan: ModelPlan, strict: bool) -> ModelPlan:
    if strict and plan.problems:
        first = min(plan.problems, key=_blocking_rank)  # the first of the lowest rank
        more = len(plan.problems) - 1
        if more:
            command = _report_command(plan)
            see = f"; see {command}" if command else ""
            first.reason += f" (and {more} more problem{'s' if more > 1 else ''}{see})"
            first.args = (first.message,)
        raise first
    return plan


def _report_command(plan: ModelPlan) -> str | None:
    """The command that lists every problem of ``plan``: ``validate`` of its file, or, for a plan made in memory
    from config.json (no file to validate), ``plan -o -``, which prints it and the N it works for, writing nothing;
    for a dict given in Python, :func:`shardload.validate`; None for a shard_info shardload made from rank files."""
    from shlex import quote

    source, checkpoint = plan.shard_info.source, plan.checkpoint
    if source.startswith("<planned from ") and checkpoint is not None:
        return f"`shardload plan {quote(checkpoint.name)} -o -`, which prints this plan and the N it works for"
    if source == "<shard_info dict>":  # given in Python: no file to name
        return f"`shardload.validate(shard_info, model, num_shards={plan.num_shards})`, which lists them"
    if source.startswith("<"):  # made by shardload from rank files: no file of the user's to validate
        return None
    if checkpoint is None:
        return f"`shardload validate {quote(source)} -n {plan.num_shards}`"
    return f"`shardload validate {quote(source)} --model {quote(checkpoint.name)} -n {plan.num_shards}`"


def _plan_steps(name: str, specs: list[StepSpec], source: TensorInfo | None, n: int) -> list[PlannedStep]:
    """Resolve and check one parameter's steps; raise a located PlanError at the first bad one."""
    in_shape: Shape | None = source.shape if source is not None else None
    in_dtype: str | None = source.logical_dtype if source is not None else None
    steps: list[PlannedStep] = []
    for k, spec in enumerate(specs, 1):
        func_name = spec.func if isinstance(spec.func, str) else repr(spec.func)

        def fail(reason: str) -> PlanError:
            return PlanError(reason, param=name, step=k, func=func_name)  # noqa: B023

        try:
            func = lookup(spec.func)
            args = func.bind(spec.args, n)
            if in_shape is None or in_dtype is None:
                # No input known (validating without a checkpoint): trust the declaration and go on.
                declared = _eval_shape(spec.shape, n)
                if declared is None or spec.dtype is None:
                    return steps
                in_shape, in_dtype = declared, spec.dtype
                continue
            if func.shape is None:  # destination-passing: the declared output is the contract
                declared = _eval_shape(spec.shape, n)
                if declared is None or spec.dtype is None:
                    raise StepArgumentError(
                        "writes into an output allocated from its declaration, so the step must declare "
                        "its output shape and dtype"
                    )
                out_shape, out_dtype = declared, spec.dtype
            else:
                out_shape, out_dtype = func.shape(in_shape, in_dtype, *args)
            out_shape = tuple(int(d) for d in out_shape)
            if out_dtype not in DTYPES or any(d < 0 for d in out_shape):
                raise StepArgumentError(f"shape rule returned an invalid result {list(out_shape)} {out_dtype!r}")
            declared = _eval_shape(spec.shape, n)
        except StepArgumentError as err:
            raise fail(str(err)) from None
        except Exception as err:  # a user's shape rule crashed: report it as a plan problem
            raise fail(f"shape rule failed: {type(err).__name__}: {err}") from None
        if declared is not None and declared != out_shape:
            raise fail(
                f"declared output shape {list(declared)} but {func.name} gives {list(out_shape)} "
                f"for input {list(in_shape)}"
            )
        if spec.dtype is not None and spec.dtype != out_dtype:
            origin = " (the checkpoint's dtype)" if k == 1 else ""
            raise fail(f"declared dtype {spec.dtype} but {func.name} gives {out_dtype} from {in_dtype} input{origin}")
        steps.append(PlannedStep(k, func, args, in_shape, in_dtype, out_shape, out_dtype))
        in_shape, in_dtype = out_shape, out_dtype
    if specs and in_shape is not None and (not in_shape or in_shape[0] != n):
        raise PlanError(
            f"last step must output [num_shards={n}, ...], got {list(in_shape)}",
            param=name, step=len(specs), func=specs[-1].func,
        )  # fmt: skip
    return steps


def _eval_shape(shape: tuple[int | str, ...] | None, n: int) -> Shape | None:
    if shape is None:
        return None
    try:
        dims = tuple(expr.evaluate(d, n) for d in shape)
    except StepArgumentError as err:
        raise StepArgumentError(f"output shape: {err}") from None
    for d in dims:
        if d < 0:
            raise StepArgumentError(f"output shape {list(dims)} has a negative dim for num_shards={n}")
    return dims


def resolve_shard_info(checkpoint: Checkpoint, shard_info: ShardInfo | dict[str, Any] | str | Any | None) -> ShardInfo:
    """Turn the ``shard_info`` argument of the API (object, dict, path or None) into a ShardInfo."""
    if shard_info is not None:
        return given_shard_info(shard_info)
    info = shard_info_beside(checkpoint)
    if info is not None:
        return info
    if checkpoint.split_for is not None:
        return ShardInfo(source="<pre-sharded: no steps>")  # already split: nothing to run
    raise PlanError(
        f"no shard_info given and {checkpoint.default_shard_info()} does not exist; write one from config.json with "
        f"`shardload plan {checkpoint.root}` (or pass --shard-info / shard_info=)",
        file=checkpoint.name,
    )


def given_shard_info(shard_info: ShardInfo | dict[str, Any] | str | Any) -> ShardInfo:
    """The ShardInfo a caller passed: itself, a dict, or a path read and checked."""
    if isinstance(shard_info, ShardInfo):
        return shard_info
    if isinstance(shard_info, dict):
        return ShardInfo.from_dict(shard_info, source="<shard_info dict>")
    return ShardInfo.load(as_path(shard_info, "shard_info (a path, a dict or a ShardInfo)"))


def shard_info_beside(checkpoint: Checkpoint) -> ShardInfo | None:
    """The shard_info.json beside the weights (None when there is none), resolved inside the model directory."""
    default = checkpoint.default_shard_info()
    if not (default.exists() or default.is_symlink()):  # a FIFO or a device is present, and refused when read
        return None
    found = resolve_inside(checkpoint.root, default.name, default)
    if isinstance(found, ObjectPath):  # in object storage: read whole, then parsed as a local file would be
        return shard_info_object(found)
    return ShardInfo.load(found)


def shard_info_object(path: ObjectPath) -> ShardInfo:
    """A shard_info.json kept in object storage, read and checked."""
    return ShardInfo.from_bytes(path.read_small(MAX_FILE_BYTES, "shard_info"), source=str(path))
