"""The layout exchange through the host's shared memory, where every rank of a group runs on one host.

Why (issue 17): at 16k rows per GPU on 2 x H100 the gather path's forward is bound by its host,
and the layout exchange over the process group (``exchange_layout``: the local row's copy to the
GPU, an all-gather, the read-back) took 240-350 us of it: each CUDA call issued while the own
block's kernels run costs the host 10-100 us (docs/distributed.md, the twelfth session). Between
processes of one host, the same few integers can go through a file in ``/dev/shm`` instead, with
no CUDA call and no collective.

The channel: ``SLOTS`` slots, one row per rank in each: ``[seq, fields..., check]``. A call
(``HostChannel.exchange``) takes the next sequence number (the same on every rank: every rank
exchanges once per loss call), writes its fields, the checksum of ``(seq, fields)`` and then
``seq`` into its row of slot ``seq mod SLOTS``, and reads every other rank's row of that slot
until it carries ``seq`` and a checksum that matches (a row read while its writer was still
writing fails the checksum and is read again, so nothing depends on the order in which the
writes become visible). A slot is written again three calls later, when every rank has read it:
a rank writes call ``n + 3`` only after it has read every row of ``n + 1`` and ``n + 2``, which
their writers wrote after reading ``n``.

Set up once per group, by every rank together (``setup``: one all-gather of whether it wants the
channel, a hash of its host's name and rank 0's token, one all-reduce of whether it could map the
file): used only where every rank wants it and is on one host; else the process group's
exchange, decided from gathered values, so ranks never disagree. ``DS_INFCL_LAYOUT_SHM``:
``auto`` (default) for NCCL groups, ``1`` for any backend (gloo too: the CPU tests), ``0`` never.
A rank that does not arrive within ``DS_INFCL_LAYOUT_SHM_TIMEOUT`` seconds (default 1800) stops
the waiting ranks with an error naming it, as the process group's timeout would.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import time
import zlib
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ds_infcl.ring.groups import group_rank, group_size

__all__ = ["HostChannel", "MODE", "TIMEOUT_S", "channel_for"]

# (ds_infcl.ring.layout's alias, which imports this module: recent torch renamed the collective)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SLOTS = 3
_DIR = "/dev/shm"
_SPIN_S = 2e-4  # poll without yielding for this long, then yield the GIL between polls
_CHANNELS: dict = {}  # id(process group) -> (process group, HostChannel or None)


def _setting() -> str:
    value = os.environ.get("DS_INFCL_LAYOUT_SHM", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"DS_INFCL_LAYOUT_SHM must be auto, 0 or 1, got {value!r}")
    return value


def _timeout() -> float:
    raw = os.environ.get("DS_INFCL_LAYOUT_SHM_TIMEOUT", "1800")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"DS_INFCL_LAYOUT_SHM_TIMEOUT must be a number of seconds > 0, got {raw!r}")
    return value


# Read at import: a bad value stops the process before any collective. Ranks may differ (the
# decision comes from gathered values, see ``setup``).
MODE = _setting()
TIMEOUT_S = _timeout()


def _check(row: np.ndarray) -> int:
    """The checksum of ``(seq, fields)`` (all of ``row`` but its last entry)."""
    return zlib.crc32(row[:-1].tobytes())


class HostChannel:
    """One group's rows in a shared file (see the module doc)."""

    def __init__(self, path: str, world: int, rank: int, width: int, create: bool):
        self.world, self.rank, self.width = world, rank, width
        size = SLOTS * world * (width + 2) * 8
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._map, dtype=np.int64).reshape(SLOTS, world, width + 2)
        self.seq = 0

    def exchange(self, fields: Sequence[int], between: Optional[Callable[[], None]] = None) -> List[List[int]]:
        """Every rank's ``fields`` in rank order (a collective of the group: every rank calls it
        once per exchange). ``between`` runs once this rank's row is written."""
        self.seq += 1
        seq, slot = self.seq, self.rows[self.seq % SLOTS]
        mine = np.empty(self.width + 2, dtype=np.int64)
        mine[0], mine[1:-1] = seq, fields
        mine[-1] = _check(mine)
        slot[self.rank, 1:] = mine[1:]
        slot[self.rank, 0] = seq
        if between is not None:
            between()
        table: List[Optional[List[int]]] = [None] * self.world
        table[self.rank] = [int(v) for v in fields]
        pending = [r for r in range(self.world) if r != self.rank]
        start = time.monotonic()
        deadline = None
        while pending:
            waiting = []
            for r in pending:
                row = slot[r].copy()
                if row[0] == seq and row[-1] == _check(row):
                    table[r] = row[1:-1].tolist()
                else:
                    waiting.append(r)
            pending = waiting
            if not pending:
                break
            now = time.monotonic()
            if now - start > _SPIN_S:
                if deadline is None:
                    deadline = start + TIMEOUT_S
                if now > deadline:
                    raise RuntimeError(
                        f"layout exchange over host shared memory: rank(s) {pending} of the group did not "
                        f"reach loss call {seq} within DS_INFCL_LAYOUT_SHM_TIMEOUT={TIMEOUT_S:g} s (a rank "
                        "stopped, or calls the loss fewer times than the others)")
                time.sleep(0 if now - start < 0.01 else 1e-4)
        return table

    def close(self) -> None:
        self.rows = None
        self._map.close()


def _host_hash() -> int:
    return zlib.crc32(socket.gethostname().encode())


def _wanted(group, dev: torch.device) -> bool:
    return MODE == "1" or (MODE == "auto" and dev.type == "cuda" and dist.get_backend(group) == "nccl")


def setup(group, dev: torch.device, width: int) -> Optional[HostChannel]:
    """The group's channel, or ``None`` (the process group's exchange): a collective of every rank
    (see the module doc). ``dev``: the group's device for small collectives."""
    world, rank = group_size(group), group_rank(group)
    want = _wanted(group, dev) and os.path.isdir(_DIR)
    token = (secrets.randbits(62) | 1) if rank == 0 and want else 0
    path = os.path.join(_DIR, f"ds_infcl_layout_{token:x}")
    channel = None
    if token:
        try:
            channel = HostChannel(path, world, rank, width, create=True)
        except OSError:
            want, token = False, 0
    try:
        info = torch.tensor([int(want), _host_hash(), token], dtype=torch.int64, device=dev)
        every = torch.empty((world * 3,), dtype=torch.int64, device=dev)
        _all_gather(every, info, group=group)
        every = every.view(world, 3).tolist()
        use = all(w for w, _, _ in every) and len({h for _, h, _ in every}) == 1 and every[0][2] != 0
        if use and rank != 0:
            try:
                channel = HostChannel(os.path.join(_DIR, f"ds_infcl_layout_{every[0][2]:x}"), world, rank,
                                      width, create=False)
            except OSError:
                channel = None
        ok = torch.tensor([int(use and channel is not None)], dtype=torch.int64, device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        use = bool(ok.item())
    finally:
        if token:  # every rank has mapped it (or given up): the name is no longer needed
            os.unlink(path)
    if not use and channel is not None:
        channel.close()
        channel = None
    return channel


def channel_for(group, dev: torch.device, width: int) -> Optional[HostChannel]:
    """The group's channel (set up by every rank together at its first exchange), or ``None``."""
    pg = group if group is not None else dist.group.WORLD
    got = _CHANNELS.get(id(pg))
    if got is not None and got[0] is pg:
        return got[1]
    channel = setup(group, dev, width)
    _CHANNELS[id(pg)] = (pg, channel)  # (the group is kept: its id is not reused meanwhile)
    return channel
