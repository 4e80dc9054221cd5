"""The ``shardload`` command line: example, plan, preflight, convert, validate, inspect, verify, quantize, hash.

The group and ``example`` are here; the other commands are registered from ``convert_cmd.py`` (convert, quantize),
``plan_cmd.py`` (plan, preflight, validate) and ``inspect_cmd.py`` (inspect, verify, hash), what they share is
``common.py``'s. Bad input prints one line per problem (``file: parameter: step K (function): reason``) and
exits 1; usage errors exit 2; no tracebacks for anything shardload can name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

from ..errors import printable
from ..version import __version__
from .args import document_on_stderr, failure_document, json_requested
from .common import OUT, BadArgument, _echo_failure, _guarded, _plugin_option, written
from .convert_cmd import convert, quantize
from .inspect_cmd import hash_command, inspect, verify
from .plan_cmd import plan, preflight, validate


class _Group(click.Group):
    """The command group; with ``--json`` a usage error (from parsing, an option's callback or a command's body)
    prints its JSON document on stdout too, before click prints the usage message and exits 2."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:  # fmt: skip
        given = list(args)
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except click.ClickException as err:
            raise self._report(given, err) from None
        ctx.meta["shardload.args"] = given
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as err:
            raise self._report(ctx.meta.get("shardload.args", []), err) from None

    @staticmethod
    def _report(args: list[str], err: click.ClickException) -> Exception:
        """Print a usage error's ``--json`` document; what to raise: the one-line error, or (a document on stderr,
        ``plan -o -``, is the line there) a bare exit with its code."""
        if not json_requested(args):
            return _one_line(err)
        kind = "UsageError" if err.exit_code == 2 else type(err).__name__
        doc = {"kind": kind, "message": printable(err.format_message())}
        if not document_on_stderr(args):
            _echo_failure(doc, err.exit_code)
            return _one_line(err)
        click.echo(failure_document(doc, err.exit_code), err=True)
        return click.exceptions.Exit(err.exit_code)


def _one_line(err: click.ClickException) -> click.ClickException:
    """A usage error as one ``error:`` line naming the help to read (click prints the usage, a hint, a blank line and
    the error: four lines); other errors as they are."""
    message = err.format_message()
    if not isinstance(err, click.UsageError) or isinstance(err, BadArgument) or "\n" in message:
        return err  # no arguments at all: the help itself, as click shows it
    hint = f" (see `{err.ctx.command_path} --help`)" if err.ctx is not None else ""
    return BadArgument(message.rstrip("."), hint)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardload")
@_plugin_option
def main() -> None:
    """Shard one safetensors checkpoint for any tensor-parallel size, at load time."""
    _show_plan_notes()


class _NoteHandler(logging.Handler):
    """Prints a ``shardload.plan`` record (a plan made from config.json) as one ``note:`` line on stderr, naming
    MODEL as typed (a Hub id, not the snapshot directory it resolved to)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        ctx = click.get_current_context(silent=True)
        typed = ctx.params.get("model") if ctx is not None else None
        args = record.args if isinstance(record.args, tuple) else ()
        if typed is not None and len(args) == 2 and str(args[0]) != str(typed):  # plan_source's "%s: %s"
            message = f"{typed}: {args[1]}"
        click.echo(printable(f"note: {message}"), err=True)


def _show_plan_notes() -> None:
    """Route the plan-source line the API logs at INFO to stderr, once per process."""
    logger = logging.getLogger("shardload.plan")
    if not any(isinstance(h, _NoteHandler) for h in logger.handlers):
        logger.addHandler(_NoteHandler())
    logger.setLevel(logging.INFO)


@main.command()
@click.argument("out_dir", type=OUT)
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists.")
@click.option("--multi-file", is_flag=True, help="Split weights over two files with an index.json.")
@_guarded
def example(out_dir: Path, overwrite: bool, multi_file: bool) -> None:
    """Write the built-in example model (a tiny Phi-3: fused QKV with GQA, fused gate_up, float16) to OUT_DIR."""
    from .example import write_example

    out = write_example(out_dir, overwrite=overwrite, multi_file=multi_file)
    written(out)
    click.echo(f"wrote example model to {out}")


for _command in (convert, plan, preflight, validate, quantize, inspect, verify, hash_command):
    main.add_command(_command)
