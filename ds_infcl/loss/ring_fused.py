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
the gather path's symmetric loss with diagonal labels needs no all-reduce, see ``merge_fn``);
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
  From ``GATHER_OWN_BACKWARD_MIN_LOGITS`` up (``own_backward_early``), the own block's backward
  runs in the forward, for the unit weight: every weight in that block is its rank's ``w`` (its
  row terms', its positives', its keys' column weights), so it is exact times ``g``, whatever
  the other ranks' ``g``. The backward then covers the other ranks' keys and sends their
  gradient to its owners by one all-to-all (no reduce-scatter of all ``M`` rows). With the Triton
  kernels the own block hands over its float32 sums before their scaling pass, and the other
  keys' block scales both in one pass over ``dq`` (``gather_blocks.rest_backward_fn``).
- Ring (``RingInfoNCEFunction``): ``ds_infcl.loss.ring``'s forward and backward ring steps with
  ``a = w``, ``b_j = w * #{i : l_i = j}`` and the positive terms on the own block.

Both are differentiable once: their backward's collectives and kernels build no graph, so a
second derivative raises (``refuse_double_backward``) instead of silently missing terms.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ds_infcl import settings
from ds_infcl.loss import peer_copy
from ds_infcl.loss.algorithm import own_backward_early, ring_predicted
from ds_infcl.loss.gather_blocks import (
    gather_backward_fn, gather_forward_fn, gather_rest_fn, merge_fn, own_backward_fn, own_block_fn, own_share,
    own_sums_weight, positive_weight, rest_backward_fn,
)
from ds_infcl.loss.ring_steps import _ring_backward, _ring_forward
from ds_infcl.ops import LSEOptions, positive_logits_forward
from ds_infcl.ops.infonce import column_weights
from ds_infcl.ops.infonce_graph import GATHER_MAX_LOGITS, inputs_of, outputs_intact, run_graphed
from ds_infcl.ops.lse import refuse_double_backward
from ds_infcl.ring import RingLayout, agree_on_input_errors, all_gather_rows, reduce_scatter_rows
from ds_infcl.ring.layout import all_gather_single

__all__ = ["GatherInfoNCEFunction", "RingInfoNCEFunction", "own_block_early"]

_F32 = torch.float32
# Smallest own block (b m logits) computed before the layout exchange (own_block_early). Measured
# on 2 x H100 (c = 512, bf16, symmetric, 2026-11-26; docs/distributed.md), each point 288 calls
# alternating with it off in one process: 0.03-0.13 ms faster at 16,384 rows per rank (three runs),
# 0.19 / 0.11 / 0.19 ms slower at 12,288 / 8,192 / 4,096, where the block's GPU time covers less of
# the exchange than the extra graph launch costs the host.
EARLY_MIN_LOGITS = settings.get("DS_INFCL_GATHER_EARLY_MIN_LOGITS")


class EarlyOwn(NamedTuple):
    """``own_block_early``'s result: the own block's ``(row, col or None, pos)`` and its graph's
    token (``inputs_of``: its copy of the query, read in place by the rest of the forward; ``None``
    when it ran eagerly)."""

    stats: tuple
    token: object
    mark: object = None  # (where the keys' copy-engine gather may start: ds_infcl.loss.peer_copy.mark)


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


def _weight_factor(layout: RingLayout, symmetric: bool) -> float:
    """``W f / B``: the weight ``w`` of the upstream gradient ``g = 1`` (see module doc)."""
    return layout.world * (0.5 if symmetric else 1.0) / layout.num_queries


def _weight(grad: torch.Tensor, layout: RingLayout, symmetric: bool) -> torch.Tensor:
    """``w = g W f / B`` as a 0-dim float32 tensor (see module doc)."""
    return (grad if grad.dtype == _F32 else grad.float()) * _weight_factor(layout, symmetric)


def _gather_payloads(payload: torch.Tensor, layout: RingLayout, group) -> torch.Tensor:
    """Every rank's payload as the rows of ``[W, len(payload)]`` (one all-gather)."""
    if layout.world == 1:
        return payload.view(1, -1)
    parts = payload.new_empty((layout.world, payload.shape[0]))
    all_gather_single(parts.view(-1), payload.contiguous(), group=group)
    return parts


def _merge_statistics(payload, layout: RingLayout, group, diagonal: bool, backend: str, logits: int):
    """``(col, loss or None)`` on every rank from the payloads of all ranks (``merge_fn``); the
    arithmetic after the all-gather replays from a CUDA graph where the shapes repeat."""
    m = layout.num_keys
    spans = None
    if diagonal and layout.query_sizes != layout.key_sizes:
        spans = tuple((layout.key_offset(r), layout.key_offset(r) + b) for r, b in enumerate(layout.query_sizes))
    factor = 0.5 / layout.num_queries if diagonal else None
    parts = _gather_payloads(payload, layout, group)
    return run_graphed("gather_merge", merge_fn(m, spans, factor), (parts,), options=(m, spans, factor),
                       logits=logits, backend=backend, max_logits=GATHER_MAX_LOGITS)


def own_block_early(query, key, scale_t, labels, symmetric, backend, tile_size, world, group=None):
    """The own block's kernels, launched before the layout exchange so that the GPU computes while
    the host waits for the other ranks' sizes (issue 17: at 16k rows per GPU the GPU sat idle for
    that wait, 0.3-0.5 ms of a 4.6-5.1 ms call). ``None`` where it would not pay or not be
    used: one rank, an empty block, fewer than ``EARLY_MIN_LOGITS`` logits in it, or a block the
    gather path is not expected to take (``ring_predicted``, unless ``DS_INFCL_ALGORITHM=gather``
    pins it; ``DS_INFCL_ALGORITHM=ring``); if the layout then picks the ring anyway, the result is
    dropped. Only local work: ranks may decide differently, their collectives are the same.

    A bad ``DS_INFCL_ALGORITHM`` raises here, before any work, as ``choose_algorithm`` does (on a
    rank whose value is bad: the layout exchange that follows tells the others, which raise too)."""
    with agree_on_input_errors(group if world > 1 else None):
        pinned = settings.get("DS_INFCL_ALGORITHM")
    b, m = query.shape[0], key.shape[0]
    if world < 2 or not b or not m or b * m < EARLY_MIN_LOGITS:
        return None
    if pinned == "ring" or (pinned != "gather" and ring_predicted(world, b, m, query.shape[1], query.element_size())):
        return None
    marked = peer_copy.mark(group, query.device)
    with torch.no_grad():  # (so the graph's copies of the inputs take no autograd history: no detach)
        stats, token = run_graphed(
            "gather_own", own_block_fn(symmetric, backend, tile_size), (query, key, scale_t, labels),
            options=(symmetric, tile_size), logits=b * m, backend=backend, max_logits=GATHER_MAX_LOGITS,
            borrow=(0, 1, 2), token=True)
    return EarlyOwn(stats, token, marked)


def _graph_sources(token, query, key_all, key, offset):
    """``(query, key_all, key)`` for a graph of this call: the forward graph's copies while they hold
    this call's (``inputs_of``; a graph captured on them reads them in place, no copy), else the
    tensors themselves. ``key`` is rows ``[offset, offset + m)`` of ``key_all``."""
    got = inputs_of(token)
    if got is None:
        return query, key_all, key
    return got[0], got[1], got[1][offset: offset + key.shape[0]]


def _own_backward(query, key, s, row, col, labels, layout: RingLayout, symmetric, backend, tile_size):
    """``(own_backward_fn's outputs for the unit weight W f / B, token)``, replayed from a graph
    where the shapes repeat (``query`` and ``key`` may be the forward graph's copies,
    ``_graph_sources``: read in place). The outputs are the graph's buffers (64 MB at 16k rows,
    c = 512, not copied): they hold this call's values while ``outputs_intact(token)``; a second
    forward before this one's backward replays the graph, and the backward computes the block
    again (a local computation: ranks may differ in that)."""
    b, m = query.shape[0], key.shape[0]
    offset = layout.key_offset()
    unit = _weight_factor(layout, symmetric)
    return run_graphed(
        "gather_own_backward", own_backward_fn(symmetric, backend, tile_size, unit),
        (query, key, s, row, None if col is None else col[offset: offset + m], labels),
        options=(symmetric, tile_size, unit), logits=b * m, backend=backend, max_logits=GATHER_MAX_LOGITS,
        borrow=(0, 1, 2, 3), static=(0, 1), token=True)


def _send_key_gradients(dk_rest: torch.Tensor, layout: RingLayout, group):
    """Start sending the gradient of the other ranks' keys (``dk_rest``, rank order, this rank's
    rows left out) to their owners and receiving theirs for this rank's keys, by one all-to-all:
    ``(work, received [(W - 1) m, c])``, unfinished (``work.wait()``)."""
    m, c = layout.key_sizes[layout.rank], dk_rest.shape[1]
    send = [0 if r == layout.rank else k for r, k in enumerate(layout.key_sizes)]
    recv = [0 if r == layout.rank else m for r in range(layout.world)]
    received = dk_rest.new_empty(((layout.world - 1) * m, c))
    work = dist.all_to_all_single(received, dk_rest.contiguous(), recv, send, group=group, async_op=True)
    return work, received


class GatherInfoNCEFunction(torch.autograd.Function):
    """The global InfoNCE from gathered keys; see the module doc. Owns its collectives, on every
    rank and in the same order (a rank without queries takes part with ``-inf`` statistics and
    zero gradients), with no autograd node of their own:

    - forward: the all-gather of the keys, then (symmetric) the all-gather of each rank's partial
      column statistics over its own queries, merged by a log-sum-exp into the global ones, then
      the all-reduce of the shares (not with diagonal labels: ``merge_fn``);
    - backward: (symmetric) the all-gather of the column weights ``b_j`` from the keys' owners
      (when no rank passed labels, of each rank's weight ``w``, one float, from which every rank
      forms them: ``diagonal_column_weights``), then the reduce-scatter of the float32 gradient
      of the gathered keys; or, with ``own_backward_early`` (the same on every rank), the
      all-to-all of the other ranks' keys' gradient (``_backward_rest``).

    **The own block's backward in the forward** (``own_backward_early``). Why (issue 17, 2 x H100,
    16k rows per GPU): the host reached the backward's first kernel ~0.25-0.5 ms after the GPU
    had finished the forward (the statistics' merge, autograd, the weight, the column weights'
    all-gather, the graph's input copies), and the reduce-scatter of all ``M`` rows sat after
    every kernel. With the own block's backward (half the backward's work) queued at the end of
    the forward, the GPU computes while the host gets to the backward; the backward's block over
    the other keys follows, and only their gradient is sent. Its outputs are its graph's buffers,
    not copies; a second forward before this one's backward replays that graph, and the backward
    then computes the block again (``outputs_intact``). Measured and dropped, the same day: the
    whole backward in the forward for ``g = 1``, checked in the backward by an all-gather of
    every rank's ``g`` (the host's read of it cost what the early launch saved), and the backward
    split into the other keys' block and the own one with the all-to-all between them (its
    transfer beside the own block's kernels slowed them as much as it hid): docs/distributed.md.

    Every logit is computed once per pass, for both directions, as in the ring. Holds the gathered
    keys and, in the backward, their float32 gradient: ``M c (e + 4)`` bytes for ``e``-byte
    features (``choose_algorithm`` caps it). With the own block's backward in the forward, also
    its float32 gradients (or sums), ``(b + m) c 4`` bytes, between the passes; in the backward,
    instead of the ``M c`` float32 gradient, the other keys' ``(M - m) c`` and what the all-to-all
    receives, ``(W - 1) m c``: the same on 2 ranks of equal sizes, up to twice that on more."""

    @staticmethod
    def forward(ctx, query, key, scale, labels, symmetric, backend, tile_size, layout, group, own=None,
                grad=False, staged=None):
        s = scale.detach()  # read on the device by the kernels: no host sync
        query, key = query.contiguous(), key.contiguous()
        b = query.shape[0]
        transport = peer_copy.peer_keys(group, layout, key.device)  # (the same on every rank)
        if transport is not None:  # one host: the copy engines, beside the own block's kernels
            key_all = transport.all_gather(key, layout, None if own is None else own.mark,
                                           *(staged if staged is not None else ()))
        else:
            key_all = all_gather_rows(key, layout.key_sizes, group)
        m, offset, num_keys = key.shape[0], layout.key_offset(), layout.num_keys
        diagonal = symmetric and layout.diagonal  # (the same on every rank: from the layout)
        row = col = pos = col_pos = payload = fwd_token = None
        # The local kernels, replayed from CUDA graphs where small shapes repeat. payload and pos
        # are read right away (the all-gather, the share): a replay may hand over its own
        # buffers; row is kept for the backward, a copy. The own block's statistics and its copy
        # of the query are its graph's buffers, read in place (static); the later graphs read the
        # forward graph's copies of the query and the keys (fwd_token, _graph_sources).
        if b and own is not None:  # the own block ran before the layout exchange (own_block_early)
            own_inputs = inputs_of(own.token)
            (row, payload, pos), fwd_token = run_graphed(
                "gather_rest", gather_rest_fn(symmetric, diagonal, backend, tile_size, offset, m),
                (query if own_inputs is None else own_inputs[0], key_all, s) + tuple(own.stats),
                options=(symmetric, diagonal, tile_size, offset, m), logits=b * (num_keys - m), backend=backend,
                max_logits=GATHER_MAX_LOGITS, borrow=(1, 2), static=(0, 3, 4, 5), token=True)
        elif b:
            (row, payload, pos), fwd_token = run_graphed(
                "gather_forward", gather_forward_fn(symmetric, diagonal, backend, tile_size, offset, m),
                (query, key_all, s, labels), options=(symmetric, diagonal, tile_size, offset, m),
                logits=b * num_keys, backend=backend, max_logits=GATHER_MAX_LOGITS, borrow=(1, 2), token=True)
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
        ctx.scale_shape = scale.shape
        ctx.options = (symmetric, backend, tile_size, layout, group)
        ctx.own_early = own_backward_early(layout)  # (the same on every rank)
        ctx.fwd_token = fwd_token
        own_grads, ctx.own_token = (), None
        if ctx.own_early and grad:  # the own block's backward for the unit weight (see the class doc)
            if b:
                q_in, _, k_in = _graph_sources(fwd_token, query, key_all, key, offset)
                own_grads, ctx.own_token = _own_backward(q_in, k_in, s, row, col, labels, layout, symmetric,
                                                         backend, tile_size)
            else:  # no queries: this rank's own block is empty (gradients, not sums: no factor)
                own_grads = (torch.zeros((0, query.shape[1]), device=query.device, dtype=_F32),
                             torch.zeros(key.shape, device=key.device, dtype=_F32),
                             torch.zeros((), device=s.device, dtype=_F32), None)
        ctx.save_for_backward(query, key, labels, row, col, s, key_all, *own_grads)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the distributed InfoNCE")
        query, key, labels, row, col, s, key_all, *own_grads = ctx.saved_tensors
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
        if ctx.own_early:
            if not own_grads:  # (the forward ran without autograd: no backward can reach here)
                raise RuntimeError("the distributed InfoNCE's forward kept no gradients; call it with "
                                   "autograd enabled to differentiate it")
            if b and not outputs_intact(ctx.own_token):  # a later call replayed the graph: again
                q_in, _, k_in = _graph_sources(ctx.fwd_token, query, key_all, key, layout.key_offset())
                own_grads, _ = _own_backward(q_in, k_in, s, row, col, labels, layout, symmetric, backend, tile_size)
            return _backward_rest(ctx, query, key, key_all, s, row, col, w, grad_col_all, sizes, own_grads, grad)
        if b:
            # d(key_all) is only read by the reduce-scatter below (a new tensor; the current
            # stream waits for it): a replay may hand over its own buffer instead of a copy
            # (M c float32 bytes, 64 MB at 32k keys).
            offset = layout.key_offset()
            q_in, k_all_in, _ = _graph_sources(ctx.fwd_token, query, key_all, key, offset)
            dq, dk_all, dscale = run_graphed(
                "gather_backward", gather_backward_fn(symmetric, backend, tile_size, offset, sizes),
                (q_in, k_all_in, s, row, col, w, grad_col_all, labels),
                options=(symmetric, tile_size, offset, sizes), logits=b * layout.num_keys, backend=backend,
                max_logits=GATHER_MAX_LOGITS, borrow=(1,), static=(0, 1))
        else:  # zeros keep this rank in the reduce-scatter
            dq = torch.zeros_like(query)
            dk_all = torch.zeros(key_all.shape, device=key.device, dtype=_F32)
            dscale = torch.zeros((), device=s.device, dtype=_F32)
        dk = reduce_scatter_rows(dk_all, layout.key_sizes, layout.rank, group)
        del dk_all
        return _backward_outputs(ctx, dq, dk.to(key.dtype), dscale)


def _backward_outputs(ctx, dq, dk, dscale):
    """``GatherInfoNCEFunction.backward``'s return: the gradients of the query, the key and the
    scale (in the scale's shape; ``None`` where it needs none), ``None`` for the other arguments."""
    dscale = dscale.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
    return dq, dk, dscale, None, None, None, None, None, None, None, None, None


def _backward_rest(ctx, query, key, key_all, s, row, col, w, grad_col_all, sizes, own_grads, grad):
    """``GatherInfoNCEFunction.backward`` when the forward computed the own block's backward for
    the unit weight (``own_grads``): the other ranks' keys' block for ``w``, its keys' gradient sent
    to their owners by an all-to-all, and the own block's times the upstream gradient."""
    symmetric, backend, tile_size, layout, group = ctx.options
    b, m, num_keys = query.shape[0], key.shape[0], layout.num_keys
    offset = layout.key_offset()
    g = grad.detach().to(_F32)
    dq_own, dk_own, ds_own, factor = own_grads  # (the own block's sums and their factor, or gradients)
    if b and num_keys > m:
        # dq and dscale come out summed with the own block's share times g. The other keys'
        # gradient is only read by the all-to-all, which this call waits for below, before any
        # later replay, and dq is copied out once the all-to-all is queued (its copy need not
        # delay it): a replay may hand over its own buffers.
        q_in, k_all_in, _ = _graph_sources(ctx.fwd_token, query, key_all, key, offset)
        (dq, dk_rest, dscale), graphed = run_graphed(
            "gather_backward_rest", rest_backward_fn(symmetric, backend, tile_size, offset, m, sizes),
            (q_in, k_all_in, s, row, col, w, grad_col_all, dq_own, ds_own, factor, g),
            options=(symmetric, tile_size, offset, m, sizes), logits=b * num_keys, backend=backend,
            max_logits=GATHER_MAX_LOGITS, borrow=(0, 1), static=(0, 1, 7, 8, 9), token=True)
        work, received = _send_key_gradients(dk_rest, layout, group)
        if graphed is not None:
            dq = dq.clone()
    else:  # zeros keep this rank in the all-to-all
        dk_rest = torch.zeros((num_keys - m, key.shape[1]), device=key.device, dtype=_F32)
        work, received = _send_key_gradients(dk_rest, layout, group)
        dq, dscale = own_share(query, s, dq_own, ds_own, factor, g)
        dq = dq.to(query.dtype)
    work.wait()  # (on CUDA: the current stream waits for the exchange, the host does not)
    del dk_rest
    if layout.world > 2:
        received = received.view(layout.world - 1, m, key.shape[1]).sum(0)
    dk = torch.addcmul(received, dk_own, own_sums_weight(factor, g), out=torch.empty_like(key))  # (one rounding)
    return _backward_outputs(ctx, dq, dk, dscale)


class RingInfoNCEFunction(torch.autograd.Function):
    """The global InfoNCE by the ring of key blocks (``ds_infcl.loss.ring``); see the module doc.
    Saves the inputs, the LSE vectors and the scale: O((b + m) c)."""

    @staticmethod
    def forward(ctx, query, key, scale, labels, symmetric, backend, tile_size, layout, group):
        s = scale.detach()
        query, key = query.contiguous(), key.contiguous()
        b = query.shape[0]
        options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)
        row, col = _ring_forward(query, key, s, None, options, layout, group)
        pos = col_pos = None
        if b:
            pos = positive_logits_forward(query, key, s, labels, options)
            col_pos = _positive_rows(col, labels, b) if symmetric else None
        loss = _share_and_sum(row if b else None, col_pos, pos, layout, group, query.device)
        ctx.save_for_backward(query, key, labels, row, col if symmetric else None, s)
        ctx.scale_shape = scale.shape
        ctx.options = (options, layout, group)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the distributed InfoNCE")
        query, key, labels, row, col, s = ctx.saved_tensors
        options, layout, group = ctx.options
        symmetric = options.compute_col
        b, m = query.shape[0], key.shape[0]
        w = _weight(grad, layout, symmetric)
        grad_col = column_weights(w, labels, b, m) if symmetric else None
        dq, dk, ds = _ring_backward(
            query, key, s, labels, options, layout, group, row, col, w.expand(b), grad_col,
            grad_pos=positive_weight(w, b, symmetric),
        )
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq.to(query.dtype), dk.to(key.dtype), dscale, None, None, None, None, None, None
