"""``python -m shardload ...`` runs the shardload command line, as the ``shardload`` script does."""

from shardload.cli.main import main

if __name__ == "__main__":
    main(prog_name="shardload")
