"""The gather path's keys between the GPUs of one host, by the copy engines (issue 17).

Why: an NCCL collective runs on SMs. Beside the gather path's persistent kernels, which hold all
or nearly all SM slots, it waits for them or delays them (docs/distributed.md, the eighth to the
eleventh sessions), so the keys' all-gather ran after the own block's forward: 93 us of a 4.7 ms
call at 16k rows per GPU on 2 x H100. A copy out of a peer's memory mapped into this process
(``torch.distributed._symmetric_memory``) is a peer-to-peer transfer of a copy engine: on the same
machine a 16 MB pull took 52 us alone and hid completely under the own block's 640 us forward.

Protocol, per call, every rank, on this module's stream ``P`` (the caller's stream is ``S``):

1. ``P`` waits for ``S`` as it was before the own block was queued (``mark``; else as it is when
   the keys are gathered): the keys are ready, and every collective of the previous calls is
   behind it. So every peer has finished reading this rank's buffer: a peer's pull precedes, on
   its ``S``, a collective of that call (the statistics' all-gather or the share's all-reduce)
   which this rank's ``S`` has passed too.
2. This rank's keys go into its buffer, then an all-reduce of one integer on ``P`` (NCCL: it ends
   on no rank before every rank's copy is done).
3. Each peer's keys are pulled from its buffer into the gathered keys, this rank's own rows copied.
4. ``S`` waits for ``P``.

Whether a call takes this path is the same on every rank: with ``DS_INFCL_PEER_COPY=1`` the
transport is set up for a group once, by every rank together (same host, and a symmetric-memory
rendezvous that every rank completed), and a call uses it when the layout's largest key block has
at least ``PEER_COPY_MIN_ROWS`` rows; the buffers are sized from the layout as well. Elsewhere
(other hosts, CPU, gloo, the default ``DS_INFCL_PEER_COPY=0``) the keys are all-gathered by the
process group.

Measured (2 x H100, docs/distributed.md): the pull itself hides under the own block, but step 2's
all-reduce is an NCCL kernel beside the own block's persistent kernel, which is what the copy
engines were to avoid: 16k rows per GPU took 5.02 ms against 4.74 with the all-gather, 32k 17.90
against 17.99. Hence off by default. The way on: let the layout exchange's all-gather be step 2's
barrier (the copy staged before it, on the metadata stream, and a per-rank "staged" field in the
layout so that every rank knows every copy is in place).
"""

from __future__ import annotations

import socket
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ds_infcl.ops.validation import choice_setting, int_setting
from ds_infcl.ring.groups import group_rank, group_size
from ds_infcl.ring.layout import RingLayout, all_gather_single

__all__ = ["PEER_COPY", "PEER_COPY_MIN_ROWS", "PeerKeys", "peer_keys", "mark", "settings_text"]

# 1: the copy engines where every rank of the group is on one host and symmetric memory works;
# 0 (default): the process group's all-gather. Off by default: measured on 2 x H100 (2026-11-26,
# docs/distributed.md) it is bitwise the all-gather's result, 0.09 ms faster at 32k rows per GPU
# but 0.28 ms slower at 16k, where step 2's NCCL all-reduce runs beside the own block's persistent
# kernel. Ranks must agree (ds_infcl.loss.ring.algorithm_settings).
PEER_COPY = choice_setting("DS_INFCL_PEER_COPY", "0", ("0", "1"))
# The smallest largest-key-block (rows) that takes the copy engines: below it the call is bound by
# the host, which the extra stream work would slow.
PEER_COPY_MIN_ROWS = int_setting("DS_INFCL_PEER_COPY_MIN_ROWS", 16384, minimum=0)

_TRANSPORTS: dict = {}  # id(process group) -> (process group, PeerKeys or None)


def settings_text() -> str:
    """This module's settings, for the fingerprint that ranks exchange with their layout."""
    return f"{PEER_COPY}|{PEER_COPY_MIN_ROWS}"


def _process_group(group):
    """The group's process-group object (``None``: the current default group, so that a default
    group destroyed and made again does not find the old one's transport)."""
    return group if group is not None else dist.group.WORLD


def _wanted(layout: RingLayout, device: torch.device) -> bool:
    return (PEER_COPY == "1" and device.type == "cuda" and layout.world > 1
            and max(layout.key_sizes) >= PEER_COPY_MIN_ROWS)


class PeerKeys:
    """One group's symmetric buffers and stream (see the module doc); made by ``peer_keys``."""

    def __init__(self, group, device: torch.device, symm):
        self.group, self.device, self.symm = group, device, symm
        self.world, self.rank = group_size(group), group_rank(group)
        self.stream = torch.cuda.Stream(device=device)
        self.flag = torch.ones((1,), device=device, dtype=torch.int32)
        self.buf = self.handle = None
        self.peers: list = []
        self.capacity, self.dtype = 0, None

    def _fit(self, numel: int, dtype: torch.dtype) -> None:
        """Buffers of at least ``numel`` elements of ``dtype`` (a rendezvous of every rank: the
        caller's decision comes from the layout, the same on every rank)."""
        if numel <= self.capacity and dtype == self.dtype:
            return
        if self.buf is not None:  # every rank's copies from and into the old buffers are done
            torch.cuda.synchronize(self.device)
            _agree(True, self.group, self.device)
        self.buf = self.symm.empty(numel, dtype=dtype, device=self.device)
        self.handle = self.symm.rendezvous(self.buf, _process_group(self.group))
        self.peers = [self.handle.get_buffer(r, (numel,), dtype) if r != self.rank else None
                      for r in range(self.world)]
        self.capacity, self.dtype = numel, dtype

    def all_gather(self, key: torch.Tensor, layout: RingLayout, marked: Optional[torch.cuda.Event]) -> torch.Tensor:
        """Every rank's keys in rank order ``[M, c]`` (steps 1-4 of the module doc)."""
        c = key.shape[1]
        self._fit(max(layout.key_sizes) * c, key.dtype)
        main = torch.cuda.current_stream(self.device)
        p = self.stream
        if marked is not None:
            p.wait_event(marked)
        else:
            p.wait_stream(main)
        m, offset = key.shape[0], layout.key_offset()
        with torch.cuda.stream(p):
            # Allocated on p: a block freed on main after the mark may still be read by main's
            # queued kernels; p's own blocks are not.
            out = key.new_empty((layout.num_keys, c))
            self.buf[: m * c].view(m, c).copy_(key)
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
            out[offset: offset + m].copy_(key)
            for r, rows in enumerate(layout.key_sizes):
                if r != self.rank and rows:
                    start = layout.key_offset(r)
                    out[start: start + rows].copy_(self.peers[r][: rows * c].view(rows, c))
        main.wait_stream(p)
        out.record_stream(main)  # (used on main from here; freed once main's uses are done)
        return out


def _same_host(group, device: torch.device) -> bool:
    """Whether every rank of ``group`` runs on this host (an all-gather of a hash of its name)."""
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64, device=device)
    every = mine.new_empty((group_size(group),))
    all_gather_single(every, mine, group=group)
    return bool((every == mine).all().item())


def _agree(ok: bool, group, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def peer_keys(group, layout: RingLayout, device: torch.device) -> Optional[PeerKeys]:
    """The copy-engine transport for this call, or ``None`` (the process group's all-gather). A
    collective of every rank the first time a group's call wants it (``_wanted``, from the layout:
    the same call on every rank); then a lookup."""
    if not _wanted(layout, device):
        return None
    pg = _process_group(group)
    got = _TRANSPORTS.get(id(pg))
    if got is not None and got[0] is pg:
        return got[1]
    transport = None
    if _same_host(group, device):
        try:
            import torch.distributed._symmetric_memory as symm

            transport = PeerKeys(group, device, symm)
            transport._fit(1, torch.float32)  # the rendezvous: every rank, or an error on every rank
        except Exception:  # noqa: BLE001 - no symmetric memory here: the process group's all-gather
            transport = None
        if not _agree(transport is not None, group, device):
            transport = None
    _TRANSPORTS[id(pg)] = (pg, transport)  # (the group is kept: its id is not reused meanwhile)
    return transport


def mark(group, device: torch.device) -> Optional[torch.cuda.Event]:
    """An event on the current stream where a group with a transport will gather its keys from (see
    step 1): recorded before the own block's kernels are queued, so that the copies do not wait
    for them. ``None`` without a transport (none is set up before the first call that wants one)."""
    if device.type != "cuda" or not _TRANSPORTS:
        return None
    pg = _process_group(group)
    got = _TRANSPORTS.get(id(pg))
    if got is None or got[0] is not pg or got[1] is None:
        return None
    return torch.cuda.current_stream(device).record_event()
