"""``--plugin MODULE``: import a module the user names on the command line so its step functions register.

This is the one place shardload imports a module by a name it did not write, and the name only ever comes
from the command line (never from a shard_info file, a checkpoint or config.json); tests/test_safety.py
allows the dynamic import here and nowhere else.
"""

from __future__ import annotations


class PluginError(Exception):
    """A --plugin module could not be imported (a usage error of the command line)."""


def load_plugin(module: str) -> None:
    """Import a module that registers step functions, named by the user (``--plugin``), never by a file.

    ``module`` is the path of a ``.py`` file, or a dotted module name looked up in the current directory first,
    then on ``sys.path``, as ``python -m`` finds one; the current directory is on the path only while it imports.
    """
    import importlib
    import importlib.util
    import os
    import sys
    from pathlib import Path

    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise PluginError(f"plugin {module!r}: no such file")
            name = f"shardload_plugin_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise PluginError(f"plugin {module!r}: cannot be imported")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded
            spec.loader.exec_module(loaded)
        else:
            here = os.getcwd()
            sys.path.insert(0, here)
            try:
                importlib.import_module(module)
            finally:
                if here in sys.path:
                    sys.path.remove(here)
    except PluginError:
        raise
    except Exception as err:
        raise PluginError(f"plugin {module!r} failed to import: {type(err).__name__}: {err}") from None
