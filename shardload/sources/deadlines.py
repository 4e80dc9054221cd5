"""Time limits of object-store requests: an overall deadline and a minimum transfer rate, enforced on the socket.

A socket timeout only bounds each read, so a server that sends one byte every few seconds keeps a request alive
for hours. Here every request runs as one or more attempts (:meth:`Deadlines.attempt`): each registers its
time limit, the connection it sends on registers itself (:meth:`Deadlines.attach`, called by the store's
connection class), and one watcher thread shuts that connection's socket down once the limit passes, which ends
any blocked read at once. The store then sees a broken connection, finds the attempt :attr:`Attempt.expired`,
and either retries (time left) or fails with one line.

The limits come from :func:`request_limits`: ``SHARDLOAD_S3_DEADLINE`` and ``SHARDLOAD_S3_MIN_RATE`` in the
environment, else :data:`DEADLINE` and :data:`MIN_RATE`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import ShardloadError

DEADLINE = 300.0
"""Seconds one request may take, every retry and resumption included (``SHARDLOAD_S3_DEADLINE``)."""
MIN_RATE = 64 << 10
"""Bytes per second an attempt must move on average, after :data:`RATE_GRACE` (``SHARDLOAD_S3_MIN_RATE``): an
attempt for B bytes is cut off after ``RATE_GRACE + B / MIN_RATE`` seconds and retried from the byte reached."""
RATE_GRACE = 10.0
"""Seconds an attempt gets before its bytes count against :data:`MIN_RATE` (connecting, the first byte)."""
UNKNOWN_SIZE = 1 << 20
"""Bytes a response of unknown size (a listing, a HEAD) is timed as."""
DEADLINE_ENV = "SHARDLOAD_S3_DEADLINE"
MIN_RATE_ENV = "SHARDLOAD_S3_MIN_RATE"
IDLE_EXIT = 30.0
"""Seconds the watcher thread waits with no request running before it ends (a new request starts it again)."""


@dataclass(frozen=True)
class RequestLimits:
    """The limits one request runs under: ``deadline`` seconds in all, ``min_rate`` bytes/s per attempt."""

    deadline: float
    min_rate: float

    def attempt_seconds(self, nbytes: int | None, left: float) -> float:
        """How long an attempt moving ``nbytes`` (None: unknown) may take with ``left`` seconds of the deadline."""
        size = UNKNOWN_SIZE if nbytes is None else nbytes
        return max(0.0, min(left, RATE_GRACE + size / self.min_rate))


def _positive(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (0 < number < float("inf")):
        raise ShardloadError(f"must be a positive number, got {value.strip()[:40]!r}", param=name)
    return number


def request_limits() -> RequestLimits:
    """The limits of object-store requests now: the environment's, else the module defaults (read per request)."""
    return RequestLimits(_positive(DEADLINE_ENV, DEADLINE), _positive(MIN_RATE_ENV, MIN_RATE))


class Expired(Exception):
    """An attempt's time limit passed (raised into the store's client before it sends again)."""


@dataclass
class Attempt:
    """One attempt of a request: its limit (a ``time.monotonic()`` time), the connection it sends on, whether the
    watcher cut it off, and the event that stops the load it serves (set: cut off, never retried)."""

    limit: float
    conn: Any = None
    expired: bool = False
    stop: threading.Event | None = None

    @property
    def stopped(self) -> bool:
        """Whether the load this attempt serves has stopped (its request ends now, without a retry)."""
        return self.stop is not None and self.stop.is_set()


class Stopped(ShardloadError):
    """A request of a load that has stopped (nobody waits for its answer)."""


_serving = threading.local()


class Deadlines:
    """The attempts running now (one per thread) and the watcher thread that cuts off those past their limit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._attempts: dict[int, Attempt] = {}
        self._watcher: threading.Thread | None = None
        self._wake = 0.0  # when the watcher wakes next (time.monotonic())

    @contextmanager
    def serving(self, stop: threading.Event) -> Iterator[None]:
        """Make this thread's requests inside the block those of the load ``stop`` stops (:meth:`stop`)."""
        before = getattr(_serving, "stop", None)
        _serving.stop = stop
        try:
            yield
        finally:
            _serving.stop = before

    def stop(self, stop: threading.Event) -> None:
        """Stop the load of ``stop``: set it, and cut off every attempt serving it (no retry follows)."""
        stop.set()
        with self._cond:
            for attempt in self._attempts.values():
                if attempt.stop is stop:
                    attempt.expired = True
                    if attempt.conn is not None:
                        _cut(attempt.conn)

    @contextmanager
    def attempt(self, seconds: float) -> Iterator[Attempt]:
        """Run one attempt of this thread's request under a limit of ``seconds`` from now (:class:`Stopped` at once
        when the load it serves has stopped)."""
        me = threading.get_ident()
        attempt = Attempt(time.monotonic() + seconds, stop=getattr(_serving, "stop", None))
        if attempt.stopped:
            raise Stopped("the load stopped before this request was made")
        with self._cond:
            self._attempts[me] = attempt
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="shardload-deadlines", daemon=True)
                self._watcher.start()
            elif attempt.limit < self._wake:  # the watcher sleeps past this limit: wake it to sleep less
                self._cond.notify()
        try:
            yield attempt
        finally:
            with self._cond:
                if self._attempts.get(me) is attempt:
                    del self._attempts[me]

    def attach(self, conn: Any) -> None:
        """Called by a connection about to send for this thread: the socket the watcher shuts down on expiry."""
        if conn is None:
            return
        with self._cond:
            attempt = self._attempts.get(threading.get_ident())
            if attempt is None:
                return
            attempt.conn = conn
            if attempt.expired:
                _cut(conn)

    def check(self) -> None:
        """Raise :class:`Expired` when this thread's attempt is past its limit (asked before each send)."""
        with self._cond:
            attempt = self._attempts.get(threading.get_ident())
            expired = attempt is not None and (attempt.expired or attempt.limit <= time.monotonic())
        if expired:
            raise Expired

    def _watch(self) -> None:
        """The watcher: sleep until the next limit, cut off every attempt past its own; end when idle."""
        with self._cond:
            while True:
                now = time.monotonic()
                upcoming = []
                for attempt in self._attempts.values():
                    if attempt.expired:
                        continue
                    if attempt.limit <= now:
                        attempt.expired = True
                        if attempt.conn is not None:
                            _cut(attempt.conn)
                    else:
                        upcoming.append(attempt.limit)
                idle = not self._attempts
                self._wake = min(upcoming) if upcoming else now + IDLE_EXIT
                self._cond.wait(self._wake - now)
                if idle and not self._attempts:
                    self._watcher = None
                    return


def _cut(conn: Any) -> None:
    """Shut the connection's socket down, which ends a read blocked on it in another thread."""
    sock = getattr(conn, "sock", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


DEADLINES = Deadlines()
"""The one registry of running attempts (the watcher thread serves every store)."""
