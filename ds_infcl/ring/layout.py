"""Size and metadata exchange: who holds how many rows, checked once per call on every rank.

Every loss path that communicates starts with :func:`exchange_layout`: one ``all_gather`` of a
small int64 vector per rank (sizes, feature dim, dtype, device type, protocol and flags). Because
the vector has a fixed length, the collective itself can never hang on a mismatch; every rank then
runs the same check on the same gathered table and raises the same ``ValueError``.

Why every call and not once per shape: with unequal per-rank sizes, a rank whose own shape did not
change cannot know that another rank's did, so a cache keyed on the local shape would send it into
a P2P exchange while its neighbour waits in the size exchange (a hang). The exchange is 12 integers
per rank, one latency per step; the checks themselves are host-side comparisons. Where every rank
of the group runs on one host (NCCL groups by default), the rows go through the host's shared
memory instead, with no collective and no CUDA call (``ds_infcl.ring.host_exchange``: at 16k rows
per GPU on 2 x H100 the call is bound by its host, and the all-gather's three CUDA calls took
~240 us of it). Otherwise, on CUDA, the all-gather runs on a side stream, so its readback waits
for that one collective, not for the GPU work queued before the loss (:func:`_metadata_stream`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ds_infcl.ring.groups import global_rank, group_rank, group_size, resolve_group
from ds_infcl.ring.host_exchange import state_for
from ds_infcl.settings import must_match

__all__ = [
    "RingLayout", "exchange_layout", "comm_device", "all_gather_single", "PROTOCOLS",
    "agree_on_input_errors", "agree_on_value_checks", "layout_flags",
]

# Recent torch renamed the flat collectives (the old names warn); older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Protocol codes: ranks that disagree on which loss path they run would otherwise pair unrelated
# collectives and hang or corrupt data.
PROTOCOLS = {"ring_lse": 1, "vanilla": 2, "local": 3, "disco": 4, "siglip": 5}
_INPUT_ERROR = -1  # protocol code of a rank whose local input checks failed
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPE_CODES.items()}
_DEVICE_CODES = {"cpu": 0, "cuda": 1, "xpu": 2, "hpu": 3, "mps": 4}
_DEVICE_NAMES = {v: k for k, v in _DEVICE_CODES.items()}
_NUM_FIELDS = 12  # b, m, c, dtype, device type, protocol, flags, settings, explicit labels, staged,
# and the host-memory channel's two setup values (ds_infcl.ring.host_exchange.GroupState)


@dataclass(frozen=True)
class RingLayout:
    """Sizes of every rank's block and the ring's neighbours (global ranks for P2P).

    ``query_sizes[i]`` / ``key_sizes[i]`` are the row counts of rank ``i`` of the group; at ring
    step ``t`` rank ``r`` holds the key block of rank ``(r - t) mod world``.
    """

    world: int
    rank: int
    query_sizes: Tuple[int, ...]
    key_sizes: Tuple[int, ...]
    feature_dim: int
    send_to: int  # global rank of group rank (rank + 1) mod world
    recv_from: int  # global rank of group rank (rank - 1) mod world
    diagonal: bool = False  # every rank pairs query i with its key i (no explicit labels anywhere)
    # Every rank's ``staged`` value, rank order: a loss path's own per-rank tag that needs no
    # agreement (the gather path's copy-engine keys: ds_infcl.loss.peer_copy); ``()`` where none.
    staged: Tuple[int, ...] = ()

    @property
    def num_queries(self) -> int:
        """Global query count ``B``."""
        return sum(self.query_sizes)

    @property
    def num_keys(self) -> int:
        """Global key count ``M``."""
        return sum(self.key_sizes)

    def query_offset(self, rank: Optional[int] = None) -> int:
        """Index of rank ``rank``'s first query in the gathered (rank-ordered) query batch."""
        return sum(self.query_sizes[: self.rank if rank is None else rank])

    def key_offset(self, rank: Optional[int] = None) -> int:
        """Index of rank ``rank``'s first key in the gathered (rank-ordered) key batch."""
        return sum(self.key_sizes[: self.rank if rank is None else rank])

    def block_owner(self, step: int) -> int:
        """Group rank whose key block this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world


def comm_device(group, device: torch.device) -> torch.device:
    """Device for small control tensors of ``group``: CPU on gloo, else the features' device."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def _describe_row(i: int, row: Sequence[int]) -> str:
    b, m, c, dt, dev, proto, flags = row[:7]
    proto_name = {v: k for k, v in PROTOCOLS.items()}.get(proto, str(proto))
    return (
        f"rank {i}: query [{b}, {c}], key [{m}, {c}], dtype {_DTYPE_NAMES.get(dt, dt)}, "
        f"device {_DEVICE_NAMES.get(dev, dev)}, loss path {proto_name}, flags {flags}"
    )


def _check_table(table, protocol: str) -> None:
    failed = [i for i, row in enumerate(table) if row[5] == _INPUT_ERROR]
    if failed:
        raise ValueError(
            f"{protocol}: rank(s) {failed} of the process group rejected their local inputs "
            "(their own error says why); the loss stops on every rank"
        )
    fields = ("feature dim", "dtype", "device type", "loss path", "flags",
              f"algorithm settings (the environment variables {', '.join(must_match())}, "
              "which ds_infcl.settings marks \"must match\")")
    for pos, name in zip(range(2, 8), fields):
        if len({row[pos] for row in table}) > 1:
            listing = "; ".join(_describe_row(i, row) for i, row in enumerate(table))
            raise ValueError(
                f"{protocol}: the ranks of the process group disagree on the {name}; every rank "
                f"must call the same loss with the same feature dim and dtype ({listing})"
            )
    if sum(row[0] for row in table) == 0 or sum(row[1] for row in table) == 0:
        listing = "; ".join(_describe_row(i, row) for i, row in enumerate(table))
        raise ValueError(f"{protocol}: the global batch is empty ({listing})")


def _comm_device_without_inputs(group) -> torch.device:
    if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def agree_on_input_errors(group=None):
    """Run local input checks so that a failure on one rank stops every rank instead of a hang.

    A ``ValueError`` raised inside the block on a rank of a group of several ranks is announced
    to the others through the same fixed-size ``all_gather`` that :func:`exchange_layout` (the
    first collective of every loss path) posts, so they raise too; then it propagates. Without an
    error nothing is communicated.
    """
    try:
        yield
    except ValueError:
        group = resolve_group(group)
        if group_size(group) > 1:
            row = torch.zeros(_NUM_FIELDS, dtype=torch.int64)
            row[5] = _INPUT_ERROR
            _exchange_rows(row.tolist(), group, _comm_device_without_inputs(group), None)
        raise


def agree_on_value_checks(checks, layout: RingLayout, group, device: torch.device) -> None:
    """Every rank's verdict on its queued value checks, all-gathered right after the layout exchange,
    before the loss path's own collectives and kernels: how a default distributed call reads its
    input checks after its forward is queued and still raises on every rank together
    (``ds_infcl.ops.validation.checks_read_after_launch(agree=True)``). ``checks`` gives this
    rank's verdict (``flag(device)``: a ``[1]`` int64 tensor made on the device, not read) and
    takes every rank's (``agreed(flags, rank)``). A loss path posts it where every rank's layout
    flags say so (then every rank does: the collectives stay paired)."""
    dev = comm_device(group, device)
    flags = torch.empty(layout.world, dtype=torch.int64, device=dev)
    all_gather_single(flags, checks.flag(dev), group=group)
    checks.agreed(flags, layout.rank)


_SIDE_STREAMS: dict = {}


def _metadata_stream(device: torch.device):
    """On CUDA, a side stream (one per device) for the metadata exchange, so that its all-gather and
    readback wait for each other only, not for the GPU work already queued on the current stream
    (the features' encoders, the previous step's backward): the host reads the sizes after one
    collective's latency instead of draining the GPU queue (issue 17). Nothing else runs on it.
    Elsewhere a no-op."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(idx)
    if stream is None:
        stream = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return torch.cuda.stream(stream)


def _exchange_rows(mine, group, dev: torch.device, between) -> list:
    """Every rank's row of ``exchange_layout``: through the host's shared memory where every rank
    of the group is on one host (``ds_infcl.ring.host_exchange``: no collective, no CUDA call),
    else by one all-gather on the metadata stream, whose rows also carry the channel's setup."""
    state = state_for(group, _NUM_FIELDS)
    if state.ready:
        return state.channel.exchange(mine, between)
    world = group_size(group)
    mine = list(mine[:_NUM_FIELDS - 2]) + state.setup_fields(dev)
    with _metadata_stream(dev):
        gathered = torch.empty((world * _NUM_FIELDS,), dtype=torch.int64, device=dev)
        all_gather_single(gathered, torch.tensor(mine, dtype=torch.int64, device=dev), group=group)
        if between is None:
            table = gathered.view(world, _NUM_FIELDS).tolist()
    if between is not None:
        try:  # (``between`` on the caller's streams, while the exchange is in flight)
            between()
        finally:  # (read back even if it raised: the exchange ends on this rank either way)
            with _metadata_stream(dev):
                table = gathered.view(world, _NUM_FIELDS).tolist()
    if state.step < 2:
        state.update([row[-1] for row in table], [row[-2] for row in table])
    return table


def layout_flags(**options) -> int:
    """The ``flags`` of :func:`exchange_layout` from a loss path's options, in the order given: bit
    ``i`` is the ``i``-th option's truth (``layout_flags(with_ids=..., agree=...)``)."""
    return sum(int(bool(v)) << i for i, v in enumerate(options.values()))


def exchange_layout(
    query: torch.Tensor,
    key: torch.Tensor,
    group=None,
    *,
    protocol: str = "ring_lse",
    flags: int = 0,
    settings: int = 0,
    explicit_labels: bool = True,
    staged: int = 0,
    between: Optional[Callable[[], None]] = None,
) -> RingLayout:
    """Gather every rank's sizes and metadata, check that they agree, return the layout.

    Collective over ``group`` (no communication with one rank). ``flags`` is a small integer of
    options all ranks must share (e.g. ``compute_col``); ``settings`` a fingerprint of process
    settings that steer the algorithm and must agree too (``ds_infcl.loss.algorithm``: the
    ``DS_INFCL_*`` settings marked "must match" in ``ds_infcl.settings``; ranks that chose
    different algorithms would wait on each other's collectives). ``explicit_labels`` may differ between ranks: the layout's ``diagonal``
    says whether no rank passed labels. ``staged`` is passed through unchecked, each rank's in
    the layout's ``staged`` (a loss path's per-rank tag, e.g. that its keys already wait in a
    peer-readable buffer: ``ds_infcl.loss.peer_copy``). ``between`` runs once the exchange is
    posted and before its result is read (host work that the exchange's latency hides). Raises
    ``ValueError`` on every rank, with a per-rank listing, when feature dims, dtypes, device
    types, protocols or flags differ or the global batch is empty.
    """
    group = resolve_group(group)
    world, rank = group_size(group), group_rank(group)
    b, m, c = query.shape[0], key.shape[0], query.shape[1]
    mine = [
        b, m, c, _DTYPE_CODES.get(query.dtype, 99), _DEVICE_CODES.get(query.device.type, 99),
        PROTOCOLS[protocol], int(flags), int(settings), int(bool(explicit_labels)), int(staged), 0, 0,
    ]
    if world == 1:
        if between is not None:
            between()
        table = [mine]
    else:
        table = _exchange_rows(mine, group, comm_device(group, query.device), between)
    _check_table(table, protocol)
    return RingLayout(
        world=world,
        rank=rank,
        query_sizes=tuple(row[0] for row in table),
        key_sizes=tuple(row[1] for row in table),
        feature_dim=c,
        send_to=global_rank(group, (rank + 1) % world) if world > 1 else -1,
        recv_from=global_rank(group, (rank - 1) % world) if world > 1 else -1,
        diagonal=not any(row[8] for row in table),
        staged=tuple(row[9] for row in table),
    )
