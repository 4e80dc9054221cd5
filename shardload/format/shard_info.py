"""Read, check and write ``shard_info.json`` in both forms (MLC-LLM/TVM seed form, document form).

The shape of the file is defined once, by ``shard_info.schema.json``; this module checks a
document against it, then turns it into :class:`ShardInfo`, a plain description of steps.
Nothing here runs a step or looks a function name up beyond the registry.

A parameter may be listed once. Listing it twice *through an alias* is an error too. Aliases
are (1) two spellings of one name: JSON escapes (``"\u006d..."``), caught as duplicate keys, and
Unicode canonical equivalents (NFC), which look identical; and (2) tied weights: two stored
tensors that are one parameter of the model (``lm_head.weight`` and the input embedding under
config.json's ``tie_word_embeddings``); they may both be listed only with the same steps.
Names that merely look related (``model.x`` and ``x``) are different tensors, not aliases.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import FormatError
from . import strictjson
from .smallfile import read_small

FORMAT_VERSION = 1
MAX_FILE_BYTES = 64 << 20
MAX_RANKS = 1 << 16
"""Cap on num_shards (in a file or asked for) and on a mesh's ranks, checked before anything loops over ranks: the
largest deployments run a model on a few thousand GPUs."""
DOCUMENT_KEYS = ("version", "params", "num_shards", "$schema", "description")
_RECORDED_NS = re.compile(r"plans for num_shards ((?:\d+, )*\d+|none) \(checked 1\.\.(\d+)\)")


def plans_for_text(supported: list[int], checked_up_to: int) -> str:
    """How a generated file's description records the N it plans for (read back by :func:`recorded_num_shards`)."""
    return f"plans for num_shards {', '.join(map(str, supported)) or 'none'} (checked 1..{checked_up_to})"


def recorded_num_shards(description: str | None) -> tuple[list[int], int] | None:
    """The N a description records the file plans for, and the N it was checked up to, as ``shardload plan`` writes
    them (:func:`plans_for_text`); None when it records none."""
    found = _RECORDED_NS.search(description or "")
    if found is None:
        return None
    listed = found.group(1)
    return ([] if listed == "none" else [int(n) for n in listed.split(", ")]), int(found.group(2))


Dim = int | str


@dataclass(frozen=True)
class StepSpec:
    """One step as written in the file: function name, declared output shape/dtype, extra args."""

    func: str
    shape: tuple[Dim, ...] | None
    dtype: str | None
    args: tuple[Any, ...] = ()

    def to_json(self) -> list[Any]:
        """The step as the ``[func, [shape, dtype], *args]`` list of the file."""
        shape = None if self.shape is None else list(self.shape)
        return [self.func, [shape, self.dtype], *self.args]


@dataclass
class ShardInfo:
    """A parsed shard_info file: parameter name -> ordered steps; absent parameters are replicated.

    ``num_shards`` is None for an N-agnostic file. ``source`` names the file in error messages. ``description`` is
    the document's own (where ``shardload plan`` records the N it plans for: :func:`recorded_num_shards`).
    """

    params: dict[str, list[StepSpec]] = field(default_factory=dict)
    num_shards: int | None = None
    version: int = FORMAT_VERSION
    form: str = "document"
    source: str = "shard_info.json"
    description: str | None = field(default=None, compare=False)

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardInfo:
        """Read and check a shard_info.json file (either form)."""
        path = Path(path)
        return cls.from_bytes(read_small(path, MAX_FILE_BYTES, "shard_info", FormatError), source=str(path))

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str) -> ShardInfo:
        """Parse a shard_info file's bytes (UTF-8 JSON), read from wherever it is kept."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise FormatError(f"not UTF-8 text ({err.reason} at byte {err.start})", file=source) from None
        return cls.from_json(text, source=source)

    @classmethod
    def from_json(cls, text: str, *, source: str = "shard_info.json") -> ShardInfo:
        """Parse shard_info JSON text; duplicate keys are an error, not a silent overwrite."""
        try:
            obj = strictjson.loads(text)
        except strictjson.DuplicateKeyError as dup:
            raise FormatError(f"duplicate key {dup.key!r} in a JSON object", file=source) from None
        except json.JSONDecodeError as err:
            raise FormatError(
                f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}", file=source
            ) from None
        except (ValueError, RecursionError) as err:
            raise FormatError(f"not valid JSON: {err}", file=source) from None
        return cls.from_dict(obj, source=source)

    @classmethod
    def from_dict(cls, obj: Any, *, source: str = "shard_info.json") -> ShardInfo:
        """Check a decoded JSON value against the schema and build a ShardInfo from it."""
        if not isinstance(obj, dict):
            raise FormatError(f"top level must be a JSON object, got {_json_type(obj)}", file=source)
        # A document key holding a list is a seed-form parameter that happens to be named "version",
        # "params", ...: in the document form none of those keys holds a list.
        is_document = any(k in obj and not isinstance(obj[k], list) for k in DOCUMENT_KEYS)
        if is_document:
            if "version" not in obj:
                raise FormatError("document form needs a 'version' (this shardload reads version 1)", file=source)
            if type(obj["version"]) is float and obj["version"] == FORMAT_VERSION:
                raise FormatError(f"'version' must be the JSON integer {FORMAT_VERSION}, not {obj['version']!r}",
                                  file=source)  # fmt: skip
            if obj["version"] != FORMAT_VERSION or type(obj["version"]) is not int:
                raise FormatError(
                    f"unsupported version {_json_spelled(repr(obj['version']), obj['version'])} (this shardload "
                    f"reads version {FORMAT_VERSION})",
                    file=source,
                )
        _check_schema(obj, "document" if is_document else "seed", source)
        if is_document:
            params = {k: [_step(s) for s in v] for k, v in obj["params"].items()}
            _check_spellings(params, source)
            n = obj.get("num_shards")
            if n is not None and type(n) is not int:  # the schema's "integer" takes 2.0, which N must never be
                raise FormatError(f"'num_shards' must be a JSON integer or null, not {n!r}", file=source)
            if n is not None and n > MAX_RANKS:
                raise FormatError(f"num_shards={n} is over the limit of {MAX_RANKS}", file=source)
            return cls(params, n, FORMAT_VERSION, "document", source, obj.get("description"))
        params = {k: [_step(s) for s in v] for k, v in obj.items()}
        _check_spellings(params, source)
        return cls(params, _seed_num_shards(params, source), FORMAT_VERSION, "seed", source)

    # -- writing ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The document form of this shard_info (a seed-form input is written as a document)."""
        return {
            "version": self.version,
            "num_shards": self.num_shards,
            "params": {name: [s.to_json() for s in steps] for name, steps in self.params.items()},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the document form to ``path`` (atomically: temporary file, then rename)."""
        strictjson.write_atomic(path, self.to_dict())

    # -- checking --------------------------------------------------------------------------

    def alias_problems(self, aliases: list[tuple[str, str]]) -> list[FormatError]:
        """One error per alias pair (names of one parameter, e.g. tied weights) listed with different steps."""
        problems = []
        for first, second in aliases:
            if first in self.params and second in self.params and self.params[first] != self.params[second]:
                problems.append(
                    FormatError(
                        f"listed twice through an alias: it is the same parameter as {first!r} (tied weights: "
                        "config.json tie_word_embeddings), which is listed with different steps",
                        file=self.source,
                        param=second,
                    )
                )
        return problems


def _check_spellings(params: dict[str, Any], source: str) -> None:
    """Two keys that are the same name in different Unicode spellings list one parameter twice."""
    seen: dict[str, str] = {}
    for key in params:
        norm = unicodedata.normalize("NFC", key)
        if norm in seen:
            raise FormatError(
                f"listed twice through an alias: {seen[norm]!a} and {key!a} are the same name "
                "(Unicode canonical equivalents)",
                file=source,
                param=key,
            )
        seen[norm] = key


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _step(raw: list[Any]) -> StepSpec:
    shape, dtype = raw[1]
    return StepSpec(raw[0], None if shape is None else tuple(shape), dtype, tuple(raw[2:]))


def _seed_num_shards(params: dict[str, list[StepSpec]], source: str) -> int | None:
    """A seed-form file is for one N: the leading dim of every last step's output."""
    found: dict[int, str] = {}
    for name, steps in params.items():
        if steps and steps[-1].shape:
            found.setdefault(int(steps[-1].shape[0]), name)
    if len(found) > 1:
        (n1, p1), (n2, p2) = list(found.items())[:2]
        raise FormatError(f"seed form is for one num_shards, but {p1} leads with {n1} and {p2} with {n2}", file=source)
    for n, name in found.items():
        if n > MAX_RANKS:
            raise FormatError(f"num_shards={n} is over the limit of {MAX_RANKS}", file=source, param=name)
        if n < 1:
            raise FormatError(
                f"the last step's output must lead with num_shards (at least 1), not {n}",
                file=source, param=name, step=len(params[name]),
            )  # fmt: skip
    return next(iter(found), None)


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The JSON Schema of shard_info.json, as shipped with the package."""
    beside = Path(__file__).with_name("shard_info.schema.json")  # an installed package: no importlib.resources
    if beside.is_file():
        return json.loads(beside.read_text())
    packaged = resources.files("shardload.format") / "shard_info.schema.json"
    if packaged.is_file():
        return json.loads(packaged.read_text())
    return json.loads((Path(__file__).resolve().parents[2] / "shard_info.schema.json").read_text())


@lru_cache(maxsize=2)
def _validator(form: str) -> Any:
    import jsonschema

    root = schema()
    sub = {"$schema": root["$schema"], "$defs": root["$defs"], "$ref": f"#/$defs/{form}"}
    return jsonschema.Draft202012Validator(sub)


def _distinct_steps(obj: dict[str, Any], form: str) -> dict[str, Any] | None:
    """``obj`` with every step list after the first of its kind replaced by ``[]`` (None if that is not possible).

    The schema says nothing that ties one parameter to another, and an empty list is always valid, so this
    document is valid exactly when ``obj`` is; checking each distinct list once (a layer's lists repeat in
    every layer) makes validation cost scale with the variety of steps, not with the model's depth.
    """
    params = obj if form == "seed" else obj.get("params")
    if not isinstance(params, dict):
        return None
    seen: set[str] = set()
    reduced: dict[str, Any] = {}
    try:
        for name, steps in params.items():
            key = json.dumps(steps, sort_keys=True)
            reduced[name] = [] if key in seen and isinstance(steps, list) else steps
            seen.add(key)
    except (TypeError, ValueError, RecursionError):
        return None
    return reduced if form == "seed" else {**obj, "params": reduced}


@lru_cache(maxsize=2)
def _fast_validator(form: str) -> Any:
    """jsonschema-rs's compiled validator of the same schema, or None where that package is missing."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    root = schema()
    return jsonschema_rs.Draft202012Validator({"$schema": root["$schema"], "$defs": root["$defs"],
                                               "$ref": f"#/$defs/{form}"})  # fmt: skip


SCHEMA_ERRORS = 64
"""How many of a document's schema problems are weighed for the one message (the first ones found)."""


def _check_schema(obj: dict[str, Any], form: str, source: str) -> None:
    fast = _fast_validator(form)
    if fast is not None:
        try:
            if fast.is_valid(obj):
                return
        except (ValueError, TypeError, OverflowError, RecursionError):
            pass  # a value it cannot take (a huge integer, a Python object): the reference validator decides
    else:
        reduced = _distinct_steps(obj, form)
        if reduced is not None and _validator(form).is_valid(reduced):
            return
    import jsonschema  # the reference validator: for the located message of the first problem

    # the reference validator reads only the first bad step (found by the compiled one), and at most its first
    # problems: a document of a million bad steps would hold a million errors, and its oneOf builds every branch's
    # errors of a value before it yields one (gigabytes, minutes, for a megabyte of bad values)
    part, at = _first_bad_part(obj, form, fast) if fast is not None else (obj, None)
    if _larger_than(part, REFERENCE_BYTES):
        where = f" (step {at[1] + 1} of {at[0]!r})" if at is not None else ""
        raise FormatError(f"does not match shard_info.schema.json{where}: a value too large to describe",
                          file=source)  # fmt: skip
    errors = list(itertools.islice(_validator(form).iter_errors(part), SCHEMA_ERRORS))
    if not errors:
        return
    err = jsonschema.exceptions.best_match(errors)
    if err.validator == "oneOf":  # a value no branch takes: the branch that lists what it may be says more
        err = next((e for e in err.context or () if e.validator == "enum"), err)
    path = list(err.absolute_path)
    names = "propertyNames" in err.absolute_schema_path  # the error is about a key, which has no path of its own
    if at is not None:  # the step's place in the whole document
        k = 0 if form == "seed" else 1
        if len(path) > k + 1 and path[k] == at[0] and path[k + 1] == 0:
            path[k + 1] = at[1]
    param = step = None
    if form == "seed" or path[:1] == ["params"]:
        path = path if form == "seed" else path[1:]
        param = str(path[0]) if path else None
        if len(path) > 1 and isinstance(path[1], int):
            step = path[1] + 1
            path = path[2:]
        else:
            path = path[1:]
    if names:
        detail = " (a parameter name in params)" if form == "document" else " (a parameter name)"
    else:
        detail = f" ({_describe(path)})" if path else ""
    reason = f"does not match shard_info.schema.json{detail}: {_short(_json_spelled(err.message, err.instance))}"
    raise FormatError(reason, file=source, param=param, step=step, func=_step_function(obj, form, param, step))


def _json_spelled(message: str, instance: Any) -> str:
    """A validator's message with the value it leads with written as JSON (``true``, ``null``), not as Python."""
    said = repr(instance)
    if isinstance(instance, str) or not message.startswith(said):
        return message
    try:
        return json.dumps(instance, allow_nan=False) + message[len(said) :]
    except (TypeError, ValueError):
        return message


def _step_function(obj: Any, form: str, param: str | None, step: int | None) -> str | None:
    """The function name a document gives step ``step`` of ``param`` (None where it names none as a string)."""
    if param is None or step is None:
        return None
    try:
        steps = obj[param] if form == "seed" else obj["params"][param]
        name = steps[step - 1][0]
    except (KeyError, IndexError, TypeError):
        return None
    return name if isinstance(name, str) else None


REFERENCE_BYTES = 64 << 10
"""The largest part of a document (as JSON) the reference validator reads for a message."""


def _larger_than(obj: Any, limit: int) -> bool:
    """Whether ``obj`` written as JSON takes more than ``limit`` bytes (stops counting past it)."""
    seen = 0
    for chunk in json.JSONEncoder(default=repr, check_circular=False).iterencode(obj):
        seen += len(chunk)
        if seen > limit:
            return True
    return False


def _first_bad_part(obj: Any, form: str, fast: Any) -> tuple[Any, tuple[str, int] | None]:
    """The smallest part of ``obj`` the compiled validator refuses, as a document of its own: the document without
    its parameters, or one parameter with its first bad step alone (then ``(name, index)`` of that step), or the
    whole document where it cannot tell."""
    params = obj if form == "seed" else obj.get("params") if isinstance(obj, dict) else None
    if not isinstance(params, dict):
        return obj, None
    base = {} if form == "seed" else {k: v for k, v in obj.items() if k != "params"}

    def alone(name: str, steps: Any) -> Any:
        return {name: steps} if form == "seed" else {**base, "params": {name: steps}}

    try:
        if form != "seed" and not fast.is_valid({**base, "params": {}}):
            return {**base, "params": {}}, None
        for name, steps in params.items():
            if fast.is_valid(alone(name, steps)):
                continue
            for i, step in enumerate(steps if isinstance(steps, list) else ()):
                if not fast.is_valid(alone(name, [step])):
                    return alone(name, [step]), (name, i)
            return alone(name, steps), None
    except (ValueError, TypeError, OverflowError, RecursionError):
        pass
    return obj, None


def _describe(path: list[Any]) -> str:
    """Name the part of a step (or of the document) that a schema error points at."""
    if path and isinstance(path[0], int):
        names = {0: "function name", 1: "[shape, dtype]"}
        what = names.get(path[0], f"argument {path[0] - 1}")
        if path[0] == 1 and len(path) > 1:
            what = "shape" if path[1] == 0 else "dtype"
        return what
    return "at " + "".join(f"[{p!r}]" for p in path)


def _short(text: str, limit: int = 160) -> str:
    """Squeeze whitespace and elide the middle of a long message (its end says what is wrong)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-(limit // 2 - 5) :]
