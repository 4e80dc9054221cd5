"""Entry shim: ``python cli.py ...`` runs the shardload command line (the real CLI is shardload.cli.main)."""

from shardload.cli.main import main

if __name__ == "__main__":
    main()
