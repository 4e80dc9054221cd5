"""What an opened model is: one type per kind of source, and the one table of which load options each type takes.

:func:`open_source` is the one place a model is told apart. It asks the registered split formats first (a server's
own per-rank layout, such as vLLM's ``sharded_state``, registered by its integration), then opens the checkpoint, and
returns one of:

- :class:`WholeTensors`: a source checkpoint storing each tensor whole (safetensors, GGUF, a TVM cache): planned,
  then each rank reads its own runs;
- :class:`RankFiles`: a directory ``convert`` wrote, loaded at the mesh it was written for: each rank reads its own
  file;
- :class:`SplitRecords`: a TVM/MLC cache pre-sharded for N, loaded at that N: each rank reads its own records;
- :class:`Boxes`: stored splits of another mesh, each rank assembled from boxes of them: :class:`ConvertedBoxes`
  (a directory converted for another mesh), :class:`PreshardedBoxes` (a pre-sharded cache at another N) and
  :class:`SavedBoxes` (a registered split format).

:data:`SUPPORT` is the table of source type x option: a cell is None where the type takes the option, else the
refusal (a format string over the source's :meth:`Source.words`). :data:`EXCLUSIONS` are the pairs of options that
exclude each other on any source. Code above this package asks the type (``isinstance``) and the table, never a
kind's name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ..errors import ShardloadError
from .checkpoint import Checkpoint, manifest_stages, open_checkpoint
from .objects import ObjectPath
from .plugins import PluginError, load_once

OPTIONS = ("shard_info", "verify_root", "verify", "group", "mmap", "read_options", "into", "stages")
"""The options a load may be refused on, in the order they are checked: ``shard_info`` (a plan given), ``verify_root``
(a pinned root), ``verify`` (any check), ``group`` (reads shared by a process group), ``mmap`` (the ``"view"`` read
strategy), ``read_options`` (any other read option), ``into`` (destination tensors or a subset of names), ``stages``
(pipeline stages)."""

_CARRIES = "{what} carries its own shard_info; do not pass one"
_BOX_VERIFY = (
    "{boxes}; a pinned root (verify=<root hash>, --verify ROOT) is not supported there: load it with verify=True "
    "(--verify with no ROOT: every rank file checked whole against its manifest){own}"
)
VIEW = 'ReadOptions(strategy="view")'
"""The view read strategy as a caller spells it."""
_NO_GROUP = "{boxes}; group= does not apply there (load without it)"
_NO_VIEWS = f"{{boxes}}; {VIEW} does not apply there (load without it)"
_NOT_STEERED = "{boxes}, which read_options does not steer (give no read_options)"
_NO_INTO = "{boxes}; into= does not apply there (load the rank, then copy)"
_PRESHARDED_VERIFY = (
    "verify is not supported when a pre-sharded cache is read for another N: load it at its own N with verify, or "
    "convert the whole checkpoint"
)
_RANK_BY_RANK = (
    "group= shares the reads of a source checkpoint or a converted directory; a pre-sharded one is read rank by rank "
    "(load it without group=)"
)


class OpenedSplit(Protocol):
    """What a split format's opener returns (an engine ``ShardsSource``): the stored tensors its rank files were
    planned from (shapes and dtypes; no file behind them), that plan's shard_info, and the rank files by (stage,
    rank), every one checked before a tensor byte is read."""

    stored: Checkpoint
    shard_info: Any
    files: Mapping[tuple[int, int], Any]


class MeshShape(Protocol):
    """What a source is classified against: a mesh's tensor-parallel size, stage count and layers per stage."""

    tp: int
    pp: int
    pp_layers: tuple[int, ...] | None


@dataclass(frozen=True)
class Source:
    """An opened model. ``checkpoint`` is its header-level view (for :class:`SavedBoxes`, the stored tensors its
    rank files were planned from)."""

    checkpoint: Checkpoint
    where: str = ""
    """The model as the caller named it (messages name it so); empty: the checkpoint's path."""
    what: ClassVar[str] = "a checkpoint"
    """How a message names this kind of source."""
    splits: ClassVar[bool] = False
    """True when the model is stored already split (no shard_info of the caller's applies, nothing to hash or plan)."""
    derived: ClassVar[bool] = False
    """True when the model was written from another checkpoint for some mesh (a conversion, a server's save):
    hashing, planning and pre-flight checks apply to that checkpoint, not to this one."""
    whole_file_checks: ClassVar[bool] = False
    """True when ``verify=True`` checks each file whole (its checksum) before a byte of it is used, rather than every
    byte as it is read: then a view of the file is a checked one."""

    @property
    def name(self) -> str:
        return self.where or str(self.checkpoint.path)

    def words(self, mesh: MeshShape | None) -> dict[str, str]:
        """The values this source's refusals are formatted with."""
        return {"what": self.what, "boxes": self.what}

    def checked(self) -> Source:
        """This source with ``verify=True``'s whole-file checks made where opening makes them (a split format's
        rank files hashed as they are opened again); itself for every other type, whose loads check as they read."""
        return self

    def refusal(self, option: str, mesh: MeshShape | None) -> str | None:
        """Why this source refuses ``option`` (None: it takes it), from :data:`SUPPORT`."""
        cell = SUPPORT[type(self)].get(option)
        return None if cell is None else cell.format(**self.words(mesh))


@dataclass(frozen=True)
class WholeTensors(Source):
    """A source checkpoint whose tensors are stored whole: planned, then each rank reads only its runs."""

    what: ClassVar[str] = "a source checkpoint"


@dataclass(frozen=True)
class RankFiles(Source):
    """A directory ``convert`` wrote, at the mesh it was written for: each rank reads its own rank file."""

    what: ClassVar[str] = "a converted directory"
    splits: ClassVar[bool] = True
    derived: ClassVar[bool] = True
    whole_file_checks: ClassVar[bool] = True


@dataclass(frozen=True)
class SplitRecords(Source):
    """A cache pre-sharded for N (``NAME_shard-K-of-N`` records), at that N: each rank reads its own records."""

    what: ClassVar[str] = "a pre-sharded checkpoint"
    splits: ClassVar[bool] = True


@dataclass(frozen=True)
class Boxes(Source):
    """Stored splits of another mesh: each rank is assembled from boxes of them (resharding: more read items)."""

    splits: ClassVar[bool] = True


@dataclass(frozen=True)
class ConvertedBoxes(Boxes):
    """A directory ``convert`` wrote for another mesh than the one asked for."""

    what: ClassVar[str] = "a converted directory"
    derived: ClassVar[bool] = True

    def words(self, mesh: MeshShape | None) -> dict[str, str]:
        n = (self.checkpoint.manifest or {}).get("num_shards")
        boxes = f"was converted for num_shards={n}: loading it for {mesh} reads boxes of several rank files"
        return {"what": self.what, "boxes": boxes, "own": ", or at its own N"}


@dataclass(frozen=True)
class PreshardedBoxes(Boxes):
    """A cache pre-sharded for another N than the one asked for."""

    what: ClassVar[str] = "a pre-sharded checkpoint"

    def words(self, mesh: MeshShape | None) -> dict[str, str]:
        n = self.checkpoint.split_for
        return {"what": self.what, "boxes": f"is pre-sharded for num_shards={n}: loading it for {mesh} reads boxes "
                                            "of several records"}  # fmt: skip


@dataclass(frozen=True)
class SavedBoxes(Boxes):
    """A registered split format (a server's per-rank layout): ``opened`` is what its opener returned (the stored
    tensors, the old plan and every rank file's header, checked), read as boxes at any N."""

    opened: OpenedSplit | None = None
    format: SplitFormat | None = None
    derived: ClassVar[bool] = True

    @property
    def what(self) -> str:  # type: ignore[override]
        return self.format.what if self.format is not None else "a split directory"

    def checked(self) -> Source:
        if self.format is None:
            return self
        return SavedBoxes(self.checkpoint, self.where, opened=self.format.open(self.where, True), format=self.format)

    def words(self, mesh: MeshShape | None) -> dict[str, str]:
        files = self.format.files if self.format is not None else "its"
        return {"what": self.what, "boxes": f"{self.what} is read in boxes of {files} rank files", "own": ""}


_BOXES = {
    "shard_info": None,
    "verify_root": _BOX_VERIFY,
    "group": _NO_GROUP,
    "mmap": _NO_VIEWS,
    "read_options": _NOT_STEERED,
    "into": _NO_INTO,
}
SUPPORT: dict[type[Source], dict[str, str | None]] = {
    WholeTensors: {},
    RankFiles: {"shard_info": _CARRIES},
    SplitRecords: {"group": _RANK_BY_RANK, "stages": "pipeline stages of a pre-sharded checkpoint are not supported"},
    ConvertedBoxes: {**_BOXES, "shard_info": _CARRIES},
    PreshardedBoxes: {
        "verify_root": _PRESHARDED_VERIFY,
        "verify": _PRESHARDED_VERIFY,
        "group": _RANK_BY_RANK,
        "mmap": f"{{boxes}}, without {VIEW}",
        "read_options": _NOT_STEERED,
        "into": _NO_INTO,
    },
    SavedBoxes: {**_BOXES, "shard_info": _CARRIES},
}
"""Source type x option: None (or absent) where the type takes the option, else its refusal."""

EXCLUSIONS: dict[frozenset[str], str] = {
    frozenset({"group", "mmap"}): f"group= and {VIEW} exclude each other (views of a file are not exchanged)",
    frozenset(
        {"mmap", "remote"}
    ): f"{VIEW} maps local files; this model is in object storage (load with another strategy, "
    "or convert it to a local directory first)",
    frozenset({"mmap", "device"}): f"{VIEW} maps files into host memory; it needs device='cpu', not {{device!r}}",
    frozenset({"group", "read_options"}): "read_options applies to a rank reading for itself; group= reads each "
    "chunk as exact runs (give no read_options)",
    frozenset({"group", "into"}): "into= applies to a rank reading its own tensors; group= exchanges a "
    "group's chunks (one or the other)",
    frozenset({"mmap", "out"}): f"into= applies to a rank reading its own tensors; {VIEW} returns views of "
    "the file (one or the other)",
    frozenset(
        {"checked_reads", "mmap"}
    ): f"verify and {VIEW} exclude each other (a view of the file is not a checked copy)",
}
"""Pairs of options (or an option and a fact of the load: ``remote``, files in object storage; ``device``, a rank on
another device than the CPU; ``checked_reads``, a verify that checks bytes as they are read) that exclude each other
on any source, with the refusal."""


def check_options(source: Source, given: Mapping[str, bool], mesh: MeshShape | None, **words: Any) -> None:
    """Raise the table's refusal for the first option in ``given`` (option -> whether it was given) that
    ``source`` does not take, then for the first pair of given options that exclude each other (formatted with
    ``words``)."""
    for option in OPTIONS:
        if given.get(option):
            reason = source.refusal(option, mesh)
            if reason is not None:
                raise ShardloadError(reason, file=source.name)
    checked = given.get("verify_root") or (given.get("verify") and not source.whole_file_checks)
    given = {**given, "checked_reads": bool(checked)}
    for pair, reason in EXCLUSIONS.items():
        if all(given.get(option) for option in pair):
            raise ShardloadError(reason.format(**words), file=source.name)


@dataclass(frozen=True)
class SplitFormat:
    """A server's per-rank layout registered as a source (vLLM's ``sharded_state``): how messages name it, and an
    opener that returns what it opened (read as boxes at any N) or None when the model is not of this format."""

    name: str
    what: str
    """How a message names such a model: ``"a sharded_state directory"``."""
    files: str
    """Whose rank files it holds, for messages: ``"vLLM's"``."""
    open: Callable[[Any, bool], OpenedSplit | None]
    """``(model, checksums) -> opened or None``: ``checksums`` checks every rank file whole as it opens."""


_SPLIT_FORMATS: dict[str, SplitFormat] = {}
SPLIT_FORMAT_GROUP = "shardload.split_formats"
"""The entry point group a package registers a split format in: each entry point names a callable that calls
:func:`register_split_format`."""


def register_split_format(fmt: SplitFormat) -> None:
    """Add (or replace) a split format; :func:`open_source` asks each before opening a checkpoint."""
    _SPLIT_FORMATS[fmt.name] = fmt


def split_formats() -> list[SplitFormat]:
    """Every registered split format, the entry points of installed packages loaded once."""
    try:
        load_once(SPLIT_FORMAT_GROUP)
    except PluginError as err:  # raised again by every call: no load goes on with a format missing
        raise ShardloadError(str(err)) from None
    return list(_SPLIT_FORMATS.values())


def open_source(
    model: str | os.PathLike[str] | Checkpoint,
    mesh: MeshShape | None = None,
    *,
    checksums: bool = False,
    where: str | None = None,
) -> Source:
    """Open ``model`` as the type of source it is for ``mesh`` (None: its own mesh); ``checksums`` checks a split
    format's rank files whole as they are opened. An opened :class:`Checkpoint` is classified as it is (no split
    format is asked); ``where`` names it in messages."""
    if not isinstance(model, Checkpoint):
        for fmt in split_formats():
            opened = fmt.open(model, checksums)
            if opened is not None:
                _alone(model, opened, fmt)
                return SavedBoxes(opened.stored, str(model), opened=opened, format=fmt)
    checkpoint = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    where = where or (checkpoint.name if isinstance(model, Checkpoint) else str(model))
    if checkpoint.kind == "converted":
        if mesh is not None and needs_reshard(checkpoint, mesh):
            return ConvertedBoxes(checkpoint, where)
        return RankFiles(checkpoint, where)
    if checkpoint.split_for is not None:
        if mesh is not None and checkpoint.split_for != mesh.tp:
            return PreshardedBoxes(checkpoint, where)
        return SplitRecords(checkpoint, where)
    return WholeTensors(checkpoint, where)


WEIGHT_SUFFIXES = (".safetensors",)
"""Names of weight files: a directory holding one that a split format did not open beside its rank files is refused.
Not an index, a GGUF file or a TVM table: vLLM's ``save_sharded_state`` example copies every file of the source but
its ``.bin``, ``.pt`` and ``.safetensors`` files into the save."""


def _alone(model: Any, opened: OpenedSplit, fmt: SplitFormat) -> None:
    """Refuse a directory whose rank files a split format opened when it also holds other weights (a checkpoint's
    own directory that a server's save was written into): which of them a load means is not shardload's guess."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        return
    claimed = {Path(p).name for p in opened.files.values()}
    claimed |= {Path(p).name for p in getattr(opened, "extra_files", ())}
    others = sorted(n for n in os.listdir(model) if n.endswith(WEIGHT_SUFFIXES) and n not in claimed)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ShardloadError(
            f"holds {fmt.files} rank files ({fmt.what}) and other weights beside them ({shown}): keep one model per "
            "directory; shardload will not guess which one a load means",
            file=str(model),
        )


def as_boxes(source: Source) -> Source:
    """``source`` as a writer reads it: a converted directory is read as boxes at any mesh (at its own, each box a
    whole rank file); every other type as it is."""
    return ConvertedBoxes(source.checkpoint, source.where) if isinstance(source, RankFiles) else source


def needs_reshard(checkpoint: Checkpoint, mesh: MeshShape) -> bool:
    """Whether a converted directory was written for another mesh than ``mesh`` (tp, pp, layers per stage)."""
    manifest = checkpoint.manifest or {}
    stored_layers = (manifest.get("mesh") or {}).get("pp_layers")
    same_layers = mesh.pp_layers is None or list(mesh.pp_layers) == stored_layers
    return manifest.get("num_shards") != mesh.tp or manifest_stages(manifest) != mesh.pp or not same_layers


def remote(source: Source) -> bool:
    """True when the source's files are in object storage (nothing to map)."""
    return isinstance(source.checkpoint.path, ObjectPath)
