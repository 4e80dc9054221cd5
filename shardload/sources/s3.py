"""S3 and S3-compatible stores through boto3 (the ``s3`` extra: ``pip install "shardload[s3]"``).

boto3 was chosen over obstore and s3fs after measuring them against the same loopback S3 server (moto):
ranged GETs ran at the same speed (the server was the bound), and boto3 brings what a cluster needs without
more code: the whole standard credential chain (environment, ``AWS_PROFILE`` and shared config files, SSO,
instance and container roles), ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for S3-compatible endpoints, a
retry policy with exponential backoff and jitter for 5xx, throttling and connection errors (``standard`` mode,
:data:`ATTEMPTS` attempts), and responses that can be read straight into the destination tensor. A failure in
the middle of a response body (a connection reset after the headers) is retried here, from the byte reached.

Credentials are never printed: errors name the bucket and key and the store's error code, nothing else.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointError, ShardloadError
from .objects import CONCURRENCY, ObjectStore

ATTEMPTS = 8
"""Attempts per request (botocore's ``standard`` retry mode: 5xx, throttling such as 503 SlowDown, connection
errors and timeouts are retried with exponential backoff and jitter)."""
STREAM_ATTEMPTS = 8
"""Attempts to finish one response whose body broke off (connection reset, timeout, short body)."""
STREAM_BACKOFF = 0.05
"""First backoff in seconds for a broken body; doubled per attempt, capped at 5 s, with full jitter."""
CONNECT_TIMEOUT = 10
READ_TIMEOUT = 60

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
        super().__init__(bucket)
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 S3 client (made on first use: standard retry mode, a connection per concurrent request)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = _make_client()
        return self._client

    def _fail(self, err: BaseException, key: str | None) -> CheckpointError:
        """The one-line error for a failed request, naming bucket and key (and never a credential)."""
        where = self.uri(key) if key is not None else f"s3://{self.bucket}"
        from botocore.exceptions import ClientError, NoCredentialsError

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

    def _list(self, prefix: str) -> dict[str, int]:
        from botocore.exceptions import BotoCoreError, ClientError

        found: dict[str, int] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for entry in page.get("Contents", ()):
                    found[entry["Key"]] = int(entry["Size"])
        except (ClientError, BotoCoreError) as err:
            raise self._fail(err, prefix.rstrip("/") or None) from None
        return found

    def _head(self, key: str) -> int | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except ClientError as err:
            if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise self._fail(err, key) from None
        except BotoCoreError as err:
            raise self._fail(err, key) from None

    def stamp(self, key: str) -> tuple[object, ...]:
        """Size, ETag and modification time of the object (a HEAD request)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except (ClientError, BotoCoreError) as err:
            raise self._fail(err, key) from None
        return (int(head["ContentLength"]), head.get("ETag"), str(head.get("LastModified")))

    def read_into(self, key: str, start: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order with the object's bytes from ``start`` on: one ranged GET (retried by botocore),
        resumed from the byte reached when its body breaks off."""
        from botocore.exceptions import BotoCoreError, ClientError

        total = sum(len(v) for v in views)
        if not total:
            return
        done = 0
        for attempt in range(STREAM_ATTEMPTS):
            try:
                response = self.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start + done}-{start + total - 1}"
                )
            except (ClientError, BotoCoreError) as err:
                raise self._fail(err, key) from None
            body = response["Body"]
            try:
                done = _fill(body, views, done, total)
                if done == total:
                    return
                problem = "the response ended early"
            except (OSError, BotoCoreError, ValueError) as err:
                problem = type(err).__name__
            except Exception as err:  # urllib3's ProtocolError and IncompleteRead are not OSErrors
                if type(err).__module__.split(".")[0] not in ("urllib3", "http"):
                    raise
                problem = type(err).__name__
            finally:
                body.close()
            time.sleep(random.random() * min(5.0, STREAM_BACKOFF * 2**attempt))
        raise CheckpointError(
            f"the response kept breaking off ({problem}) after {STREAM_ATTEMPTS} attempts", file=self.uri(key)
        )

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


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


def _make_client() -> Any:
    boto3 = _boto3()
    from botocore import UNSIGNED
    from botocore.config import Config

    session = boto3.session.Session()
    options: dict[str, Any] = {
        "retries": {"total_max_attempts": ATTEMPTS, "mode": "standard"},
        "max_pool_connections": CONCURRENCY + 8,
        "connect_timeout": CONNECT_TIMEOUT,
        "read_timeout": READ_TIMEOUT,
    }
    if session.get_credentials() is None:
        options["signature_version"] = UNSIGNED  # no credentials anywhere in the chain: a public bucket
    return session.client("s3", config=Config(**options))
