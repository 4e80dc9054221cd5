"""Entry shim: ``python cli.py ...`` runs the shardload command line (the real CLI is shardload.cli)."""

from shardload.cli import main

if __name__ == "__main__":
    main()
