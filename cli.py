"""Entry shim: ``python cli.py ...`` runs the shardload command line, as the ``shardload`` script does (the commands
are shardload.cli.main's, run by shardload.cli.entry)."""

from shardload.cli.entry import run

if __name__ == "__main__":
    run(prog_name="shardload")
