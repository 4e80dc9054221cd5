"""The ``shardload`` command line: click commands (:mod:`.main`), report tables (:mod:`.report`) and the
built-in example model (:mod:`.example`).
May import: every layer below it (``engine`` and down); nothing imports it.
"""
