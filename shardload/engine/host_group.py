"""Who shares this host: which of the host's ranks this process is (:class:`LocalRanks`), and the reader threads
its share of the host's cores gives it. Told by the ``local_ranks`` read option, else by the launcher's
environment (``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, as torchrun sets them), else by torch.distributed's rank
when only ``LOCAL_WORLD_SIZE`` is set; otherwise the process is alone. What was chosen is logged once, at INFO,
on the ``shardload.host`` logger.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from ..errors import ShardloadError

log = logging.getLogger("shardload.host")
"""Where the local ranks and reader threads a process chose are announced, once, at INFO."""

MAX_READ_THREADS = 8
"""Reader threads of a rank alone on its host, at most: page-cache copies scale with cores until memory bandwidth
is the bound."""
ENV_RANK = "LOCAL_RANK"
ENV_COUNT = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class LocalRanks:
    """This process is local rank ``index`` of the ``count`` ranks loading on its host; ``source`` says who told."""

    index: int
    count: int
    source: str = "local_ranks option"

    def __post_init__(self) -> None:
        if type(self.count) is not int or self.count < 1:
            raise ShardloadError(f"local_ranks count must be an int >= 1, got {self.count!r}")
        if type(self.index) is not int or not 0 <= self.index < self.count:
            raise ShardloadError(f"local_ranks index must be an int in [0, {self.count}), got {self.index!r}")

    @property
    def alone(self) -> bool:
        """Whether no other rank loads on this host."""
        return self.count == 1


ALONE = LocalRanks(0, 1, "alone")
"""A process no other rank loads beside."""
LocalRanksOption: TypeAlias = "LocalRanks | tuple[int, int] | Literal['auto'] | None"
"""``ReadOptions.local_ranks``: ``"auto"`` (from the environment), None (alone), or this process's place given."""


def as_local_ranks(value: Any) -> LocalRanks | Literal["auto"] | None:
    """``value`` as the option holds it: ``"auto"``, None (``"off"`` too), or a :class:`LocalRanks` (a pair
    ``(index, count)`` given); anything else raises one line."""
    if value is None or value == "off":
        return None
    if value == "auto" or isinstance(value, LocalRanks):
        return value  # type: ignore[no-any-return]
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return LocalRanks(value[0], value[1])
    raise ShardloadError(f'local_ranks must be "auto", None, "off", a LocalRanks or (index, count), got {value!r}')


def local_ranks(option: LocalRanksOption = "auto", environ: Mapping[str, str] | None = None) -> LocalRanks:
    """This process's place among its host's ranks: the option's, else the environment's (see the module)."""
    chosen = as_local_ranks(option)
    if chosen is None:
        return LocalRanks(0, 1, "local_ranks off")
    if isinstance(chosen, LocalRanks):
        return chosen
    env = os.environ if environ is None else environ
    try:
        count = _env_int(env, ENV_COUNT, minimum=1)
        if count is None:
            return LocalRanks(0, 1, f"no {ENV_COUNT}")
        index = _env_int(env, ENV_RANK, minimum=0)
        source = f"{ENV_RANK}/{ENV_COUNT}"
        if index is None:
            index = _dist_rank()
            if index is None:
                return LocalRanks(0, 1, f"{ENV_COUNT} without {ENV_RANK} or a process group")
            index, source = index % count, f"torch.distributed rank % {ENV_COUNT}"
        elif index >= count:
            raise ShardloadError(f"{ENV_RANK}={index} is not below {ENV_COUNT}={count}")
    except ShardloadError as err:  # the environment only tunes speed: a stale or bad value must not stop a load
        _warn_once(f"shardload: {err}; loading as the only rank on this host (ReadOptions(local_ranks=...) says "
                   "otherwise)")  # fmt: skip
        return LocalRanks(0, 1, f"bad {ENV_RANK}/{ENV_COUNT}")
    return LocalRanks(index, count, source)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning, once per process."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _env_int(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    """The integer environment variable ``name`` (None when unset or empty); a bad value raises one line."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ShardloadError(f"{name} must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise ShardloadError(f"{name} must be an integer >= {minimum}, got {text!r}")
    return value


def _dist_rank() -> int | None:
    """The global rank of an initialised torch.distributed group (torch only if already imported), else None."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def host_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a cpuset), or fewer where a cgroup CPU
    quota (``docker --cpus``, a Kubernetes CPU limit) allows less time than that, rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where this process's cgroups are read (a v1 controller's hierarchy under ``CGROUP_ROOT/<controller>``; tests
point them elsewhere)."""


def own_cgroup(controller: str) -> tuple[list[Path], int] | None:
    """This process's cgroup for ``controller`` (``"memory"``, ``"cpu"``) and its parents up to its hierarchy's root,
    nearest first, with the cgroup version: the controller's own v1 hierarchy where it has one (a hybrid host keeps
    its controllers on v1), else the v2 group (``0::``). None where ``/proc/self/cgroup`` cannot be read."""
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except (OSError, ValueError):  # not Linux, unreadable, or not text
        return None
    found = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy != "0" and controller in controllers.split(","):
            root = CGROUP_ROOT / controller
            group = root / path.strip().lstrip("/")
            # a container's own mount of its group: the path /proc/self/cgroup names is the host's, not there
            found = (group if group.is_dir() else root), root, 1
            break
    else:
        for line in lines:
            if line.startswith("0::"):
                found = CGROUP_ROOT / line[3:].strip().lstrip("/"), CGROUP_ROOT, 2
                break
    if found is None:
        return None
    group, root, version = found
    return [d for d in (group, *group.parents) if d.is_relative_to(root)], version


def cgroup_least(controller: str, read: Callable[[Path, int], float | None]) -> float | None:
    """The least of ``read(group, version)`` over this process's cgroup for ``controller`` and its parents (a limit
    set anywhere above binds), None where none has one."""
    own = own_cgroup(controller)
    if own is None:
        return None
    groups, version = own
    found = [v for v in (read(d, version) for d in groups) if v is not None]
    return min(found) if found else None


def cpu_quota() -> float | None:
    """The CPUs a cgroup CPU quota allows this process (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), the least of its group's and its parents'; None without one."""
    return cgroup_least("cpu", _cpu_limit)


def _cpu_limit(group: Path, version: int) -> float | None:
    """The CPUs ``group``'s own quota allows, None without one or where its files cannot be read."""
    try:
        if version == 2:
            quota, period = (group / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        us = int((group / "cpu.cfs_quota_us").read_text())
        return None if us <= 0 else us / int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def rank_threads(local: LocalRanks, cores: int | None = None) -> int:
    """A rank's reader threads by default: its share of the host's ``cores`` (at least 1, at most
    :data:`MAX_READ_THREADS`). Ranks loading together on a host all copy at once: eight ranks each taking eight
    threads on a 16-core host run 64 threads on 16 cores, each copy waiting its turn, while each rank's share keeps
    every core busy. A launcher that pins each rank to its own cores makes ``cores`` that share already: it is
    divided again (a smaller pool, still at least one thread)."""
    cores = host_cores() if cores is None else cores
    return max(1, min(MAX_READ_THREADS, cores // local.count))


_announced: set[tuple[LocalRanks, int]] = set()


def announce(local: LocalRanks, threads: int) -> None:
    """Log, once per process for each choice, this process's place on its host and its reader threads."""
    if (local, threads) in _announced:
        return
    _announced.add((local, threads))
    if local.alone:
        log.info("shardload: alone on this host (%s): reads its own bytes; %d reader threads", local.source, threads)
    else:
        log.info("shardload: local rank %d of %d (%s): %d reader threads (%d cores / %d local ranks)", local.index,
                 local.count, local.source, threads, host_cores(), local.count)  # fmt: skip
