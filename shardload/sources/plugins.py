"""Entry points of installed packages: how registries (step functions, split formats) find what a package adds.

Only packages installed in site-packages or on an explicit path count: a ``*.dist-info`` in the current directory or
beside the running script (a model directory one runs from) is never read, so a downloaded model cannot add code.
"""

from __future__ import annotations

import configparser
import importlib
import os
import re
import site
import sys
import sysconfig
import threading
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any


class PluginError(Exception):
    """An installed entry point failed to load (the message names it)."""


_LOADED: set[tuple[str, str, str]] = set()
"""Entry points (group, name, value) loaded without error in this process: a later run (after another one failed)
does not call them twice."""
_LOADED_LOCK = threading.Lock()


WAIT_S = 10.0
"""How long a thread waits for another thread loading a group's entry points before it goes on with what is
registered: a plugin module whose own top level looks the group up, imported by one thread while the loading thread
imports that same module, would otherwise leave both waiting for ever."""
_DONE: set[str] = set()
"""Groups whose entry points have all loaded in this process (:func:`load_once`)."""
_LOADING: dict[str, int] = {}
"""Groups being loaded, by the loading thread's ident."""
_COND = threading.Condition()


def load_once(group: str, around: Callable[[str], AbstractContextManager[Any]] | None = None) -> None:
    """Load ``group``'s entry points once per process (:func:`run_entry_points`, ``around`` each): another thread
    waits for the load under way (at most :data:`WAIT_S`); a failure is raised again by every call until they all
    load; a call made from inside one of them returns at once. No lock is held while a plugin is imported."""
    if group in _DONE:
        return
    me = threading.get_ident()
    with _COND:
        deadline = time.monotonic() + WAIT_S
        while group in _LOADING and _LOADING[group] != me:
            left = deadline - time.monotonic()
            if left <= 0:
                return  # waited long enough: go on with what is registered
            _COND.wait(left)
        if group in _DONE or group in _LOADING:
            return
        _LOADING[group] = me
    done = False
    try:
        run_entry_points(group, around)
        done = True
    finally:
        with _COND:
            del _LOADING[group]
            if done:
                _DONE.add(group)
            _COND.notify_all()


def run_entry_points(group: str, around: Callable[[str], AbstractContextManager[Any]] | None = None) -> None:
    """Load every installed package's entry points in ``group``, each once per process (``around(name)``: a context
    each runs in, e.g. one that withdraws what a failing entry point registered); one naming a callable is called
    with no arguments (one naming a module registers by being imported)."""
    for name, value in _entry_points(group):
        with _LOADED_LOCK:
            if (group, name, value) in _LOADED:
                continue
        try:
            with around(name) if around is not None else nullcontext():
                _load(value)
        except Exception as err:
            raise PluginError(
                f"the installed {group} entry point {name!r} ({value}) failed to load: {type(err).__name__}: {err}"
            ) from None
        with _LOADED_LOCK:
            _LOADED.add((group, name, value))


def _load(value: str) -> None:
    """Import an entry point's module; call what it names when that is a callable."""
    module, _, attr = value.split("[")[0].partition(":")
    loaded: Any = importlib.import_module(module.strip())
    for part in filter(None, attr.strip().split(".")):
        loaded = getattr(loaded, part)
    if callable(loaded) and not isinstance(loaded, types.ModuleType):
        loaded()


def _entry_points(group: str) -> list[tuple[str, str]]:
    """``(name, value)`` of every entry point in ``group`` of the packages installed on :func:`installed_paths`, the
    first package of a name on the path only (the one Python imports). Read from each package's
    ``entry_points.txt`` directly: ``importlib.metadata`` costs tens of milliseconds to import and parses every
    package's metadata, which a process's first load would pay."""
    seen: set[str] = set()
    found: list[tuple[str, str]] = []
    header = f"[{group}]"
    for entry in installed_paths():
        try:
            names = sorted(e.name for e in os.scandir(entry) if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue  # a zip file or a path that is gone: no packages here to scan
        for folder in names:
            package = re.sub(r"[-_.]+", "-", folder.rsplit(".", 1)[0].split("-")[0]).lower()
            if package in seen:
                continue
            seen.add(package)
            try:
                with open(os.path.join(entry, folder, "entry_points.txt"), encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            if header not in text:  # most packages: nothing to parse
                continue
            found.extend(_group_entries(os.path.join(entry, folder, "entry_points.txt"), text, group))
    return found


def _group_entries(path: str, text: str, group: str) -> list[tuple[str, str]]:
    """``(name, value)`` of ``group`` in an ``entry_points.txt``; a file that does not parse is a :class:`PluginError`
    naming it (as a broken package is named, not skipped)."""
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None, strict=False, default_section="\0")
    parser.optionxform = str  # type: ignore[assignment,method-assign]  (entry point names keep their case)
    try:
        parser.read_string(text, source=path)
    except configparser.Error as err:
        raise PluginError(f"{path}: cannot be read as entry points: {str(err).splitlines()[0]}") from None
    return list(parser[group].items()) if parser.has_section(group) else []


def installed_paths() -> list[str]:
    """The ``sys.path`` entries entry points are read from: every one but the current directory (``''``, ``.``
    or its full path, as ``-c``, ``-m`` and ``PYTHONPATH=.`` put it there) and the directory of the running script;
    site-packages directories (the interpreter's, a virtualenv's, the user's) always count."""
    sites = {os.path.realpath(p) for p in site.getsitepackages() if p} if hasattr(site, "getsitepackages") else set()
    sites |= {os.path.realpath(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    if site.ENABLE_USER_SITE:
        sites.add(os.path.realpath(site.getusersitepackages()))
    denied = {os.path.realpath(os.getcwd())}
    if sys.path and not getattr(sys.flags, "safe_path", False):
        denied.add(os.path.realpath(sys.path[0] or os.getcwd()))
    if sys.argv and sys.argv[0] and os.path.isfile(sys.argv[0]):
        denied.add(os.path.dirname(os.path.realpath(sys.argv[0])))
    kept = []
    for entry in sys.path:
        if not isinstance(entry, str) or not entry:
            continue
        real = os.path.realpath(entry)
        if real in sites or real not in denied:
            kept.append(entry)
    return kept
