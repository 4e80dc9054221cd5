"""S3 and S3-compatible stores through boto3 (the ``s3`` extra: ``pip install "shardload[s3]"``).

boto3 was chosen over obstore and s3fs after measuring them against the same loopback S3 server (moto):
ranged GETs ran at the same speed (the server was the bound), and boto3 brings what a cluster needs without
more code: the whole standard credential chain (environment, ``AWS_PROFILE`` and shared config files, SSO,
instance and container roles), ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for S3-compatible endpoints, a
retry policy with exponential backoff and jitter for 5xx, throttling and connection errors (``standard`` mode,
:data:`ATTEMPTS` attempts), and responses that can be read straight into the destination tensor. A failure in
the middle of a response body (a connection reset after the headers) is retried here, from the byte reached.

A ranged GET is taken only as ``206 Partial Content`` with the ``Content-Range`` and ``Content-Length`` of the
range asked for: a store, proxy or CDN that ignores ``Range`` (``200`` and the whole object) or answers another
range would otherwise put bytes from the wrong place into a tensor. Every request runs under the deadline and
minimum rate of :mod:`shardload.sources.deadlines`; a redirect that names no region is refused (botocore would
otherwise ask the bucket's region over and over, each answer another such redirect).

Credentials are never printed: errors name the bucket and key and the store's error code, nothing else; an
endpoint URL is checked before boto3 sees it, and a bad one is named by its variable, never echoed.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..errors import CheckpointError, ShardloadError
from ..format import input_log
from .deadlines import DEADLINE_ENV, DEADLINES, MIN_RATE_ENV, Expired, RequestLimits, Stopped, request_limits
from .objects import MAX_CONCURRENCY, ObjectStore

ATTEMPTS = 8
"""Attempts per request (botocore's ``standard`` retry mode: 5xx, throttling such as 503 SlowDown, connection
errors and timeouts are retried with exponential backoff and jitter)."""
STREAM_ATTEMPTS = 8
"""Attempts to finish one response whose body broke off (connection reset, timeout, short body)."""
STREAM_BACKOFF = 0.05
"""First backoff in seconds for a broken body; doubled per attempt, capped at 5 s, with full jitter."""
CONNECT_TIMEOUT = 10
"""Seconds to open a connection (botocore's ``connect_timeout``)."""
READ_TIMEOUT = 60
"""Seconds one socket read may wait (botocore's ``read_timeout``); whole requests are bounded by
:mod:`shardload.sources.deadlines`."""
MAX_LIST_PAGES = 10_000
"""Pages of one listing (1000 objects each) before it is refused as endless."""
MAX_LIST_BYTES = 64 << 20
"""Bytes of keys and continuation tokens one listing may hold before it is refused (about 500,000 keys of a model's
length): a store that keeps answering new pages cannot fill the memory before :data:`MAX_LIST_PAGES`."""
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Where boto3 finds an S3-compatible endpoint, the first one set winning."""
_CONTENT_RANGE = re.compile(r"bytes (?P<first>\d+)-(?P<last>\d+)/(?P<size>\d+|\*)")

_PERMANENT = {
    "NoSuchKey": "no such object",
    "NotFound": "no such object",
    "404": "no such object",
    "NoSuchBucket": "no such bucket",
    "AccessDenied": "access denied (check the credentials and the bucket policy)",
    "403": "access denied (check the credentials and the bucket policy)",
    "Forbidden": "access denied (check the credentials and the bucket policy)",
    "InvalidAccessKeyId": "the access key is not known to the store",
    "SignatureDoesNotMatch": "the request signature does not match (check the secret key)",
    "InvalidRange": "the object is shorter than its header says (changed while loading?)",
    "ExpiredToken": "the session token has expired (renew the credentials: AWS_SESSION_TOKEN, the profile or role)",
    "TokenRefreshRequired": "the session token has expired (renew the credentials: AWS_SESSION_TOKEN, the profile or "
    "role)",
    "InvalidToken": "the session token is not valid (check AWS_SESSION_TOKEN, the profile or role)",
    "400": "the store refused the request as malformed (HTTP 400; a HEAD carries no reason: most often an expired or "
    "invalid session token, or a region or endpoint the bucket does not answer at)",
}


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise ShardloadError('s3:// models need boto3: pip install "shardload[s3]"', file="s3://") from None
    return boto3


class S3Store(ObjectStore):
    """One S3 bucket, through a boto3 client shared by every thread of this store."""

    scheme = "s3"

    def __init__(self, bucket: str) -> None:
        _boto3()  # without the [s3] extra: its one line, before any request imports botocore
        super().__init__(bucket)
        self._client: Any = None
        self._made_from: tuple[Any, ...] = ()

    @property
    def client(self) -> Any:
        """The boto3 S3 client (made on first use: standard retry mode, a connection per concurrent request), made
        again when the configuration it came from changed (an endpoint or credentials set in a long-lived process)."""
        made_from = _configuration()
        if self._client is None or self._made_from != made_from:
            with self._lock:
                if self._client is None or self._made_from != made_from:
                    # the old client is left to requests still in flight on it, not closed under them
                    self._client, self._made_from = _make_client(), made_from
        return self._client

    def _where(self, key: str | None) -> str:
        return self.uri(key) if key is not None else f"s3://{self.bucket}"

    def _fail(self, err: BaseException, key: str | None) -> CheckpointError:
        """The one-line error for a failed request, naming bucket and key (and never a credential)."""
        where = self._where(key)
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(err, RegionlessRedirect):
            return CheckpointError(
                f"the store redirected the request (HTTP {err.status}{err.name}) without naming the bucket's region: "
                "set AWS_DEFAULT_REGION to the bucket's region, or AWS_ENDPOINT_URL_S3 to the endpoint it answers at",
                file=where,
            )

        if isinstance(err, NoCredentialsError):
            return CheckpointError(
                "no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run "
                "with an instance role)",
                file=where,
            )
        if isinstance(err, ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            reason = _PERMANENT.get(code) or _PERMANENT.get(str(status))
            if reason is None:
                retried = err.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
                reason = f"the store answered {code or 'an error'} (HTTP {status})" + (
                    f" after {retried + 1} attempts" if retried else ""
                )
            return CheckpointError(reason, file=where)
        return CheckpointError(f"cannot reach the store: {type(err).__name__}", file=where)

    def _call(
        self,
        key: str | None,
        operation: Callable[[Any], Callable[..., Any]],
        missing_ok: bool = False,
        nbytes: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """One request with a small answer (a listing page, a HEAD, a PUT of ``nbytes``) under the deadline and
        minimum rate; its failures as one line. ``missing_ok``: None for a 404."""
        from botocore.exceptions import BotoCoreError, ClientError

        limits = request_limits()
        began = time.monotonic()
        for attempt in range(STREAM_ATTEMPTS):  # an attempt cut off by its time limit is made again, as a GET's is
            left = began + limits.deadline - time.monotonic()
            if left <= 0:
                break
            with DEADLINES.attempt(limits.attempt_seconds(nbytes, left)) as watch:
                try:
                    return operation(self.client)(**kwargs)
                except CheckpointError as err:  # no client could be made
                    raise CheckpointError(err.reason, file=self._where(key)) from None
                except (ClientError, BotoCoreError, Expired, RegionlessRedirect) as err:
                    if not (watch.expired or isinstance(err, Expired)):
                        if missing_ok and isinstance(err, ClientError) and _status(err) == 404:
                            return None
                        raise self._fail(err, key) from None
            _back_off(attempt, began, limits)
        if time.monotonic() >= began + limits.deadline:
            raise _too_slow(self._where(key), "", limits, began)
        raise CheckpointError(f"{_slow_reason(limits)}, {STREAM_ATTEMPTS} times", file=self._where(key))

    def _list(self, prefix: str) -> dict[str, int]:
        found: dict[str, int] = {}
        key = prefix.rstrip("/") or None
        token: str | None = None
        seen: set[str] = set()
        held = 0
        for _ in range(MAX_LIST_PAGES):
            more = {"ContinuationToken": token} if token else {}
            page = self._call(
                key, lambda c: c.list_objects_v2, Bucket=self.bucket, Prefix=prefix, Delimiter="/", **more
            )
            for entry in page.get("Contents", ()):
                found[entry["Key"]] = int(entry["Size"])
                held += len(entry["Key"])
            held += len(page.get("NextContinuationToken") or "")
            if held > MAX_LIST_BYTES:
                raise CheckpointError(
                    f"the store's listing of this prefix ran past {MAX_LIST_BYTES >> 20} MiB of keys ({len(found)} "
                    "objects): a model's prefix holds its files, not a bucket's worth",
                    file=self._where(key),
                )
            if not page.get("IsTruncated"):
                return found
            token = page.get("NextContinuationToken")
            if not token or token in seen:
                raise CheckpointError(
                    "the store's listing does not end (a continuation token came again)", file=self._where(key)
                )
            seen.add(token)
        raise CheckpointError(f"the store's listing ran past {MAX_LIST_PAGES} pages", file=self._where(key))

    def _head(self, key: str) -> int | None:
        head = self._call(key, lambda c: c.head_object, missing_ok=True, Bucket=self.bucket, Key=key)
        return None if head is None else int(head["ContentLength"])

    def _put(self, key: str, data: bytes) -> None:
        self._call(key, lambda c: c.put_object, nbytes=len(data), Bucket=self.bucket, Key=key, Body=data)

    def stamp(self, key: str) -> tuple[object, ...]:
        """Size, ETag and modification time of the object (a HEAD request)."""
        head = self._call(key, lambda c: c.head_object, Bucket=self.bucket, Key=key)
        return (int(head["ContentLength"]), head.get("ETag"), str(head.get("LastModified")))

    def read_into(self, key: str, start: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order with the object's bytes from ``start`` on: one ranged GET (retried by botocore),
        taken only as the range asked for, resumed from the byte reached when its body breaks off, all within
        the request's deadline."""
        from botocore.exceptions import BotoCoreError, ClientError

        total = sum(len(v) for v in views)
        if not total:
            return
        where, span = self.uri(key), f"bytes {start}-{start + total - 1}: "
        limits = request_limits()
        began = time.monotonic()
        done = 0
        problem = ""
        for attempt in range(STREAM_ATTEMPTS):
            left = began + limits.deadline - time.monotonic()
            if left <= 0:
                raise _too_slow(where, span, limits, began)
            with DEADLINES.attempt(limits.attempt_seconds(total - done, left)) as watch:
                first, end = start + done, start + total
                try:
                    response = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={first}-{end - 1}")
                except CheckpointError as err:  # no client could be made
                    raise CheckpointError(err.reason, file=where) from None
                except (ClientError, BotoCoreError, Expired, RegionlessRedirect) as err:
                    if not (watch.expired or isinstance(err, Expired)):
                        failed = self._fail(err, key)
                        if isinstance(err, ClientError) and _status(err) == 416:  # the range is the point
                            failed = CheckpointError(span + failed.reason, file=where)
                        raise failed from None
                    response = None
                if response is not None:
                    body = response["Body"]
                    DEADLINES.attach(getattr(getattr(body, "_raw_stream", None), "connection", None) or watch.conn)
                    etag = response.get("ETag")
                    unversioned = input_log.unversioned(where, etag)  # asked again, as a wrong answer is
                    if not unversioned:
                        size = _object_size(response)
                        if size is not None and size < end:
                            body.close()
                            raise CheckpointError(
                                f"{span}the object is {size} bytes, shorter than this range (changed while loading?)",
                                file=where,
                            )
                    try:
                        wrong = _wrong_answer(response, first, end)
                        if wrong is None and unversioned:
                            wrong = "the answer came without the object's version (ETag), which earlier answers had"
                        if wrong is None:  # only an answer that is the range asked pins or is held to a version
                            input_log.object_version(where, etag or _modified(response))
                            done = _fill(body, views, done, total)
                            if done == total:
                                return
                            problem = "the response ended early"
                        else:
                            problem = wrong
                    except (OSError, BotoCoreError, ValueError) as err:
                        problem = f"the response broke off ({type(err).__name__})"
                    except Exception as err:  # urllib3's ProtocolError and IncompleteRead are not OSErrors
                        if type(err).__module__.split(".")[0] not in ("urllib3", "http"):
                            raise
                        problem = f"the response broke off ({type(err).__name__})"
                    finally:
                        body.close()
                if watch.expired or response is None:
                    if watch.stopped:
                        raise Stopped("the load stopped while this range was read", file=where)
                    if time.monotonic() >= began + limits.deadline:
                        raise _too_slow(where, span, limits, began)
                    problem = _slow_reason(limits)
            _back_off(attempt, began, limits)
        raise CheckpointError(f"{span}{problem}, {STREAM_ATTEMPTS} times", file=where)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class RegionlessRedirect(Exception):
    """The store redirected a request without naming the bucket's region (raised before botocore's redirector
    would ask for the region, which recurses without end)."""

    def __init__(self, status: int | None, code: str) -> None:
        super().__init__(status, code)
        self.status = status
        self.code = code
        self.name = f" {code}" if code and code != str(status) else ""


def _back_off(attempt: int, began: float, limits: RequestLimits) -> None:
    """Wait before attempt ``attempt + 1`` of a request begun at ``began``: a random share of a backoff doubling
    per attempt (at most 5 s), never past the request's deadline."""
    pause = random.random() * min(5.0, STREAM_BACKOFF * 2**attempt)
    time.sleep(max(0.0, min(pause, began + limits.deadline - time.monotonic())))


def _status(err: Any) -> int | None:
    return err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _modified(response: dict[str, Any]) -> str | None:
    """The version an answer without an ETag is held to: its Last-Modified and the object's size (None without a
    Last-Modified)."""
    modified = response.get("LastModified")
    if modified is None:
        return None
    return f"{input_log.MODIFIED}{modified}, {_object_size(response)} bytes"


def _object_size(response: dict[str, Any]) -> int | None:
    """The object's size as a 206 answer's Content-Range states it (None when it does not)."""
    match = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange") or "").strip())
    return int(match["size"]) if match is not None and match["size"] != "*" else None


def _wrong_answer(response: dict[str, Any], first: int, end: int) -> str | None:
    """Why ``response`` is not bytes ``[first, end)`` of the object as asked (None when it is)."""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status != 206:
        return f"the store answered HTTP {status} instead of 206 Partial Content (does it ignore Range?)"
    content_range = str(response.get("ContentRange") or "")
    match = _CONTENT_RANGE.fullmatch(content_range.strip())
    if match is None or (int(match["first"]), int(match["last"])) != (first, end - 1):
        return f"the store answered Content-Range {content_range[:80]!r}"
    length = response.get("ContentLength")
    if length != end - first:
        return f"the store answered {length} bytes (Content-Length) for a {end - first}-byte range"
    return None


def _number(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:g}"


def _slow_reason(limits: RequestLimits) -> str:
    return f"the store sent under {_number(limits.min_rate)} bytes/s ({MIN_RATE_ENV})"


def _too_slow(where: str, span: str, limits: RequestLimits, began: float) -> CheckpointError:
    """The error for a request its deadline or minimum rate cut off."""
    if time.monotonic() >= began + limits.deadline:
        return CheckpointError(
            f"{span}no complete answer within the {_number(limits.deadline)} s deadline ({DEADLINE_ENV})", file=where
        )
    return CheckpointError(f"{span}{_slow_reason(limits)}", file=where)


def _fill(body: Any, views: Sequence[memoryview], done: int, total: int) -> int:
    """Read the response body into ``views`` from overall byte ``done`` on; return the bytes reached."""
    raw = getattr(body, "_raw_stream", None)
    readinto = getattr(raw, "readinto", None)
    skip = done
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        part = view[skip:]
        skip = 0
        while len(part):
            if readinto is not None:
                got = readinto(part)
            else:
                data = body.read(len(part))
                got = len(data)
                part[:got] = data
            if not got:
                return done
            done += got
            part = part[got:]
    return done


def _check_endpoint() -> None:
    """Refuse the endpoint URL in effect unless it is ``http(s)://host[:port][/path]`` with no user or password,
    naming only its variable (the URL itself may carry credentials)."""
    for name in ENDPOINT_VARIABLES:
        value = os.environ.get(name, "")
        if not value:
            continue
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (a port out of range raises here)
            bad = (
                parts.scheme not in ("http", "https")
                or not parts.hostname
                or parts.username is not None
                or parts.password is not None
                or not value.isprintable()
                or any(c.isspace() for c in value)
            )
        except ValueError:
            bad = True
        if bad:
            raise CheckpointError(
                f"{name} is not an endpoint URL (http:// or https://, a host, an optional port below 65536, no user "
                "name or password)"
            )
        return


def _refuse_regionless_redirect(response: Any = None, **kwargs: Any) -> None:
    """``needs-retry`` hook, run before botocore's region redirector: a redirect naming no region is an error."""
    if response is None:
        return
    http, parsed = response
    status = getattr(http, "status_code", None)
    error = parsed.get("Error", {}) if isinstance(parsed, dict) else {}
    code = str(error.get("Code", ""))
    if status not in (301, 302, 307) and code != "PermanentRedirect":
        return
    headers = parsed.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    if "x-amz-bucket-region" in headers or error.get("Region"):
        return
    raise RegionlessRedirect(status, code)


def _before_send(**kwargs: Any) -> None:
    """``before-send`` hook: an attempt past its time limit sends nothing more (botocore would retry)."""
    DEADLINES.check()


def _watched_pools(client: Any) -> None:
    """Give the client's connection pools connections that report to :data:`DEADLINES` when they send, so the
    watcher can shut down the socket of a request past its time (botocore keeps its urllib3 pool classes in
    one table per client, the one place where every connection it makes can be reached)."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    table = getattr(session, "_pool_classes_by_scheme", None)
    if not isinstance(table, dict):
        return
    for scheme, pool_cls in list(table.items()):
        table[scheme] = _watched_pool(pool_cls)


def _watched_pool(pool_cls: type) -> type:
    base: Any = pool_cls.ConnectionCls  # type: ignore[attr-defined]

    class WatchedConnection(base):
        def request(self, *args: Any, **kwargs: Any) -> Any:
            DEADLINES.attach(self)
            return super().request(*args, **kwargs)

    return type(f"Watched{pool_cls.__name__}", (pool_cls,), {"ConnectionCls": WatchedConnection})


def _configuration() -> tuple[Any, ...]:
    """What a boto3 client is made from: every ``AWS_*`` variable, and the AWS config and credentials files'
    identities (boto3 reads either once per client)."""
    # the names first, then each value with a default: a variable another thread deletes in between is not an error
    env = sorted((k, v) for k in list(os.environ) if k.startswith("AWS_") and (v := os.environ.get(k)) is not None)
    files: list[tuple[object, ...]] = []
    for var, default in (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")):
        path = os.path.expanduser(os.environ.get(var, default))
        try:
            st = os.stat(path)
            files.append((path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            files.append((path,))
    return (env, files)


def _make_client() -> Any:
    """A boto3 S3 client: standard retries, a pooled connection per concurrent request, deadlines, redirects
    refused when they name no region; a bad endpoint or configuration is one line without its value."""
    boto3 = _boto3()
    from botocore import UNSIGNED
    from botocore.config import Config

    _check_endpoint()
    options: dict[str, Any] = {
        "retries": {"total_max_attempts": ATTEMPTS, "mode": "standard"},
        "max_pool_connections": MAX_CONCURRENCY + 8,  # kept connections only: none is opened before it is used
        "connect_timeout": CONNECT_TIMEOUT,
        "read_timeout": READ_TIMEOUT,
    }
    try:
        session = boto3.session.Session()
        if session.get_credentials() is None:
            options["signature_version"] = UNSIGNED  # no credentials anywhere in the chain: a public bucket
        client = session.client("s3", config=Config(**options))
    except Exception as err:  # botocore's messages can echo the endpoint URL, credentials included
        raise CheckpointError(f"cannot make an S3 client from this configuration: {type(err).__name__}") from None
    client.meta.events.register_first("needs-retry.s3", _refuse_regionless_redirect)
    client.meta.events.register_first("before-send.s3", _before_send)
    _watched_pools(client)
    return client
