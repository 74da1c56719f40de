"""Process-group helpers that also work without torch.distributed (one process, no group)."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

__all__ = ["group_size", "group_rank"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    """World size of ``group`` (the default group if ``None``); 1 when not running distributed."""
    if not _initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional["dist.ProcessGroup"] = None) -> int:
    """Rank of this process within ``group``; 0 when not running distributed."""
    if not _initialized():
        return 0
    return dist.get_rank(group)
