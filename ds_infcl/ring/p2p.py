"""Raw asynchronous ring exchange: send to the next rank, receive from the previous one.

One call posts every tensor of a hop as one batched P2P operation
(``torch.distributed.batch_isend_irecv``) and returns the pending work; the caller computes on
the current block and then waits. Peers are the *global* ranks stored in the layout, so any
subgroup works. Empty tensors are skipped on both sides (both know the sizes from the layout),
and one rank never communicates: there is nothing to post.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from ds_infcl.ring.layout import RingLayout

__all__ = ["post_ring_shift", "wait_all", "ring_shift"]


def post_ring_shift(
    send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], layout: RingLayout, group=None
) -> List["dist.Work"]:
    """Post ``send[i] -> rank + 1`` and ``recv[i] <- rank - 1`` for all ``i``; returns the works.

    ``send[i]`` on rank ``r`` must have the shape and dtype of ``recv[i]`` on rank ``r + 1``
    (message ``i`` carries tag ``i``). Nothing is posted with one rank.
    """
    if layout.world == 1:
        return []
    ops = []
    for tag, t in enumerate(send):
        if t.numel():
            ops.append(dist.P2POp(dist.isend, t.contiguous(), layout.send_to, group, tag))
    for tag, t in enumerate(recv):
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, layout.recv_from, group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


def wait_all(works: Sequence["dist.Work"]) -> None:
    """Wait for the works of :func:`post_ring_shift`."""
    for w in works:
        w.wait()


def ring_shift(
    send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], layout: RingLayout, group=None
) -> None:
    """Blocking :func:`post_ring_shift`."""
    wait_all(post_ring_shift(send, recv, layout, group))
