"""Entry points of installed packages: how registries (step functions, split formats) find what a package adds.

Only packages installed in site-packages or on an explicit path count: a ``*.dist-info`` in the current directory or
beside the running script (a model directory one runs from) is never read, so a downloaded model cannot add code.
"""

from __future__ import annotations

import os
import re
import site
import sys
import sysconfig


class PluginError(Exception):
    """An installed entry point failed to load (the message names it)."""


def run_entry_points(group: str) -> None:
    """Load every installed package's entry points in ``group``; one naming a callable is called with no arguments
    (one naming a module registers by being imported)."""
    from importlib.metadata import distributions

    seen: set[str] = set()
    for dist in distributions(path=installed_paths()):
        name = re.sub(r"[-_.]+", "-", str(dist.metadata["Name"] or "")).lower()
        if name in seen:  # the first of a name on the path is the one Python imports
            continue
        seen.add(name)
        for ep in dist.entry_points.select(group=group):
            try:
                loaded = ep.load()
                if callable(loaded):
                    loaded()
            except Exception as err:
                raise PluginError(
                    f"the installed {group} entry point {ep.name!r} ({ep.value}) failed to load: "
                    f"{type(err).__name__}: {err}"
                ) from None


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
