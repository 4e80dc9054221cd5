"""vLLM integration: everything shardload knows of vLLM, in one package.

- :mod:`.loader`: ``load_format="shardload"`` for vLLM, the only module of shardload that imports vLLM. With vLLM
  present, the ``vllm.general_plugins`` entry point calls :func:`register` in every vLLM process, which adds it.
  Copying a rank into vLLM's parameters is the server-neutral :mod:`shardload.integrations.fill`.
- :mod:`.names`: checkpoint names -> vLLM's parameters (fusion, stacked experts, padded vocabulary);
  :mod:`.families`: what vLLM's model of each model family fuses and how it names its state.
- :mod:`.layout`: vLLM's ``sharded_state`` layout planned (which tensors each rank file holds).
- :mod:`.writer`: ``shardload convert --layout vllm`` (registered by :mod:`.target`, the ``shardload.layouts``
  entry point); :mod:`.verify`: ``shardload verify --source`` of its output.
- :mod:`.sharded_state`: a ``sharded_state`` directory read back as a source for any N (the ``shardload.split_formats``
  entry point); :mod:`.saved`: one vLLM's own ``save_model`` wrote.

``pip install "shardload[vllm]"`` installs nothing of vLLM's (its builds are platform specific); only
:mod:`.loader` needs vLLM. May import: ``shardload.engine`` and every layer below it; the loader uses the public API
and :mod:`shardload.integrations.api`.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the ``shardload`` load format with vLLM (the ``vllm.general_plugins`` entry point)."""
    from .loader import register_loader

    register_loader()
