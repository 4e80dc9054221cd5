"""Helper process for test_crash.py: runs ``convert`` in forked children and SIGKILLs them mid-write.

Protocol: one JSON job per line on stdin, one JSON result per line on stdout. The helper imports
torch once and never runs a torch op itself, so forking it is safe and each child starts at once.

A job is ``{"model", "out", "num_shards", "overwrite", "fsync", "kill_at" | "kill_after_s" | none}``:
``kill_at`` = K kills the child just before its K-th output event (a write to an output file, an
fsync, a rename or a directory removal); ``kill_after_s`` kills it from outside after a delay; with
neither, the child runs to the end and its event log is returned (the test picks kill points from it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from typing import Any

import torch  # noqa: F401  (imported once here: children start converting at once)

import shard_funcs  # noqa: F401
import shardload
from shardload.format.shard_info import _validator

writer_module = sys.modules["shardload.engine.writer"]  # every output file of a convert is created there
_validator("document")  # build the schema validators before forking (no torch op runs here)
_validator("seed")


def _install_hooks(kill_at: int | None) -> list[list[str]]:
    """Count output events; kill this process with SIGKILL just before event ``kill_at``."""
    events: list[list[str]] = []

    def event(*what: str) -> None:
        events.append(list(what))
        if kill_at is not None and len(events) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    real_create, real_replace, real_fsync, real_rmtree = writer_module.create_file, os.replace, os.fsync, shutil.rmtree

    class Out:
        def __init__(self, path: Any) -> None:
            self.name = os.path.basename(path)
            self.fh = real_create(path)

        def write(self, data: Any) -> int:
            event("write", self.name)
            return self.fh.write(data)

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.fh, attr)

    def replace(src: Any, dst: Any) -> None:
        event("replace", os.path.basename(src), os.path.basename(dst))
        real_replace(src, dst)

    def fsync(fd: int) -> None:
        event("fsync")
        real_fsync(fd)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        event("rmtree", os.path.basename(path))
        real_rmtree(path, *args, **kwargs)

    writer_module.create_file = Out  # type: ignore[assignment]
    os.replace, os.fsync, shutil.rmtree = replace, fsync, rmtree  # type: ignore[assignment]
    return events


def run_job(job: dict[str, Any], log_path: str) -> dict[str, Any]:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: convert, then leave without running any exit handlers
        code = 3
        events: list[list[str]] = []
        try:
            events = _install_hooks(job.get("kill_at"))
            shardload.convert(
                job["model"], job["num_shards"], job["out"], overwrite=job["overwrite"], fsync=job.get("fsync")
            )
            code = 0
        except BaseException as err:
            print(f"child error: {type(err).__name__}: {err}", file=sys.stderr)
        with open(log_path, "w") as fh:
            json.dump(events, fh)
        os._exit(code)
    if job.get("kill_after_s") is not None:
        time.sleep(job["kill_after_s"])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    events = None
    if not killed and os.path.exists(log_path):
        with open(log_path) as fh:
            events = json.load(fh)
        os.unlink(log_path)
    return {**job, "killed": killed, "exit_code": exit_code, "seconds": time.monotonic() - start, "events": events}


def main() -> None:
    log_path = os.path.join(sys.argv[1], "crash-child-events.json")
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_job(json.loads(line), log_path)), flush=True)


if __name__ == "__main__":
    main()
