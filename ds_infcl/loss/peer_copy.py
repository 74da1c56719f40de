"""The gather path's keys between the GPUs of one host, by the copy engines (issue 17).

Why: an NCCL collective runs on SMs. Beside the gather path's persistent kernels, which hold all
or nearly all SM slots, it waits for them or delays them (docs/distributed.md, the eighth to the
eleventh sessions), so the keys' all-gather ran after the own block's forward: 93 us of a 4.7 ms
call at 16k rows per GPU on 2 x H100. A copy out of a peer's memory mapped into this process
(``torch.distributed._symmetric_memory``) is a peer-to-peer transfer of a copy engine: on the same
machine a 16 MB pull took 52 us alone and hid completely under the own block's 640 us forward.

Per call, on every rank; this module's stream ``P``, the caller's ``S``. The keys are ready on
``S`` where the own block was about to be queued (``mark``, recorded before it, so that nothing
here waits for the own block's kernels; else ``S`` as it is when the keys are staged).

**Staged** (every call once the transport is set up: ``ds_infcl.loss.ring._exchange``):

1. Before the layout exchange, each rank takes the next epoch (one per call, the same on every
   rank) and posts it in the layout with whether its keys fit the buffers
   (``RingLayout.staged``: ``2 epoch + fits``). While the exchange is in flight (its
   ``between``), ``P`` waits for the mark, copies the keys into this rank's buffer (where they
   fit) and writes the epoch into this rank's slot of every peer's signal array by
   ``cuStreamWriteValue32``, a memory operation of the GPU's front end (no SM), fenced after the
   copy. The signal is written on every call, fitting or not: a peer may be waiting for it.
2. Where the own block ran early (the gather path expected), ``P`` also pulls *ahead*: it waits
   for each peer's slot to reach the epoch (``cuStreamWaitValue32``, no SM either) and copies
   each peer's first ``m`` rows, as if every rank had this rank's ``m``, and its own rows.
3. After the exchange (``PeerKeys.settle``): the layout says whether every rank posted the same
   epoch and fitted. If the epochs differ (a call that raised on some ranks only), each rank
   sets its own slots to the call's epoch from ``S``, so that no wait on ``P`` is left hanging,
   and all take the largest epoch. ``S`` then waits for ``P``, on every call and every path.
4. The gather path uses the keys pulled ahead where every rank fitted and every size equals
   this rank's; else, where every rank fitted, ``P`` pulls now with the real sizes; else the
   barrier protocol runs.

**Barrier** (the first call, a buffer to grow, a rank whose keys did not fit): ``P`` copies the
keys into the buffer (grown first, collectively, from the layout's sizes), all-reduces one
integer (NCCL: it ends on no rank before every rank's copy is done) and pulls.

A buffer is rewritten only once every peer has read it: a call's pulls precede, on that peer's
``S`` (step 3), the call's later collectives (the statistics' all-gather, the share's
all-reduce, the ring's exchanges), which this rank's ``S`` has passed before its next mark.

Whether a call takes this module's path is the same on every rank: with ``DS_INFCL_PEER_COPY=1``
the transport is set up for a group once, by every rank together (same host, a symmetric-memory
rendezvous and the driver's stream memory operations, tried on every rank), and the gather path
uses it when the layout's largest key block has at least ``PEER_COPY_MIN_ROWS`` rows; which
protocol, and the buffers' size, come from the layout as well. Elsewhere (other hosts, CPU, gloo,
the default ``DS_INFCL_PEER_COPY=0``) the keys are all-gathered by the process group.

Measured (2 x H100, 16k rows per GPU, c = 512, bf16; docs/distributed.md, "The keys by the copy
engines, twelfth session"): the results are bitwise the all-gather's, but every protocol has been
slower than the all-gather at 16k: the barrier 5.02 against 4.74 ms, the staged one with pulls
ahead 5.06 against 4.77 (at 32k: 18.03 against 17.94). Not the GPU: with the pulls ahead, nothing
of the keys' transfer is left between the own block and the rest. The host: each CUDA call
issued while the own block runs costs 10-30 us of host time (a stream switch 10-20), so the
transport's dozen calls took ~200 us of host time in the layout exchange's shadow and lengthened
it, and the 16k call is bound by its host. Hence off by default.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ds_infcl import settings
from ds_infcl.ring.groups import PerGroup, group_rank, group_size, process_group
from ds_infcl.ring.host_exchange import host_hash
from ds_infcl.ring.layout import RingLayout, all_gather_single

__all__ = ["PEER_COPY", "PEER_COPY_MIN_ROWS", "PeerKeys", "Ticket", "peer_keys", "mark", "transport_of"]

# 1: the copy engines where every rank of the group is on one host and symmetric memory works;
# 0 (default): the process group's all-gather, faster at 16k rows per GPU on 2 x H100 (see the
# module doc). Ranks must agree (ds_infcl.loss.algorithm.algorithm_settings).
PEER_COPY = settings.get("DS_INFCL_PEER_COPY")
# The smallest largest-key-block (rows) that takes the copy engines: below it the call is bound by
# the host, which the extra stream work would slow.
PEER_COPY_MIN_ROWS = settings.get("DS_INFCL_PEER_COPY_MIN_ROWS")

_TRANSPORTS = PerGroup()  # process group -> PeerKeys, or None where it could not be set up
_EPOCHS = 0xFFFFFFFF  # epochs run 1 .. 2**32 - 1 (the driver compares them cyclically, 0: not staged)


def _wanted(layout: RingLayout, device: torch.device) -> bool:
    return (PEER_COPY == "1" and device.type == "cuda" and layout.world > 1
            and max(layout.key_sizes) >= PEER_COPY_MIN_ROWS)


class _StreamMemOps:
    """The CUDA driver's stream memory operations on 32-bit words: a write (after a fence over the
    stream's earlier work) and a wait until ``(int32)(word - value) >= 0``. The GPU's front end
    carries them out; they take no SM."""

    _GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ (CU_STREAM_WRITE_VALUE_DEFAULT is 0 too: with the fence)

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._write, self._wait = lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2
        for fn in (self._write, self._wait):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"ds_infcl peer_copy: {what} failed with CUresult {code}")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        self._check(self._write(stream.cuda_stream, address, value, 0), "cuStreamWriteValue32")

    def wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        self._check(self._wait(stream.cuda_stream, address, value, self._GEQ), "cuStreamWaitValue32")


class Ticket(NamedTuple):
    """One call's staged keys (``PeerKeys.begin``): its epoch, whether this rank's keys went into
    its buffer, and the gathered keys pulled ahead of the layout for equal sizes (``None``: not
    pulled)."""

    epoch: int
    fits: bool
    keys: Optional[torch.Tensor]


class PeerKeys:
    """One group's symmetric buffers, signal arrays and stream (see the module doc); made by
    ``peer_keys``. ``counts``: how many calls took each protocol on this rank."""

    def __init__(self, group, device: torch.device, symm):
        self.group, self.device, self.symm = group, device, symm
        self.world, self.rank = group_size(group), group_rank(group)
        self.stream = torch.cuda.Stream(device=device)
        self.flag = torch.ones((1,), device=device, dtype=torch.int32)
        self.buf = self.handle = None
        self.peers: list = []
        self.capacity, self.dtype = 0, None
        self.ops = _StreamMemOps()
        # Slot r of this rank's signal array: the last epoch rank r signalled; peer_signals[r]:
        # the address of this rank's slot in rank r's array.
        self.signals = symm.empty(self.world, dtype=torch.int32, device=device)
        self.signals.zero_()
        self.signal_handle = symm.rendezvous(self.signals, process_group(group))
        self.peer_signals = [self.signal_handle.get_buffer(r, (self.world,), torch.int32).data_ptr() + 4 * self.rank
                             for r in range(self.world)]
        self.epoch = 0  # the same on every rank: one per ring_infonce call while the transport is on
        self.counts = {"ahead": 0, "staged": 0, "barrier": 0}
        # The driver's operations on this device, tried on this rank's own slot (an error here
        # makes the group fall back to the all-gather, on every rank alike: peer_keys).
        stream = torch.cuda.current_stream(device)
        self.ops.write(stream, self.peer_signals[self.rank], 1)
        self.ops.wait(stream, self._slot(self.rank), 1)
        torch.cuda.synchronize(device)

    def _slot(self, r: int) -> int:
        return self.signals.data_ptr() + 4 * r

    def _fit(self, numel: int, dtype: torch.dtype) -> None:
        """Buffers of at least ``numel`` elements of ``dtype`` (a rendezvous of every rank: the
        caller's decision comes from the layout, the same on every rank)."""
        if numel <= self.capacity and dtype == self.dtype:
            return
        if self.buf is not None:  # every rank's copies from and into the old buffers are done
            torch.cuda.synchronize(self.device)
            _agree(True, self.group, self.device)
        self.buf = self.symm.empty(numel, dtype=dtype, device=self.device)
        self.handle = self.symm.rendezvous(self.buf, process_group(self.group))
        self.peers = [self.handle.get_buffer(r, (numel,), dtype) if r != self.rank else None
                      for r in range(self.world)]
        self.capacity, self.dtype = numel, dtype

    def _fits(self, key: torch.Tensor) -> bool:
        return key.numel() <= self.capacity and key.dtype == self.dtype

    def _after_keys(self, marked: Optional[torch.cuda.Event]) -> None:
        """``P`` waits until the keys are ready: the mark, else the current stream as it is now."""
        if marked is not None:
            self.stream.wait_event(marked)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def tag(self, key: torch.Tensor) -> int:
        """The next epoch and whether ``key`` fits the buffers, as the layout's ``staged`` value
        (``2 epoch + fits``; never 0)."""
        self.epoch = self.epoch % _EPOCHS + 1
        return 2 * self.epoch + int(self._fits(key))

    def begin(self, key: torch.Tensor, marked: Optional[torch.cuda.Event], ahead: bool) -> Ticket:
        """Steps 1-2 of the module doc, queued on ``P`` while the layout exchange is in flight:
        this rank's keys into its buffer (where they fit), its epoch to every peer, and with
        ``ahead`` every peer's first ``m`` rows pulled into the gathered keys as if every rank had
        this rank's ``m`` (checked against the layout by ``all_gather``)."""
        p, epoch = self.stream, self.epoch
        self._after_keys(marked)
        fits = self._fits(key)
        m, c = key.shape
        keys = None
        with torch.cuda.stream(p):
            if fits:
                self.buf[: m * c].view(m, c).copy_(key)
            for r in range(self.world):  # (every call: a peer may be waiting for it)
                if r != self.rank:
                    self.ops.write(p, self.peer_signals[r], epoch)
            if fits and ahead and m:
                keys = key.new_empty((self.world * m, c))  # (on p: see all_gather)
                self._pull(keys, key, epoch, [m] * self.world)
        return Ticket(epoch, fits, keys)

    def _pull(self, out: torch.Tensor, key: torch.Tensor, epoch: int, sizes) -> None:
        """On ``P``: wait for every peer's ``epoch`` (``None``: no wait), then its ``sizes[r]`` rows
        into ``out`` (rank order), this rank's from ``key``."""
        c, start = key.shape[1], 0
        for r, rows in enumerate(sizes):
            if r == self.rank:
                out[start: start + rows].copy_(key)
            elif rows:
                if epoch is not None:  # (None: the barrier protocol's all-reduce ordered it)
                    self.ops.wait(self.stream, self._slot(r), epoch)
                out[start: start + rows].copy_(self.peers[r][: rows * c].view(rows, c))
            start += rows

    def settle(self, ticket: Ticket, layout: Optional[RingLayout]) -> bool:
        """After the layout exchange (``None``: it raised): whether every rank staged this call's
        keys in step. Where not, this rank's own signal slots are set to the call's epoch from the
        current stream, so that nothing on ``P`` waits for a signal that will not come, and the
        epoch is brought to the largest of the group (ranks out of step: a call that raised on
        some ranks before its exchange). The current stream then waits for ``P``: a peer's buffer
        is read before this rank's next collective."""
        main = torch.cuda.current_stream(self.device)
        tags = () if layout is None else layout.staged
        in_step = len(tags) == self.world and all(t and t // 2 == ticket.epoch for t in tags)
        if not in_step:
            for r in range(self.world):
                if r != self.rank:
                    self.ops.write(main, self._slot(r), ticket.epoch)
            if tags:
                self.epoch = max(t // 2 for t in tags)
        main.wait_stream(self.stream)
        return in_step and all(t % 2 for t in tags)

    def all_gather(self, key: torch.Tensor, layout: RingLayout, marked: Optional[torch.cuda.Event],
                   ticket: Optional[Ticket] = None, staged: bool = False) -> torch.Tensor:
        """Every rank's keys in rank order ``[M, c]`` (the module doc's protocols; ``staged``:
        ``settle``'s answer for ``ticket``)."""
        c, m = key.shape[1], key.shape[0]
        main = torch.cuda.current_stream(self.device)
        p = self.stream
        if staged and ticket.keys is not None and all(k == m for k in layout.key_sizes):
            out, how = ticket.keys, "ahead"
        else:
            self._after_keys(marked)
            if not staged:
                self._fit(max(layout.key_sizes) * c, key.dtype)
            with torch.cuda.stream(p):
                # Allocated on p: a block freed on main after the mark may still be read by main's
                # queued kernels; p's own blocks are not.
                out = key.new_empty((layout.num_keys, c))
                if staged:
                    self._pull(out, key, ticket.epoch, layout.key_sizes)
                    how = "staged"
                else:
                    self.buf[: m * c].view(m, c).copy_(key)
                    dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
                    self._pull(out, key, None, layout.key_sizes)
                    how = "barrier"
        main.wait_stream(p)
        out.record_stream(main)  # (used on main from here; freed once main's uses are done)
        self.counts[how] += 1
        return out


def _same_host(group, device: torch.device) -> bool:
    """Whether every rank of ``group`` runs on this host (an all-gather of a hash of its name)."""
    mine = torch.tensor([host_hash()], dtype=torch.int64, device=device)
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
    if group in _TRANSPORTS:
        return _TRANSPORTS.get(group)
    transport, why = None, "the ranks of the group are not all on one host"
    if _same_host(group, device):
        try:
            import torch.distributed._symmetric_memory as symm

            transport = PeerKeys(group, device, symm)  # the signals' rendezvous and the driver's ops
            transport._fit(1, torch.float32)  # the rendezvous: every rank, or an error on every rank
        except Exception as err:  # noqa: BLE001 - no symmetric memory here: the process group's all-gather
            transport = None
            why = f"symmetric memory failed on this rank ({type(err).__name__}: {str(err).strip()[:300]})"
        if not _agree(transport is not None, group, device):
            if transport is not None:
                why = "another rank of the group could not set up symmetric memory (its warning says why)"
            transport = None
    if transport is None:
        settings.warn_once("peer_copy", (
            f"ds_infcl: DS_INFCL_PEER_COPY=1, but the copy-engine transport of the gather path's keys cannot "
            f"be used: {why}; the process group's all-gather carries the keys instead (set DS_INFCL_PEER_COPY=0 "
            "to silence)"))
    _TRANSPORTS.set(group, transport)
    return transport


def transport_of(group, device: torch.device) -> Optional[PeerKeys]:
    """The group's transport where one is set up and the setting is on (a lookup, no collective),
    else ``None``. The same on every rank of the group."""
    if PEER_COPY != "1" or device.type != "cuda" or not _TRANSPORTS:
        return None
    return _TRANSPORTS.get(group)


def mark(group, device: torch.device) -> Optional[torch.cuda.Event]:
    """An event on the current stream where a group with a transport will gather its keys from (see
    the module doc): recorded before the own block's kernels are queued, so that the copies do not
    wait for them. ``None`` without a transport (none is set up before the first call that wants
    one)."""
    if transport_of(group, device) is None:
        return None
    return torch.cuda.current_stream(device).record_event()
