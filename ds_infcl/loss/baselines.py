"""Baseline loss implementations: the communication patterns of CLIP, OpenCLIP and DisCo-CLIP.

All three materialize logits (memory quadratic in the batch) and exist to be compared with the
ring (``impl="infcl"``). They keep the same contract (DESIGN.md 3.1): the global loss on every
rank, and after the data-parallel mean of gradients over ``group`` every gradient (features,
hence tower weights, and the scale) equals the single-device gradient on the global batch; with
unequal per-rank sizes (variable all-gather with padding) and local labels (converted to global
indices with the key offsets). Logits are computed in float32 whatever the feature dtype.

| name | logits per rank | backward communication |
| --- | --- | --- |
| ``vanilla`` | full ``[B, M]`` (and its transpose direction), every rank computes the whole loss | reduce-scatter of feature gradients |
| ``local`` | own rows ``[b, M]`` (+ ``[b, B]`` symmetric) | reduce-scatter (OpenCLIP ``gather_with_grad``) |
| ``disco`` | own rows ``[b, M]`` (+ ``[b, B]`` symmetric) | all-reduce of the gathered gradient, own slice kept (DisCo-CLIP) |

The peers' factors of ``W``, corrected here: OpenCLIP's default (``gather_with_grad=False``)
loses the gradient that flows through the other ranks' copies; DisCo-CLIP averages the gathered
gradient and then the data-parallel mean averages again. Here ``vanilla`` computes the whole loss
on every rank and sums the feature gradients over ranks (``W * dL/dF_r``, scale gradient
``dL/ds`` on every rank); ``local`` and ``disco`` compute each rank's share of the loss and turn
the shares into the global value with ``global_sum_with_grad`` (backward times ``W``).
"""

from __future__ import annotations

import torch

from ds_infcl.loss.registry import register_loss_impl
from ds_infcl.ops import labels_or_diagonal
from ds_infcl.ring import (
    all_gather_nograd,
    all_gather_with_grad,
    exchange_layout,
    global_sum_with_grad,
    resolve_group,
)

__all__ = ["vanilla_loss", "local_loss", "disco_loss"]


def _logits(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scale * (a.float() @ b.float().T)


@register_loss_impl("vanilla")
def vanilla_loss(query, key, scale, labels, *, symmetric, backend=None, group=None, tile_size=None):
    """CLIP: gather both sides with autograd; every rank computes the full ``[B, M]`` loss."""
    group = resolve_group(group)
    labels = labels_or_diagonal(labels, query.shape[0], query.device)
    layout = exchange_layout(query, key, group, protocol="vanilla", flags=int(symmetric))
    q_all = all_gather_with_grad(query, layout.query_sizes, layout.rank, group)
    k_all = all_gather_with_grad(key, layout.key_sizes, layout.rank, group)
    glabels = all_gather_nograd(labels + layout.key_offset(), layout.query_sizes, group)
    x = _logits(q_all, k_all, scale)  # [B, M]
    loss = torch.nn.functional.cross_entropy(x, glabels)
    if symmetric:
        pos = x[torch.arange(x.shape[0], device=x.device), glabels]
        loss = (loss + (torch.logsumexp(x, dim=0)[glabels] - pos).mean()) / 2
    return loss


def _local_share(query, key, scale, labels, symmetric, layout, group, reduce):
    b = query.shape[0]
    labels = labels_or_diagonal(labels, b, query.device)
    rows = torch.arange(b, device=query.device)
    k_all = all_gather_with_grad(key, layout.key_sizes, layout.rank, group, reduce=reduce)
    x = _logits(query, k_all, scale)  # [b, M]
    pos = x[rows, labels + layout.key_offset()]
    share = (torch.logsumexp(x, dim=1) - pos).sum() / layout.num_queries
    if symmetric:
        q_all = all_gather_with_grad(query, layout.query_sizes, layout.rank, group, reduce=reduce)
        xt = _logits(key[labels], q_all, scale)  # [b, B]: each positive key against all queries
        pos_t = xt[rows, rows + layout.query_offset()]
        share = (share + (torch.logsumexp(xt, dim=1) - pos_t).sum() / layout.num_queries) / 2
    return global_sum_with_grad(share, layout, group)


@register_loss_impl("local")
def local_loss(query, key, scale, labels, *, symmetric, backend=None, group=None, tile_size=None):
    """OpenCLIP ``local_loss=True, gather_with_grad=True``: own rows against gathered keys."""
    group = resolve_group(group)
    layout = exchange_layout(query, key, group, protocol="local", flags=int(symmetric))
    return _local_share(query, key, scale, labels, symmetric, layout, group, "reduce_scatter")


@register_loss_impl("disco")
def disco_loss(query, key, scale, labels, *, symmetric, backend=None, group=None, tile_size=None):
    """DisCo-CLIP: local rows, gathered features whose gradient is all-reduced (summed, not
    averaged) and sliced back to the owner."""
    group = resolve_group(group)
    layout = exchange_layout(query, key, group, protocol="disco", flags=int(symmetric))
    return _local_share(query, key, scale, labels, symmetric, layout, group, "all_reduce")
