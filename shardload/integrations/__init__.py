"""Integrations with inference servers and other hosts, each in its own subpackage, each slotting into the
host's own extension point (a vLLM load format, ...). A host's package is imported only inside its subpackage.
May import: ``shardload.engine`` and every layer below it; never ``shardload.cli``.
"""
