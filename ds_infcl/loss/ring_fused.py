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
queries, ``pos_i = s q_i . k_{l_i}``. The forward all-reduces the share (every rank returns ``L``);
the backward, with upstream ``g``, uses the weight ``w = g W f / B`` (the ``W`` of the data-parallel
contract, see ``ds_infcl.ring.collectives``) for every LSE term and ``-w`` per direction for each
positive logit.

- Gather (``GatherInfoNCEFunction``): the Function all-gathers the keys ``K_all`` (and, symmetric,
  the queries ``Q_all``) in its forward and reduce-scatters their gradients in its backward, on
  every rank and in the same order; a rank without queries reduce-scatters zeros, which keeps the
  collectives paired without extra graph terms. ``row = lse(Q_r, K_all)``,
  ``col' = lse(K_r[l], Q_all)`` (``K_r`` itself for the diagonal with one key per query: no
  copy). The positive of query i is key ``key_offset + l_i`` of ``K_all``, so the row
  direction's backward adds the positive terms.
- Ring (``RingInfoNCEFunction``): ``ds_infcl.loss.ring``'s forward and backward ring steps with
  ``a = w``, ``b_j = w * #{i : l_i = j}`` and the positive terms on the own block.

Both are differentiable once: their backward's collectives and kernels build no graph, so a
second derivative raises (``refuse_double_backward``) instead of silently missing terms.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ds_infcl.loss.ring import _ring_backward, _ring_forward, refuse_double_backward
from ds_infcl.ops import lse_backward, lse_forward, positive_logits_forward
from ds_infcl.ring import RingLayout, all_gather_rows, reduce_scatter_rows

__all__ = ["GatherInfoNCEFunction", "RingInfoNCEFunction"]

_F32 = torch.float32


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


class GatherInfoNCEFunction(torch.autograd.Function):
    """The global InfoNCE from gathered features; see the module doc. Owns its collectives: the
    all-gather of the keys (and, symmetric, of the queries) in the forward, the reduce-scatter of
    their gradients in the backward, on every rank (a rank without queries sends and receives
    zeros), with no autograd node of their own. Holds the gathered features: O((B + M) c)."""

    @staticmethod
    def forward(ctx, query, key, scale, labels, symmetric, backend, tile_size, layout, group):
        s = scale.detach()  # read on the device by the kernels: no host sync
        b = query.shape[0]
        key_all = all_gather_rows(key, layout.key_sizes, group)
        query_all = all_gather_rows(query, layout.query_sizes, group) if symmetric else None
        row = col = pos = None
        if b:
            row, _ = lse_forward(query, key_all, s, compute_col=False, backend=backend, tile_size=tile_size)
            pos = positive_logits_forward(query, key, s, labels, backend=backend, tile_size=tile_size)
            if symmetric:
                col, _ = lse_forward(_positive_rows(key, labels, b), query_all, s, compute_col=False,
                                     backend=backend, tile_size=tile_size)
        loss = _share_and_sum(row, col, pos, layout, group, query.device)
        ctx.save_for_backward(query, key, labels, row, col, s, query_all, key_all)
        ctx.scale_shape = scale.shape
        ctx.options = (symmetric, backend, tile_size, layout, group)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the distributed InfoNCE")
        query, key, labels, row, col, s, query_all, key_all = ctx.saved_tensors
        symmetric, backend, tile_size, layout, group = ctx.options
        b = query.shape[0]
        # Every rank runs the same collectives in the same order (keys, then queries); each
        # gathered gradient is reduce-scattered as soon as it is complete, so that at most one of
        # them is alive at a time.
        if b == 0:  # zeros keep this rank in the reduce-scatters
            dk = reduce_scatter_rows(torch.zeros_like(key_all), layout.key_sizes, layout.rank, group)
            dq = torch.zeros_like(query)
            if symmetric:
                dq = reduce_scatter_rows(torch.zeros_like(query_all), layout.query_sizes, layout.rank, group)
            dscale = None
            if ctx.needs_input_grad[2]:
                dscale = torch.zeros(ctx.scale_shape, device=s.device, dtype=_F32)
            return dq, dk, dscale, None, None, None, None, None, None
        w = _weight(grad, layout, symmetric)
        wb = w.expand(b)
        # Query i's positive is key key_offset + l_i of key_all: its terms join the row direction.
        offset = layout.key_offset()
        if labels is not None:
            lab_all = labels + offset if offset else labels
        else:
            lab_all = torch.arange(offset, offset + b, device=query.device) if offset else None
        dq, dk_all, dscale = lse_backward(
            query, key_all, s, row, None, wb, None, labels=lab_all,
            grad_pos=(w * (-2.0 if symmetric else -1.0)).expand(b), out_dtype=query.dtype,
            backend=backend, tile_size=tile_size,
        )
        dk = reduce_scatter_rows(dk_all, layout.key_sizes, layout.rank, group)
        del dk_all
        if symmetric:
            dkp, dq_all, ds_col = lse_backward(
                _positive_rows(key, labels, b), query_all, s, col, None, wb, None,
                out_dtype=query.dtype, backend=backend, tile_size=tile_size,
            )
            dq.add_(reduce_scatter_rows(dq_all, layout.query_sizes, layout.rank, group))
            del dq_all
            dscale = dscale + ds_col
            if labels is None:  # the diagonal: key i (a slice when there are more keys)
                dk[:b].add_(dkp)
            else:
                dk.index_add_(0, labels, dkp)
        dscale = dscale.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq, dk, dscale, None, None, None, None, None, None


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
        grad_col = None
        if symmetric:  # w per query whose positive is key j (no bincount: that would sync)
            if labels is None and m == b:
                grad_col = w.expand(m)
            else:
                grad_col = torch.zeros((m,), device=key.device, dtype=_F32)
                if labels is None:
                    grad_col[:b] = w
                else:
                    grad_col.index_add_(0, labels, w.expand(b))
        dq, dk, ds = _ring_backward(
            query, key, s, labels, False, symmetric, backend, tile_size, layout, group, row, col,
            w.expand(b), grad_col, grad_pos=(w * (-2.0 if symmetric else -1.0)).expand(b),
        )
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq.to(query.dtype), dk.to(key.dtype), dscale, None, None, None, None, None, None
