"""The ring's steps (DESIGN.md section 4): the forward and the backward of the key blocks' hops
around the ring of a group, and when each hop's exchange is posted (``overlap_exchange``).

``ds_infcl.loss.ring`` (``ring_lse``) and ``ds_infcl.loss.ring_fused`` (the fused InfoNCE) both
build on these; the module doc of ``ds_infcl.loss.ring`` describes the protocol. This module sits
below both, so that their imports go one way (``ring`` -> ``ring_fused`` -> ``ring_steps``).
"""

from __future__ import annotations

import torch

from ds_infcl import settings
from ds_infcl.ops import LSEOptions, lse_backward, lse_forward
from ds_infcl.ring import RingLayout, post_ring_shift, wait_all

__all__ = ["RING_OVERLAP", "RING_OVERLAP_MAX_ROWS", "overlap_exchange"]

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
# Checked at import: a bad value stops the process before any collective.
RING_OVERLAP = settings.get("DS_INFCL_RING_OVERLAP")
RING_OVERLAP_MAX_ROWS = settings.get("DS_INFCL_RING_OVERLAP_MAX_ROWS")


def overlap_exchange(layout: RingLayout) -> bool:
    """Whether the ring posts each hop's exchange before the block's kernels (overlapped) or after
    them; the same on every rank (a function of the layout)."""
    if settings.check("DS_INFCL_RING_OVERLAP", RING_OVERLAP) == "auto":
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
