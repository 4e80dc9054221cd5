"""The named choices of a generated shard_info (``shardload plan``'s ``--style``, ``--experts``, ``--vocab-padding``).

Standard library only, so the command line lists them at start without importing the planning code.
"""

from __future__ import annotations

STYLES = ("auto", "megatron", "hf")
"""Where placements come from: ``hf`` transformers' TP tables, ``megatron`` the family presets, ``auto`` either."""
EXPERT_MODES = ("tp", "parallel")
"""How mixture-of-experts weights are split: inside each expert (``tp``) or whole experts per rank."""
SERVER_VOCAB_MULTIPLE = 64
"""The row multiple inference servers pad a vocabulary-parallel embedding or LM head to before splitting it."""
VOCAB_PADDING: dict[str, int | str | None] = {"server": SERVER_VOCAB_MULTIPLE, "plain": "num_shards", "none": None}
"""How a vocabulary N does not divide is padded (``pad_to`` of its placements): ``server`` to a multiple of 64 as
the servers pad it (the default: rank r then holds a server's rows), ``plain`` to a multiple of N (the least
padding; every N), ``none`` not at all (such an N fails). Under every rule an N that divides the vocabulary splits
it evenly, unpadded, where a server would still pad it to a multiple of 64 (docs/model-plans.md). The command line
calls ``server`` by the server users know it from (``--vocab-padding``)."""
DEFAULT_VOCAB_PADDING = "server"
