"""A real S3 server on loopback for the tests: moto in server mode, behind a small faulty proxy.

The proxy forwards every request to moto and records what it served (method, key, requested range, body bytes);
it can fail every k-th request with an HTTP 503/500, reset the connection before answering, or cut a response
body off halfway, so tests can show that transient failures are survived and count the bytes each load fetched.
It can also answer 403 for chosen keys (a permanent failure).

It can play a hostile or broken store too: ignore Range (``200`` and the whole object, as some S3-compatible
stores, proxies and CDNs do), lie in ``Content-Range``, send a consistent but short body, trickle the body or the
headers one byte at a time, or redirect without naming a region.
"""

from __future__ import annotations

import http.client
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

BUCKET = "shardload-test"


@dataclass
class Served:
    """One request the proxy answered."""

    method: str
    key: str
    range: tuple[int, int] | None
    status: int
    nbytes: int


@dataclass
class Faults:
    """What the proxy breaks: every ``every``-th request (counted over all requests) gets ``kind``."""

    every: int = 0
    kind: str = "503"
    """"503", "500", "reset" (close without answering), "cut" (half the body, then close); hostile answers to a
    ranged GET: "whole" (200 and the whole object), "lie" (206, Content-Range naming the next byte's range),
    "short" (206, Content-Range as asked, half the body with a Content-Length saying so); "trickle" (the body one
    byte every ``trickle_s`` seconds), "trickle-headers" (the status line and headers that way), "trickle-all" (any
    answer, listings and HEADs too, that way); "redirect" (301 PermanentRedirect naming no region, for any
    request); "no-etag" (the answer as the store gave it, without its ETag header)."""
    trickle_s: float = 0.5
    from_byte: int = 0
    """Only ranged GETs starting at or past this byte are broken (a checkpoint's tensors, not its header)."""
    only_get: bool = True
    forbidden: set[str] = field(default_factory=set)
    """Keys answered with 403 AccessDenied, every time."""
    expired: set[str] = field(default_factory=set)
    """Keys answered with 400 ExpiredToken (a session token past its time), every time."""
    forge: dict[str, Any] = field(default_factory=dict)
    """Key -> ``f(body, range) -> bytes | None``: a GET's body replaced by what ``f`` returns (None: served as is), a
    store that lies about an object's bytes while its size stays right."""
    limit: int = 0
    """Faults injected at most (0: no limit)."""
    count: int = 0
    injected: int = 0


class _Server(ThreadingHTTPServer):
    """The proxy's server: a client that hangs up (as a refused or cut-off answer makes it do) is no error."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultyProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.faults = Faults()
        self.served: list[Served] = []
        self.lock = threading.Lock()
        self._local = threading.local()
        self._closing = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body leave in separate writes: no 40 ms delayed-ACK stall

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def reset(self) -> None:
        """Forget what was served and stop injecting faults."""
        with self.lock:
            self.served.clear()
            self.faults = Faults()

    def get_bytes(self, key_suffix: str = "") -> int:
        """Body bytes served by successful GETs of keys ending with ``key_suffix``."""
        with self.lock:
            return sum(s.nbytes for s in self.served if s.method == "GET" and s.key.endswith(key_suffix))

    def _upstream(self) -> http.client.HTTPConnection:
        """This handler thread's keep-alive connection to moto."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=60)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _fault(self, method: str, rng: tuple[int, int] | None) -> str | None:
        with self.lock:
            f = self.faults
            if f.every <= 0 or (f.only_get and method != "GET" and f.kind != "redirect"):
                return None
            if f.from_byte and (rng is None or rng[0] < f.from_byte):
                return None
            if f.limit and f.injected >= f.limit:
                return None
            f.count += 1
            if f.count % f.every:
                return None
            f.injected += 1
            return f.kind

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        path = urlsplit(h.path).path
        key = unquote(path.split("/", 2)[2]) if path.count("/") >= 2 else ""
        if key in self.faults.forbidden:
            _send_error(
                h, 403, b"<?xml version='1.0'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            )
            return
        if key in self.faults.expired or (path.count("/") == 1 and path.strip("/") + "/" in self.faults.expired):
            _send_error(h, 400, b"<?xml version='1.0'?><Error><Code>ExpiredToken</Code><Message>The provided token "
                                b"has expired.</Message></Error>")  # fmt: skip
            return
        rng = _range(h.headers.get("Range"))
        fault = self._fault(h.command, rng)
        if fault == "reset":
            h.close_connection = True
            try:
                h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            except OSError:
                pass
            return
        if fault in ("503", "500"):
            code = "SlowDown" if fault == "503" else "InternalError"
            payload = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            _send_error(h, int(fault), payload, body_on_head=True)
            return
        if fault == "redirect":
            payload = (
                b"<?xml version='1.0'?><Error><Code>PermanentRedirect</Code><Message>The bucket you are attempting "
                b"to access must be addressed using the specified endpoint.</Message></Error>"
            )
            _send_error(h, 301, payload)
            return
        drop = ("connection", "range") if fault == "whole" else ("connection",)
        conn = self._upstream()
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in drop}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self._local.conn = None
            conn.close()
            raise
        forge = self.faults.forge.get(key) if h.command == "GET" and resp.status in (200, 206) else None
        if forge is not None:
            data = forge(data, rng) or data
        if h.command == "GET" and resp.status == 206 and fault in ("lie", "short", "trickle", "trickle-headers"):
            self._hostile_range(h, resp, data, fault)
            return
        if fault == "trickle-all":  # any answer (a listing, a HEAD too): status line, headers and body trickled
            self._trickle_answer(h, resp, data)
            return
        if h.command != "HEAD" and fault != "cut":
            # Recorded before the answer goes out (what was answered, whether or not the client reads it all): a
            # client may act on the headers or the body and look at `served` before this thread runs again.
            with self.lock:
                self.served.append(Served(h.command, key, rng, resp.status, len(data) if h.command == "GET" else 0))
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                if not (fault == "no-etag" and k.lower() == "etag"):
                    h.send_header(k, v)
        size = resp.getheader("Content-Length") if h.command == "HEAD" else None
        h.send_header("Content-Length", size or str(len(data)))
        h.end_headers()
        if h.command == "HEAD":
            return
        if fault == "cut" and len(data) > 1:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        try:
            h.wfile.write(data)
        except OSError:  # the client hung up (a ranged GET answered with a whole object it refused)
            h.close_connection = True
            return

    def _hostile_range(
        self, h: BaseHTTPRequestHandler, resp: http.client.HTTPResponse, data: bytes, fault: str
    ) -> None:
        """Answer a ranged GET as a broken or hostile store would (see :class:`Faults`)."""
        content_range = resp.getheader("Content-Range") or ""
        if fault == "lie":  # the same bytes, said to be those of the range one byte further on
            first, last, size = (int(x) for x in content_range[6:].replace("/", "-").split("-"))
            content_range = f"bytes {first + 1}-{last + 1}/{size}"
        if fault == "short":
            data = data[: len(data) // 2]
        etag = resp.getheader("ETag")  # the object's version, as a store that breaks ranges still sends it
        head = (
            f"HTTP/1.1 206 Partial Content\r\nContent-Type: binary/octet-stream\r\nContent-Range: {content_range}"
            + (f"\r\nETag: {etag}" if etag else "")
            + f"\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        h.close_connection = True
        try:
            if fault == "trickle-headers":
                self._trickle(h, head)
                return
            h.wfile.write(head)
            h.wfile.flush()
            if fault == "trickle":
                self._trickle(h, data)
            else:
                h.wfile.write(data)
        except OSError:  # the client gave up: what a hostile server expects
            pass

    def _trickle_answer(self, h: BaseHTTPRequestHandler, resp: http.client.HTTPResponse, data: bytes) -> None:
        """Send upstream's whole answer one byte every ``trickle_s`` seconds."""
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                lines.append(f"{k}: {v}")
        size = resp.getheader("Content-Length") if h.command == "HEAD" else None
        lines.append(f"Content-Length: {size or len(data)}")
        h.close_connection = True
        try:
            self._trickle(h, ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if h.command == "HEAD" else data))
        except OSError:
            pass

    def _trickle(self, h: BaseHTTPRequestHandler, data: bytes) -> None:
        """Send ``data`` one byte every ``trickle_s`` seconds (bounded by its length; ends when the client leaves
        or the proxy closes)."""
        for i in range(len(data)):
            if self._closing.wait(self.faults.trickle_s):
                return
            h.wfile.write(data[i : i + 1])
            h.wfile.flush()

    def close(self) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()


def _range(value: str | None) -> tuple[int, int] | None:
    if not value or not value.startswith("bytes="):
        return None
    a, _, b = value[6:].partition("-")
    return int(a), int(b) + 1 if b else -1


class S3:
    """moto's threaded server on 127.0.0.1 with the faulty proxy in front; ``url`` is the proxy's."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        self.proxy = FaultyProxy(self.moto.get_host_and_port())

    @property
    def url(self) -> str:
        return self.proxy.url

    def client(self) -> Any:
        """A boto3 client talking to moto directly (for uploads: never through the proxy)."""
        import boto3

        host, port = self.moto.get_host_and_port()
        return boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip

    def upload_dir(self, directory: Path, prefix: str, bucket: str = BUCKET) -> str:
        """Put every file of ``directory`` (following symlinks) under ``s3://bucket/prefix/``; return that URI."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        for f in sorted(Path(directory).iterdir()):
            if f.is_file():
                client.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
        return f"s3://{bucket}/{prefix}"

    def close(self) -> None:
        self.proxy.close()
        self.moto.stop()


def use_endpoint(monkeypatch: Any, url: str, tmp: Path) -> None:
    """Point boto3 at ``url`` with test credentials, away from any real AWS configuration of this machine."""
    from shardload.sources.location import forget_stores

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": url, "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-creds"),
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    forget_stores()


def _send_error(h: Any, status: int, payload: bytes, body_on_head: bool = False) -> None:
    """Answer the request ``h`` with an S3-style XML error ``payload`` (no body to a HEAD unless ``body_on_head``)."""
    h.send_response(status)
    h.send_header("Content-Type", "application/xml")
    h.send_header("Content-Length", str(len(payload)))
    h.end_headers()
    if body_on_head or h.command != "HEAD":
        h.wfile.write(payload)
