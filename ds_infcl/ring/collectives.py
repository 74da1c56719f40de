"""Autograd-aware collectives used by the loss paths (the names say so: ``*_with_grad``).

The data-parallel contract (DESIGN.md 3.1): each rank back-propagates only through its own
features, and DeepSpeed then takes the *mean* of parameter gradients over the ranks. So rank
``r`` must hold ``W * dL/dfeatures_r`` for the mean to equal the single-device gradient of the
global loss ``L``.

- :func:`global_sum_with_grad` turns per-rank *shares* of the loss (``sum_r share_r = L``) into
  the global value on every rank, with a backward that multiplies by ``W``.
- :func:`all_gather_with_grad` gathers variable-size blocks; its backward sums the gradients of
  all ranks (reduce-scatter, or all-reduce and slice as DisCo-CLIP does) without averaging.
- :func:`all_gather_nograd` / :func:`all_gather_blocks`: the same without gradient, with the
  sizes given or exchanged first.
- :func:`all_gather_rows` / :func:`reduce_scatter_rows`: the same two steps without autograd, for
  a Function that owns its backward (the fused InfoNCE of ``ds_infcl.loss.ring_fused``: no
  autograd node per collective, issue 17).

These are the package's only autograd collectives: the InfoNCE ring, the baselines, SigLIP and the
retrieval loss with false-negative masking all use them.
"""

from __future__ import annotations

from typing import List, Sequence, Union

import torch
import torch.distributed as dist

from ds_infcl.ring.layout import RingLayout, all_gather_single, reduce_scatter_single

__all__ = [
    "global_sum_with_grad", "all_gather_with_grad", "all_gather_nograd", "all_gather_blocks",
    "all_gather_rows", "reduce_scatter_rows",
]


class _GlobalSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, share, world, group):
        ctx.world = world
        out = share.detach().reshape(1).clone()
        if world > 1:
            dist.all_reduce(out, group=group)
        return out.reshape(share.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.world, None, None


def global_sum_with_grad(share: torch.Tensor, layout: Union[RingLayout, int], group=None) -> torch.Tensor:
    """Sum of a scalar over the ranks (forward); gradient times the world size (backward).

    Use on a rank's share of a loss whose shares add up to the global loss: every rank returns
    the global value, and after the data-parallel mean the gradients are exact. The backward
    assumes what the trainer does: every rank back-propagates the same upstream gradient through
    the (identical) global value. ``layout`` is a ``RingLayout`` or the group's size.
    """
    world = layout if isinstance(layout, int) else layout.world
    if world == 1:
        return share
    return _GlobalSum.apply(share, world, group)


def _gather_padded(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    world, rows = len(sizes), max(sizes)
    if x.shape[0] < rows:
        x = torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])
    out = x.new_empty((world * rows,) + tuple(x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    if all(s == rows for s in sizes):
        return out
    return torch.cat([out[i * rows : i * rows + s] for i, s in enumerate(sizes)])


def all_gather_blocks(x: torch.Tensor, group=None) -> List[torch.Tensor]:
    """Every rank's ``x`` as a list in rank order, when the row counts are not known in advance
    (one small all-gather of the counts first; trailing dims must agree). No gradient."""
    if not (dist.is_available() and dist.is_initialized()):
        return [x]
    world = dist.get_world_size(group)
    if world == 1:
        return [x]
    count = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    counts = count.new_empty(world)
    all_gather_single(counts, count, group=group)
    sizes = [int(n) for n in counts.tolist()]
    rows = max(max(sizes), 1)
    padded = x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])
    out = x.new_empty((world * rows,) + tuple(x.shape[1:]))
    all_gather_single(out, padded.contiguous(), group=group)
    return [out[i * rows : i * rows + s] for i, s in enumerate(sizes)]


def all_gather_nograd(x: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """Concatenation of every rank's ``x`` (``sizes[i]`` rows on rank ``i``), in rank order."""
    if len(sizes) == 1:
        return x
    return _gather_padded(x, sizes, group)


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, rank, group, reduce):
        ctx.sizes, ctx.rank, ctx.group, ctx.reduce = sizes, rank, group, reduce
        return _gather_padded(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, rank, group = ctx.sizes, ctx.rank, ctx.group
        if ctx.reduce == "all_reduce":  # DisCo-CLIP: sum the whole gradient, keep our slice
            start = sum(sizes[:rank])
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=group)
            return grad[start : start + sizes[rank]], None, None, None, None
        return reduce_scatter_rows(grad, sizes, rank, group), None, None, None, None


def all_gather_rows(x: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """Every rank's ``x`` (``sizes[i]`` rows on rank ``i``) concatenated in rank order, by one
    all-gather (padded to the largest block when sizes differ); no autograd."""
    return x if len(sizes) == 1 else _gather_padded(x, sizes, group)


def reduce_scatter_rows(grad: torch.Tensor, sizes: Sequence[int], rank: int, group=None) -> torch.Tensor:
    """The backward of :func:`all_gather_rows`: this rank's rows of ``grad`` summed over the ranks,
    by one reduce-scatter; no autograd."""
    if len(sizes) == 1:
        return grad
    rows = max(sizes)
    tail = tuple(grad.shape[1:])
    if all(s == rows for s in sizes):
        padded = grad.contiguous()
    else:
        padded = grad.new_zeros((len(sizes) * rows,) + tail)
        offset = 0
        for i, s in enumerate(sizes):
            padded[i * rows : i * rows + s] = grad[offset : offset + s]
            offset += s
    out = grad.new_empty((rows,) + tail)
    reduce_scatter_single(out, padded, group=group)
    return out[: sizes[rank]]


def all_gather_with_grad(
    x: torch.Tensor, layout_sizes: Sequence[int], rank: int, group=None, *, reduce: str = "reduce_scatter"
) -> torch.Tensor:
    """Differentiable concatenation of every rank's ``x`` (``layout_sizes[i]`` rows on rank ``i``).

    Backward: rank ``r`` receives the *sum over ranks* of the gradients of its rows, by a
    reduce-scatter (``reduce="reduce_scatter"``, as ``torch.distributed.nn.all_gather``) or by an
    all-reduce of the whole gradient followed by a slice (``reduce="all_reduce"``, DisCo-CLIP).
    """
    if reduce not in ("reduce_scatter", "all_reduce"):
        raise ValueError(f'reduce must be "reduce_scatter" or "all_reduce", got {reduce!r}')
    if len(layout_sizes) == 1:
        return x
    return _AllGatherWithGrad.apply(x, tuple(layout_sizes), rank, group, reduce)

