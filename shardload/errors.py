"""The one exception family shardload raises for bad input.

Every message names the file, the parameter and the step where they are known, then the
reason, so a CLI can print it as a single line: ``file: param: step K (func): reason``.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text: str) -> str:
    """``text`` safe to print on one terminal line: control characters (newlines, escapes), bidirectional
    overrides and other format characters are written as ``\\xNN`` / ``\\uNNNN``, so a name taken from a file
    cannot forge an output line, move the cursor or reorder what is shown."""
    if text.isprintable() and not (_BIDI & set(text)):
        return text
    out = []
    for ch in text:
        if ch.isprintable() and ch not in _BIDI and unicodedata.category(ch) != "Cf":
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a value taken from a file that may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_PART = 4096
"""Characters of one part of a message (a file, a parameter, the reason) printed; past it the middle is cut, so a
value a file controls (a name of megabytes) cannot make a line of megabytes."""


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,31}://)[^/\s@]{1,1024}@")
_SIGNED = re.compile(
    r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|"
    r"access_token|key-pair-id|policy)=)[^&\s)'\"]+"
)
"""A URL's user and password (``https://user:token@host``) and the secret parameters of a signed URL's query."""


def hide_secrets(text: str) -> str:
    """``text`` with every URL's credentials and signed-query secrets replaced by ``***``: a message names an
    endpoint or a URL, never what opens it."""
    if "://" not in text and "=" not in text:
        return text
    return _SIGNED.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def _clip(text: str, limit: int = MAX_PART) -> str:
    if len(text) <= limit:
        return hide_secrets(text)
    keep = limit // 2  # cut first: what a file controls is searched for secrets only as far as it is printed
    return f"{hide_secrets(text[:keep])}...({len(text) - 2 * keep} characters cut)...{hide_secrets(text[-keep:])}"


class ShardloadError(Exception):
    """Base error: a bad shard_info, a bad checkpoint, or a plan that cannot work."""

    def __init__(
        self,
        reason: str,
        *,
        file: str | None = None,
        param: str | None = None,
        step: int | None = None,
        func: str | None = None,
    ) -> None:
        self.reason = reason
        self.file = file
        self.param = param
        self.step = step
        self.func = func
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """The full one-line message: location parts, then the reason."""
        parts = []
        if self.file:
            parts.append(self.file)
        if self.param is not None:
            parts.append(self.param)
        if self.step is not None:
            parts.append(f"step {self.step} ({self.func})" if self.func else f"step {self.step}")
        parts.append(self.reason)
        return printable(": ".join(_clip(part) for part in parts))

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form of the error, for ``validate --json``."""
        return {
            "kind": type(self).__name__,
            "file": self.file if self.file is None else _clip(self.file),
            "param": self.param if self.param is None else _clip(self.param),
            "step": self.step,
            "function": self.func if self.func is None else _clip(self.func),
            "reason": _clip(self.reason),
            "message": self.message,
        }

    def located(self, **where: object) -> ShardloadError:
        """Return this error with missing location fields filled in from ``where``."""
        for key, value in where.items():
            if getattr(self, key) is None and value is not None:
                setattr(self, key, value)
        self.args = (self.message,)
        return self


class FormatError(ShardloadError):
    """The shard_info document is malformed (schema, JSON, expressions)."""


class PlanError(ShardloadError):
    """The shard_info is well formed but cannot be planned against this checkpoint and N."""


class CheckpointError(ShardloadError):
    """The checkpoint (safetensors file, index, converted directory) is unreadable or inconsistent."""


class StepArgumentError(ValueError):
    """Raised by shape rules and argument binding; the planner wraps it into a PlanError."""
