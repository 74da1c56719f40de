"""Process-group helpers that also work without torch.distributed (one process, no group).

``group=None`` everywhere in ds_infcl means :func:`default_group`: DeepSpeed's data-parallel group
when DeepSpeed has set up a parallel topology (a mesh or a Megatron-style ``mpu``), otherwise
torch's default (world) group. The DeepSpeed engine may also pass ``engine.data_parallel_group``
explicitly; both name the same ranks. This package never imports deepspeed: the check only looks
at ``sys.modules``, so it costs nothing when DeepSpeed is not in use.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["default_group", "resolve_group", "group_size", "group_rank", "global_rank", "process_group", "PerGroup"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_group() -> Optional["dist.ProcessGroup"]:
    """The process group a loss uses when given ``group=None``.

    DeepSpeed's data-parallel group if DeepSpeed is imported and has been given a mesh
    (``mesh_param``) or a model-parallel unit (``mpu``); ``None`` (torch's world group) otherwise,
    which is also DeepSpeed's data-parallel group in plain data parallelism.
    """
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is None or not _initialized():
        return None
    if getattr(ds_groups, "mesh_device", None) is None and getattr(ds_groups, "mpu", None) is None:
        return None
    return ds_groups._get_data_parallel_group()


def resolve_group(group: Optional["dist.ProcessGroup"] = None) -> Optional["dist.ProcessGroup"]:
    """``group`` itself, or :func:`default_group` for ``None``."""
    return default_group() if group is None else group


def group_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    """World size of ``group`` (:func:`default_group` if ``None``); 1 when not running distributed."""
    if not _initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 1
    return dist.get_world_size(resolve_group(group))


def group_rank(group: Optional["dist.ProcessGroup"] = None) -> int:
    """Rank of this process within ``group``; 0 when not running distributed."""
    if not _initialized():
        return 0
    return dist.get_rank(resolve_group(group))


def global_rank(group: Optional["dist.ProcessGroup"], rank_in_group: int) -> int:
    """Global rank of ``rank_in_group`` of ``group``: P2P peers are always global ranks."""
    if group is None or group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def process_group(group: Optional["dist.ProcessGroup"]) -> "dist.ProcessGroup":
    """The process-group object ``group`` names (``None``: torch's current default group, so that a
    default group destroyed and made again is another object)."""
    return group if group is not None else dist.group.WORLD


_MISSING = object()


class PerGroup:
    """A value kept per process-group object (``process_group``). The group is kept with it, so
    that its ``id`` is not reused by another group meanwhile."""

    def __init__(self):
        self._values: dict = {}  # id(process group) -> (process group, value)

    def get(self, group, default: Any = None) -> Any:
        pg = process_group(group)
        got = self._values.get(id(pg))
        return got[1] if got is not None and got[0] is pg else default

    def __contains__(self, group) -> bool:
        return self.get(group, _MISSING) is not _MISSING

    def set(self, group, value: Any) -> None:
        pg = process_group(group)
        self._values[id(pg)] = (pg, value)

    def values(self) -> list:
        return [value for _, value in self._values.values()]

    def items(self) -> list:
        """``[(process group, value), ...]``."""
        return list(self._values.values())

    def discard(self, group) -> None:
        """Forget ``group`` (and let its process-group object go)."""
        pg = process_group(group)
        got = self._values.get(id(pg))
        if got is not None and got[0] is pg:
            del self._values[id(pg)]

    def __bool__(self) -> bool:
        return bool(self._values)
