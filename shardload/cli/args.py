"""What a command line asks for, read from its arguments before click parses them (standard library only: the
script's entry reads them before it imports the commands)."""

from __future__ import annotations

import json
from typing import Any


def json_requested(args: list[str]) -> bool:
    """Whether the command line asks for ``--json`` (before any ``--``)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def document_on_stderr(args: list[str]) -> bool:
    """Whether the command line's ``--json`` document goes to stderr: ``plan -o -`` (stdout holds the plan)."""
    given = args[: args.index("--")] if "--" in args else args
    if "plan" not in given:
        return False
    pairs = zip(given, [*given[1:], ""], strict=True)
    return "--out=-" in given or "-o-" in given or any(a in ("-o", "--out") and b == "-" for a, b in pairs)


def failure_document(error: dict[str, Any], exit_code: int) -> str:
    """The ``--json`` document of a command that failed: ``{"ok": false, "exit_code": ..., "error": {...}}``."""
    return json.dumps({"ok": False, "exit_code": exit_code, "error": error}, indent=2)
