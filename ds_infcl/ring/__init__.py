"""Communication only: ring schedule, P2P exchange, size/metadata exchange (DESIGN.md section 4).

Imports torch.distributed through the group it is given; never ops, never models.
"""

from ds_infcl.ring.groups import group_rank, group_size

__all__ = ["group_rank", "group_size"]
