"""A Hugging Face Hub model that is not in the local cache, read over HTTP without downloading it: what
``shardload preflight`` reads for such an id.

One API call lists the repository's files at the revision and names its commit (``GET /api/models/REPO/revision/REV``,
:meth:`huggingface_hub.HfApi.model_info`); every file after it is read at that commit, so a branch that moves meanwhile
cannot mix two commits. Then ``config.json``, the index and ``shard_info.json``, those the repository has, by one plain
GET each into a temporary directory (never the Hub cache: a snapshot holding config.json alone would pass for a
cached model later), and of each safetensors file its 8-byte header length and its header, by two range requests
(``Range: bytes=0-7``, then ``bytes=8-(7+length)``), answered ``206`` or refused; never a tensor byte. The headers
become :class:`~shardload.sources.tensor_info.TensorInfo` records as a local file's do, their ``file`` a path in the
temporary directory that names the file and is never read.

huggingface_hub does the talking: its HTTP session (the user's token, proxy and redirect settings, its offline
switch) and its errors for a missing, private or gated repository or revision. Its ``get_safetensors_metadata`` is
not used: its first request asks for a fixed 100 kB of each file (``bytes=0-100000``), tensor bytes included whenever
the header is shorter, and it reads a missing or private repository as "not a safetensors repo".
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import CheckpointError, ShardloadError
from .checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    MAX_CONFIG_BYTES,
    PICKLE_REFUSED,
    PICKLE_SUFFIXES,
    SHARD_INFO_NAME,
    SINGLE_NAME,
    Checkpoint,
    _open_files,
    _open_index,
    read_json,
)
from .deadlines import MIN_RATE_ENV, request_limits
from .location import hub_refusal, split_hub_id
from .manifest import MANIFEST_NAME, RANK_FILE_RE
from .safetensors_header import MAX_HEADER_BYTES, _check_size, _header_length, _parse_header
from .tensor_info import TensorInfo

SMALL_FILES = {CONFIG_NAME: MAX_CONFIG_BYTES, INDEX_NAME: MAX_HEADER_BYTES, SHARD_INFO_NAME: MAX_HEADER_BYTES}
"""The JSON files fetched whole (those the repository has), and the cap on each."""
WORKERS = 8
"""Headers fetched at once (a model of 160 files: 320 range requests)."""
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass
class HubRemote:
    """A Hub model's checkpoint view made over HTTP, and every GET of a file's bytes made to make it."""

    checkpoint: Checkpoint
    """Root: the temporary directory holding the JSON files fetched; each tensor's ``file`` a path in it, not there."""
    root: str
    """The files' URL at the commit, ``{endpoint}/{repo}/resolve/{commit}``."""
    commit: str
    reads: list[tuple[str, int]]
    """URL and bytes served, in order: each JSON file whole; each safetensors file's 8 + header length bytes (two
    range requests)."""

    def url(self, path: str | Path) -> str:
        """The URL of a path under the checkpoint's root (a tensor's placeholder file, a fetched JSON file)."""
        base = str(self.checkpoint.root)
        text = str(path)
        return self.root + text[len(base) :] if text.startswith(base + "/") else text

    def relabel(self, err: ShardloadError) -> ShardloadError:
        """``err`` naming the file by its URL rather than by the temporary directory (gone once checked)."""
        return _relabel(err, self.checkpoint.root, self.root)

    def text(self, message: str) -> str:
        """A message (a plan problem's) naming files by their URLs rather than in the temporary directory."""
        return message.replace(str(self.checkpoint.root) + "/", self.root + "/")


def _relabel(err: ShardloadError, workdir: Path, root: str) -> ShardloadError:
    base = str(workdir)
    if err.file and (err.file == base or err.file.startswith(base + "/")):
        err.file = root + err.file[len(base) :]
    return err


def open_hub(value: str, workdir: Path) -> HubRemote:
    """Open Hub id ``org/name[@revision]`` over HTTP, the JSON files written to ``workdir``; one-line errors for a
    network failure, a private or gated model, a missing model or revision."""
    from huggingface_hub import HfApi, constants

    repo, revision = split_hub_id(value)
    endpoint = constants.ENDPOINT.rstrip("/")  # read now: hf_hub_url's template is fixed when huggingface_hub loads
    with _hub_errors(value, repo, revision, endpoint):
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, timeout=_timeout())
        commit = info.sha
        if not isinstance(commit, str) or not commit:
            raise CheckpointError(f"the Hugging Face Hub named no commit for {repo}", file=value)
        names = {s.rfilename for s in info.siblings or []}
        http = _Http(f"{endpoint}/{quote(repo)}/resolve/{quote(commit, safe='')}")
        reads: list[tuple[str, int]] = []
        for name, limit in SMALL_FILES.items():
            if name in names:
                body, _ = http.get(name, limit)
                (workdir / name).write_bytes(body)
                reads.append((http.url(name), len(body)))
        try:
            checkpoint = _open(value, workdir, names, _Headers(http, workdir, reads))
        except ShardloadError as err:
            raise _relabel(err, workdir, http.root) from None
    return HubRemote(checkpoint, http.root, commit, reads)


def _open(value: str, root: Path, names: set[str], headers: _Headers) -> Checkpoint:
    """The checkpoint a local snapshot of these files would open to (:func:`~.checkpoint.open_checkpoint`'s order:
    an index, else ``model.safetensors``, else every top-level ``*.safetensors``)."""
    if MANIFEST_NAME in names:
        raise CheckpointError(
            f"holds {MANIFEST_NAME}: a converted directory; preflight checks the source checkpoint", file=value
        )
    if INDEX_NAME in names:
        index = root / INDEX_NAME

        def locate(base: Path, file_name: str, referrer: Path) -> Path:
            candidate = Path(file_name)
            if (
                not file_name
                or "\0" in file_name
                or "\\" in file_name
                or candidate.is_absolute()
                or ".." in candidate.parts
            ):
                raise CheckpointError(f"file name {file_name!r} points outside the model directory", file=str(referrer))
            if file_name not in names:
                raise CheckpointError(f"references missing file {file_name!r}", file=str(referrer))
            return base / file_name

        doc = read_json(index, "index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if isinstance(weight_map, dict):  # fetch the headers at once; a malformed index is refused just below
            headers.prefetch(v for v in dict.fromkeys(weight_map.values()) if isinstance(v, str) and v in names)
        return _open_index(root, index, locate, headers.read)
    if SINGLE_NAME in names:
        files = [SINGLE_NAME]
    else:
        files = sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)
        if any(RANK_FILE_RE.fullmatch(n) for n in files):
            raise CheckpointError(
                f"holds rank-*-of-*.safetensors files but no {MANIFEST_NAME}: an incomplete or damaged converted "
                "directory",
                file=value,
            )
        if not files:
            pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
            if pickles:
                raise CheckpointError(f"holds {pickles[0]}: {PICKLE_REFUSED}", file=value)
            raise CheckpointError(
                f"the Hugging Face Hub model has no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors file", file=value
            )
    headers.prefetch(files)
    return _open_files(root, root, [root / n for n in files], headers.read)


class _Headers:
    """Safetensors headers by range requests, fetched in parallel ahead of the parse and read in file order."""

    def __init__(self, http: _Http, root: Path, reads: list[tuple[str, int]]) -> None:
        self.http, self.root, self.reads = http, root, reads
        self.got: dict[str, tuple[bytes, bytes, int]] = {}

    def prefetch(self, names: Iterable[str]) -> None:
        todo = [n for n in dict.fromkeys(names) if n not in self.got]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(WORKERS, len(todo)), thread_name_prefix="shardload-hub") as pool:
                self.got.update(zip(todo, pool.map(self.http.header, todo), strict=True))

    def read(self, path: Path) -> dict[str, TensorInfo]:
        name = path.relative_to(self.root).as_posix()
        first, raw, size = self.got.pop(name, None) or self.http.header(name)
        self.reads.append((self.http.url(name), len(first) + len(raw)))
        return _parse_header(path, raw, len(raw), size)[0]


class _Http:
    """GETs of a repository's files at one commit through huggingface_hub's session, each body counted."""

    def __init__(self, root: str) -> None:
        from huggingface_hub.utils import build_hf_headers

        self.root = root
        # identity: the bytes counted are the file's bytes, as served
        self.headers = {**build_hf_headers(), "Accept-Encoding": "identity"}

    def url(self, name: str) -> str:
        return f"{self.root}/{quote(name)}"

    def header(self, name: str) -> tuple[bytes, bytes, int]:
        """A safetensors file's 8-byte header length, its header, and the file's size: two range requests."""
        where = self.url(name)
        first, size = self.get(name, 8, (0, 7))
        if size is None:
            raise CheckpointError("the Hub's answer to a range request gave no Content-Range", file=where)
        _check_size(size, where)
        if len(first) != 8:
            raise CheckpointError(f"the Hub sent {len(first)} of the 8 bytes asked", file=where)
        header_len = _header_length(first, size, where)
        raw = self.get(name, header_len, (8, 7 + header_len))[0] if header_len else b""
        if len(raw) != header_len:
            raise CheckpointError(
                f"the Hub sent {len(first) + len(raw)} of the {8 + header_len} bytes asked", file=where
            )
        return first, raw, size

    def get(self, name: str, limit: int, span: tuple[int, int] | None = None) -> tuple[bytes, int | None]:
        """The file's bytes ``span`` (first and last, inclusive: a range request answered 206), else the whole file
        up to ``limit`` bytes; and the file's size when a Content-Range gives it."""
        from huggingface_hub.utils import get_session

        url = self.url(name)
        headers = dict(self.headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1]}"
        session = get_session()
        if hasattr(session, "stream"):  # huggingface_hub >= 1.0: an httpx client
            with session.stream("GET", url, headers=headers, timeout=_timeout()) as response:
                return _body(response, url, limit, span, lambda: response.iter_bytes())
        response = session.get(url, headers=headers, timeout=_timeout(), stream=True)  # requests
        with response:
            return _body(response, url, limit, span, lambda: response.iter_content(1 << 16))


def _body(response: Any, url: str, limit: int, span: tuple[int, int] | None, chunks: Any) -> tuple[bytes, int | None]:
    from huggingface_hub.utils import hf_raise_for_status

    if response.status_code >= 400:
        read = getattr(response, "read", None)  # the error's body, for huggingface_hub's message
        _ = read() if callable(read) else response.content
        hf_raise_for_status(response)
    size = None
    if span is not None:
        if response.status_code != 206:
            raise CheckpointError(
                f"the Hub answered a range request with HTTP {response.status_code}, not 206 (partial content): the "
                "whole file is not read",
                file=url,
            )
        match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
        if match is not None:
            if (int(match[1]), int(match[2])) != (span[0], min(span[1], int(match[3]) - 1)):
                raise CheckpointError(
                    f"the Hub answered bytes {match[1]}-{match[2]} for bytes {span[0]}-{span[1]}", file=url
                )
            size = int(match[3])
        limit = span[1] - span[0] + 1
    elif response.status_code != 200:
        raise CheckpointError(f"the Hub answered HTTP {response.status_code}", file=url)
    body = bytearray()
    limits = request_limits()  # the object stores' deadline and minimum rate: a trickled answer cannot hold a read
    began, allowed = time.monotonic(), limits.attempt_seconds(limit, limits.deadline)
    for chunk in chunks():
        body += chunk
        if time.monotonic() - began > allowed:
            raise CheckpointError(
                f"the Hub sent {len(body)} of {limit} bytes in {time.monotonic() - began:.0f} s, under "
                f"{limits.min_rate:.0f} bytes/s ({MIN_RATE_ENV})",
                file=url,
            )
        if len(body) > limit:
            what = "more bytes than asked" if span is not None else f"more than the {limit}-byte cap"
            raise CheckpointError(f"the Hub sent {what}", file=url)
    if span is not None and size is not None and len(body) != min(span[1], size - 1) - span[0] + 1:
        raise CheckpointError(f"the Hub sent {len(body)} bytes for bytes {span[0]}-{span[1]}", file=url)
    return bytes(body), size


def _timeout() -> float:
    from huggingface_hub import constants

    return float(getattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 10))


def _network_errors() -> tuple[type[BaseException], ...]:
    """Failures to reach the Hub: OSError (requests' errors are OSErrors), and httpx's transport errors."""
    found: list[type[BaseException]] = [OSError]
    try:  # huggingface_hub 2.x speaks HTTP through httpx2
        import httpx2

        found.append(httpx2.TransportError)
    except (ImportError, AttributeError):
        pass
    try:  # older ones through httpx (or requests, whose errors are OSErrors)
        import httpx

        found.append(httpx.TransportError)
    except (ImportError, AttributeError):
        pass
    return tuple(found)


@contextmanager
def _hub_errors(value: str, repo: str, revision: str | None, endpoint: str) -> Iterator[None]:
    """The Hub's errors as one line each."""
    from huggingface_hub import errors

    try:
        yield
    except ShardloadError:
        raise
    except (errors.GatedRepoError, errors.RevisionNotFoundError, errors.RepositoryNotFoundError) as err:
        raise hub_refusal(err, value, repo, revision) from None
    except errors.HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            raise CheckpointError(
                f"the Hugging Face Hub refused access to {repo} (HTTP {status}): a private or gated model needs a "
                "token with access (`hf auth login`, or HF_TOKEN)",
                file=value,
            ) from None
        url = getattr(getattr(getattr(err, "response", None), "request", None), "url", endpoint)
        raise CheckpointError(f"the Hugging Face Hub answered HTTP {status} for {url}", file=value) from None
    except _network_errors() as err:
        detail = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"cannot reach the Hugging Face Hub at {endpoint} ({type(err).__name__}{': ' + detail if detail else ''});"
            " HF_HUB_OFFLINE=1 takes the model from the local cache alone",
            file=value,
        ) from None
