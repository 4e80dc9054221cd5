"""vLLM integration: a ``shardload`` load format for vLLM, and vLLM's ``sharded_state`` layout as a convert target.

``pip install "shardload[vllm]"`` installs nothing of vLLM's (its builds are platform specific); with vLLM
present, the ``vllm.general_plugins`` entry point calls :func:`register` in every vLLM process, which adds
``load_format="shardload"`` (:mod:`.loader`), the only module of shardload that imports vLLM. How checkpoint
names become vLLM's parameters is :mod:`shardload.models.vllm_names`; ``shardload convert --layout vllm`` is
:mod:`shardload.engine.vllm_layout` (neither needs vLLM).
May import: ``shardload.engine`` and every layer below it.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the ``shardload`` load format with vLLM (the ``vllm.general_plugins`` entry point)."""
    from .loader import register_loader

    register_loader()
