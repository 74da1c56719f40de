"""The layout exchange through the host's shared memory (``ds_infcl.ring.host_exchange``), on gloo
ranks of one host with ``MODE = "1"``: the same layouts as the process group's all-gather over
calls whose sizes change on every rank, a failed input check that stops every rank, a rank that
never arrives (an error naming it, not a hang, after the process group's own timeout where that is
shorter than the setting), ranks that disagree on the setting (both fall back), the loss over it
against the reference, and a destroyed group's channel unmapped at the next exchange."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.ring.ring_harness import spawn

C = 8


def _sizes(call: int, rank: int):
    return 1 + (3 * call + 5 * rank) % 7, (2 * call + rank) % 5  # (a rank with no keys now and then)


def _layouts(rank, world, payload):
    from ds_infcl.ring import host_exchange
    from ds_infcl.ring.layout import exchange_layout

    host_exchange.MODE = payload["mode"][rank]
    seen, between = [], []
    for call in range(8):  # more calls than slots: every slot written again
        b, m = _sizes(call, rank)
        layout = exchange_layout(torch.zeros(b, C), torch.zeros(m, C), None,
                                 staged=100 * call + rank, between=lambda: between.append(call))
        seen.append((layout.query_sizes, layout.key_sizes, layout.staged))
    return {"seen": seen, "between": between, "channel": host_exchange._STATES.values()[0].ready}


@pytest.mark.parametrize("modes, used", [(("1", "1", "1"), True), (("1", "0", "1"), False)])
def test_layouts_over_shared_memory_match_every_rank(modes, used):
    """Every rank gets every rank's sizes and tags of each call, in rank order (the first two calls
    over the process group, which set the channel up, the others over it); ``between`` runs once
    per call; a rank that does not want the channel makes every rank use the process group."""
    results = spawn(_layouts, 3, {"mode": modes}, timeout=120)
    for rank, res in enumerate(results):
        assert res["channel"] is used, (rank, res["channel"])
        assert res["between"] == list(range(8))
        for call, (qs, ks, staged) in enumerate(res["seen"]):
            want = [_sizes(call, r) for r in range(3)]
            assert qs == tuple(b for b, _ in want), (rank, call)
            assert ks == tuple(m for _, m in want), (rank, call)
            assert staged == tuple(100 * call + r for r in range(3)), (rank, call)


def _input_error(rank, world, payload):
    from ds_infcl.ring import host_exchange
    from ds_infcl.ring.layout import agree_on_input_errors, exchange_layout

    host_exchange.MODE = "1"
    for _ in range(2):  # (the channel set up)
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    try:
        if rank == 1:
            with agree_on_input_errors():
                raise ValueError("rank 1's own input error")
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    except ValueError as err:
        after = exchange_layout(torch.zeros(3, C), torch.zeros(1, C), None)  # still in step
        return str(err), after.query_sizes
    return "no error", None


def test_a_rank_that_rejects_its_inputs_stops_every_rank_over_shared_memory():
    (msg0, after0), (msg1, after1) = spawn(_input_error, 2, None, timeout=90)
    assert "rank(s) [1]" in msg0 and "rejected their local inputs" in msg0, msg0
    assert msg1 == "rank 1's own input error"
    assert after0 == after1 == (3, 3)


def _rank1_misses_a_call(rank, absent_s):
    """After the channel is set up, rank 1 sleeps ``absent_s`` and leaves (one loss call fewer than
    rank 0); rank 0 returns (the error of its exchange, seconds it waited)."""
    from ds_infcl.ring.layout import exchange_layout

    for _ in range(2):  # (the channel set up)
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    if rank == 1:  # calls the loss once fewer than rank 0
        time.sleep(absent_s)
        return "left"
    start = time.monotonic()
    try:
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    except RuntimeError as err:
        return str(err), time.monotonic() - start
    return "no error", 0.0


def _missing(rank, world, payload):
    from ds_infcl.ring import host_exchange

    host_exchange.MODE, host_exchange.TIMEOUT_S = "1", 1.0
    return _rank1_misses_a_call(rank, 3.0)


def test_a_rank_that_never_arrives_is_an_error_naming_it():
    (msg, waited), left = spawn(_missing, 2, None, timeout=90)
    assert left == "left"
    assert "rank(s) [1]" in msg and "DS_INFCL_LAYOUT_SHM_TIMEOUT=1 s" in msg, msg
    assert 1.0 <= waited < 2.5, waited


def _one_exchange(rank, world, payload):
    from ds_infcl.ring import host_exchange
    from ds_infcl.ring.layout import exchange_layout

    host_exchange.MODE = "1"
    exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)  # the first of the two setup calls
    token = host_exchange._STATES.values()[0].token
    return host_exchange._path(token) if token else None


def test_a_group_with_one_exchange_leaves_no_file_name():
    """Rank 0 removes the file's name after the second exchange; a process that leaves after the
    first (here through ``exit_process``, which skips the exit handlers, as the trainer and the
    benchmarks leave) removes it on the way out."""
    path, _ = spawn(_one_exchange, 2, None, timeout=90)
    assert path is not None and os.path.basename(path).startswith("ds_infcl_layout_")
    assert not os.path.exists(path), path


def _loss(rank, world, payload):
    from ds_infcl.loss import contrastive_loss
    from ds_infcl.ring import host_exchange

    host_exchange.MODE = "1"
    out = []
    for call, b in enumerate((5, 3, 6, 4)):  # sizes differ per rank and per call
        g = torch.Generator().manual_seed(10 * call + rank)
        q = torch.nn.functional.normalize(torch.randn(b + rank, C, generator=g), dim=1)
        k = torch.nn.functional.normalize(torch.randn(b + rank, C, generator=g), dim=1)
        q.requires_grad_(True)
        k.requires_grad_(True)
        loss = contrastive_loss(q, k, torch.tensor(7.0), symmetric=True, impl="infcl",
                                backend="torch")
        loss.backward()
        out.append((q.detach(), k.detach(), loss.detach(), q.grad, k.grad))
    return out, host_exchange._STATES.values()[0].ready


def test_the_loss_over_shared_memory_matches_the_reference():
    """The global symmetric InfoNCE (unequal sizes per rank and per call) with its layouts over
    shared memory: the loss and the gradients of the data-parallel contract (each rank's
    gradient is the world size times the global loss's gradient of its rows)."""
    results = spawn(_loss, 2, None, timeout=120)
    assert all(used for _, used in results)
    for call in range(4):
        parts = [res[0][call] for res in results]
        q = torch.cat([p[0] for p in parts]).double().requires_grad_(True)
        k = torch.cat([p[1] for p in parts]).double().requires_grad_(True)
        logits = 7.0 * q @ k.T
        target = torch.arange(len(q))
        ref = 0.5 * (torch.nn.functional.cross_entropy(logits, target)
                     + torch.nn.functional.cross_entropy(logits.T, target))
        ref.backward()
        start = 0
        for p in parts:
            n = len(p[0])
            assert torch.allclose(p[2].double(), ref.detach(), rtol=1e-5, atol=1e-6)
            assert torch.allclose(p[3].double() / 2, q.grad[start: start + n], rtol=1e-4, atol=1e-6)
            assert torch.allclose(p[4].double() / 2, k.grad[start: start + n], rtol=1e-4, atol=1e-6)
            start += n


def test_a_bad_setting_stops_the_import():
    import subprocess
    import sys

    for name, value, want in (("DS_INFCL_LAYOUT_SHM", "yes", "must be auto, 0 or 1, got 'yes'"),
                              ("DS_INFCL_LAYOUT_SHM_TIMEOUT", "0", "must be a number of seconds > 0, got '0'")):
        r = subprocess.run([sys.executable, "-c", "import ds_infcl.ring"], env=dict(os.environ, **{name: value}),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"{name} {want}" in r.stderr, r.stderr


def _missing_short_group_timeout(rank, world, payload):
    from ds_infcl.ring import host_exchange

    host_exchange.MODE = "1"  # DS_INFCL_LAYOUT_SHM_TIMEOUT left at its default, 1800 s
    result = _rank1_misses_a_call(rank, 5.0)
    return result if rank == 1 else (*result, host_exchange.TIMEOUT_S)


def test_the_wait_ends_at_the_process_groups_own_timeout():
    """A library user's group made with ``timeout=2 s`` (no watchdog of the trainer): a rank that
    never arrives is an error after about 2 s, not after DS_INFCL_LAYOUT_SHM_TIMEOUT's 1,800 s."""
    (msg, waited, setting), left = spawn(_missing_short_group_timeout, 2, None, timeout=120, pg_timeout=2.0)
    assert left == "left" and setting == 1800.0
    assert "rank(s) [1]" in msg and "the process group's timeout of 2 s" in msg, msg
    assert 2.0 <= waited < 4.0, waited


def _mapped_layout_files():
    with open("/proc/self/maps") as f:
        return sum("ds_infcl_layout_" in line for line in f)


def _destroyed(rank, world, payload):
    import torch.distributed as dist

    from ds_infcl.ring import host_exchange
    from ds_infcl.ring.layout import exchange_layout

    host_exchange.MODE = "1"
    sub = dist.new_group([0, 1])
    for _ in range(3):  # set up, then one exchange over the channel
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), sub)
    state = host_exchange._STATES.get(sub)
    channel = state.channel
    ready, mapped = state.ready, _mapped_layout_files()
    dist.destroy_process_group(sub)
    del sub
    after_destroy = _mapped_layout_files()  # nothing happens until the next exchange
    for _ in range(3):  # the next exchange (any group) releases the destroyed group's channel
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    out = dict(ready=ready, mapped=mapped, after_destroy=after_destroy, after_next=_mapped_layout_files(),
               map_closed=channel._map.closed, channel=state.channel, states=len(host_exchange._STATES.values()),
               world_ready=host_exchange._STATES.get(None).ready, released_again=host_exchange.release_destroyed_groups())
    # The whole world destroyed, then made again (a new default group): its first exchange releases
    # the old world's channel; release_destroyed_groups() does it at once.
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{payload}/store", rank=rank, world_size=world)
    for _ in range(3):
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    out.update(after_reinit=_mapped_layout_files(), states_after_reinit=len(host_exchange._STATES.values()))
    dist.destroy_process_group()
    out.update(released_at_end=host_exchange.release_destroyed_groups(), mapped_at_end=_mapped_layout_files())
    return out


def test_a_destroyed_groups_channel_is_unmapped():
    """Channels of destroyed groups used to stay mapped until the process ended; now the next
    exchange releases them (the world group's own channel, made then, stays)."""
    import tempfile

    with tempfile.TemporaryDirectory() as store:
        results = spawn(_destroyed, 2, store, timeout=120)
    for rank, res in enumerate(results):
        assert res["ready"] and res["mapped"] == 1 and res["after_destroy"] == 1, (rank, res)
        assert res["map_closed"] and res["channel"] is None, (rank, res)
        assert res["after_next"] == 1 and res["world_ready"] and res["states"] == 1, (rank, res)  # the world's
        assert res["released_again"] == 0, (rank, res)
        assert res["after_reinit"] == 1 and res["states_after_reinit"] == 1, (rank, res)
        assert res["released_at_end"] == 1 and res["mapped_at_end"] == 0, (rank, res)


def _reinit(rank, world, payload):
    import torch.distributed as dist

    from ds_infcl.ring import host_exchange
    from ds_infcl.ring.layout import exchange_layout

    host_exchange.MODE = "1"
    for _ in range(3):
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    dist.destroy_process_group()  # no group but the world's: the registry's counts look the same after
    dist.init_process_group("gloo", init_method=f"file://{payload}/store", rank=rank, world_size=world)
    for _ in range(3):
        exchange_layout(torch.zeros(2, C), torch.zeros(2, C), None)
    return _mapped_layout_files(), len(host_exchange._STATES.values())


def test_a_default_group_made_again_releases_the_old_ones_channel():
    import tempfile

    with tempfile.TemporaryDirectory() as store:
        results = spawn(_reinit, 2, store, timeout=120)
    assert results == [(1, 1), (1, 1)], results
