#!/usr/bin/env python
"""An HTTP proxy for benchmarks/object_storage.py: it forwards every request to an S3 server on loopback, after a
set delay per request (added latency), and counts the requests and the body bytes it served.

Usage (the benchmark starts it in its own process)::

    python benchmarks/latency_proxy.py UPSTREAM_PORT PORT_FILE

It listens on 127.0.0.1 at a free port, which it writes to PORT_FILE once it accepts connections. Three paths are
its own, never forwarded: ``GET /__stats`` (JSON: requests, GETs, GET body bytes), ``POST /__reset`` (zero the
counts) and ``POST /__delay?seconds=S`` (the delay before each later request is forwarded).
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

CHUNK = 1 << 20


class Proxy:
    """The counts and the delay, shared by the handler threads."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.delay = 0.0
        self.lock = threading.Lock()
        self.requests = self.gets = self.get_bytes = 0
        self.local = threading.local()

    def connection(self) -> http.client.HTTPConnection:
        """This handler thread's keep-alive connection to the server."""
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(*self.upstream, timeout=300)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def own(self, h: BaseHTTPRequestHandler) -> bool:
        """Answer the proxy's own paths; False for a request to forward."""
        url = urlsplit(h.path)
        if url.path == "/__stats":
            with self.lock:
                body = json.dumps({"requests": self.requests, "gets": self.gets, "get_bytes": self.get_bytes})
        elif url.path == "/__reset":
            with self.lock:
                self.requests = self.gets = self.get_bytes = 0
            body = "{}"
        elif url.path == "/__delay":
            self.delay = float(parse_qs(url.query)["seconds"][0])
            body = "{}"
        else:
            return False
        data = body.encode()
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
        return True

    def forward(self, h: BaseHTTPRequestHandler) -> None:
        """Wait the delay, forward the request, stream the answer back, count it."""
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        if self.delay:
            time.sleep(self.delay)
        conn = self.connection()
        try:
            conn.request(h.command, h.path, body=body, headers={k: v for k, v in h.headers.items()})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            self.local.conn = None
            conn.close()
            raise
        whole = None if resp.getheader("Content-Length") or h.command == "HEAD" else resp.read()  # chunked: buffered
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "server", "date"):
                h.send_header(k, v)
        if whole is not None:
            h.send_header("Content-Length", str(len(whole)))
        h.end_headers()
        sent = 0
        try:
            if whole is not None:
                h.wfile.write(whole)
                sent = len(whole)
            elif h.command != "HEAD":
                while chunk := resp.read(CHUNK):
                    h.wfile.write(chunk)
                    sent += len(chunk)
        except OSError:  # the client hung up (a timeout on its side): counted as far as it got
            h.close_connection = True
        resp.read()
        with self.lock:
            self.requests += 1
            if h.command == "GET":
                self.gets += 1
                self.get_bytes += sent


def main() -> int:
    upstream_port, port_file = int(sys.argv[1]), Path(sys.argv[2])
    proxy = Proxy(("127.0.0.1", upstream_port))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:
            pass

        def _any(self) -> None:
            if not proxy.own(self):
                proxy.forward(self)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
