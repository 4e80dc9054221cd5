"""The step-function registry: names in shard_info files are keys here, never import paths.

A registered step carries its callable and a *shape rule* (input shape/dtype + arguments ->
output shape/dtype), so a plan can be checked without touching data. A step that also
declares *source boxes* is an index remap: the planner can turn a chain of remaps into the
byte regions each rank reads. A remap registered with ``pads=True`` may also leave output
elements with no source (padding): they are zeros, written without reading anything.

Built-in steps (the ``shard_funcs`` package) register with :func:`register` like any user step; the
package root ``shardload/__init__.py`` imports ``shard_funcs`` once, so they are present whenever
shardload is. This module never imports them: the registry sits below every step function.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import StepArgumentError
from ..format import expr
from ..sources.plugins import PluginError, load_once

Shape = tuple[int, ...]
Box = tuple[tuple[int, int], ...]
"""A box is a half-open ``[start, stop)`` interval per dimension."""

ShapeRule = Callable[..., tuple[Shape, str]]
"""``rule(in_shape, in_dtype, *args) -> (out_shape, out_dtype)``; raises StepArgumentError."""

BoxRule = Callable[..., list[tuple[Box | None, Box]]]
"""``boxes(out_box, in_shape, *args) -> [(in_box, out_part), ...]``.

The parts tile ``out_box``; each ``in_box`` holds the same elements as its ``out_part`` in
the same row-major order (the two shapes are equal once size-1 dimensions are dropped).
A step registered with ``pads=True`` may give ``None`` for ``in_box``: that part has no
source and is zeros.
"""


@dataclass(frozen=True)
class ArgSpec:
    """One extra argument of a step function: its name, kind and default."""

    name: str
    kind: str
    default: Any = inspect.Parameter.empty

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


@dataclass(frozen=True)
class StepFunction:
    """A registered step: the callable, its shape rule, and (for index remaps) its box rule."""

    name: str
    fn: Callable[..., Any]
    shape: ShapeRule | None
    """None for a destination-passing step: its output is what the file declares."""
    boxes: BoxRule | None
    params: tuple[ArgSpec, ...]
    variadic: bool
    out: bool = False
    """Destination-passing (TVM's convention): called as ``fn(x, *args, out)`` with ``out`` allocated from the
    declared output shape and dtype; it writes into ``out``."""
    pads: bool = False
    """The box rule may return parts with no source (``in_box`` None): output elements that are zeros
    (padding). A rank's zeros are written in place, never read; the function itself must return zeros there."""
    inverse: Callable[..., Any] | None = None
    """For a compute step: ``inverse(out, *args)`` gives the input back from the whole output ``[N, ...]``, so a
    directory converted with the step serves another N (its result is checked by running the step again)."""

    @property
    def remap(self) -> bool:
        """True when every output element is a copy of one input element (no arithmetic)."""
        return self.boxes is not None

    def arity(self) -> str:
        """Human-readable count of extra arguments, e.g. ``"4"`` or ``"3 to 4"``."""
        low = sum(p.required for p in self.params)
        high = len(self.params)
        if self.variadic:
            return f"at least {low}"
        return str(low) if low == high else f"{low} to {high}"

    def bind(self, args: Sequence[Any], num_shards: int | None) -> tuple[Any, ...]:
        """Check arity and kinds of ``args`` from a file, evaluating expressions; return the call args."""
        low = sum(p.required for p in self.params)
        if len(args) < low or (len(args) > len(self.params) and not self.variadic):
            raise StepArgumentError(f"takes {self.arity()} extra argument(s), got {len(args)}")
        bound = []
        for i, value in enumerate(args):
            spec = self.params[i] if i < len(self.params) else ArgSpec(f"arg{i}", "any")
            bound.append(_coerce(spec, value, num_shards))
        return tuple(bound)


def _coerce(spec: ArgSpec, value: Any, num_shards: int | None) -> Any:
    where = f"argument {spec.name!r}"
    try:
        if spec.kind == "int":
            return expr.evaluate(value, num_shards)
        if spec.kind == "ints":
            if not isinstance(value, list):
                raise StepArgumentError(f"expected a list of integers, got {value!r}")
            return [expr.evaluate(v, num_shards) for v in value]
    except StepArgumentError as err:
        raise StepArgumentError(f"{where}: {err}") from None
    if spec.kind == "str" and not isinstance(value, str):
        raise StepArgumentError(f"{where}: expected a string, got {value!r}")
    if spec.kind == "float" and (type(value) not in (int, float)):
        raise StepArgumentError(f"{where}: expected a number, got {value!r}")
    if spec.kind == "bool" and type(value) is not bool:
        raise StepArgumentError(f"{where}: expected true or false, got {value!r}")
    return value


_STRING_KINDS = {
    "int": "int", "str": "str", "float": "float", "bool": "bool",
    "list[int]": "ints", "List[int]": "ints", "Sequence[int]": "ints", "tuple[int,...]": "ints",
}  # fmt: skip


def _kind_of(annotation: Any) -> str:
    if isinstance(annotation, str):  # postponed annotations: read the common spellings
        return _STRING_KINDS.get(annotation.replace(" ", ""), "any")
    if annotation is int:
        return "int"
    if annotation in (str, float, bool):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    if origin in (list, Sequence, tuple) and typing.get_args(annotation)[:1] == (int,):
        return "ints"
    return "any"


def _arg_specs(fn: Callable[..., Any], out: bool = False) -> tuple[tuple[ArgSpec, ...], bool]:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(f"step function {fn!r} must take the input tensor as its first argument")
    if out:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) < 2:
            raise TypeError(
                f"destination-passing step function {fn!r} must take (x, *fixed args, out): the output last, no *args"
            )
        params = positional[:-1]
    specs, variadic = [], False
    for p in params[1:]:
        if p.kind is p.VAR_POSITIONAL:
            variadic = True
            continue
        if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD):
            continue
        kind = "any" if p.annotation is p.empty else _kind_of(p.annotation)
        specs.append(ArgSpec(p.name, kind, p.default))
    return tuple(specs), variadic


_REGISTRY: dict[str, StepFunction] = {}


def register(
    name: str,
    *,
    shape: ShapeRule | None = None,
    boxes: BoxRule | None = None,
    out: bool = False,
    pads: bool = False,
    replace: bool = False,
    inverse: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn(x, *args)`` under ``name`` with its shape rule (and box rule for remaps).

    A compute step may give ``inverse(out, *args)``, its input back from the whole output ``[N, ...]``: a directory
    converted with it then serves another N without a record of the stored tensor (``shard_funcs.shard_group_index``).

    With ``pads=True`` the box rule may map parts of the output to no input (``(None, out_part)``): those
    elements are zeros, filled without a read (``shard_funcs.pad_dim``); the function must give zeros there too.

    With ``out=True`` the function is destination-passing, as TVM's step functions are: ``fn(x, *args, out)``
    writes into ``out``, allocated from the output shape and dtype the file declares (the declaration is the
    shape rule; ``shape`` may still be given to check it).

    Example::

        @shardload.register("myorg.scale_rows", shape=lambda s, d, n: ((n, *s), d))
        def scale_rows(x, num_shards: int):
            return (x * 2).expand(num_shards, *x.shape)
    """
    if not isinstance(name, str) or not name:
        raise TypeError("a step function name must be a non-empty string")
    if shape is None and not out:
        raise TypeError(f"step function {name!r} needs a shape rule (or out=True: the file's declaration)")
    if pads and boxes is None:
        raise TypeError(f"step function {name!r}: pads=True declares zero parts of a box rule; give boxes=")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and not replace and _REGISTRY[name].fn is not fn:
            raise ValueError(f"step function {name!r} is already registered (pass replace=True)")
        params, variadic = _arg_specs(fn, out)
        _REGISTRY[name] = StepFunction(name, fn, shape, boxes, params, variadic, out, pads, inverse)
        return fn

    return decorator


def unregister(name: str) -> None:
    """Remove a registered step function (mainly for tests)."""
    _REGISTRY.pop(name, None)


def lookup(name: str) -> StepFunction:
    """The registered step for ``name``; raises StepArgumentError for an unknown name.

    A name not registered yet loads the installed ``shardload.steps`` entry points first (once).
    """
    if name not in _REGISTRY:
        load_entry_points()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        close = closest_name(name) if isinstance(name, str) and len(name) < 200 else None
        hint = f"; did you mean {close!r}?" if close else "; --plugin MODULE registers your own"
        raise StepArgumentError(f"unknown function {name!r} (not registered{hint})") from None


def closest_name(name: str) -> str | None:
    """The registered name ``name`` was most likely meant as: the closest by last dotted part (``shard_dim`` ->
    ``shard_funcs.shard_dim``), the whole name breaking ties; None when none is close."""
    last = name.rpartition(".")[2]

    def score(candidate: str) -> tuple[float, float]:
        tail = difflib.SequenceMatcher(None, last, candidate.rpartition(".")[2]).ratio()
        return tail, difflib.SequenceMatcher(None, name, candidate).ratio()

    ranked = sorted(_REGISTRY, key=lambda c: (score(c), c), reverse=True)
    if ranked and score(ranked[0])[0] >= 0.6:
        return ranked[0]
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    return close[0] if close else None


def names() -> list[str]:
    """All registered step names, sorted."""
    load_entry_points()
    return sorted(_REGISTRY)


ENTRY_POINT_GROUP = "shardload.steps"


def load_entry_points() -> None:
    """Load, once per process, every installed package's ``shardload.steps`` entry point (other threads wait for
    it; one that fails is raised again by every lookup until it loads).

    An entry point names a module (importing it registers its steps) or a callable (called with no
    arguments). Which code runs is decided by what is installed, never by a name in a shard_info file:
    all of them load together, at the first lookup of a name not registered yet, whatever that name is.
    Installed means found in :func:`~shardload.sources.plugins.installed_paths`: a ``*.dist-info`` in the current
    directory or beside the running script (a model directory one runs from) is never read.
    """
    try:
        load_once(ENTRY_POINT_GROUP, _withdrawn_on_failure)
    except PluginError as err:  # raised again by every lookup: no plan goes on with a package's steps missing
        raise StepArgumentError(str(err)) from None


@contextmanager
def _withdrawn_on_failure(name: str) -> Iterator[None]:
    """Run one entry point; if it fails, withdraw the steps it registered (a half-loaded package's steps are not
    used, and running it again registers them afresh)."""
    before = set(_REGISTRY)
    try:
        yield
    except BaseException:
        for added in set(_REGISTRY) - before:
            _REGISTRY.pop(added, None)
        raise
