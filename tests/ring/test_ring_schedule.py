"""The ring's schedule in one process, with the P2P layer replaced by a recorder: each hop is
posted before the block is computed (overlapped) or after it, and waited for after; the right blocks are received, in the
right sizes and dtypes (features in their own dtype, statistics and ``dk`` in float32); column
statistics and ``dk`` end with a final hop home."""

from __future__ import annotations

import os

import pytest
import torch

import ds_infcl.loss.algorithm as algorithm
import ds_infcl.loss.ring_steps as steps
from ds_infcl.ops import LSEOptions
from ds_infcl.ring import RingLayout

WORLD, RANK = 3, 1
QUERY_SIZES, KEY_SIZES, C = (2, 3, 4), (4, 6, 8), 5


@pytest.fixture
def recorder(monkeypatch):
    events = []

    def post(send, recv, layout, group):
        events.append(("post", [(tuple(t.shape), t.dtype) for t in send],
                       [(tuple(t.shape), t.dtype) for t in recv]))
        return ["work"]

    def wait(works):
        if works:
            events.append(("wait",))

    def forward(query, key, scale, labels, options):
        events.append(("compute", key.shape[0], options.exclude_positive))
        col = torch.zeros(key.shape[0]) if options.compute_col else None
        return torch.zeros(query.shape[0]), col

    def backward(query, key, scale, row, col, grad_row, grad_col, labels, grad_pos, options):
        events.append(("compute", key.shape[0], options.exclude_positive))
        return torch.zeros(query.shape[0], C), torch.zeros(key.shape[0], C), torch.zeros(())

    monkeypatch.setattr(steps, "post_ring_shift", post)
    monkeypatch.setattr(steps, "wait_all", wait)
    monkeypatch.setattr(steps, "lse_forward", forward)
    monkeypatch.setattr(steps, "lse_backward", backward)
    return events


def _layout():
    return RingLayout(world=WORLD, rank=RANK, query_sizes=QUERY_SIZES, key_sizes=KEY_SIZES,
                      feature_dim=C, send_to=2, recv_from=0)


def _inputs():
    q = torch.zeros(QUERY_SIZES[RANK], C, dtype=torch.bfloat16)
    k = torch.zeros(KEY_SIZES[RANK], C, dtype=torch.bfloat16)
    return q, k


def _order(expected, overlap):
    """The overlapped schedule as written below, or each hop's post moved after its compute."""
    if overlap:
        return expected
    out = list(expected)
    for i in range(len(out) - 1):
        if out[i][0] == "post" and out[i + 1][0] == "compute":
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


@pytest.fixture(params=[True, False], ids=["overlap", "serial"])
def overlap(request, monkeypatch):
    monkeypatch.setattr(steps, "RING_OVERLAP", "1" if request.param else "0")
    return request.param


def test_forward_schedule(recorder, overlap):
    q, k = _inputs()
    steps._ring_forward(q, k, 2.0, None, LSEOptions(exclude_positive=True), _layout(), None)
    bf16, f32 = torch.bfloat16, torch.float32
    owners = [(RANK - t) % WORLD for t in range(WORLD)]  # 1, 0, 2
    expected = [
        # step 0: own block (positive excluded); the next key block (rank 0's) is received
        ("post", [((KEY_SIZES[1], C), bf16)], [((KEY_SIZES[0], C), bf16)]),
        ("compute", KEY_SIZES[owners[0]], True), ("wait",),
        # step 1: keys of rank 2 arrive; block 1's partial column LSE leaves, block 0's arrives
        ("post", [((KEY_SIZES[0], C), bf16), ((KEY_SIZES[1],), f32)],
         [((KEY_SIZES[2], C), bf16), ((KEY_SIZES[0],), f32)]),
        ("compute", KEY_SIZES[owners[1]], False), ("wait",),
        # step 2 (last): no keys left to fetch; block 0's partial leaves, block 2's arrives
        ("post", [((KEY_SIZES[0],), f32)], [((KEY_SIZES[2],), f32)]),
        ("compute", KEY_SIZES[owners[2]], False), ("wait",),
        # final hop: block 2's complete statistics go home, this rank's own arrive
        ("post", [((KEY_SIZES[2],), f32)], [((KEY_SIZES[1],), f32)]), ("wait",),
    ]
    assert recorder == _order(expected, overlap)


def test_backward_schedule(recorder, overlap):
    q, k = _inputs()
    row, col = torch.zeros(QUERY_SIZES[RANK]), torch.zeros(KEY_SIZES[RANK])
    dq, dk, ds = steps._ring_backward(q, k, 2.0, None, LSEOptions(), _layout(), None, row, col,
                                         torch.ones_like(row), None)
    assert dq.shape == (QUERY_SIZES[RANK], C) and dk.shape == (KEY_SIZES[RANK], C)
    assert dq.dtype == dk.dtype == torch.float32
    bf16, f32 = torch.bfloat16, torch.float32
    m0, m1, m2 = KEY_SIZES
    expected = [
        # keys travel with [col_lse; grad_col] (fp32 [2, m]); dk accumulators one hop behind
        ("post", [((m1, C), bf16), ((2, m1), f32)], [((m0, C), bf16), ((2, m0), f32)]),
        ("compute", m1, False), ("wait",),
        ("post", [((m0, C), bf16), ((2, m0), f32), ((m1, C), f32)],
         [((m2, C), bf16), ((2, m2), f32), ((m0, C), f32)]),
        ("compute", m0, False), ("wait",),
        ("post", [((m0, C), f32)], [((m2, C), f32)]),
        ("compute", m2, False), ("wait",),
        # final hop: block 2's complete dk goes home, this rank's own dk arrives
        ("post", [((m2, C), f32)], [((m1, C), f32)]), ("wait",),
    ]
    assert recorder == _order(expected, overlap)


def test_the_algorithm_is_chosen_by_size_and_can_be_pinned(monkeypatch):
    """Small per-rank batches take one all-gather and fused single-device calls, large ones the
    ring; DS_INFCL_ALGORITHM pins either (issue 17)."""
    from ds_infcl.ring import RingLayout

    def layout(b, world=2):
        return RingLayout(world=world, rank=0, query_sizes=(b,) * world, key_sizes=(b,) * world, feature_dim=512,
                          send_to=1, recv_from=1)

    monkeypatch.delenv("DS_INFCL_ALGORITHM", raising=False)
    # 2 ranks: gather up to GATHER_MAX_LOCAL rows per rank, the ring above (measured on H100s).
    assert algorithm.choose_algorithm(layout(algorithm.GATHER_MAX_LOCAL), 512, 2) == "gather"
    assert algorithm.choose_algorithm(layout(algorithm.GATHER_MAX_LOCAL + 1), 512, 2) == "ring"
    # More ranks: gather while the gathered keys and their float32 gradient fit the byte cap.
    def fits(b, world):
        return world * b * 512 * (2 + 4) <= algorithm.GATHER_MAX_BYTES

    assert algorithm.gather_bytes(layout(1000, world=4), 512, 2) == 4 * 1000 * 512 * 6
    assert algorithm.GATHER_MAX_LOCAL == 65536 and fits(65536, 2)  # (the cap on 2 ranks is the rows')
    big = 32768
    assert fits(big, 4) and not fits(big, 8)  # the default cap sits between these
    assert algorithm.choose_algorithm(layout(big, world=4), 512, 2) == "gather"
    assert algorithm.choose_algorithm(layout(big, world=8), 512, 2) == "ring"
    # One more row past the cap at 128 ranks: the ring, even for small per-rank batches.
    rows = algorithm.GATHER_MAX_BYTES // (128 * 512 * 6) + 1
    assert rows <= algorithm.GATHER_MAX_LOCAL
    assert algorithm.choose_algorithm(layout(rows - 1, world=128), 512, 2) == "gather"
    assert algorithm.choose_algorithm(layout(rows, world=128), 512, 2) == "ring"
    # The early own block's guess from a rank's own sizes (as if every rank held as many keys)
    # agrees with the choice wherever the sizes are equal, the byte cap included.
    for b, world in ((65536, 2), (65537, 2), (32768, 4), (32768, 8), (rows - 1, 128), (rows, 128)):
        predicted = algorithm.ring_predicted(world, b, b, 512, 2)
        assert predicted == (algorithm.choose_algorithm(layout(b, world=world), 512, 2) == "ring"), (b, world)
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "ring")
    assert algorithm.choose_algorithm(layout(16), 512, 2) == "ring"
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "gather")
    assert algorithm.choose_algorithm(layout(10**6), 512, 2) == "gather"
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "fast")
    with pytest.raises(ValueError, match="DS_INFCL_ALGORITHM"):
        algorithm.choose_algorithm(layout(16), 512, 2)


def test_the_fused_path_rejects_a_bad_algorithm_setting(monkeypatch):
    """ring_fused (the gather path's early own block, before the layout exchange) reads
    DS_INFCL_ALGORITHM as choose_algorithm does: a value that names no algorithm is an error, not
    "auto"."""
    from ds_infcl.loss import ring_fused

    q, k, s = torch.randn(4, C), torch.randn(6, C), torch.tensor(2.0)
    monkeypatch.setattr(ring_fused, "EARLY_MIN_LOGITS", 1)
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "fast")
    for world in (1, 2):
        with pytest.raises(ValueError, match="^DS_INFCL_ALGORITHM must be auto, ring or gather, got 'fast'$"):
            ring_fused.own_block_early(q, k, s, None, True, "torch", None, world)
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "ring")
    assert ring_fused.own_block_early(q, k, s, None, True, "torch", None, 2) is None
    monkeypatch.setenv("DS_INFCL_ALGORITHM", "gather")
    assert ring_fused.own_block_early(q, k, s, None, True, "torch", None, 2) is not None


def test_the_exchange_overlaps_small_blocks_only(monkeypatch):
    """auto: the hop's exchange runs beside the block's kernels up to RING_OVERLAP_MAX_ROWS rows in
    the largest block, after them above (measured, see overlap_exchange); 1 / 0 pin it."""
    n = steps.RING_OVERLAP_MAX_ROWS

    def layout(q, k):
        return RingLayout(world=2, rank=0, query_sizes=q, key_sizes=k, feature_dim=8, send_to=1, recv_from=1)

    monkeypatch.setattr(steps, "RING_OVERLAP", "auto")
    assert steps.overlap_exchange(layout((n, 1), (n, n)))
    assert not steps.overlap_exchange(layout((1, 1), (1, n + 1)))  # another rank's block decides
    assert not steps.overlap_exchange(layout((n + 1, 0), (0, 0)))
    monkeypatch.setattr(steps, "RING_OVERLAP", "1")
    assert steps.overlap_exchange(layout((10**6,) * 2, (10**6,) * 2))
    monkeypatch.setattr(steps, "RING_OVERLAP", "0")
    assert not steps.overlap_exchange(layout((1, 1), (1, 1)))
    monkeypatch.setattr(steps, "RING_OVERLAP", "yes")
    with pytest.raises(ValueError, match="DS_INFCL_RING_OVERLAP"):
        steps.overlap_exchange(layout((1, 1), (1, 1)))


def test_a_bad_overlap_setting_stops_the_import(monkeypatch):
    """DS_INFCL_RING_OVERLAP is checked when the module is imported (before any collective), and
    is part of the settings fingerprint the ranks compare with the layout."""
    import subprocess
    import sys

    env = {**os.environ, "DS_INFCL_RING_OVERLAP": "yes"}
    proc = subprocess.run([sys.executable, "-c", "import ds_infcl.loss.ring"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "DS_INFCL_RING_OVERLAP must be auto, 1 or 0, got 'yes'" in proc.stderr
    fingerprint = algorithm.algorithm_settings()
    monkeypatch.setattr(steps, "RING_OVERLAP", "0" if steps.RING_OVERLAP != "0" else "1")
    assert algorithm.algorithm_settings() != fingerprint


def test_a_bad_overlap_value_set_after_the_import_stops_the_call(monkeypatch):
    """RING_OVERLAP set on the module after the import (a script's switch) is checked again where
    it is read, with the same message."""
    layout = RingLayout(world=2, rank=0, query_sizes=(4, 4), key_sizes=(4, 4), feature_dim=8, send_to=1,
                        recv_from=1)
    monkeypatch.setattr(steps, "RING_OVERLAP", "on")
    with pytest.raises(ValueError, match="DS_INFCL_RING_OVERLAP must be auto, 1 or 0, got 'on'"):
        steps.overlap_exchange(layout)
    monkeypatch.setattr(steps, "RING_OVERLAP", "0")
    assert steps.overlap_exchange(layout) is False


def test_peer_copy_is_chosen_from_the_layout_and_off_by_default(monkeypatch):
    """The keys' copy-engine transport (ds_infcl.loss.peer_copy) is a decision every rank makes
    alike, from the settings and the layout: off unless DS_INFCL_PEER_COPY=1, only on CUDA, only
    from PEER_COPY_MIN_ROWS rows in the largest key block; where it is not wanted no collective
    runs (here: no process group at all)."""
    from ds_infcl.loss import peer_copy
    from ds_infcl.ring import RingLayout

    def layout(rows):
        return RingLayout(world=2, rank=0, query_sizes=(rows, 5), key_sizes=(rows, 5), feature_dim=8,
                          send_to=1, recv_from=1)

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    big, small = layout(peer_copy.PEER_COPY_MIN_ROWS), layout(peer_copy.PEER_COPY_MIN_ROWS - 1)
    assert peer_copy.PEER_COPY == "0" and not peer_copy._wanted(big, cuda)
    fingerprint = algorithm.algorithm_settings()
    monkeypatch.setattr(peer_copy, "PEER_COPY", "1")
    assert peer_copy._wanted(big, cuda) and not peer_copy._wanted(small, cuda) and not peer_copy._wanted(big, cpu)
    assert peer_copy.peer_keys(None, big, cpu) is None and peer_copy.mark(None, cpu) is None
    # no transport set up: nothing staged (the layout's tag stays 0), no collective
    assert peer_copy.transport_of(None, cuda) is None and peer_copy.transport_of(None, cpu) is None
    # the setting is one the ranks must share: part of the fingerprint they exchange
    assert algorithm.algorithm_settings() != fingerprint
