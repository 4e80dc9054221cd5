"""The options ``load`` and ``load_rank`` share, as typed values, checked once against the source-type table.

:class:`Verify` names what a load checks, :class:`Destination` where a rank's tensors go; a process group given as
``group`` shares the reading, and ``ReadOptions(strategy="view")`` returns views of the files. :class:`LoadOptions`
is all of them after the old spellings (``mmap=``, ``share_reads=``, ``params=``, ``out=``, ``verify="<root>"``) are
mapped and warned about; :meth:`LoadOptions.check` asks :data:`~shardload.sources.source_types.SUPPORT` and
:data:`~shardload.sources.source_types.EXCLUSIONS`, so neither entry point raises an option refusal of its own.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from ..errors import ShardloadError
from ..sources.dtypes import to_torch
from ..sources.source_types import MeshShape, Source, check_options, remote
from .read_strategy import ReadOptions

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ModelPlan

Tensors: TypeAlias = "Mapping[str, torch.Tensor] | Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None]"
"""A destination's tensors: name -> the caller's tensor, or ``(name, shape, dtype) -> tensor or None``."""
_ROOT_RE = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class Verify:
    """What a load checks before it returns a tensor: the source's integrity record (a converted directory: each rank
    file checked whole against its manifest); ``root`` (the hex root ``shardload hash`` prints) pins that record."""

    root: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.root, str):  # as read from a file or a config: a trailing newline, upper case
            object.__setattr__(self, "root", self.root.strip().lower())
        if self.root is not None and not (isinstance(self.root, str) and _ROOT_RE.fullmatch(self.root)):
            raise ShardloadError(f"Verify(root=) must be 64 hex digits (shardload hash prints it), got {self.root!r}")


@dataclass(frozen=True)
class Destination:
    """Where one rank's tensors go: ``tensors`` are the caller's, filled in place (a mapping name -> tensor, or a
    callable ``(name, shape, dtype) -> tensor or None``; the rest are fresh); ``only`` reads just those stored
    tensors (default: all)."""

    tensors: Tensors | None = None
    only: Collection[str] | None = None


@dataclass(frozen=True)
class LoadOptions:
    """Every option of one load, in one form: ``verify`` False, True or a pinned root; ``group`` None, True (the
    default group) or a ProcessGroup; ``mmap`` the ``"view"`` read strategy; ``read_options`` the rest of the read
    options (None: the defaults); ``into`` a checked :class:`Fill`."""

    shard_info: Any = None
    verify: bool | str = False
    group: Any = None
    mmap: bool = False
    read_options: ReadOptions | None = None
    into: Fill | None = None
    progress: Any = False

    def check(self, source: Source, mesh: MeshShape, devices: Collection[Any]) -> None:
        """Refuse, in today's words, an option ``source`` does not take or a pair of options that exclude each
        other (the source-type table), before any byte is read."""
        given = {
            "shard_info": self.shard_info is not None,
            "verify_root": isinstance(self.verify, str),
            "verify": bool(self.verify),
            "group": self.group is not None,
            "mmap": self.mmap,
            "read_options": self.read_options not in (None, ReadOptions()),  # the defaults are as good as none
            "into": self.into is not None,
            "out": self.into is not None and self.into.out is not None,
            "stages": mesh.pp != 1,
            "remote": remote(source),
            "device": any(_device_type(d) != "cpu" for d in devices),
        }
        device = next((d for d in devices if _device_type(d) != "cpu"), "cpu")
        check_options(source, given, mesh, device=device)


def load_options(
    where: str,
    *,
    shard_info: Any,
    verify: Any,
    group: Any,
    read_options: ReadOptions | None,
    into: Destination | Tensors | None,
    progress: Any,
    legacy: Mapping[str, Any],
) -> LoadOptions:
    """The options of one call in one form, the old spellings in ``legacy`` (``mmap``, ``share_reads``, ``params``,
    ``out``) mapped with a DeprecationWarning; a bad value raises one line naming ``where``."""
    unknown = sorted(set(legacy) - {"mmap", "share_reads", "params", "out"})
    if unknown:
        raise TypeError(f"got an unexpected keyword argument {unknown[0]!r}")
    for old, new in (("mmap", 'read_options=ReadOptions(strategy="view")'), ("share_reads", "group="),
                     ("params", "into=Destination(only=...)"), ("out", "into=")):  # fmt: skip
        if legacy.get(old) not in (None, False):
            warn_caller(f"load_rank's {old}= is deprecated: use {new}")
    if legacy.get("share_reads") not in (None, False):
        if group is not None:
            raise ShardloadError("give group= or share_reads=, not both", file=where)
        group = legacy["share_reads"]
    if group is False:
        group = None
    params, out = legacy.get("params"), legacy.get("out")
    if params is not None or out is not None:
        if into is not None:
            raise ShardloadError("give into= or params=/out=, not both", file=where)
        into = Destination(out, params)
    mmap = bool(legacy.get("mmap"))
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise ShardloadError(f"progress must be True, False or a callable (done, total), got {progress!r}", file=where)
    if read_options is not None and not isinstance(read_options, ReadOptions):
        raise ShardloadError(f"read_options must be a ReadOptions, got {read_options!r}", file=where)
    if read_options is not None and read_options.strategy == "view":
        mmap = True
        plain = replace(read_options, strategy="auto")
        read_options = None if plain == ReadOptions() else plain
    return LoadOptions(shard_info, verify_value(verify, where), group, mmap, read_options, Fill.of(into, where),
                       progress)  # fmt: skip


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_caller(message: str) -> None:
    """A DeprecationWarning placed at the first line outside shardload that led here (the user's call, at whatever
    depth of shardload's own frames it was given)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def verify_value(verify: Any, where: str) -> bool | str:
    """``verify`` as False, True or a pinned root (a :class:`Verify`, or the old spelling: the root as a string)."""
    if verify is None or verify is False or verify is True:
        return bool(verify)
    if isinstance(verify, Verify):
        return True if verify.root is None else verify.root
    if isinstance(verify, str):
        warn_caller('verify="<root hash>" is deprecated: use verify=Verify(root="<root hash>")')
        return verify  # the root as a string: checked where the record is read, as before
    raise ShardloadError(f"verify must be True, False or a Verify, got {verify!r}", file=where)


def _device_type(device: Any) -> str:
    import torch

    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return str(device)


@dataclass(frozen=True)
class Fill:
    """A checked :class:`Destination`: which stored tensors a rank reads (``params``), and into whose (``out``)."""

    params: frozenset[str] | None
    out: Tensors | None
    where: str
    handed: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)
    """The caller's tensors a load was given to fill, once checked: zero-filled when that load fails."""

    @classmethod
    def of(cls, into: Destination | Tensors | None, where: str) -> Fill | None:
        """``into`` checked for type (a mapping or callable alone: tensors to fill); None when nothing is given."""
        if into is None:
            return None
        if not isinstance(into, Destination):
            into = Destination(into)
        params, out = into.only, into.tensors
        if params is None and out is None:
            return None
        if params is not None and (isinstance(params, (str, bytes)) or not isinstance(params, Collection)):
            raise ShardloadError(f"Destination.only must be a collection of tensor names, got {params!r}", file=where)
        if out is not None and not (isinstance(out, Mapping) or callable(out)):
            raise ShardloadError(
                f"into must be a Destination, a mapping of names to tensors or a callable, got {out!r}", file=where
            )
        return cls(None if params is None else frozenset(params), out, where)

    def known(self, names: Collection[str]) -> None:
        """Raise when ``params`` names a tensor that is not among ``names`` (all the checkpoint holds)."""
        unknown = sorted(set(self.params or ()) - set(names))
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise ShardloadError(f"Destination.only names a tensor the checkpoint does not hold{more}", file=self.where,
                                 param=unknown[0])  # fmt: skip

    def select(self, stage: ModelPlan, whole: ModelPlan) -> ModelPlan:
        """``stage`` (a pipeline stage of the plan ``whole``, or all of it) narrowed to ``params``."""
        if self.params is None:
            return stage
        self.known(whole.params)
        return replace(stage, params={n: p for n, p in stage.params.items() if n in self.params})

    def destinations(self, plan: ModelPlan) -> dict[str, torch.Tensor]:
        """The caller's tensors by name, each checked against the rank's shape and dtype in ``plan``."""
        import torch

        if self.out is None:
            return {}
        if not isinstance(self.out, Mapping):
            given = {n: self.out(n, tuple(p.shape), to_torch(p.dtype)) for n, p in plan.params.items()}
            found = {n: t for n, t in given.items() if t is not None}
        else:
            found = dict(self.out)
        for name, t in found.items():
            p = plan.params.get(name)
            if p is None:
                raise ShardloadError("into names a tensor this rank does not read (not in the checkpoint, not in "
                                     "Destination.only, or another pipeline stage's)", file=self.where,
                                     param=name)  # fmt: skip
            if not isinstance(t, torch.Tensor):
                raise ShardloadError(
                    f"into gives an object of type {type(t).__name__}, not a tensor", file=self.where, param=name
                )
            want = (list(p.shape), to_torch(p.dtype))
            if (list(t.shape), t.dtype) != want:
                raise ShardloadError(f"into's tensor is {list(t.shape)} {t.dtype}, this rank's tensor is {want[0]} "
                                     f"{want[1]}", file=self.where, param=name)  # fmt: skip
            what = _unfillable(t)
            if what is not None:
                raise ShardloadError(f"into's tensor is {what}; give a contiguous tensor of {want[0]}", file=self.where,
                                     param=name)  # fmt: skip
        _disjoint(found, self.where)
        self.handed.extend(found.values())
        return found

    def clear(self) -> None:
        """Zero every tensor a failed load was given to fill, so that none holds part of what it read (best
        effort: a device that fails again keeps the first error the caller sees)."""
        import torch

        for t in self.handed:
            try:
                with torch.inference_mode():  # an inference tensor too; a normal one is written in place either way
                    t.detach().zero_()
            except Exception:  # the load's own error is the one raised
                continue
        self.handed.clear()


def _unfillable(t: torch.Tensor) -> str | None:
    """Why a destination cannot be filled byte for byte, None when it can."""
    import torch

    if t.layout != torch.strided:
        return f"not dense ({t.layout})"
    if t.device.type == "meta":
        return "on the meta device (no memory)"
    if t.is_neg() or t.is_conj():
        return "a negated or conjugated view (its memory holds other values than it reads as)"
    if not t.is_contiguous():
        return "not contiguous"
    return None


def _disjoint(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise when two of the caller's (contiguous) tensors share memory: their reads would overwrite each other."""
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in tensors.items()
        if t.numel()
    )
    for (device, _, end, first), (other, start, _, name) in itertools.pairwise(spans):
        if device == other and start < end:
            raise ShardloadError(f"into's tensor shares memory with {first}'s; give each tensor its own memory",
                                 file=where, param=name)  # fmt: skip
