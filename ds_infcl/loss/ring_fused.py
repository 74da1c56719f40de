"""The distributed InfoNCE as one autograd Function per algorithm (gather or ring).

Why (issue 17): at a small per-GPU batch one loss call is host-bound. Composed by autograd, the
global InfoNCE ran ~15 autograd nodes per call: the LSE Function(s), the positive logits
(``key[labels]`` with its index-put backward, casts, products, sums), the composition of the
shares, zero-weighted pairing terms that kept the collectives paired on ranks without queries,
and the global sum. Here each algorithm is one Function whose backward forms the upstream weights
once and folds the positive terms into the LSE backward (``grad_pos``, as the single-device
``ds_infcl.ops.infonce.InfoNCEFunction`` does), so the positive logits cost no autograd node, no
gather of keys and no pass of their own.

Maths (DESIGN.md section 2). Rank ``r`` holds ``b`` queries, ``m`` keys and labels ``l_i`` (local
key indices, ``None``: the diagonal); ``B`` queries in all, ``W`` ranks, ``f = 1/2`` when
symmetric (else 1). Its share of the loss and the global value are::

    share_r = (f / B) sum_i (row_i - pos_i)  [+ (f / B) sum_i (col'_i - pos_i)]     L = sum_r share_r

``row_i`` over all keys of all ranks, ``col'_i`` the column LSE of query i's positive key over all
queries, ``pos_i = s q_i . k_{l_i}``. The forward all-reduces the share (every rank returns ``L``;
the gather path's symmetric loss with diagonal labels needs no all-reduce, see ``_merge_fn``);
the backward, with upstream ``g``, uses the weight ``w = g W f / B`` (the ``W`` of the data-parallel
contract, see ``ds_infcl.ring.collectives``) for every LSE term and ``-w`` per direction for each
positive logit.

- Gather (``GatherInfoNCEFunction``): the Function all-gathers the keys ``K_all`` in its forward
  and reduce-scatters their float32 gradient in its backward. Each rank computes its queries
  against all keys once, for both directions, exactly as the ring computes one block:
  ``row = lse(Q_r, K_all)`` and the partial column statistics over its own queries, which one
  all-gather of ``W x M`` floats and a log-sum-exp merge into the global ``col`` on every rank.
  The backward all-gathers the column weights ``b_j`` from the keys' owners (with no labels on
  any rank, each owner's one weight) and runs one backward over ``(Q_r, K_all)`` with the global
  statistics. The positive of query i is key
  ``key_offset + l_i`` of ``K_all``. (The first version gathered the queries too and computed
  the two directions as two separate passes: twice the logits of the ring, issue 17.) From
  ``EARLY_MIN_LOGITS`` up, the own block ``lse(Q_r, K_r)`` runs before the layout exchange
  (``own_block_early``) and the forward then covers the other ranks' keys and merges the two.
- Ring (``RingInfoNCEFunction``): ``ds_infcl.loss.ring``'s forward and backward ring steps with
  ``a = w``, ``b_j = w * #{i : l_i = j}`` and the positive terms on the own block.

Both are differentiable once: their backward's collectives and kernels build no graph, so a
second derivative raises (``refuse_double_backward``) instead of silently missing terms.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ds_infcl.loss.ring import _ring_backward, _ring_forward, refuse_double_backward
from ds_infcl.ops import lse_backward, lse_forward, positive_logits_forward
from ds_infcl.ops.infonce import column_weights
from ds_infcl.ops.infonce_graph import GATHER_MAX_LOGITS, run_graphed
from ds_infcl.ops.validation import int_setting
from ds_infcl.ring import RingLayout, all_gather_rows, reduce_scatter_rows
from ds_infcl.ring.layout import all_gather_single

__all__ = ["GatherInfoNCEFunction", "RingInfoNCEFunction", "own_block_early"]

_F32 = torch.float32
# Smallest own block (b m logits) computed before the layout exchange (own_block_early). Measured
# on 2 x H100 (c = 512, bf16, symmetric, 2026-11-26; docs/distributed.md), each point 288 calls
# alternating with it off in one process: 0.03-0.13 ms faster at 16,384 rows per rank (three runs),
# 0.19 / 0.11 / 0.19 ms slower at 12,288 / 8,192 / 4,096, where the block's GPU time covers less of
# the exchange than the extra graph launch costs the host.
EARLY_MIN_LOGITS = int_setting("DS_INFCL_GATHER_EARLY_MIN_LOGITS", 1 << 28, minimum=0)


def _positive_rows(x: torch.Tensor, labels: Optional[torch.Tensor], b: int) -> torch.Tensor:
    """Rows ``x[labels]`` (the positives of the ``b`` queries); a view for the diagonal."""
    if labels is None:
        return x if x.shape[0] == b else x[:b]
    return x[labels]


def _share_and_sum(row, col_pos, pos, layout: RingLayout, group, device) -> torch.Tensor:
    """This rank's share of the loss (see module doc), all-reduced into the global value."""
    if row is None:  # no queries here: a zero share, still part of the all-reduce
        share = torch.zeros((1,), device=device, dtype=_F32)
    elif col_pos is None:
        share = (row - pos).sum().mul_(1.0 / layout.num_queries).reshape(1)
    else:
        share = torch.add(row, col_pos).sub_(pos, alpha=2.0).sum().mul_(0.5 / layout.num_queries)
        share = share.reshape(1)
    if layout.world > 1:
        dist.all_reduce(share, group=group)
    return share.reshape(())


def _weight(grad: torch.Tensor, layout: RingLayout, symmetric: bool) -> torch.Tensor:
    """``w = g W f / B`` as a 0-dim float32 tensor (see module doc)."""
    factor = layout.world * (0.5 if symmetric else 1.0) / layout.num_queries
    return (grad if grad.dtype == _F32 else grad.float()) * factor


def _lse_over_ranks(parts: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp over dim 0 of ``[W, n]``: one kernel for ``W <= 2`` (``torch.logsumexp`` is
    several: its maximum, the shift, the exponentials, the sum, the logarithm)."""
    if parts.shape[0] == 1:
        return parts[0]
    if parts.shape[0] == 2:
        return torch.logaddexp(parts[0], parts[1])
    return torch.logsumexp(parts, dim=0)


def _gather_payloads(payload: torch.Tensor, layout: RingLayout, group) -> torch.Tensor:
    """Every rank's payload as the rows of ``[W, len(payload)]`` (one all-gather)."""
    if layout.world == 1:
        return payload.view(1, -1)
    parts = payload.new_empty((layout.world, payload.shape[0]))
    all_gather_single(parts.view(-1), payload.contiguous(), group=group)
    return parts


def _merge_fn(m: int, diagonal_spans, factor: Optional[float]):
    """The statistics' merge as a function of the gathered payloads ``parts [W, ...]`` (what a
    graph captures): the global column LSE ``[M]`` from each rank's partial one over its own
    queries (the first ``m`` floats of each row). With ``factor`` (the symmetric loss when no rank
    passed labels, without an all-reduce) also the loss: each row ends with its rank's row term
    ``sum_i (row_i - 2 pos_i)``, and the column term ``sum_i col_{offset_r + i}`` over every rank's
    queries is known to all once ``col`` is (query ``i`` of rank ``r`` is paired with key
    ``offset_r + i``; ``diagonal_spans``: those keys' ranges, ``None`` when they are all keys)."""

    def merge(parts):
        col = _lse_over_ranks(parts[:, :m])
        if factor is None:
            return col, None
        if diagonal_spans is None:  # every key is some query's positive (CLIP)
            cols = col.sum()
        else:
            cols = torch.cat([col[lo:hi] for lo, hi in diagonal_spans]).sum()
        return col, (parts[:, m].sum() + cols) * factor

    return merge


def _merge_statistics(payload, layout: RingLayout, group, diagonal: bool, backend: str, logits: int):
    """``(col, loss or None)`` on every rank from the payloads of all ranks (``_merge_fn``); the
    arithmetic after the all-gather replays from a CUDA graph where the shapes repeat."""
    m = layout.num_keys
    spans = None
    if diagonal and layout.query_sizes != layout.key_sizes:
        spans = tuple((layout.key_offset(r), layout.key_offset(r) + b) for r, b in enumerate(layout.query_sizes))
    factor = 0.5 / layout.num_queries if diagonal else None
    parts = _gather_payloads(payload, layout, group)
    return run_graphed("gather_merge", _merge_fn(m, spans, factor), (parts,), options=(m, spans, factor),
                       logits=logits, backend=backend, max_logits=GATHER_MAX_LOGITS)


def _diagonal_column_weights(w_all: torch.Tensor, query_sizes, key_sizes) -> torch.Tensor:
    """``[M]`` upstream weights of the keys' column LSE when no rank passed labels: ``w`` of rank
    ``r`` (``w_all[r]``) for each of its first ``b_r`` keys, 0 for its keys beyond its queries
    (``column_weights`` of every rank, concatenated)."""
    if query_sizes == key_sizes and len(set(key_sizes)) == 1:
        return w_all.view(-1, 1).expand(-1, key_sizes[0]).reshape(-1)
    pieces = []
    for r, (b, m) in enumerate(zip(query_sizes, key_sizes)):
        pieces.append(w_all[r].expand(b))
        if m > b:
            pieces.append(w_all.new_zeros((m - b,)))
    return torch.cat(pieces)


def _gather_forward_fn(symmetric, diagonal, backend, tile_size, offset, m):
    """The gather path's local forward kernels as a function of tensors (what a graph captures):
    ``(row [b], payload, positive logits [b] or None)``. The payload goes to the all-gather of the
    column statistics: the partial column statistics ``[M]`` (symmetric), followed by this rank's
    row term ``sum_i (row_i - 2 pos_i)`` when no rank has labels (``_merge_fn``; ``pos`` is
    then not returned). This rank's keys are rows ``[offset, offset + m)`` of ``key_all``."""

    def forward(query, key_all, s, labels):
        row, col_part = lse_forward(query, key_all, s, compute_col=symmetric, backend=backend,
                                    tile_size=tile_size)
        pos = positive_logits_forward(query, key_all[offset: offset + m], s, labels, backend=backend,
                                      tile_size=tile_size)
        return _forward_outputs(row, col_part, pos, diagonal)

    return forward


def _forward_outputs(row, col_part, pos, diagonal):
    """The local forward's ``(row, payload, pos)`` from its statistics: the payload is the partial
    column statistics (``None`` one-directional); with ``diagonal`` (symmetric, no labels on any
    rank) this rank's row term ``sum_i (row_i - 2 pos_i)`` ends it and ``pos`` is not returned."""
    if diagonal:
        return row, torch.cat([col_part, row.sub(pos, alpha=2.0).sum().reshape(1)]), None
    return row, col_part, pos


def _own_block_fn(symmetric, backend, tile_size):
    """This rank's queries against its own keys, the block that needs no other rank's data:
    ``(row [b], partial column statistics [m] or None, positive logits [b])`` (what a graph
    captures; see ``GatherInfoNCEFunction``'s ``own``)."""

    def own(query, key, s, labels):
        row, col = lse_forward(query, key, s, compute_col=symmetric, backend=backend, tile_size=tile_size)
        pos = positive_logits_forward(query, key, s, labels, backend=backend, tile_size=tile_size)
        return row, col, pos

    return own


def _gather_rest_fn(symmetric, diagonal, backend, tile_size, offset, m):
    """The gather path's local forward when the own block ran early (``_own_block_fn``): the
    queries against the other ranks' keys (rows ``[0, offset)`` and ``[offset + m, M)`` of
    ``key_all``), merged with the own block's statistics into the outputs of ``_gather_forward_fn``."""

    def forward(query, key_all, s, row_own, col_own, pos):
        row, cols = row_own, []
        for lo, hi in ((0, offset), (offset + m, key_all.shape[0])):
            if lo == hi:
                continue
            row_t, col_t = lse_forward(query, key_all[lo:hi], s, compute_col=symmetric, backend=backend,
                                       tile_size=tile_size)
            row = torch.logaddexp(row, row_t)
            cols.append(col_t)
        col_part = None
        if symmetric:
            cols.insert(1 if offset else 0, col_own)
            col_part = torch.cat(cols)
        return _forward_outputs(row, col_part, pos, diagonal)

    return forward


def own_block_early(query, key, scale_t, labels, symmetric, backend, tile_size, world):
    """The own block's kernels, launched before the layout exchange so that the GPU computes while
    the host waits for the other ranks' sizes (issue 17: at 16k rows per GPU the GPU sat idle for
    that wait, 0.3-0.5 ms of a 4.6-5.1 ms call). ``None`` where it would not pay or not be
    used: one rank, an empty block, fewer than ``EARLY_MIN_LOGITS`` logits in it, or a block the
    gather path will not take (``GATHER_MAX_LOCAL`` on 2 ranks, ``DS_INFCL_ALGORITHM=ring``); if the
    layout then picks the ring anyway, the result is dropped. Only local work: ranks may decide
    differently, their collectives are the same."""
    from ds_infcl.loss.ring import GATHER_MAX_LOCAL

    b, m = query.shape[0], key.shape[0]
    if world < 2 or not b or not m or b * m < EARLY_MIN_LOGITS:
        return None
    if os.environ.get("DS_INFCL_ALGORITHM", "auto") == "ring" or (world <= 2 and max(b, m) > GATHER_MAX_LOCAL):
        return None
    with torch.no_grad():
        return run_graphed(
            "gather_own", _own_block_fn(symmetric, backend, tile_size),
            (query.detach(), key.detach(), scale_t.detach(), labels), options=(symmetric, tile_size),
            logits=b * m, backend=backend, max_logits=GATHER_MAX_LOGITS, borrow=(0, 1, 2))


def _gather_backward_fn(symmetric, backend, tile_size, offset, diagonal_sizes=None):
    """The gather path's local backward: ``(dq in the queries' dtype, d key_all float32, dscale
    float32)`` for the upstream weight ``w`` (0-dim) of every LSE term and ``-w`` per direction for
    each positive logit. Query i's positive is key ``offset + l_i`` of ``key_all`` (``offset + i``
    for ``labels=None``). ``grad_col`` is the keys' column weights ``[M]``, or, with
    ``diagonal_sizes = (query sizes, key sizes)`` (no rank passed labels), every rank's ``w``
    ``[W]``, from which they are formed here (``_diagonal_column_weights``)."""

    def backward(query, key_all, s, row, col, w, grad_col, labels):
        b = query.shape[0]
        if diagonal_sizes is not None:
            grad_col = _diagonal_column_weights(grad_col, *diagonal_sizes)
        if labels is not None:
            labels = labels + offset if offset else labels
        elif offset:
            labels = torch.arange(offset, offset + b, device=query.device)
        dq, dk_all, dscale = lse_backward(
            query, key_all, s, row, col, w.expand(b), grad_col, labels=labels,
            grad_pos=(w * (-2.0 if symmetric else -1.0)).expand(b), backend=backend, tile_size=tile_size)
        return dq.to(query.dtype), dk_all, dscale

    return backward


class GatherInfoNCEFunction(torch.autograd.Function):
    """The global InfoNCE from gathered keys; see the module doc. Owns its collectives, on every
    rank and in the same order (a rank without queries takes part with ``-inf`` statistics and
    zero gradients), with no autograd node of their own:

    - forward: the all-gather of the keys, then (symmetric) the all-gather of each rank's partial
      column statistics over its own queries, merged by a log-sum-exp into the global ones, then
      the all-reduce of the shares (not with diagonal labels: ``_merge_fn``);
    - backward: (symmetric) the all-gather of the column weights ``b_j`` from the keys' owners
      (when no rank passed labels, of each rank's weight ``w``, one float, from which every rank
      forms them: ``_diagonal_column_weights``), then the reduce-scatter of the float32 gradient
      of the gathered keys.

    Every logit is computed once per pass, for both directions, as in the ring. Holds the gathered
    keys and, in the backward, their float32 gradient: ``M c (e + 4)`` bytes for ``e``-byte
    features (``choose_algorithm`` caps it)."""

    @staticmethod
    def forward(ctx, query, key, scale, labels, symmetric, backend, tile_size, layout, group, own=None):
        s = scale.detach()  # read on the device by the kernels: no host sync
        query, key = query.contiguous(), key.contiguous()
        b = query.shape[0]
        key_all = all_gather_rows(key, layout.key_sizes, group)
        m, offset, num_keys = key.shape[0], layout.key_offset(), layout.num_keys
        diagonal = symmetric and layout.diagonal  # (the same on every rank: from the layout)
        row = col = pos = col_pos = payload = None
        # The local kernels, replayed from CUDA graphs where small shapes repeat. payload and pos
        # are read right away (the all-gather, the share): a replay may hand over its own
        # buffers; row is kept for the backward, a copy.
        if b and own is not None:  # the own block ran before the layout exchange (own_block_early)
            row, payload, pos = run_graphed(
                "gather_rest", _gather_rest_fn(symmetric, diagonal, backend, tile_size, offset, m),
                (query, key_all, s) + tuple(own), options=(symmetric, diagonal, tile_size, offset, m),
                logits=b * (num_keys - m), backend=backend, max_logits=GATHER_MAX_LOGITS, borrow=(1, 2))
        elif b:
            row, payload, pos = run_graphed(
                "gather_forward", _gather_forward_fn(symmetric, diagonal, backend, tile_size, offset, m),
                (query, key_all, s, labels), options=(symmetric, diagonal, tile_size, offset, m),
                logits=b * num_keys, backend=backend, max_logits=GATHER_MAX_LOGITS, borrow=(1, 2))
        elif symmetric:  # no queries here: an empty sum for every key (and a zero row term)
            payload = torch.full((num_keys + diagonal,), float("-inf"), device=query.device, dtype=_F32)
            if diagonal:
                payload[num_keys] = 0.0
        if symmetric:
            col, loss = _merge_statistics(payload, layout, group, diagonal, backend, b * num_keys)
            if b and not diagonal:
                col_pos = _positive_rows(col[offset: offset + m], labels, b)
        if not diagonal:
            loss = _share_and_sum(row, col_pos, pos, layout, group, query.device)
        ctx.save_for_backward(query, key, labels, row, col, s, key_all)
        ctx.scale_shape = scale.shape
        ctx.options = (symmetric, backend, tile_size, layout, group)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the distributed InfoNCE")
        query, key, labels, row, col, s, key_all = ctx.saved_tensors
        symmetric, backend, tile_size, layout, group = ctx.options
        b = query.shape[0]
        w = _weight(grad, layout, symmetric)
        grad_col_all = sizes = None
        if symmetric and layout.diagonal:  # every rank's w: the column weights follow (the same
            sizes = (layout.query_sizes, layout.key_sizes)  # branch on every rank: the layout's)
            grad_col_all = _gather_payloads(w.reshape(1), layout, group).view(-1)
        elif symmetric:  # b_j from each key's owner (its own upstream weight), for all M keys
            grad_col_all = all_gather_rows(column_weights(w, labels, b, key.shape[0]),
                                           layout.key_sizes, group)
        if b:
            # d(key_all) is only read by the reduce-scatter below (a new tensor; the current
            # stream waits for it): a replay may hand over its own buffer instead of a copy
            # (M c float32 bytes, 64 MB at 32k keys).
            offset = layout.key_offset()
            dq, dk_all, dscale = run_graphed(
                "gather_backward", _gather_backward_fn(symmetric, backend, tile_size, offset, sizes),
                (query, key_all, s, row, col, w, grad_col_all, labels),
                options=(symmetric, tile_size, offset, sizes), logits=b * layout.num_keys, backend=backend,
                max_logits=GATHER_MAX_LOGITS, borrow=(1,))
        else:  # zeros keep this rank in the reduce-scatter
            dq = torch.zeros_like(query)
            dk_all = torch.zeros(key_all.shape, device=key.device, dtype=_F32)
            dscale = torch.zeros((), device=s.device, dtype=_F32)
        dk = reduce_scatter_rows(dk_all, layout.key_sizes, layout.rank, group)
        del dk_all
        dscale = dscale.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq, dk.to(key.dtype), dscale, None, None, None, None, None, None, None


class RingInfoNCEFunction(torch.autograd.Function):
    """The global InfoNCE by the ring of key blocks (``ds_infcl.loss.ring``); see the module doc.
    Saves the inputs, the LSE vectors and the scale: O((b + m) c)."""

    @staticmethod
    def forward(ctx, query, key, scale, labels, symmetric, backend, tile_size, layout, group):
        s = scale.detach()
        query, key = query.contiguous(), key.contiguous()
        b = query.shape[0]
        row, col = _ring_forward(query, key, s, None, False, symmetric, backend, tile_size, layout, group)
        pos = col_pos = None
        if b:
            pos = positive_logits_forward(query, key, s, labels, backend=backend, tile_size=tile_size)
            col_pos = _positive_rows(col, labels, b) if symmetric else None
        loss = _share_and_sum(row if b else None, col_pos, pos, layout, group, query.device)
        ctx.save_for_backward(query, key, labels, row, col if symmetric else None, s)
        ctx.scale_shape = scale.shape
        ctx.options = (symmetric, backend, tile_size, layout, group)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the distributed InfoNCE")
        query, key, labels, row, col, s = ctx.saved_tensors
        symmetric, backend, tile_size, layout, group = ctx.options
        b, m = query.shape[0], key.shape[0]
        w = _weight(grad, layout, symmetric)
        grad_col = column_weights(w, labels, b, m) if symmetric else None
        dq, dk, ds = _ring_backward(
            query, key, s, labels, False, symmetric, backend, tile_size, layout, group, row, col,
            w.expand(b), grad_col, grad_pos=(w * (-2.0 if symmetric else -1.0)).expand(b),
        )
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq.to(query.dtype), dk.to(key.dtype), dscale, None, None, None, None, None, None
