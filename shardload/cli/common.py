"""What the command modules share: the MODEL argument, one-line failures and ``--json`` documents, the guard
every command runs under (signals, errors, partial outputs), the progress bar, mesh and plugin options."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from ..engine.convert_targets import BUILT_IN as BUILT_IN_LAYOUT
from ..engine.convert_targets import layout_names
from ..errors import ShardloadError, printable
from ..sources.location import is_uri
from .args import failure_document


class ModelArgument(click.ParamType):
    """A MODEL argument: a local path (a Path, as before), or kept as typed when it is an object-store URI
    (``s3://bucket/prefix``) or a Hugging Face Hub id (``org/name[@revision]``) that names no local path."""

    name = "model"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..sources.location import model_kind

        if isinstance(value, str) and not value.strip():  # Path("") is the current directory: an unset variable
            self.fail("is empty: give a model directory or file, an s3:// URI or a Hub id", param, ctx)
        if isinstance(value, Path) or model_kind(value) == "local":
            return Path(value)
        return value


MODEL = ModelArgument()


class OutputPath(click.Path):
    """An output path (``-o``, ``example``'s OUT_DIR): refused when empty, which ``Path`` reads as the current
    directory (an unset variable would write there), and when it is an object-store URI unless ``remote``."""

    def __init__(self, *, remote: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.remote = remote

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty: name the output (`.` for the current directory)", param, ctx)
        if not self.remote and is_uri(value):
            self.fail(f"{value} is not local: this command writes a local output; write it here, then copy it to "
                      "object storage (e.g. `aws s3 sync`)", param, ctx)  # fmt: skip
        return super().convert(value, param, ctx)


OUT = OutputPath(path_type=Path)


class _LayoutChoice(click.Choice):
    """``convert --layout``'s choices: the built-in layout and every registered target, read when first asked (the
    installed integrations' entry points load then, not when the command line starts)."""

    def __init__(self) -> None:
        super().__init__([BUILT_IN_LAYOUT])

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return layout_names()

    @choices.setter
    def choices(self, value: Any) -> None:
        pass

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if value == BUILT_IN_LAYOUT else super().convert(value, param, ctx)


MAX_LISTED_N = 16


def _fail(message: str) -> None:
    if not _DOCUMENTED:  # a failure document printed on stderr is the line there
        click.echo(f"error: {message}", err=True)
    sys.exit(1)


_DOCUMENT_ON_STDERR: list[bool] = []
"""Set while a command prints its ``--json`` document on stderr (``plan --json -o -``: stdout holds the file)."""
_DOCUMENTED: list[bool] = []
"""Set once such a command has printed its failure document on stderr."""


def json_on_stderr_when(to_stdout: Callable[[dict[str, Any]], bool]) -> Callable[[Any], Any]:
    """Mark a command whose ``--json`` documents go to stderr when ``to_stdout(its arguments)`` says its output goes
    to stdout (``plan -o -``), a failure's too; applied below :func:`_guarded`."""

    def mark(fn: Any) -> Any:
        fn.stdout_holds_output = to_stdout
        return fn

    return mark


def _echo_json(doc: dict[str, Any], ok: bool = True, err: bool = False) -> None:
    """Print a command's ``--json`` document, led by ``ok`` and the ``exit_code`` the command exits with (1 when
    not ok), as every document has them, a failure's too."""
    click.echo(json.dumps({"ok": ok, "exit_code": 0 if ok else 1, **doc}, indent=2), err=err)


def _echo_failure(error: dict[str, Any], exit_code: int) -> None:
    """The ``--json`` document of a command that failed: ``{"ok": false, "exit_code": ..., "error": {...}}``; where
    stdout cannot take it, the error line on stderr that follows is all there is."""
    try:
        click.echo(failure_document(error, exit_code), err=bool(_DOCUMENT_ON_STDERR))
        if _DOCUMENT_ON_STDERR:
            _DOCUMENTED[:] = [True]
    except OSError:
        _drop_stdout()


def _written_to_stdout(err: OSError) -> bool:
    """Whether ``err`` was raised writing the command's output to stdout (``click.echo`` without ``err=True``)."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "echo" and frame.f_globals.get("__name__") == "click.utils":
            return not frame.f_locals.get("err", True)
        tb = tb.tb_next
    return False


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of output that could not be written raises
    nothing more (a stream without a descriptor, as under click's test runner, is left as it is)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


class BadArgument(click.ClickException):
    """A usage error shown as one ``error:`` line (a bad option value, a missing file or model) naming the help of
    the command it was raised in, exit 2."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        ctx = click.get_current_context(silent=True)
        if hint is None:
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        self.hint = hint
        """Where the line names the help (the current command's unless given); a ``--json`` document's message
        leaves it out, as it does click's."""

    def show(self, file: Any = None) -> None:
        """Print ``error: MESSAGE`` and the help to read on stderr."""
        click.echo(printable(f"error: {self.format_message()}{self.hint}"), err=True)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so every partial output is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


_WRITTEN: list[Any] = []
"""What the running command has put in place (its OUT), for a line about a later failure to print."""


def written(out: Any) -> None:
    """Record that the command has put ``out`` in place: a failure after it (stdout full) says so."""
    _WRITTEN.append(out)


def _forget_published() -> None:
    """Start a command with no output recorded as put in place (the engine records each it publishes)."""
    from ..engine.output import published

    published.clear()


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


_STARTED: list[str] = []
"""The commands this process has begun (the script's entry ignores a stop signal once one has: its status stands)."""


def command_started() -> bool:
    """Whether a command has begun in this process."""
    return bool(_STARTED)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn shardload and OS errors into a one-line message and exit 1 (with ``--json``, a JSON document on stdout
    too); SIGINT, SIGTERM and SIGHUP (Kubernetes, Slurm and ``timeout`` stop a job with SIGTERM) clean up and
    exit 128 + the signal number."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        previous = {}
        _STARTED.append(fn.__name__)
        if threading.current_thread() is threading.main_thread():
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt
            for signum in _STOP_SIGNALS:
                previous[signum] = signal.signal(signum, _terminate)
        as_json = bool(kwargs.get("as_json"))
        to_stdout = getattr(fn, "stdout_holds_output", None)
        _DOCUMENT_ON_STDERR[:] = [True] if as_json and to_stdout is not None and to_stdout(kwargs) else []
        _DOCUMENTED.clear()
        _WRITTEN.clear()
        _forget_published()
        try:
            return fn(*args, **kwargs)
        except ShardloadError as err:
            if as_json:
                _echo_failure(err.to_dict(), 1)
            _fail(err.message)
        except BrokenPipeError:  # `| head` closed the pipe: stop quietly, as a command killed by SIGPIPE would
            _drop_stdout()
            sys.exit(128 + 13)
        except OSError as err:
            if _written_to_stdout(err):  # a full disk or a dead terminal: no document can follow on stdout either
                _drop_stdout()
                done = f" ({', '.join(map(str, _WRITTEN))} was written and is complete)" if _WRITTEN else ""
                _fail(printable(f"cannot write to standard output: {err.strerror or err}{done}"))
            where = f"{err.filename}: " if err.filename else ""
            message = printable(f"{where}{err.strerror or err}")
            if as_json:
                _echo_failure({"kind": type(err).__name__, "message": message}, 1)
            _fail(message)
        except KeyboardInterrupt:
            _stop(_stopped("interrupted", kwargs.get("out_dir")), 130, as_json, "Interrupted")
        except _Terminated as err:
            what = f"terminated by {signal.Signals(err.signum).name}"
            _stop(_stopped(what, kwargs.get("out_dir")), 128 + err.signum, as_json, "Terminated")
        except MemoryError:
            given = kwargs.get("model") or kwargs.get("target") or (kwargs.get("shard_info_paths") or [None])[0]
            where = printable(f"{given}: ") if given else ""
            _stop(f"{where}out of memory (the input may be larger than this machine can plan or hold)", 1, as_json,
                  "MemoryError", prefix="error: ")  # fmt: skip
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:  # a bug: one line, not a traceback; SHARDLOAD_DEBUG=1 shows where
            if os.environ.get(DEBUG_ENV):
                raise
            reason = printable(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            _stop(f"internal error: {reason} (a bug in shardload; {DEBUG_ENV}=1 shows the traceback)", 1, as_json,
                  type(err).__name__, prefix="error: ")  # fmt: skip
        finally:
            _DOCUMENT_ON_STDERR.clear()
            _DOCUMENTED.clear()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    return wrapper


DEBUG_ENV = "SHARDLOAD_DEBUG"
"""Set to 1, a command stopped by an unexpected exception (a bug) shows its traceback instead of one line."""


def _stop(message: str, code: int, as_json: bool, kind: str, prefix: str = "") -> NoReturn:
    """End a command that something other than bad input stopped: one line on stderr and, with ``--json``, the
    failure document on stdout."""
    if as_json:
        _echo_failure({"kind": kind, "message": message}, code)
    if not _DOCUMENTED:
        click.echo(f"{prefix}{message}", err=True)
    sys.exit(code)


def _stopped(what: str, out_dir: Path | None) -> str:
    """The line a command stopped by a signal prints: what stopped it and, for one that writes a directory, which
    (its staging directory is removed on the way out; an existing OUT stays as it was), or that OUT was already in
    place and is complete."""
    from ..engine.output import published

    if out_dir is None:
        return what
    if any(Path(p).absolute() == Path(out_dir).absolute() for p in published):
        return printable(f"{what}: {out_dir} was written and is complete (stopped after it was put in place)")
    return printable(f"{what}: {out_dir} was not written (the partial output was removed)")


class _ProgressBar:
    """Bytes done, on stderr; the bar first appears at the first update, after planning, so a note printed while
    planning (a plan made from config.json) stands on its own line above it."""

    def __init__(self, label: str, total: Callable[[], int]) -> None:
        self.label, self.total = label, total
        self.bar: Any = None
        self.done = 0

    def __call__(self, done: int, name: str) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=self.total(), label=self.label, file=sys.stderr, show_pos=False)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


SUMMARY_AFTER = 3
"""``validate`` prints a reason seen for many parameters this many times, then one line counting the rest."""


def summarised(problems: list[dict[str, Any]]) -> list[str]:
    """Problem lines, each reason printed for at most :data:`SUMMARY_AFTER` parameters, then counted."""
    seen: dict[str, int] = {}
    lines = []
    for problem in problems:
        key = f"{problem.get('step')}|{problem.get('function')}|{problem['reason']}|{problem.get('num_shards')}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= SUMMARY_AFTER:
            lines.append(problem["message"])
    for key, count in seen.items():
        if count > SUMMARY_AFTER:
            reason = key.split("|", 3)[2]
            lines.append(f"... and {count - SUMMARY_AFTER} more parameters with the same problem ({reason})")
    return lines


def _mesh_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --mesh, --world-size and --pp-layers to a command."""
    fn = click.option(
        "--pp-layers", help="Decoder layers per pipeline stage, e.g. 10,14 (default: as even as possible)."
    )(fn)
    fn = click.option("--world-size", type=click.IntRange(min=1), help="Number of ranks, to infer a -1 mesh axis.")(fn)
    return click.option("--mesh", help="Device mesh, e.g. pp=2,tp=4 (axes dp, pp, tp; one may be -1).")(fn)


def _mesh_arg(mesh: str | None, world_size: int | None, pp_layers: str | None, num_shards: int | None = None) -> Any:
    """The Mesh the options describe, or None when --mesh is absent; a bad one, or one whose tp is not
    ``num_shards`` (-n), is a usage error (exit 2) in one line."""
    from ..planning.mesh import Mesh

    if mesh is None:
        if world_size is not None or pp_layers is not None:
            raise click.UsageError("--world-size and --pp-layers need --mesh")
        return None
    try:
        layout = Mesh.parse(mesh, world_size, pp_layers)
    except ShardloadError as err:
        raise BadArgument(err.message) from None
    if num_shards is not None and num_shards != layout.tp:
        raise BadArgument(f"--num-shards {num_shards} disagrees with the mesh's tp={layout.tp}")
    return layout


def _load_plugins(ctx: click.Context, param: click.Parameter, modules: tuple[str, ...]) -> None:
    """Import the --plugin modules (they register step functions) before the command runs."""
    from .plugins import PluginError, load_plugin

    for module in modules:
        try:
            load_plugin(module)
        except PluginError as err:
            raise click.UsageError(str(err)) from None


_PLUGIN_HELP = (
    "Import MODULE (a dotted name, or a .py file) first, so the step functions it registers can be used; "
    "repeatable. Installed packages register theirs through the 'shardload.steps' entry point group."
)


def _plugin_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --plugin to a command (also accepted before the command name)."""
    return click.option(
        "--plugin", "plugins", metavar="MODULE", multiple=True, expose_value=False, is_eager=True,
        callback=_load_plugins, help=_PLUGIN_HELP,
    )(fn)  # fmt: skip
