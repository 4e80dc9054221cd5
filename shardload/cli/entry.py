"""The ``shardload`` script: the command line run with a stop signal answered before and after its command too.

Inside a command, :func:`~shardload.cli.common._guarded` answers SIGINT, SIGTERM and SIGHUP (cleanup, one line, the
``--json`` failure document, exit 128 + the signal). Outside it the process would die with no word: while the command
line imports its commands, and after the command has finished and printed its result, while the interpreter shuts
down (up to a second after a large convert), when a late signal made the exit status contradict the document already
printed. Here, a signal before the command answers as a command stopped by it would; one after it is ignored, so the
process exits with the status its output reports. Imports only the standard library before the command line; what
runs before this module (the interpreter's start and ``import shardload``: 0.2 s idle, up to a second on a busy host)
no handler of Python's can cover.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, NoReturn

from .args import document_on_stderr, failure_document, json_requested

_STOPS = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


class _Stopped(BaseException):
    """A stop signal that arrived outside a command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def run(prog_name: str | None = None) -> None:
    """Run the command line on ``sys.argv`` and exit with its status."""
    for signum in _STOPS:
        signal.signal(signum, _raise)
    try:
        from .common import command_started
        from .main import main

        def outside(signum: int, frame: Any) -> None:  # a command installs its own handlers while it runs
            if not command_started():
                raise _Stopped(signum)  # before it: stopped; after it: its status stands

        for signum in _STOPS:
            signal.signal(signum, outside)
        main(prog_name=prog_name)
    except _Stopped as err:
        _stopped(err.signum)
    except SystemExit:
        for signum in _STOPS:  # the command's status is decided and printed: the exit reports it, signal or not
            signal.signal(signum, signal.SIG_IGN)
        raise


def _stopped(signum: int) -> NoReturn:
    """Exit as a command stopped by ``signum`` before it began: one line on stderr, and with ``--json`` the failure
    document (the shape :func:`~shardload.cli.common._echo_failure` prints) on stdout, or on stderr instead of the
    line where the command's output goes to stdout (``plan -o -``)."""
    for stop in _STOPS:
        signal.signal(stop, signal.SIG_IGN)
    interrupted = signum == signal.SIGINT
    message = "interrupted" if interrupted else f"terminated by {signal.Signals(signum).name}"
    code = 128 + signum
    args = sys.argv[1:]
    documented = json_requested(args)
    if documented:
        error = {"kind": "Interrupted" if interrupted else "Terminated", "message": f"{message} (nothing was done)"}
        stream = sys.stderr if document_on_stderr(args) else sys.stdout
        try:
            stream.write(failure_document(error, code) + "\n")
            stream.flush()
        except OSError:
            documented = False
    if not (documented and document_on_stderr(args)):  # a document on stderr is the line there
        try:
            sys.stderr.write(f"{message} (nothing was done)\n")
            sys.stderr.flush()
        except OSError:
            pass
    sys.exit(code)
