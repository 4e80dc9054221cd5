"""Reading into a caller's tensors (a server's own parameter memory), checked on any device; the GPU's data path
with the CPU as its device; files dropped from the page cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import shardload
from shardload.engine.paths import DataPath, data_path_for
from shardload.engine.run import run_plan
from shardload.engine.transfer import Transfer
from shardload.sources.reader import Reader


def check_reads_into_slots(model: Path, device: str, copy_out: bool, strategy: str = "auto") -> None:
    """``Transfer.param(out=...)`` onto ``device`` (a server's own parameter memory: views into a larger buffer)
    holds exactly what fresh tensors would, and writes nothing around the views."""
    plan = shardload.plan_model(model, 4)
    want = run_plan(plan, [2], ["cpu"])[0]
    slots = {}
    options = shardload.ReadOptions(strategy=strategy)
    with (
        Reader() as reader,
        Transfer(reader, path=data_path_for([device], one_rank=copy_out), read_options=options, defer=True) as transfer,
    ):
        for name, param in plan.params.items():
            backing = torch.full((param.rank_nbytes + 16,), 7, dtype=torch.uint8, device=device)
            slot = backing[8 : 8 + param.rank_nbytes].view(want[name].dtype).view(want[name].shape)
            assert transfer.param(param, [2], out=[slot])[0] is slot
            slots[name] = (slot, backing)
        transfer.wait()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    for name, (slot, backing) in slots.items():
        assert slot.device == torch.device(device)
        assert torch.equal(slot.cpu(), want[name]), name
        end = 8 + slot.numel() * slot.element_size()
        assert backing[:8].eq(7).all() and backing[end:].eq(7).all(), name


def stand_in(devices: Any, **kw: Any) -> DataPath:
    """The data path a load onto a GPU takes, for CPU tensors (the CPU as its device): patched over
    ``shardload.engine.run.data_path_for``, every load takes it."""
    return data_path_for(devices, **kw | {"staged": True})


def stand_in_apart(devices: Any, **kw: Any) -> DataPath:
    """:func:`stand_in` with each destination on a device of its own: a load onto several GPUs, the CPU as each."""
    from shardload.engine.paths import DevicePath

    return DevicePath(one_rank=kw.get("one_rank", False), stand_in=True, apart=True)


def drop_from_cache(path: Path) -> None:
    """Write back and evict ``path``'s pages from the page cache (best effort: tmpfs keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
