"""The package version (ground floor: any layer may import it)."""

__version__ = "0.1.0"
