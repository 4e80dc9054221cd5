"""``python -m shardload ...`` runs the shardload command line, as the ``shardload`` script does."""

from shardload.cli.entry import run

if __name__ == "__main__":
    run(prog_name="shardload")
