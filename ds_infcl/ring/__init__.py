"""Communication only: ring schedule, P2P exchange, size/metadata exchange (DESIGN.md section 4).

Imports torch.distributed through the group it is given; never ops, never models, never
deepspeed (:func:`default_group` only looks at ``sys.modules``).

- ``groups``: ``group=None`` resolution (DeepSpeed's data-parallel group when set up), sizes,
  ranks, global peer ranks.
- ``layout``: the per-call size/metadata exchange and cross-rank check (:class:`RingLayout`).
- ``p2p``: raw async ring shift (post before compute, wait after).
- ``collectives``: autograd-aware collectives (global loss from shares, all-gather with grad).
"""

from ds_infcl.ring.collectives import (
    all_gather_blocks,
    all_gather_nograd,
    all_gather_rows,
    all_gather_with_grad,
    global_sum_with_grad,
    reduce_scatter_rows,
)
from ds_infcl.ring.groups import default_group, global_rank, group_rank, group_size, resolve_group
from ds_infcl.ring.layout import (
    PROTOCOLS,
    RingLayout,
    agree_on_input_errors,
    agree_on_value_checks,
    comm_device,
    exchange_layout,
    layout_flags,
)
from ds_infcl.ring.p2p import post_ring_shift, ring_shift, wait_all

__all__ = [
    "PROTOCOLS",
    "RingLayout",
    "agree_on_input_errors",
    "agree_on_value_checks",
    "all_gather_blocks",
    "all_gather_nograd",
    "all_gather_rows",
    "all_gather_with_grad",
    "comm_device",
    "default_group",
    "exchange_layout",
    "global_rank",
    "global_sum_with_grad",
    "group_rank",
    "group_size",
    "layout_flags",
    "post_ring_shift",
    "reduce_scatter_rows",
    "resolve_group",
    "ring_shift",
    "wait_all",
]
