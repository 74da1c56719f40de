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
- :func:`all_gather_packed` / :func:`reduce_scatter_packed`: raw (no autograd) gather of several
  row blocks in one collective, and the reduce-scatter of their gradients in one collective, for
  an autograd Function that owns its backward (the fused InfoNCE of ``ds_infcl.loss.ring_fused``:
  queries and keys in one all-gather instead of two, issue 17).

These are the package's only autograd collectives: the InfoNCE ring, the baselines, SigLIP and the
retrieval loss with false-negative masking all use them.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ds_infcl.ring.layout import RingLayout, all_gather_single, reduce_scatter_single

__all__ = [
    "global_sum_with_grad", "all_gather_with_grad", "all_gather_nograd", "all_gather_blocks",
    "all_gather_packed", "reduce_scatter_packed",
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
        start = sum(sizes[:rank])
        if ctx.reduce == "all_reduce":  # DisCo-CLIP: sum the whole gradient, keep our slice
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=group)
            return grad[start : start + sizes[rank]], None, None, None, None
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
        return out[: sizes[rank]], None, None, None, None


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


def _packed_rows(sizes_per_part: Sequence[Sequence[int]]) -> Tuple[List[int], int]:
    """Offsets of each part inside one rank's packed block and the block's row count (every part
    padded to its largest per-rank size, so that all ranks send blocks of one shape)."""
    offsets, rows = [], 0
    for sizes in sizes_per_part:
        offsets.append(rows)
        rows += max(sizes)
    return offsets, rows


def all_gather_packed(parts: Sequence[torch.Tensor], sizes_per_part: Sequence[Sequence[int]], group=None
                      ) -> List[torch.Tensor]:
    """Every rank's rows of each of ``parts`` (``[n_r, c]`` tensors of one dtype and ``c``), in rank
    order, by one all-gather: ``[sum_r sizes_per_part[j][r], c]`` for part ``j``. No gradient
    (pair with :func:`reduce_scatter_packed` in a backward). Padding rows are never read."""
    world = len(sizes_per_part[0])
    if world == 1:
        return list(parts)
    offsets, rows = _packed_rows(sizes_per_part)
    ref = parts[0]
    padded = any(len(set(sizes)) > 1 for sizes in sizes_per_part)
    if padded:
        send = ref.new_empty((rows,) + tuple(ref.shape[1:]))
        for off, t in zip(offsets, parts):
            send[off:off + t.shape[0]] = t
    else:
        send = torch.cat(list(parts)) if len(parts) > 1 else parts[0].contiguous()
    out = ref.new_empty((world * rows,) + tuple(ref.shape[1:]))
    all_gather_single(out, send, group=group)
    blocks = out.view((world, rows) + tuple(ref.shape[1:]))
    gathered = []
    for off, sizes in zip(offsets, sizes_per_part):
        if not padded and len(parts) == 1:
            gathered.append(out)
        elif not padded:
            gathered.append(blocks[:, off:off + sizes[0]].reshape((-1,) + tuple(ref.shape[1:])))
        else:
            gathered.append(torch.cat([blocks[r, off:off + n] for r, n in enumerate(sizes)]))
    return gathered


def reduce_scatter_packed(grads: Sequence[torch.Tensor], sizes_per_part: Sequence[Sequence[int]], rank: int,
                          group=None) -> List[torch.Tensor]:
    """The backward of :func:`all_gather_packed`: ``grads[j]`` (gradient of gathered part ``j``,
    rank-ordered rows) summed over the ranks, by one reduce-scatter; returns this rank's rows of
    each part (views into one buffer)."""
    world = len(sizes_per_part[0])
    if world == 1:
        return list(grads)
    offsets, rows = _packed_rows(sizes_per_part)
    ref = grads[0]
    tail = tuple(ref.shape[1:])
    padded = any(len(set(sizes)) > 1 for sizes in sizes_per_part)
    if padded:
        buf = ref.new_zeros((world, rows) + tail)
        for off, sizes, g in zip(offsets, sizes_per_part, grads):
            start = 0
            for r, n in enumerate(sizes):
                buf[r, off:off + n] = g[start:start + n]
                start += n
    elif len(grads) == 1:
        buf = ref.contiguous()
    else:
        buf = torch.cat([g.reshape((world, sizes[0]) + tail) for g, sizes in zip(grads, sizes_per_part)], dim=1)
    out = ref.new_empty((rows,) + tail)
    reduce_scatter_single(out, buf.reshape((world * rows,) + tail), group=group)
    return [out[off:off + sizes[rank]] for off, sizes in zip(offsets, sizes_per_part)]
