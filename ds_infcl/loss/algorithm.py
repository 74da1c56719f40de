"""Which algorithm a distributed InfoNCE call takes (``"gather"`` or ``"ring"``, see the module doc
of ``ds_infcl.loss.ring``), the gather path's thresholds, and the fingerprint of the settings that
the ranks of a group must share.

Every choice here is a function of the layout, which every rank holds, and of settings that are
part of ``algorithm_settings()``: the ranks choose alike. Both ``ds_infcl.loss.ring`` and
``ds_infcl.loss.ring_fused`` read it; it imports neither.
"""

from __future__ import annotations

from ds_infcl import settings
from ds_infcl.ring import RingLayout

__all__ = ["GATHER_MAX_LOCAL", "GATHER_MAX_BYTES", "GATHER_OWN_BACKWARD_MIN_LOGITS", "choose_algorithm",
           "ring_for_local_size", "ring_predicted", "own_backward_early", "gather_bytes", "algorithm_settings"]

# The gather path while its buffers, the gathered keys and their float32 gradient
# (M c (e + 4) bytes), fit GATHER_MAX_BYTES and, on 2 ranks, the largest per-rank batch is at most
# GATHER_MAX_LOCAL rows (see choose_algorithm). Measured on 4 x H200 (c = 512, bf16, symmetric,
# one run each at 2 and 4 ranks, 2026-11-26; docs/distributed.md): on 4 ranks the gather path is
# faster at every size measured (4k-64k rows per rank: 3.0 vs 6.1 ms at 4k, 12.2 vs 13.1 at 16k,
# 47.2 vs 48.5 at 32k, 183.3 vs 185.7 at 64k), on 2 ranks up to 16k (2.9 vs 4.1 ms at 8k; 6.2 vs
# 6.3 at 16k) and the ring from 32k (23.5 vs 24.4 ms; 92.2 vs 109.9 at 64k). That 2-rank gap was
# the forward's grid (a second wave at b x 2b, since fixed): after it the two are even there
# (21.0 vs 21.1 ms at 32k, 81.4 vs 80.0 at 64k). Since the gather path's own block moved ahead of
# the layout exchange and its backward into the forward, it is faster on 2 ranks at 32k and 64k
# too (2 x H100, 2026-11-26, paired in one process: 18.0 vs 18.9 ms at 32k, 69.2 vs 70.3 at 64k),
# so the cap sits at the largest size measured, 65,536.
# The byte cap keeps the extra memory of the gather path at most 0.5 GiB (c = 512, bf16:
# M <= 174,762 keys); above it the ring's memory does not grow with the world size.
GATHER_MAX_LOCAL = settings.get("DS_INFCL_GATHER_MAX_LOCAL")
GATHER_MAX_BYTES = settings.get("DS_INFCL_GATHER_MAX_BYTES")
# The gather path runs its own block's backward in the forward (ds_infcl.loss.ring_fused) where
# some rank's own block (b_r m_r) has at least this many logits: see own_backward_early. Measured
# on 2 x H100 (c = 512, bf16, symmetric, 2026-11-26, docs/distributed.md), 192 calls each, paired
# in one process: 2.29 against 2.43 ms at 8,192 rows per rank, 4.92 against 4.97 at 16,384;
# 2.12 against 1.76 at 4,096, where the host's extra graph launch costs more than it hides.
GATHER_OWN_BACKWARD_MIN_LOGITS = settings.get("DS_INFCL_GATHER_OWN_BACKWARD_MIN_LOGITS")


def choose_algorithm(layout: RingLayout, dim: int, element_size: int) -> str:
    """``"gather"`` or ``"ring"`` for this call; the same on every rank (a function of the layout,
    which every rank holds). ``DS_INFCL_ALGORITHM=ring|gather`` pins it."""
    pinned = settings.get("DS_INFCL_ALGORITHM")
    if pinned != "auto":
        return pinned
    if gather_bytes(layout, dim, element_size) > GATHER_MAX_BYTES:
        return "ring"
    if ring_for_local_size(layout.world, max(max(layout.query_sizes), max(layout.key_sizes))):
        return "ring"
    return "gather"


def ring_for_local_size(world: int, largest: int) -> bool:
    """``choose_algorithm``'s rule on the per-rank batch: on 2 ranks, the ring once some rank holds
    more than ``GATHER_MAX_LOCAL`` rows (``largest``)."""
    return world <= 2 and largest > GATHER_MAX_LOCAL


def ring_predicted(world: int, b: int, m: int, dim: int, element_size: int) -> bool:
    """What ``choose_algorithm`` will pick, predicted from this rank's own sizes (as if every rank
    held ``m`` keys): the gather path's early own block (``ds_infcl.loss.ring_fused.own_block_early``)
    runs only where the gather path is expected. A wrong guess costs time, never correctness."""
    return ring_for_local_size(world, max(b, m)) or world * m * dim * (element_size + 4) > GATHER_MAX_BYTES


def own_backward_early(layout: RingLayout) -> bool:
    """Whether the gather path computes its own block's backward in the forward: the same on every
    rank (the layout and a setting in ``algorithm_settings``), since its backward's collectives
    follow (an all-to-all of the other keys' gradient instead of a reduce-scatter)."""
    return max(b * m for b, m in zip(layout.query_sizes, layout.key_sizes)) >= GATHER_OWN_BACKWARD_MIN_LOGITS


def gather_bytes(layout: RingLayout, dim: int, element_size: int) -> int:
    """Bytes the gather path holds per rank: the gathered keys and their float32 gradient."""
    return layout.num_keys * dim * (element_size + 4)


def algorithm_settings() -> int:
    """A fingerprint of this process's algorithm settings: every setting that ``ds_infcl.settings``
    marks "must match" (``DS_INFCL_ALGORITHM``, the gather thresholds, the ring's overlap setting
    and the keys' copy-engine transport), exchanged with the layout so that ranks launched with
    different values stop with an error naming them instead of running different collectives (a
    hang on NCCL)."""
    return settings.fingerprint()
