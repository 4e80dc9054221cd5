"""Checkpoint reading: a model's files found and opened, headers only (single file, HF indexed multi-file,
converted output, registered formats); the headers themselves are :mod:`.safetensors_header`'s, a converted
directory's manifest :mod:`.manifest`'s.

Opening a checkpoint reads headers only; tensor bytes are read by the executor, run by run,
through :class:`shardload.sources.reader.Reader`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, printable
from ..format import input_log, strictjson
from ..format.smallfile import read_small
from .formats import SourceFormat, format_for_dir, format_for_file, source_format
from .location import is_uri, resolve_model
from .manifest import (  # noqa: F401  (some re-exported for engine/convert.py, sources/source_types.py)
    CONVERSION_KEY,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    RANK_FILE_RE,
    check_manifest,
    manifest_stages,
    rank_file_name,
)
from .objects import ObjectPath
from .safetensors_header import MAX_HEADER_BYTES, exact_reads, read_header
from .tensor_info import TensorInfo

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_INFO_NAME = "shard_info.json"
CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 16 << 20
"""Cap on config.json (real ones are a few KB; a multimodal one with a vocabulary inside, a few MB)."""
TMP_MARKER = ".shardload-tmp-"
"""Part of the name of every temporary entry ``convert`` makes; such a path is never read as a model."""
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "embed_in.weight", "word_embeddings.weight")


def as_path(value: Any, what: str) -> Path:
    """``value`` as a Path, or a one-line error when it is not a path (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        raise CheckpointError(f"{what} must be a path (str or os.PathLike), got {value!r}")
    return Path(value)


def local_output(value: Any, what: str) -> Path:
    """``value`` as the Path of an output written locally, refused in one line when it is an object-store URI (a
    Path would read ``s3://b/out`` as the local ``s3:/b/out``)."""
    if is_uri(value):
        raise CheckpointError(f"{what} {value} is not local: this writes a local directory or file; write it here, "
                              "then copy it to object storage (e.g. `aws s3 sync`)")  # fmt: skip
    return as_path(value, what)


@dataclass
class Checkpoint:
    """The header-level view of a model: every tensor's location, no data read.

    ``kind`` is ``"safetensors"`` or a registered format's name (``"gguf"``, ``"tvm-cache"``) for a source
    checkpoint and ``"converted"`` for a directory written by ``convert`` (then ``manifest`` holds its manifest
    and ``tensors`` is empty: each rank's file is opened with :func:`read_header` when needed). Code outside
    :mod:`shardload.sources` asks the capabilities below rather than comparing ``kind`` with a format's name.
    """

    path: Path
    root: Path
    kind: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    split_for: int | None = None
    """For a source stored already split for one N (a TVM cache of ``NAME_shard-K-of-N`` records): that N."""
    shards: dict[str, list[TensorInfo]] = field(default_factory=dict)
    """For a pre-sharded source: parameter name -> its stored part for each rank, rank order."""
    mlc_preshard: bool = False
    """A TVM cache whose records are MLC-LLM's pre-sharded ``NAME_shard-I``, as ``mlc-chat-config.json`` says: that
    file is then a plan input (a verified load needs it in the record)."""

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def source_format(self) -> SourceFormat | None:
        """The registered format this checkpoint was opened by; None for safetensors and converted directories."""
        return source_format(self.kind)

    def config_file(self) -> Path:
        """The file the model config is read from: ``config.json`` beside the weights unless the format keeps it
        elsewhere (a GGUF file's metadata)."""
        fmt = self.source_format
        return fmt.config_file(self) if fmt is not None and fmt.config_file is not None else self.root / CONFIG_NAME

    def model_config(self) -> dict[str, Any]:
        """The model config in config.json's terms, read where the format keeps it."""
        fmt = self.source_format
        return fmt.read_config(self) if fmt is not None and fmt.read_config is not None else read_config(self.root)

    @property
    def plain_safetensors(self) -> bool:
        """True for a source of whole tensors in plain safetensors files, what ``quantize`` and ``convert --layout
        vllm`` read (not another format, a pre-sharded source or a converted directory)."""
        fmt = self.source_format
        plain = self.kind == "safetensors" or (fmt is not None and fmt.plain_safetensors)
        return plain and self.split_for is None

    def rank_view(self, rank: int) -> Checkpoint:
        """A pre-sharded source as rank ``rank`` sees it: its own part of every split parameter, under the
        parameter's name, beside every tensor stored whole."""
        own = {name: parts[rank] for name, parts in self.shards.items()}
        return Checkpoint(self.path, self.root, self.kind, {**self.tensors, **own}, self.files)

    def default_shard_info(self) -> Path:
        """Where a shard_info.json is looked for when none is given: beside the weights."""
        return self.root / SHARD_INFO_NAME

    def tied_weights(self) -> list[tuple[str, str]]:
        """Stored tensor pairs that are one parameter of the model (aliases): ``(lm_head.weight, embedding)``
        when config.json sets ``tie_word_embeddings: true`` and both are stored."""
        if "lm_head.weight" not in self.tensors:
            return []
        config = read_config(self.root, missing_ok=True)  # absent: no declared ties; unreadable: an error
        if config.get("tie_word_embeddings") is not True:
            return []
        embeddings = [n for n in self.tensors if n != "lm_head.weight" and n.endswith(_EMBEDDING_SUFFIXES)]
        return [("lm_head.weight", embeddings[0])] if len(embeddings) == 1 else []


def read_config(root: str | os.PathLike[str], *, missing_ok: bool = False) -> dict[str, Any]:
    """A model directory's ``config.json`` as a JSON object (``{}`` when absent and ``missing_ok``)."""
    base = root if isinstance(root, ObjectPath) else Path(root)
    path = base / CONFIG_NAME
    if not (path.exists() or path.is_symlink()):
        if missing_ok:
            return {}
        raise CheckpointError(f"no {CONFIG_NAME} here (a plan reads the model's config)", file=str(root))
    config = read_json(resolve_inside(base, CONFIG_NAME, path), "config", MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise CheckpointError("top level must be a JSON object", file=str(path))
    return config


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a model directory, a ``.safetensors`` or ``.gguf`` file, or a converted directory (headers only).

    ``path`` may also be a Hugging Face Hub id or an ``s3://`` URI (:func:`~shardload.sources.location.resolve_model`).
    """
    path = resolve_model(path)
    if isinstance(path, ObjectPath):
        return _open_object(path)
    if TMP_MARKER in path.name or (path.is_file() and TMP_MARKER in path.parent.name):
        raise CheckpointError(
            "is a temporary entry of an unfinished or interrupted convert, not a model; convert again", file=str(path)
        )
    if path.is_file():
        if path.name == MANIFEST_NAME:
            return _open_converted(path.parent)
        fmt = format_for_file(path)
        if fmt is not None:
            return fmt.open(path)
        if path.name.endswith(".index.json"):
            return _open_index(path.parent, path)
        if _is_pickle(path):
            raise CheckpointError(PICKLE_REFUSED, file=str(path))
        return _open_files(path, path.parent, [path])
    if not path.is_dir():
        kind = (
            "no such file or directory"
            if not path.exists()
            else "is not a regular file or a directory (a FIFO, a device?)"
        )
        raise CheckpointError(kind, file=str(path))
    if (path / MANIFEST_NAME).is_file():
        return _open_converted(path)
    if (path / INDEX_NAME).is_file():
        return _open_index(path, path / INDEX_NAME)
    if (path / SINGLE_NAME).is_file():
        return _open_files(path, path, [resolve_inside(path, SINGLE_NAME, path)])
    for name in (MANIFEST_NAME, INDEX_NAME, SINGLE_NAME):  # there, but no file to read: say so, not "no such file"
        odd = path / name
        if odd.is_symlink() or odd.exists():
            what = "a dangling link" if not odd.exists() else "not a regular file (a FIFO, a directory, a device?)"
            raise CheckpointError(f"is {what}", file=str(odd))
    found = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if any(RANK_FILE_RE.fullmatch(p.name) for p in found):
        raise CheckpointError(
            f"holds rank-*-of-*.safetensors files but no {MANIFEST_NAME}: an incomplete or damaged converted "
            "directory; convert the source checkpoint again",
            file=str(path),
        )
    fmt = format_for_dir(path) if not found else None
    if fmt is not None:
        return fmt.open(path)
    if not found:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(f"holds {pickles[0]}: {PICKLE_REFUSED}", file=str(path))
        raise CheckpointError(
            f"no {SINGLE_NAME}, {INDEX_NAME}, {MANIFEST_NAME} or *.safetensors file here", file=str(path)
        )
    return _open_files(path, path, [resolve_inside(path, p.name, path) for p in found])


def _open_object(path: ObjectPath) -> Checkpoint:
    """Open a checkpoint in object storage (headers by range requests): one object, or a prefix holding a
    single file, an HF index with its files, or a converted directory."""
    path.store.forget_listings()  # outside a load (whose listings are its own): listed afresh for each open
    if path.key and path.size() is not None:
        name = path.name
        if name == MANIFEST_NAME:
            return _open_converted(path.parent)
        if name.endswith(".index.json"):
            return _open_index(path.parent, path)
        if name.endswith(PICKLE_SUFFIXES):
            raise CheckpointError(PICKLE_REFUSED, file=str(path))
        if not name.endswith(".safetensors"):
            raise CheckpointError(
                "is not a .safetensors object (from object storage shardload reads safetensors: a file, a prefix "
                "with an HF index, or a converted directory)",
                file=str(path),
            )
        return _open_files(path, path.parent, [path])
    children = path.children()
    if not children:
        raise CheckpointError("no such object, and no objects under this prefix", file=str(path))
    if MANIFEST_NAME in children:
        return _open_converted(path)
    if INDEX_NAME in children:
        return _open_index(path, path / INDEX_NAME)
    if SINGLE_NAME in children:
        return _open_files(path, path, [path / SINGLE_NAME])
    found = sorted(n for n in children if n.endswith(".safetensors"))
    if any(RANK_FILE_RE.fullmatch(n) for n in found):
        raise CheckpointError(
            f"holds rank-*-of-*.safetensors files but no {MANIFEST_NAME}: an incomplete or damaged converted "
            "directory; convert the source checkpoint again",
            file=str(path),
        )
    if not found:
        pickles = sorted(n for n in children if n.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise CheckpointError(f"holds {pickles[0]}: {PICKLE_REFUSED}", file=str(path))
        raise CheckpointError(
            f"no {SINGLE_NAME}, {INDEX_NAME}, {MANIFEST_NAME} or *.safetensors object here", file=str(path)
        )
    return _open_files(path, path, [path / n for n in found])


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
"""Files torch.save and pickle write (``pytorch_model.bin``): never read, since unpickling runs code."""
PICKLE_REFUSED = "pickle checkpoints are not read (loading one runs code); convert it to safetensors first"


def _is_pickle(path: Path) -> bool:
    """A torch.save / pickle file by its name or its first bytes (a zip archive, or a pickle protocol opcode)."""
    if path.suffix in PICKLE_SUFFIXES:
        return True
    try:
        with open(path, "rb") as fh:
            exact_reads(fh.fileno())
            head = fh.read(9)
            input_log.count(path, len(head))
    except OSError:
        return False
    if len(head) == 9 and head[8:] == b"{":  # a safetensors header's length, then its JSON: not a pickle
        return False
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _open_files(
    path: Path, root: Path, files: list[Path], read: Callable[[Path], dict[str, TensorInfo]] | None = None
) -> Checkpoint:
    """A checkpoint of safetensors ``files``, each header read by ``read`` (a Hub model not downloaded reads them by
    range requests: :mod:`shardload.sources.hub_remote`; default :func:`read_header`)."""
    read = read or read_header
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read(f).items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor is stored in two files: {tensors[name].file.name} and {f.name}", file=str(f), param=name
                )
            tensors[name] = info
    return Checkpoint(path, root, "safetensors", tensors, list(files))


def _open_index(
    root: Path,
    index: Path,
    locate: Callable[[Path, str, Path], Path] | None = None,
    read: Callable[[Path], dict[str, TensorInfo]] | None = None,
) -> Checkpoint:
    """A checkpoint by its index: each file it names found by ``locate`` (default :func:`resolve_inside`) and its
    header read by ``read`` (default :func:`read_header`)."""
    locate = locate or resolve_inside
    doc = read_json(index, "index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("'weight_map' must be an object of tensor name -> file name", file=str(index))
    if not weight_map:
        raise CheckpointError("'weight_map' lists no tensors", file=str(index))
    files: dict[str, Path] = {}
    for file_name in dict.fromkeys(weight_map.values()):
        files[file_name] = locate(root, file_name, index)
    ckpt = _open_files(index, root, list(dict.fromkeys(files.values())), read)  # "./a" and "a": one file
    for name, file_name in weight_map.items():
        info = ckpt.tensors.get(name)
        if info is None:
            raise CheckpointError(f"listed in the index but not stored in {file_name}", file=str(index), param=name)
        if info.file != files[file_name]:
            raise CheckpointError(
                f"the index says {file_name}, but it is stored in {info.file.name}", file=str(index), param=name
            )
    return ckpt


HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
"""How the Hugging Face cache names a repository's folder (``models--org--name``)."""


def resolve_inside(root: Path, file_name: str, referrer: Path) -> Path:
    """Resolve a file name found in a model directory, an index or a manifest, refusing anything outside ``root``.

    A symlink may point into the Hugging Face cache's ``blobs`` folder (``snapshots/REV/f -> ../../blobs/X``).
    """
    candidate = Path(file_name)
    if not file_name or "\0" in file_name or candidate.is_absolute() or ".." in candidate.parts:
        raise CheckpointError(f"file name {file_name!r} points outside the model directory", file=str(referrer))
    if isinstance(root, ObjectPath):
        if "\\" in file_name or file_name.startswith("/") or "//" in file_name:
            raise CheckpointError(f"file name {file_name!r} is not a plain object name", file=str(referrer))
        obj = root / file_name
        if obj.size() is None:
            raise CheckpointError(f"references missing file {file_name!r}", file=str(referrer))
        return obj  # type: ignore[return-value]
    full = root / candidate
    try:
        real = full.resolve(strict=True)
        allowed = [root.resolve()]
        named = Path(os.path.abspath(root))  # where the caller's path says the model is, links not followed
        if named.parent.name == "snapshots" and named.parent.parent.name.startswith(HUB_REPO_PREFIXES):
            repo = named.parent.parent.resolve()  # a Hub cache's revision: its own repository's blobs, nothing else
            allowed = [a for a in allowed if a.is_relative_to(repo)] + [repo / "blobs"]
        elif allowed[0].parent.name == "snapshots":
            allowed.append(allowed[0].parent.parent / "blobs")
    except (OSError, RuntimeError, ValueError):
        raise CheckpointError(f"references missing file {file_name!r}", file=str(referrer)) from None
    if not any(real.is_relative_to(a) for a in allowed):
        raise CheckpointError(
            f"file {file_name!r} resolves outside the model directory (symlink to {real})", file=str(referrer)
        )
    if not real.is_file():
        raise CheckpointError(f"{file_name!r} is not a regular file", file=str(referrer))
    return full


def _open_converted(root: Path) -> Checkpoint:
    manifest_path = root / MANIFEST_NAME
    manifest = read_json(manifest_path, "manifest")
    check_manifest(manifest, manifest_path)
    return Checkpoint(root, root, "converted", {}, [], manifest)


def check_disjoint(tensors: Iterable[TensorInfo], where: str | None = None) -> None:
    """Refuse stored tensors that share bytes (two records or tensor infos over one range of a file, or of two
    names for one file), so a model never claims more bytes than its files hold. ``where`` names the file that
    placed them (a cache table); by default the data file."""
    by_file: dict[tuple[int, int], list[TensorInfo]] = {}
    identity: dict[Path, tuple[int, int]] = {}
    for t in tensors:
        if t.nbytes == 0:
            continue
        if t.file not in identity:
            st = os.stat(t.file)
            identity[t.file] = (st.st_dev, st.st_ino)
        by_file.setdefault(identity[t.file], []).append(t)
    for infos in by_file.values():
        infos.sort(key=lambda t: t.offset)
        for before, t in pairwise(infos):
            if t.offset < before.offset + before.nbytes:
                raise CheckpointError(
                    f"its bytes {t.offset}..{t.offset + t.nbytes} of {t.file.name} overlap tensor "
                    f"{printable(before.name)!r} ({before.offset}..{before.offset + before.nbytes}{_in(before, t)}): "
                    "stored tensors may not share bytes",
                    file=where or str(t.file),
                    param=t.name,
                )


def _in(before: TensorInfo, t: TensorInfo) -> str:
    """`` in FILE`` when ``before`` is named through another path to the same file than ``t``."""
    return "" if before.file == t.file else f" in {before.file.name}"


def read_small_file(path: Path | ObjectPath, limit: int, what: str) -> bytes:
    """The bytes of a small file of a checkpoint (at most ``limit``), local or in object storage."""
    if isinstance(path, ObjectPath):
        return path.read_small(limit, what)
    return read_small(path, limit, what, CheckpointError)


def read_json(path: Path, what: str, limit: int = MAX_HEADER_BYTES) -> Any:
    """A JSON file of a checkpoint (config, index, manifest, cache table): a regular file, size-capped, UTF-8, no
    duplicate keys."""
    raw = read_small_file(path, limit, what)
    try:
        return strictjson.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{what} is not UTF-8 text (byte {err.start})", file=str(path)) from None
    except strictjson.DuplicateKeyError as dup:
        raise CheckpointError(f"{what} has the key {dup.key!r} twice in one object", file=str(path)) from None
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{what} is not valid JSON: {err}", file=str(path)) from None
