"""Peak memory per rank at 4 gloo ranks: the ring grows as (b + m) * c, the baselines as the
materialized logits (a small version of ``python -m ds_infcl.bench.ring_memory``)."""

from __future__ import annotations

import sys

import pytest

from ds_infcl.bench.ring_memory import format_table, measure

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]


def test_ring_memory_linear_baselines_quadratic():
    rows = measure(world=4, batch=[256, 512], impls=("infcl", "local", "vanilla"), c=64, tile=128,
                   timeout=240)
    print(format_table(rows))
    got = {(r["impl"], r["b"]): r for r in rows}
    for b in (256, 512):
        ring = got[("infcl", b)]
        # Inputs' gradients are pre-allocated; the ring holds about 7 feature-sized fp32 buffers
        # (dq, dk, a received block, dk accumulators) plus tile scratch (128 x 128 here).
        assert ring["extra_mib"] <= 8 * ring["features_mib"] + 1.0, format_table(rows)
        # The baselines hold at least one logits matrix: B x M (vanilla), b x M (local).
        assert got[("vanilla", b)]["extra_mib"] >= ring["global_logits_mib"], format_table(rows)
        assert got[("local", b)]["extra_mib"] >= ring["global_logits_mib"] / 4, format_table(rows)
    # Doubling b: the baselines grow about 4x, the ring about 2x (plus a constant).
    for impl in ("vanilla", "local"):
        assert got[(impl, 512)]["extra_mib"] >= 3 * got[(impl, 256)]["extra_mib"], format_table(rows)
    growth = got[("infcl", 512)]["extra_mib"] - got[("infcl", 256)]["extra_mib"]
    assert growth <= 8 * (got[("infcl", 512)]["features_mib"] - got[("infcl", 256)]["features_mib"]) + 0.5
    assert got[("infcl", 512)]["extra_mib"] * 10 <= got[("local", 512)]["extra_mib"], format_table(rows)
