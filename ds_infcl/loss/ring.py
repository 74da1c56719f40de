"""Inf-CL across ranks: the ring of key blocks (DESIGN.md section 4).

Each rank keeps its queries ``Q_r [b_r, c]``; key blocks ``K_o [m_o, c]`` travel around the ring
of ``group``. At step ``t`` rank ``r`` holds the block of rank ``o = (r - t) mod W``; the exchange
of the next block is posted before the current one is computed (small blocks) or after it (large
blocks, see ``overlap_exchange``) and waited for after.

Forward (``W`` steps, ``W - 1`` key hops, one final hop of column statistics)::

    row_r  = logaddexp over blocks o of row_lse(Q_r, K_o)          (stays on rank r)
    col_o  = logaddexp over ranks r of col_lse(Q_r, K_o)           (travels with K_o, ends at o)

The partial column statistics of a block follow it one hop behind the keys (they are only known
after the block is computed), so they ride on the next step's exchange; after the last step one
small hop brings each complete ``col_o`` home. Only the own block excludes the positive.

Backward, with upstream ``a_r = dL/d row_r`` and ``b_o = dL/d col_o``: key blocks travel again
together with ``[col_o, b_o]``; each rank forms ``G = a P + b P'`` on (Q_r, K_o) with the *global*
statistics, adds ``s G K_o`` into its local ``dq`` and passes the fp32 ``dk`` accumulator of the
block along (one hop behind, like the column statistics) until it arrives at the owner. The
scale gradient of rank ``r`` is the sum of its block ``dscale`` (its share of the total).

Choice by size (``ring_infonce``): where the gathered features are small, the ring's ``W`` hops of
small blocks cost more than they save (a fixed cost per hop and per launch). Then one all-gather
of the keys and one fused call over them compute the same loss: ``row_r = lse(Q_r, K_all)`` and
the partial column statistics of rank r's queries, merged across ranks by one small all-gather;
the gathered keys' float32 gradient goes back to the owners by a reduce-scatter. It is exact the
same way (the shares add up to the global loss) and holds ``M c`` gathered values and their
gradient: linear in the global batch, so ``choose_algorithm`` caps its bytes and otherwise picks
by the world size and the largest per-rank batch (thresholds below, measured on H200s); the
environment variable ``DS_INFCL_ALGORITHM`` (``ring`` / ``gather``) pins it, and
``last_algorithm()`` reports the last choice.

Gradient semantics: ``ring_lse`` returns to rank ``r`` the gradient of ``sum over ranks`` of the
objectives each rank built on its outputs. The InfoNCE (``ring_infonce``) is the sum of per-rank
shares, all-reduced into the global value, with a backward that multiplies by ``W`` (as
``global_sum_with_grad``): after the data-parallel mean every gradient equals the single-device
one. Each algorithm runs as one autograd Function (``ds_infcl.loss.ring_fused``): the positive
logits and the composition of the shares cost the host no autograd nodes of their own (issue 17).
"""

from __future__ import annotations

import os
import zlib
from typing import Optional, Tuple

import torch

from ds_infcl.loss import peer_copy
from ds_infcl.ops import LSEOptions, lse_backward, lse_forward, resolve_backend
from ds_infcl.ops.lse import refuse_double_backward
from ds_infcl.ops.validation import check_choice, choice_setting, int_setting
from ds_infcl.ring import (
    RingLayout,
    agree_on_input_errors,
    exchange_layout,
    group_size,
    post_ring_shift,
    resolve_group,
    wait_all,
)

__all__ = ["RingLSEFunction", "ring_lse", "ring_infonce"]

_F32 = torch.float32


# Each hop's exchange is posted either before the block's kernels (it runs beside them) or after
# them (it runs alone, between two blocks). Beside them, NCCL's send/recv kernel holds SMs from its
# launch until the peer has posted too; when the peer is late, the persistent forward kernel
# launched next finds those SMs taken and its programs there start only when the exchange ends, so
# one rank's lateness makes the other's forward slower, and the ranks alternate in being late.
# Measured on 2 x H200 (c = 512, bf16, symmetric, 2026-11-26; docs/distributed.md): at 131,072 rows
# per rank, calls of 355-404 ms (the forward kernel 123 ms on one rank, 172 on the other) beside,
# 358-364 ms (123 ms on both) alone; alone is faster from 16,384 rows (6.4 vs 6.9 ms), beside at
# 8,192 (4.9 vs 5.3 ms). A hop moves b c values against b^2 c of block work, so the share of the
# transfer falls with the rows only: "auto" overlaps while the largest block has at most
# RING_OVERLAP_MAX_ROWS rows. DS_INFCL_RING_OVERLAP=1 / 0 pins it.
_OVERLAP_CHOICES = ("auto", "1", "0")
# Checked at import: a bad value stops the process before any collective.
RING_OVERLAP = choice_setting("DS_INFCL_RING_OVERLAP", "auto", _OVERLAP_CHOICES)
RING_OVERLAP_MAX_ROWS = int_setting("DS_INFCL_RING_OVERLAP_MAX_ROWS", 12288, minimum=0)


def overlap_exchange(layout: RingLayout) -> bool:
    """Whether the ring posts each hop's exchange before the block's kernels (overlapped) or after
    them; the same on every rank (a function of the layout)."""
    if check_choice("DS_INFCL_RING_OVERLAP", RING_OVERLAP, _OVERLAP_CHOICES) == "auto":
        return max(max(layout.key_sizes), max(layout.query_sizes)) <= RING_OVERLAP_MAX_ROWS
    return RING_OVERLAP == "1"


def _ring_forward(query, key, scale, labels, options: LSEOptions, layout: RingLayout, group):
    b, c = query.shape
    compute_col = options.compute_col
    overlap = overlap_exchange(layout)
    row = None  # the first block's row statistics start the merge (a fresh float32 tensor)
    cur_key, col_acc = key, None
    for t in range(layout.world):
        owner, nxt = layout.block_owner(t), layout.block_owner(t + 1)
        send, recv = [], []
        next_key = col_in = None
        if t < layout.world - 1:
            next_key = key.new_empty((layout.key_sizes[nxt], c))
            send.append(cur_key)
            recv.append(next_key)
        if compute_col and t > 0:
            col_in = torch.empty((layout.key_sizes[owner],), device=key.device, dtype=_F32)
            send.append(col_acc)
            recv.append(col_in)
        works = post_ring_shift(send, recv, layout, group) if overlap else None
        own = owner == layout.rank
        row_t, col_t = lse_forward(query, cur_key, scale, labels if own else None, options.on_block(own))
        if works is None:
            works = post_ring_shift(send, recv, layout, group)
        row = row_t if row is None else torch.logaddexp(row, row_t, out=row)
        wait_all(works)
        if compute_col:
            col_acc = col_t if col_in is None else torch.logaddexp(col_t, col_in)
        if next_key is not None:
            cur_key = next_key
    col = None
    if compute_col:
        if layout.world == 1:
            col = col_acc
        else:  # col_acc now holds the complete statistics of rank (r + 1)'s block: send it home
            col = torch.empty((layout.key_sizes[layout.rank],), device=key.device, dtype=_F32)
            wait_all(post_ring_shift([col_acc], [col], layout, group))
    return row, col


def _ring_backward(query, key, scale, labels, options: LSEOptions, layout: RingLayout, group, row, col,
                   grad_row, grad_col, grad_pos=None):
    # grad_pos: upstream gradient of the positive logits x_{i, labels_i}, added on the own block
    # (the fused InfoNCE of ds_infcl.loss.ring_fused); labels None there means the diagonal.
    # The blocks' gradients are float32 (options.out_dtype is not used: the sums accumulate).
    b, c = query.shape
    compute_col = options.compute_col
    options = options.replace(out_dtype=None)
    m = key.shape[0]
    overlap = overlap_exchange(layout)
    dq = dscale = None  # the first block's results start the sums (fresh float32 tensors)
    # Every rank must run the same protocol, so missing upstream gradients become zeros.
    a = grad_row.float() if grad_row is not None else torch.zeros_like(row)
    cur_key, cur_info, dk_acc = key, None, None
    if compute_col:
        bcol = grad_col.float() if grad_col is not None else torch.zeros_like(col)
        cur_info = torch.stack([col, bcol])  # [2, m]: global col_lse and its upstream gradient
    for t in range(layout.world):
        owner, nxt = layout.block_owner(t), layout.block_owner(t + 1)
        send, recv = [], []
        next_key = next_info = dk_in = None
        if t < layout.world - 1:
            next_key = key.new_empty((layout.key_sizes[nxt], c))
            send.append(cur_key)
            recv.append(next_key)
            if compute_col:
                next_info = torch.empty((2, layout.key_sizes[nxt]), device=key.device, dtype=_F32)
                send.append(cur_info)
                recv.append(next_info)
        if t > 0:
            dk_in = torch.empty((layout.key_sizes[owner], c), device=key.device, dtype=_F32)
            send.append(dk_acc)
            recv.append(dk_in)
        works = post_ring_shift(send, recv, layout, group) if overlap else None
        own = owner == layout.rank
        dq_t, dk_t, ds_t = lse_backward(
            query, cur_key, scale, row, cur_info[0] if compute_col else None, a,
            cur_info[1] if compute_col else None, labels if own else None, grad_pos if own else None,
            options.on_block(own),
        )
        dq = dq_t if dq is None else dq.add_(dq_t)
        dscale = ds_t if dscale is None else dscale.add_(ds_t)
        del dq_t
        if works is None:
            works = post_ring_shift(send, recv, layout, group)
        wait_all(works)
        dk_acc = dk_t if dk_in is None else dk_t.add_(dk_in)
        if next_key is not None:
            cur_key, cur_info = next_key, next_info
    if layout.world == 1:
        dk = dk_acc
    else:  # dk_acc is the complete gradient of rank (r + 1)'s keys: send it home
        dk = torch.empty((m, c), device=key.device, dtype=_F32)
        wait_all(post_ring_shift([dk_acc], [dk], layout, group))
    return dq, dk, dscale


class RingLSEFunction(torch.autograd.Function):
    """``(row_lse [b], col_lse [m])`` over all ranks of ``group``, by the ring; see module doc.

    Saves ``query``, ``key``, ``labels`` and the two LSE vectors: O((b + m) * c) per rank.
    ``col_lse`` is an empty tensor when ``compute_col`` is false. Differentiable once
    (``refuse_double_backward``).
    """

    @staticmethod
    def forward(ctx, query, key, scale, labels, options: LSEOptions, layout, group):
        s = scale.detach()  # read on the device by the kernels: no host sync
        query, key = query.contiguous(), key.contiguous()
        row, col = _ring_forward(query, key, s, labels, options, layout, group)
        if col is None:
            col = row.new_empty((0,))
        ctx.save_for_backward(query, key, labels, row, col, s)
        ctx.scale_shape = scale.shape
        ctx.options = (options, layout, group)
        ctx.set_materialize_grads(False)
        if not options.compute_col:
            ctx.mark_non_differentiable(col)
        return row, col

    @staticmethod
    def backward(ctx, grad_row, grad_col):
        refuse_double_backward("the distributed lse")
        query, key, labels, row, col, s = ctx.saved_tensors
        options, layout, group = ctx.options
        compute_col = options.compute_col
        dq, dk, ds = _ring_backward(
            query, key, s, labels, options, layout, group, row, col if compute_col else None, grad_row,
            grad_col if compute_col else None,
        )
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq.to(query.dtype), dk.to(key.dtype), dscale, None, None, None, None


def _flags(**options) -> int:
    return sum(int(bool(v)) << i for i, v in enumerate(options.values()))


_BACKENDS: dict = {}  # (backend, device type, interpreting) -> resolve_backend's answer


def _resolve_backend(backend, device, group):
    """``resolve_backend``, remembered per device type once it answered (its errors, which every
    rank must see, are raised each time: they are never remembered)."""
    k = (backend, device.type, os.environ.get("TRITON_INTERPRET"))
    got = _BACKENDS.get(k)
    if got is None:
        with agree_on_input_errors(group):  # one rank without Triton must not leave the others waiting
            got = _BACKENDS[k] = resolve_backend(backend, device)
    return got


def ring_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale_t: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    options: LSEOptions = LSEOptions(backend="auto"),
    group=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row LSE ``[b]`` over all keys of all ranks and column LSE ``[m]`` over all queries.

    Inputs are validated locally by the caller (``ds_infcl.loss.lse``); the cross-rank check of
    dims, dtypes and sizes runs here, on every call, and raises on every rank. ``scale_t`` is a
    0-dim float tensor; ``options`` (``backend`` may be ``"auto"``) as for ``lse_forward``. The
    gradient that reaches rank ``r`` is that of the *sum over ranks* of the objectives built on the
    outputs (see the module doc for the factor ``W`` of the data-parallel contract).
    """
    group = resolve_group(group)
    options = options.replace(backend=_resolve_backend(options.backend, query.device, group))
    layout = exchange_layout(
        query, key, group, protocol="ring_lse",
        flags=_flags(exclude_positive=options.exclude_positive, compute_col=options.compute_col),
    )
    row, col = RingLSEFunction.apply(query, key, scale_t, labels, options, layout, group)
    return row, (col if options.compute_col else None)


# The gather path while its buffers, the gathered keys and their float32 gradient
# (M c (e + 4) bytes), fit GATHER_MAX_BYTES and, on 2 ranks, the largest per-rank batch is at most
# GATHER_MAX_LOCAL rows (see choose_algorithm). Measured on 4 x H200 (c = 512, bf16, symmetric,
# one run each at 2 and 4 ranks, 2026-11-26; docs/distributed.md): on 4 ranks the gather path is
# faster at every size measured (4k-64k rows per rank: 3.0 vs 6.1 ms at 4k, 12.2 vs 13.1 at 16k,
# 47.2 vs 48.5 at 32k, 183.3 vs 185.7 at 64k), on 2 ranks up to 16k (2.9 vs 4.1 ms at 8k; 6.2 vs
# 6.3 at 16k) and the ring from 32k (23.5 vs 24.4 ms; 92.2 vs 109.9 at 64k). That 2-rank gap was
# the forward's grid (a second wave at b x 2b, since fixed): after it the two are even there
# (21.0 vs 21.1 ms at 32k, 81.4 vs 80.0 at 64k). Since the gather path's own block moved ahead of
# the layout exchange and its backward into the forward, it is faster on 2 ranks at 32k and 64k
# too (2 x H100, 2026-11-26, paired in one process: 18.0 vs 18.9 ms at 32k, 69.2 vs 70.3 at 64k),
# so the cap sits at the largest size measured, 65,536.
# The byte cap keeps the extra memory of the gather path at most 0.5 GiB (c = 512, bf16:
# M <= 174,762 keys); above it the ring's memory does not grow with the world size.
GATHER_MAX_LOCAL = int_setting("DS_INFCL_GATHER_MAX_LOCAL", 65536, minimum=0)
GATHER_MAX_BYTES = int_setting("DS_INFCL_GATHER_MAX_BYTES", 1 << 29, minimum=0)
# The gather path runs its own block's backward in the forward (ds_infcl.loss.ring_fused) where
# some rank's own block (b_r m_r) has at least this many logits: see own_backward_early. Measured
# on 2 x H100 (c = 512, bf16, symmetric, 2026-11-26, docs/distributed.md), 192 calls each, paired
# in one process: 2.29 against 2.43 ms at 8,192 rows per rank, 4.92 against 4.97 at 16,384;
# 2.12 against 1.76 at 4,096, where the host's extra graph launch costs more than it hides.
GATHER_OWN_BACKWARD_MIN_LOGITS = int_setting("DS_INFCL_GATHER_OWN_BACKWARD_MIN_LOGITS", 1 << 26, minimum=0)
_LAST = {"algorithm": None}


def choose_algorithm(layout: RingLayout, dim: int, element_size: int) -> str:
    """``"gather"`` or ``"ring"`` for this call; the same on every rank (a function of the layout,
    which every rank holds). ``DS_INFCL_ALGORITHM=ring|gather`` pins it."""
    pinned = os.environ.get("DS_INFCL_ALGORITHM", "auto")
    if pinned in ("ring", "gather"):
        return pinned
    if pinned != "auto":
        raise ValueError(f"DS_INFCL_ALGORITHM must be 'auto', 'ring' or 'gather', got {pinned!r}")
    if gather_bytes(layout, dim, element_size) > GATHER_MAX_BYTES:
        return "ring"
    if ring_for_local_size(layout.world, max(max(layout.query_sizes), max(layout.key_sizes))):
        return "ring"
    return "gather"


def ring_for_local_size(world: int, largest: int) -> bool:
    """``choose_algorithm``'s rule on the per-rank batch: on 2 ranks, the ring once some rank holds
    more than ``GATHER_MAX_LOCAL`` rows (``largest``)."""
    return world <= 2 and largest > GATHER_MAX_LOCAL


def ring_predicted(world: int, b: int, m: int, dim: int, element_size: int) -> bool:
    """What ``choose_algorithm`` will pick, predicted from this rank's own sizes (as if every rank
    held ``m`` keys): the gather path's early own block (``ds_infcl.loss.ring_fused.own_block_early``)
    runs only where the gather path is expected. A wrong guess costs time, never correctness."""
    return ring_for_local_size(world, max(b, m)) or world * m * dim * (element_size + 4) > GATHER_MAX_BYTES


def own_backward_early(layout: RingLayout) -> bool:
    """Whether the gather path computes its own block's backward in the forward: the same on every
    rank (the layout and a setting in ``algorithm_settings``), since its backward's collectives
    follow (an all-to-all of the other keys' gradient instead of a reduce-scatter)."""
    return max(b * m for b, m in zip(layout.query_sizes, layout.key_sizes)) >= GATHER_OWN_BACKWARD_MIN_LOGITS


def gather_bytes(layout: RingLayout, dim: int, element_size: int) -> int:
    """Bytes the gather path holds per rank: the gathered keys and their float32 gradient."""
    return layout.num_keys * dim * (element_size + 4)


def algorithm_settings() -> int:
    """A fingerprint of this process's algorithm settings (``DS_INFCL_ALGORITHM``, the gather
    thresholds, the ring's overlap setting and the keys' copy-engine transport), exchanged with
    the layout so that ranks launched with different values stop with an error naming them
    instead of running different collectives (a hang on NCCL)."""
    text = (f"{os.environ.get('DS_INFCL_ALGORITHM', 'auto')}|{GATHER_MAX_LOCAL}|{GATHER_MAX_BYTES}|"
            f"{RING_OVERLAP}|{RING_OVERLAP_MAX_ROWS}|{GATHER_OWN_BACKWARD_MIN_LOGITS}|{peer_copy.settings_text()}")
    return zlib.crc32(text.encode())


def last_algorithm() -> Optional[str]:
    """The algorithm the last ``ring_infonce`` call on this process used (``"ring"``/``"gather"``)."""
    return _LAST["algorithm"]


def _exchange(query, key, labels, symmetric, group, own):
    """``(layout, staged)``: the layout exchange of ``ring_infonce``, and where the group has a
    copy-engine transport (``ds_infcl.loss.peer_copy``), this call's keys staged for it while the
    exchange is in flight (``staged``: ``(ticket, whether every rank staged in step)``, else
    ``None``). The transport's epoch advances on every call, on every rank alike."""
    transport = peer_copy.transport_of(group, key.device)
    tag, box = 0, []
    if transport is not None:
        tag = transport.tag(key)

        def between():  # (own block early: the gather path expected, its keys pulled ahead)
            box.append(transport.begin(key, None if own is None else own.mark, ahead=own is not None))

    try:
        layout = exchange_layout(
            query, key, group, protocol="ring_lse",
            flags=_flags(exclude_positive=False, compute_col=symmetric), settings=algorithm_settings(),
            explicit_labels=labels is not None, staged=tag, between=None if transport is None else between,
        )
    except BaseException:
        if box:
            transport.settle(box[0], None)
        raise
    if not box:
        return layout, None
    return layout, (box[0], transport.settle(box[0], layout))


def ring_infonce(
    query: torch.Tensor,
    key: torch.Tensor,
    scale_t: torch.Tensor,
    labels: Optional[torch.Tensor],
    *,
    symmetric: bool,
    backend: str = "auto",
    group=None,
    tile_size: Optional[int] = None,
) -> torch.Tensor:
    """Global InfoNCE across ranks: the global loss on every rank, exact gradients after the
    data-parallel mean (``labels`` are local indices, so a positive lives on its query's rank;
    ``None``: the diagonal). By the ring, or by one all-gather where the features are small
    (``choose_algorithm``)."""
    # The fused Functions build on this module's ring steps (hence imported here, not on top).
    from ds_infcl.loss.ring_fused import GatherInfoNCEFunction, RingInfoNCEFunction, own_block_early

    group = resolve_group(group)
    backend = _resolve_backend(backend, query.device, group)
    if labels is not None:
        labels = labels.to(device=query.device, dtype=torch.long)
    query, key = query.contiguous(), key.contiguous()
    own = own_block_early(query, key, scale_t, labels, symmetric, backend, tile_size, group_size(group), group)
    layout, staged = _exchange(query, key, labels, symmetric, group, own)
    algorithm = choose_algorithm(layout, query.shape[1], query.element_size())
    _LAST["algorithm"] = algorithm
    if algorithm == "gather":
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or scale_t.requires_grad)
        return GatherInfoNCEFunction.apply(query, key, scale_t, labels, symmetric, backend, tile_size,
                                           layout, group, own, grad, staged)
    return RingInfoNCEFunction.apply(query, key, scale_t, labels, symmetric, backend, tile_size, layout,
                                     group)
