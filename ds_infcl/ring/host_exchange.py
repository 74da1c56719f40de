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

Set up by a group's first two exchanges over the process group, which carry two more values per
rank (``GroupState``): whether it wants the channel and its host's hash (rank 0 sends the file's
token), then whether it could map the file. The channel is used only where every rank wants it,
is on one host and mapped the file; else the process group for good. The decision comes from
gathered values, so ranks never disagree, and no collective is added. ``DS_INFCL_LAYOUT_SHM``:
``auto`` (default) for NCCL groups, ``1`` for any backend (gloo too: the CPU tests), ``0`` never.
A rank that does not arrive within the process group's own timeout (its backend's options, the
``timeout`` of ``init_process_group`` / ``new_group``) or ``DS_INFCL_LAYOUT_SHM_TIMEOUT`` seconds
(default 1800), whichever is shorter, stops the waiting ranks with an error naming it, as the
process group's collective would; a rank that has waited a second polls every millisecond.

A destroyed group's channel is unmapped (and its file name removed, if it is still there) at the
next exchange of any group after ``torch.distributed.destroy_process_group`` (which offers no hook:
the states of groups no longer registered with torch.distributed are released then), or by
:func:`release_destroyed_groups`.
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

from ds_infcl import settings
from ds_infcl.exits import at_exit
from ds_infcl.ring.groups import PerGroup, group_rank, group_size

__all__ = ["GroupState", "HostChannel", "MODE", "TIMEOUT_S", "group_timeout_s", "host_hash", "release_destroyed_groups",
           "release_names", "state_for"]

SLOTS = 3
_DIR = "/dev/shm"
_SPIN_S = 2e-4  # poll without yielding for this long, then yield the GIL between polls
_STATES = PerGroup()  # process group -> GroupState
_NAMES: set = set()  # files this process created whose names are not removed yet


# Read at import: a bad value stops the process before any collective. Ranks may differ (the
# decision comes from gathered values, see ``GroupState``).
MODE = settings.get("DS_INFCL_LAYOUT_SHM")
TIMEOUT_S = settings.get("DS_INFCL_LAYOUT_SHM_TIMEOUT")


def _check(row: np.ndarray) -> int:
    """The checksum of ``(seq, fields)`` (all of ``row`` but its last entry)."""
    return zlib.crc32(row[:-1].tobytes())


class HostChannel:
    """One group's rows in a shared file (see the module doc)."""

    def __init__(self, path: str, world: int, rank: int, width: int, create: bool,
                 group_timeout: Optional[float] = None):
        self.world, self.rank, self.width = world, rank, width
        self.group_timeout = group_timeout  # the process group's own timeout (s), None if unknown
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
        limit = TIMEOUT_S if self.group_timeout is None else min(TIMEOUT_S, self.group_timeout)
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
            waited = time.monotonic() - start
            if waited > limit:
                which = (f"DS_INFCL_LAYOUT_SHM_TIMEOUT={TIMEOUT_S:g} s" if limit == TIMEOUT_S else
                         f"the process group's timeout of {limit:g} s (DS_INFCL_LAYOUT_SHM_TIMEOUT={TIMEOUT_S:g} s)")
                raise RuntimeError(
                    f"layout exchange over host shared memory: rank(s) {pending} of the group did not "
                    f"reach this loss call (the channel's exchange {seq}) within {which} (a rank stopped, "
                    "or calls the loss fewer times than the others)")
            if waited > _SPIN_S:
                time.sleep(0 if waited < 0.01 else 1e-4 if waited < 1.0 else 1e-3)
        return table

    def close(self) -> None:
        self.rows = None
        self._map.close()


def group_timeout_s(group, dev: torch.device) -> Optional[float]:
    """The process group's own collective timeout in seconds (its backend's options: the
    ``timeout`` given to ``init_process_group`` / ``new_group``, or torch's default), ``None``
    where the backend does not tell it."""
    try:
        backend = dist.distributed_c10d._get_default_group() if group is None else group
        timeout = backend._get_backend(dev).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # a backend without options (e.g. a fake one)
        return None
    return timeout.total_seconds() if timeout is not None else None


def host_hash() -> int:
    """A hash of this host's name (ranks that share it run on one host)."""
    return zlib.crc32(socket.gethostname().encode())


def _path(token: int) -> str:
    return os.path.join(_DIR, f"ds_infcl_layout_{token:x}")


def _unlink(path: str) -> None:
    _NAMES.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def release_names() -> None:
    """Remove the names of the files this process created and still names (a group that made one
    exchange only). Runs when the process ends (``ds_infcl.exits.at_exit``)."""
    for path in list(_NAMES):
        _unlink(path)


at_exit(release_names)


class GroupState:
    """Where a group's layout rows go, decided by its first two exchanges over the process group
    (no collective of its own): each carries two more values per rank, ``setup_fields``, and
    every rank reads the same gathered values (``update``), so every rank decides alike.

    1. Whether the rank wants the channel (``MODE``) and its host's hash; rank 0, wanting it,
       has created the file and sends its name's token instead of 1.
    2. Whether the rank could map rank 0's file. Rank 0 then removes the name (every rank has
       mapped it or given up).

    From the third exchange on, ``channel`` is the group's channel, or ``None`` for good."""

    def __init__(self, group, rank: int, world: int, width: int):
        self.group, self.rank, self.world, self.width = group, rank, world, width
        self.step, self.channel, self.token = 0, None, 0
        self.group_timeout: Optional[float] = None

    @property
    def ready(self) -> bool:
        return self.step == 2 and self.channel is not None

    def setup_fields(self, dev: torch.device) -> List[int]:
        """``[host hash, word]`` for this exchange's row (``[0, 0]`` once decided)."""
        if self.step == 0:
            want = _wanted(self.group, dev) and os.path.isdir(_DIR)
            self.group_timeout = group_timeout_s(self.group, dev) if want else None
            if want and self.rank == 0:
                self.token = secrets.randbits(62) | 2
                try:
                    self.channel = HostChannel(_path(self.token), self.world, 0, self.width, create=True,
                                               group_timeout=self.group_timeout)
                    _NAMES.add(_path(self.token))  # removed at exit if no second exchange comes
                except OSError:
                    want, self.token = False, 0
            return [host_hash(), (self.token or 1) if want else 0]
        if self.step == 1:
            return [host_hash(), int(self.channel is not None)]
        return [0, 0]

    def update(self, words: Sequence[int], hosts: Sequence[int]) -> None:
        """After an exchange over the process group: every rank's ``word`` and host hash."""
        if self.step == 0:
            use = all(words) and len(set(hosts)) == 1 and words[0] > 1
            if use and self.rank != 0:
                try:
                    self.channel = HostChannel(_path(words[0]), self.world, self.rank, self.width, create=False,
                                               group_timeout=self.group_timeout)
                except OSError:
                    self.channel = None
            self.step = 1 if use else 2
            if not use:
                self._drop()
        elif self.step == 1:
            use = all(w == 1 for w in words)
            self.step = 2
            if not use:
                self._drop()
        if self.step == 2 and self.token:  # every rank has mapped it or given up: the name goes
            _unlink(_path(self.token))
            self.token = 0

    def _drop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None

    def release(self) -> None:
        """Unmap the channel and remove the file's name if this rank still holds it (the group is
        gone); the state is decided for good (no channel)."""
        self._drop()
        if self.token:
            _unlink(_path(self.token))
            self.token = 0
        self.step = 2


def _wanted(group, dev: torch.device) -> bool:
    return MODE == "1" or (MODE == "auto" and dev.type == "cuda" and dist.get_backend(group) == "nccl")


_REGISTRY_STAMP: list = [None]  # (number of live groups, groups made, default group) at the last sweep


def _live_groups():
    """torch.distributed's table of registered process groups (destroyed ones leave it)."""
    return dist.distributed_c10d._world.pg_map


def release_destroyed_groups() -> int:
    """Release the states of groups that ``destroy_process_group`` has destroyed: unmap their
    channels, remove a file name still held. Returns how many. Runs at every exchange where the
    set of registered groups changed since the last sweep (a cheap check); callable directly."""
    live = _live_groups()
    released = 0
    for pg, state in _STATES.items():
        if pg not in live:
            state.release()
            _STATES.discard(pg)
            released += 1
    return released


def state_for(group, width: int) -> GroupState:
    """The group's state (made at its first exchange; a lookup, no collective). Releases the
    states of destroyed groups first when the set of registered groups has changed."""
    world_state = dist.distributed_c10d._world
    # (a default group made again after destroy_process_group() is another object: the old one,
    # kept by _STATES, cannot lend it its id)
    stamp = (len(world_state.pg_map), world_state.group_count, id(dist.group.WORLD))
    if stamp != _REGISTRY_STAMP[0]:
        if _STATES:
            release_destroyed_groups()
        _REGISTRY_STAMP[0] = stamp
    state = _STATES.get(group)
    if state is None:
        state = GroupState(group, group_rank(group), group_size(group), width)
        _STATES.set(group, state)
    return state
