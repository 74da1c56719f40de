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
by the world size and the largest per-rank batch (thresholds measured on H200s, in
``ds_infcl.loss.algorithm``); the
environment variable ``DS_INFCL_ALGORITHM`` (``ring`` / ``gather``) pins it, and
``last_algorithm()`` reports the last choice.

Gradient semantics: ``ring_lse`` returns to rank ``r`` the gradient of ``sum over ranks`` of the
objectives each rank built on its outputs. The InfoNCE (``ring_infonce``) is the sum of per-rank
shares, all-reduced into the global value, with a backward that multiplies by ``W`` (as
``global_sum_with_grad``): after the data-parallel mean every gradient equals the single-device
one. Each algorithm runs as one autograd Function (``ds_infcl.loss.ring_fused``): the positive
logits and the composition of the shares cost the host no autograd nodes of their own (issue 17).

Modules: the ring's steps are ``ds_infcl.loss.ring_steps``, the choice of algorithm
``ds_infcl.loss.algorithm``; both sit below this module and ``ring_fused``, and this module imports
``ring_fused`` (never the other way).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ds_infcl.loss import peer_copy, ring_fused
from ds_infcl.loss.algorithm import algorithm_settings, choose_algorithm
from ds_infcl.loss.ring_steps import _ring_backward, _ring_forward
from ds_infcl.ops import LSEOptions, resolve_backend
from ds_infcl.ops.lse import refuse_double_backward
from ds_infcl.ring import (
    agree_on_input_errors, agree_on_value_checks, exchange_layout, group_size, layout_flags, resolve_group,
)

__all__ = ["RingLSEFunction", "ring_lse", "ring_infonce"]


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
    checks=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row LSE ``[b]`` over all keys of all ranks and column LSE ``[m]`` over all queries.

    Inputs are validated locally by the caller (``ds_infcl.loss.lse``); the cross-rank check of
    dims, dtypes and sizes runs here, on every call, and raises on every rank. ``scale_t`` is a
    0-dim float tensor; ``options`` (``backend`` may be ``"auto"``) as for ``lse_forward``. The
    gradient that reaches rank ``r`` is that of the *sum over ranks* of the objectives built on the
    outputs (see the module doc for the factor ``W`` of the data-parallel contract). ``checks``:
    the value checks the caller queued, agreed on by every rank right after the layout exchange
    (``agree_on_value_checks``), as ``ring_infonce`` does.
    """
    group = resolve_group(group)
    options = options.replace(backend=_resolve_backend(options.backend, query.device, group))
    layout = exchange_layout(
        query, key, group, protocol="ring_lse",
        flags=layout_flags(exclude_positive=options.exclude_positive, compute_col=options.compute_col,
                     agree=checks is not None),
    )
    if checks is not None:
        agree_on_value_checks(checks, layout, group, query.device)
    row, col = RingLSEFunction.apply(query, key, scale_t, labels, options, layout, group)
    return row, (col if options.compute_col else None)


_LAST = {"algorithm": None}


def last_algorithm() -> Optional[str]:
    """The algorithm the last ``ring_infonce`` call on this process used (``"ring"``/``"gather"``)."""
    return _LAST["algorithm"]


def _exchange(query, key, labels, symmetric, group, own, agree):
    """``(layout, staged)``: the layout exchange of ``ring_infonce`` (``agree``: whether this call
    agrees on its value checks, which every rank must do alike), and where the group has a
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
            flags=layout_flags(exclude_positive=False, compute_col=symmetric, agree=agree), settings=algorithm_settings(),
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
    checks=None,
) -> torch.Tensor:
    """Global InfoNCE across ranks: the global loss on every rank, exact gradients after the
    data-parallel mean (``labels`` are local indices, so a positive lives on its query's rank;
    ``None``: the diagonal). By the ring, or by one all-gather where the features are small
    (``choose_algorithm``). ``checks``: the value checks the caller queued, agreed on by every rank
    in the first collective after the layout exchange (``agree_on_value_checks``; the caller reads
    them once the forward is queued)."""
    group = resolve_group(group)
    backend = _resolve_backend(backend, query.device, group)
    if labels is not None:
        labels = labels.to(device=query.device, dtype=torch.long)
    query, key = query.contiguous(), key.contiguous()
    own = ring_fused.own_block_early(query, key, scale_t, labels, symmetric, backend, tile_size, group_size(group),
                                     group)
    layout, staged = _exchange(query, key, labels, symmetric, group, own, checks is not None)
    if checks is not None:
        agree_on_value_checks(checks, layout, group, query.device)
    algorithm = choose_algorithm(layout, query.shape[1], query.element_size())
    _LAST["algorithm"] = algorithm
    if algorithm == "gather":
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or scale_t.requires_grad)
        return ring_fused.GatherInfoNCEFunction.apply(query, key, scale_t, labels, symmetric, backend, tile_size,
                                                      layout, group, own, grad, staged)
    return ring_fused.RingInfoNCEFunction.apply(query, key, scale_t, labels, symmetric, backend, tile_size, layout,
                                                group)
