"""Peak memory per rank at 4 gloo ranks: the ring grows as (b + m) * c, infcl's gather path as the
gathered features (world x (b + m) * c), the baselines as the materialized logits (a small version
of ``python -m ds_infcl.bench.ring_memory``)."""

from __future__ import annotations

import sys

import pytest

from ds_infcl.bench.ring_memory import format_table, measure

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]


def test_ring_memory_linear_baselines_quadratic():
    # infcl picks the gather path at these small sizes (ds_infcl.loss.algorithm.choose_algorithm): each
    # algorithm is pinned and held to its own bound.
    world, c, tile = 4, 64, 128
    rows = measure(world=world, batch=[256, 512], impls=("infcl_ring", "infcl_gather", "local", "vanilla"),
                   c=c, tile=tile, timeout=240)
    print(format_table(rows))
    got = {(r["impl"], r["b"]): r for r in rows}
    mib = 2.0**20
    for b in (256, 512):
        ring = got[("infcl_ring", b)]
        # Inputs' gradients are pre-allocated; the ring holds about 7 feature-sized fp32 buffers
        # (dq, dk, a received block, dk accumulators) plus tile scratch (128 x 128 here).
        assert ring["extra_mib"] <= 8 * ring["features_mib"] + 1.0, format_table(rows)
        # The gather path holds every rank's features and their gradients (2 x world x the local
        # features) plus a tile of logits against all keys (tile x world*b fp32): linear in the
        # global batch, no b x M matrix.
        gather = got[("infcl_gather", b)]
        scratch = tile * world * b * 4 / mib
        assert gather["extra_mib"] <= 3 * world * gather["features_mib"] + scratch + 1.0, format_table(rows)
        # The baselines hold at least one logits matrix: B x M (vanilla), b x M (local).
        assert got[("vanilla", b)]["extra_mib"] >= ring["global_logits_mib"], format_table(rows)
        assert got[("local", b)]["extra_mib"] >= ring["global_logits_mib"] / 4, format_table(rows)
    # Doubling b: the baselines grow about 4x, the ring about 2x (plus a constant).
    for impl in ("vanilla", "local"):
        assert got[(impl, 512)]["extra_mib"] >= 3 * got[(impl, 256)]["extra_mib"], format_table(rows)
    d_features = got[("infcl_ring", 512)]["features_mib"] - got[("infcl_ring", 256)]["features_mib"]
    growth = got[("infcl_ring", 512)]["extra_mib"] - got[("infcl_ring", 256)]["extra_mib"]
    assert growth <= 8 * d_features + 0.5, format_table(rows)
    growth = got[("infcl_gather", 512)]["extra_mib"] - got[("infcl_gather", 256)]["extra_mib"]
    assert growth <= 3 * world * d_features + tile * world * 256 * 4 / mib + 0.5, format_table(rows)
    assert got[("infcl_ring", 512)]["extra_mib"] * 10 <= got[("local", 512)]["extra_mib"], format_table(rows)
    assert got[("infcl_gather", 512)]["extra_mib"] * 5 <= got[("local", 512)]["extra_mib"], format_table(rows)
