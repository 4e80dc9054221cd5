"""Where a model comes from: the one place a model argument is resolved.

- a local file or directory (a path that exists locally always wins);
- an object-store URI, ``s3://bucket/prefix`` (a model "directory" or one object): an
  :class:`~shardload.sources.objects.ObjectPath`, read with range requests (the ``s3`` extra);
- a Hugging Face Hub id, ``org/name`` or ``org/name@revision``: the snapshot directory in the local
  Hugging Face cache, downloaded first when online (only weights, index, config, tokenizer and
  shard_info files) and taken from the cache alone when offline (``HF_HUB_OFFLINE=1``, or no network).

Every entry point that takes a model (``load``, ``load_rank``, ``convert``, ``inspect``, ``plan``,
``validate --model``, ``verify --source``) opens it through :func:`shardload.sources.checkpoint.open_checkpoint`,
which asks :func:`resolve_model`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .objects import ObjectPath, ObjectStore

HUB_ID_RE = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})(?:@(?P<rev>[^\s@]{1,255}))?"
)
"""``org/name`` or ``org/name@revision`` (the Hub's repository naming rules, loosely)."""
HUB_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json", "shard_info.json",
    "shard_manifest.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
    "*.model", "*.tiktoken", "chat_template*", "preprocessor_config.json", "processor_config.json",
]  # fmt: skip
"""What a Hub download fetches: weights, their index, config, tokenizer and shard_info (no .bin, no .pt)."""
SCHEMES = ("s3",)
"""Object-store URI schemes shardload reads."""

_stores: dict[tuple[str, str], ObjectStore] = {}


def is_uri(value: Any) -> bool:
    """Whether ``value`` is a string naming an object-store location (``scheme://...``)."""
    return isinstance(value, str) and "://" in value


def is_hub_id(value: Any) -> bool:
    """Whether ``value`` reads as a Hub id (``org/name[@revision]``) and names no local path."""
    if not isinstance(value, str) or is_uri(value) or value.startswith((".", "/", "~")):
        return False
    return HUB_ID_RE.fullmatch(value) is not None and not (os.path.exists(value) or os.path.islink(value))


def model_kind(value: Any) -> str:
    """``"object"``, ``"hub"`` or ``"local"``: how :func:`resolve_model` will take ``value``."""
    if isinstance(value, ObjectPath) or is_uri(value):
        return "object"
    return "hub" if is_hub_id(value) else "local"


def resolve_model(value: Any, what: str = "model") -> Path | ObjectPath:
    """A model argument as a local Path (a Hub id becomes its snapshot directory) or an ObjectPath."""
    if isinstance(value, ObjectPath):
        return value
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        raise CheckpointError(f"{what} must be a path (str or os.PathLike), got {value!r}")
    if is_uri(value):
        return object_path(value)
    if is_hub_id(value):
        return hub_snapshot(value)
    return Path(value)


def object_path(uri: str) -> ObjectPath:
    """The ObjectPath of ``scheme://bucket/key`` (one store object per bucket, shared)."""
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in SCHEMES:
        hint = (
            "; Google Cloud Storage speaks S3 too: s3://BUCKET/PREFIX with AWS_ENDPOINT_URL_S3="
            "https://storage.googleapis.com and an HMAC key as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            if scheme in ("gs", "gcs")
            else ""
        )
        raise CheckpointError(
            f"{scheme}:// is not a supported object store (s3:// is, and S3-compatible stores through "
            f"AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL){hint}",
            file=uri,
        )
    if not bucket:
        raise CheckpointError("names no bucket (s3://BUCKET/PREFIX)", file=uri)
    store = _stores.get((scheme, bucket))
    if store is None:
        from .s3 import S3Store

        store = _stores.setdefault((scheme, bucket), S3Store(bucket))
    return ObjectPath(store, key.rstrip("/"))


def forget_stores() -> None:
    """Drop every cached store and its connections (tests switch endpoints; a long-lived process may too)."""
    for store in list(_stores.values()):
        store.close()
    _stores.clear()


def is_revision(revision: str) -> bool:
    """Whether ``revision`` can name a branch, tag or commit without naming a path: the Hub's cache keeps refs
    as files (``refs/<revision>``), so ``..`` parts, a leading ``/`` or a backslash could reach outside it."""
    parts = revision.split("/")
    return "\\" not in revision and all(part not in ("", ".", "..") for part in parts)


class NotCachedError(CheckpointError):
    """A Hub id asked of the cache alone (``cache_only``) while online, and not in it: ``shardload preflight`` then
    reads its config and headers over HTTP (:mod:`shardload.sources.hub_remote`)."""


def split_hub_id(value: str) -> tuple[str, str | None]:
    """``org/name[@revision]`` as (repository, revision or None), the revision checked by :func:`is_revision`."""
    match = HUB_ID_RE.fullmatch(value)
    assert match is not None
    repo, revision = match["repo"], match["rev"]
    if revision is not None and not is_revision(revision):
        raise CheckpointError(
            f"the revision {revision!r} is not a branch, tag or commit name (no empty, '.' or '..' parts, no leading "
            "or trailing '/', no backslash)",
            file=value,
        )
    return repo, revision


def hub_snapshot(value: str, *, cache_only: bool = False) -> Path:
    """The local snapshot directory of Hub id ``org/name[@revision]``: downloaded (weights, index, config,
    tokenizer and shard_info only) when online, from the cache alone when offline or ``cache_only`` (nothing is
    downloaded; online and not cached, :class:`NotCachedError`: ``shardload preflight`` then reads over HTTP)."""
    repo, revision = split_hub_id(value)
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors, file_download
    except ImportError:
        raise CheckpointError(
            "no such file or directory (as a Hugging Face Hub id it needs huggingface_hub: pip install "
            "huggingface_hub)",
            file=value,
        ) from None
    offline = constants.HF_HUB_OFFLINE or cache_only
    blobs = Path(constants.HF_HUB_CACHE) / file_download.repo_folder_name(repo_id=repo, repo_type="model") / "blobs"
    before = {} if offline else _blob_stamps(blobs)
    try:
        path = huggingface_hub.snapshot_download(
            repo, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline
        )
    except errors.LocalEntryNotFoundError:
        missing = (
            f"no such file or directory, and the Hugging Face Hub model {repo}"
            f"{'@' + revision if revision else ''} is not in the local cache ({constants.HF_HUB_CACHE})"
        )
        if cache_only and not constants.HF_HUB_OFFLINE:
            raise NotCachedError(missing, file=value) from None
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise CheckpointError(
            f"{missing} and {why}: download it where the Hub is reachable (`hf download {repo}`), or point "
            "HF_HUB_CACHE at a cache that holds it",
            file=value,
        ) from None
    except (errors.GatedRepoError, errors.RevisionNotFoundError, errors.RepositoryNotFoundError) as err:
        raise hub_refusal(err, value, repo, revision) from None
    except (errors.HfHubHTTPError, OSError, ValueError) as err:
        if not offline:  # what it wrote before it failed is checked too: the next load would take it as cached
            check_downloaded(blobs, before, None)
        raise CheckpointError(f"cannot fetch from the Hugging Face Hub: {type(err).__name__}", file=value) from None
    if not offline:
        check_downloaded(blobs, before, Path(path))
    return Path(path)


def _blob_stamps(blobs: Path) -> dict[str, tuple[int, int, int]]:
    """Each blob of a Hub cache entry by name: its inode, size and change time (a new download is a new file)."""
    try:
        entries = list(os.scandir(blobs))
    except OSError:
        return {}
    stamps = {}
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        stamps[entry.name] = (st.st_ino, st.st_size, st.st_ctime_ns)
    return stamps


def blob_digest(path: Path) -> str | None:
    """The digest a Hub cache names blob ``path`` by, computed from its bytes: the sha256 of a file kept in LFS
    (a 64-digit name), the git blob id of one kept in git (40 digits); None for a name of neither form."""
    import hashlib

    name = path.name
    if not re.fullmatch(r"[0-9a-f]{64}|[0-9a-f]{40}", name):
        return None
    with open(path, "rb") as f:
        digest = hashlib.sha256() if len(name) == 64 else hashlib.sha1(b"blob %d\0" % os.fstat(f.fileno()).st_size)
        while chunk := f.read(1 << 22):
            digest.update(chunk)
        return digest.hexdigest()


def check_downloaded(blobs: Path, before: dict[str, tuple[int, int, int]], snapshot: Path | None) -> None:
    """Hash every blob the download just wrote (``snapshot``: where it links them; None for a download that failed)
    against the digest the Hub names it by (huggingface_hub checks only sizes): every file corrupted in transit is
    dropped from the cache, and the first is refused in one line naming it."""
    from concurrent.futures import ThreadPoolExecutor

    new = [blobs / name for name, stamp in _blob_stamps(blobs).items() if before.get(name) != stamp]
    if not new:
        return
    with ThreadPoolExecutor(min(len(new), os.cpu_count() or 1), thread_name_prefix="shardload-hub-hash") as pool:
        digests = list(pool.map(_digest_or_none, new))  # hashlib lets go of the GIL: one file per core
    bad = [(blob, digest) for blob, digest in zip(new, digests, strict=True) if digest not in (None, blob.name)]
    if not bad:
        return
    blob, digest = bad[0]
    links = [p for p in snapshot.rglob("*") if p.is_symlink()] if snapshot is not None else []
    names = [link.name for link in links if link.resolve() == blob.resolve()]
    for each, _ in bad:
        each.unlink(missing_ok=True)  # the next download fetches them again
    more = f" ({len(bad) - 1} more file(s) likewise)" if len(bad) > 1 else ""
    raise CheckpointError(
        f"its bytes downloaded from the Hugging Face Hub hash to {digest[:16]}..., not the "
        f"{'sha256' if len(digest) == 64 else 'git blob id'} {blob.name[:16]}... the Hub names them by (corrupted "
        f"in transit){more}: dropped from the cache; load again to download it again",
        file=str(snapshot / names[0]) if snapshot is not None and names else str(blob),
    )


def _digest_or_none(path: Path) -> str | None:
    """:func:`blob_digest`, None for a blob gone meanwhile (another process's download replaced it)."""
    try:
        return blob_digest(path)
    except OSError:
        return None


def hub_refusal(err: Exception, value: str, repo: str, revision: str | None) -> CheckpointError:
    """The one line for the Hub's refusals of a model: gated, no such revision, no such (or a private) repository."""
    from huggingface_hub import errors

    if isinstance(err, errors.GatedRepoError):  # a RepositoryNotFoundError too: asked first
        return CheckpointError(f"the Hugging Face Hub model {repo} is gated: accept its terms on the Hub and log in "
                               "(`hf auth login`, or HF_TOKEN)", file=value)  # fmt: skip
    if isinstance(err, errors.RevisionNotFoundError):
        return CheckpointError(f"the Hugging Face Hub model {repo} has no revision {revision!r}", file=value)
    return CheckpointError(f"no such file or directory, and no Hugging Face Hub model {repo} (or it is private: log "
                           "in with `hf auth login`, or set HF_TOKEN)", file=value)  # fmt: skip


def hub_cache_dir() -> Path | None:
    """The Hugging Face Hub cache directory (None where huggingface_hub is not installed)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE)
