"""A small Hugging Face Hub on loopback, for reading Hub ids over HTTP offline (``shardload preflight`` of an id not in
the local cache). Point huggingface_hub at it with :func:`use_fake_hub`.

It serves what huggingface_hub asks of the Hub for a model: ``GET /api/models/REPO[/revision/REV]`` (the file list and
the commit, :meth:`HfApi.model_info`), ``GET /api/models/REPO/tree/REV`` (each file's size, git blob id and, for
``*.safetensors``, its LFS sha256: what ``snapshot_download`` lists), and ``GET``/``HEAD /REPO/resolve/REV/FILE`` with
the headers huggingface_hub reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``), a ``Range: bytes=A-B`` answered
``206`` with ``Content-Range``; errors as the Hub sends them (``X-Error-Code``: ``RepoNotFound`` 404, or 401 for a
private repo; ``RevisionNotFound``, ``EntryNotFound`` 404; ``GatedRepo`` 403; a bare 403 for a token without access).
It records every request (method, file, range asked, status, body bytes answered) before answering it. It can ignore
Range (``200`` and the whole file, as a broken proxy would).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_API = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_TREE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)")


def git_blob_id(data: bytes) -> str:
    """A file's git blob id (the Hub's ``oid`` of a file kept in git)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _tree(files: dict[str, bytes]) -> list[dict[str, Any]]:
    """A repository's tree listing as the Hub answers it: weights in LFS (their sha256), the rest in git."""
    return [{"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data),
             **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                if name.endswith(".safetensors") else {})}
            for name, data in files.items()]  # fmt: skip


@dataclass
class Served:
    """One request the fake Hub answered."""

    method: str
    path: str
    file: str | None
    """The repository file a resolve request named (None for an API call)."""
    range: tuple[int, int] | None
    """The bytes asked, first and last (inclusive), as the client wrote them."""
    status: int
    nbytes: int
    """Body bytes answered (the client may hang up before reading them all)."""


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    refs: dict[str, str]
    gated: bool = False
    private: bool = False
    forbidden: bool = False
    """Files answered 403 with no error code (a token without access), the listing served."""
    garbled: dict[str, bytes] = field(default_factory=dict)
    """Bytes served in place of a file's own, its ETag and listing still naming its own (a proxy or CDN that
    corrupts it in transit)."""


@dataclass
class FakeHub:
    """A fake Hub serving ``repos`` on 127.0.0.1 from a daemon thread; :meth:`close` stops it."""

    repos: dict[str, Repo] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    ignore_range: bool = False

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo: str, source: Path, commit: str, **flags: bool) -> None:
        """Serve every file of directory ``source`` as ``repo`` at ``commit``, the branch main pointing at it."""
        files = {p.name: p.read_bytes() for p in sorted(source.iterdir()) if p.is_file()}
        self.repos[repo] = Repo(files, commit, {"main": commit}, **flags)

    def resolved(self, method: str = "GET") -> list[Served]:
        """The requests of a file's bytes answered with some (a 2xx status)."""
        return [s for s in self.served if s.method == method and s.file is not None and s.status < 300]

    def reset(self) -> None:
        with self._lock:
            self.served.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- answering

    def _answer(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        method = "HEAD" if head else "GET"
        asked = _RANGE.fullmatch(req.headers.get("Range", "").strip())
        span = None
        if asked is not None:
            span = (int(asked[1]), int(asked[2]) if asked[2] else -1)
        api, resolve, tree = _API.fullmatch(path), _RESOLVE.fullmatch(path), _TREE.fullmatch(path)
        match = api or resolve or tree
        repo = self.repos.get(match[1]) if match else None
        file = resolve[3] if resolve else None
        status, headers, body = 200, {}, b""
        if match is None:
            status, headers = 404, {"X-Error-Message": "not a route of this fake Hub"}
        elif repo is None or repo.private:
            status, headers = (401 if repo else 404), {"X-Error-Code": "RepoNotFound"}
        else:
            rev = match[2] or "main"
            commit = repo.refs.get(rev) or (rev if rev == repo.commit else None)
            if commit is None:
                status, headers = 404, {"X-Error-Code": "RevisionNotFound"}
            elif tree is not None:
                body, headers = json.dumps(_tree(repo.files)).encode(), {"Content-Type": "application/json"}
            elif api is not None:
                body = json.dumps({"id": match[1], "sha": commit, "private": False, "gated": repo.gated,
                                   "siblings": [{"rfilename": n} for n in repo.files]}).encode()  # fmt: skip
                headers = {"Content-Type": "application/json"}
            elif repo.gated:
                status, headers = 403, {"X-Error-Code": "GatedRepo", "X-Error-Message": "access to this model is gated"}
            elif repo.forbidden:
                status = 403
            elif file not in repo.files:
                status, headers = 404, {"X-Error-Code": "EntryNotFound"}
            else:
                data = repo.files[file]
                headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Accept-Ranges": "bytes"}  # fmt: skip
                data = body = repo.garbled.get(file, data)
                if span is not None and not self.ignore_range:
                    first, last = span[0], min(len(data) - 1 if span[1] < 0 else span[1], len(data) - 1)
                    if first >= len(data):
                        status, body = 416, b""
                        headers["Content-Range"] = f"bytes */{len(data)}"
                    else:
                        status, body = 206, data[first : last + 1]
                        headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        if status >= 400 and not body:
            body = json.dumps({"error": headers.get("X-Error-Code", "error")}).encode()
        # Recorded before the answer goes out: a client that refuses an answer hangs up mid-body, and a record made
        # after that (this thread's write failing) could land after the test's next reset().
        with self._lock:
            self.served.append(Served(method, path, file, span, status, 0 if head else len(body)))
        try:
            req.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                req.send_header(key, value)
            req.end_headers()
            if not head:
                for start in range(0, len(body), 1 << 16):
                    req.wfile.write(body[start : start + (1 << 16)])
        except (BrokenPipeError, ConnectionResetError):
            req.close_connection = True


def use_fake_hub(monkeypatch: Any, url: str, home: Path) -> None:
    """Point huggingface_hub at the fake Hub ``url``, online, with an empty cache and no token under ``home``.

    huggingface_hub reads ``HF_ENDPOINT`` once, when it is imported, into ``constants.ENDPOINT`` (what
    :class:`HfApi` and shardload read at each call) and into ``constants.HUGGINGFACE_CO_URL_TEMPLATE`` (what
    ``hf_hub_url`` formats): both are patched, and the environment too for any process started from here."""
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    cache = home / "hub"
    for name, value in {"HF_ENDPOINT": url, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
                        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"), raising=False)
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"), raising=False)
    close_session()  # the shared client is made again, reading the proxy settings above
