"""The default distributed call's input checks (``check_finite``), agreed by every rank after the
layout exchange and read once the forward is queued (``checks_read_after_launch(agree=True)``,
``ds_infcl.ring.agree_on_value_checks``), on 3 gloo ranks with unequal sizes, InfoNCE and SigLIP,
the gather path and the ring, and ``lse``:

- NaN rows on one rank: that rank raises its own error, counting its rows; the others raise one that
  names it; the loss's forward ran before anything was read, and only the bad rank read its values.
- The next call with good inputs equals the float64 reference on the gathered batch on every rank
  (the collectives stayed paired), and equals the call with ``check_finite=False``.
- A non-finite scale on every rank, a non-finite bias on one rank.
- Ranks that would not all agree (one inside ``deferred_value_checks``) stop with one clear error.

And the agreement's host side on its own (``_AgreedAfterLaunch``, no processes).
"""

from __future__ import annotations

import os

import pytest
import torch

from ds_infcl.ops import validation
from ds_infcl.ops.reference import contrastive_loss_reference
from ds_infcl.ops.siglip import siglip_reference
from tests.ring.ring_harness import spawn

C, SCALE, BIAS = 8, 5.0, -2.0
QUERIES, KEYS = (3, 4, 2), (3, 5, 2)  # per rank; the diagonal labels need keys >= queries
BAD_RANK, BAD_ROWS = 1, (0, 2)


def _features(rank: int, seed: int):
    """Rank ``rank``'s ``(query, key)`` of one global batch (every rank builds all of it)."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.nn.functional.normalize(torch.randn(b, C, generator=g), dim=1) for b in QUERIES]
    ks = [torch.nn.functional.normalize(torch.randn(m, C, generator=g), dim=1) for m in KEYS]
    return qs, ks


def _reference(loss_name: str, seed: int) -> float:
    qs, ks = _features(0, seed)
    offsets = torch.tensor((0,) + KEYS[:-1]).cumsum(0)
    labels = torch.cat([torch.arange(b) + int(off) for b, off in zip(QUERIES, offsets)])
    q, k = torch.cat(qs).double(), torch.cat(ks).double()
    if loss_name == "infonce":
        return contrastive_loss_reference(q, k, SCALE, labels, symmetric=True).item()
    return siglip_reference(q, k, SCALE, BIAS, labels=labels).item()


def _call(loss_name, q, k, scale=SCALE, bias=BIAS, **kwargs):
    from ds_infcl.loss import contrastive_loss, siglip_loss

    if loss_name == "infonce":
        return contrastive_loss(q, k, scale, symmetric=True, backend="torch", **kwargs)
    return siglip_loss(q, k, scale, bias, backend="torch", **kwargs)


def _message(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _order_worker(rank, world, payload):
    """Per (loss, algorithm): the bad call's message and the order of forward and reads, then a good
    call's loss with the check and without it."""
    from ds_infcl.loss import ring_fused, siglip

    events: list = []
    plain_read = validation._read
    validation._read = lambda *a: events.append("read") or plain_read(*a)
    for cls in (ring_fused.GatherInfoNCEFunction, ring_fused.RingInfoNCEFunction, siglip.SigLIPGatherFunction,
                siglip.SigLIPRingFunction):
        def recording(*args, _plain=cls.forward):
            events.append("forward")
            return _plain(*args)
        cls.forward = staticmethod(recording)
    out = {}
    for loss_name in ("infonce", "siglip"):
        for alg in ("gather", "ring"):
            os.environ["DS_INFCL_ALGORITHM"] = alg
            qs, ks = _features(rank, seed=1)
            q, k = qs[rank].clone(), ks[rank]
            if rank == BAD_RANK:
                q[list(BAD_ROWS), 1] = float("nan")
            events.clear()
            msg = _message(lambda: _call(loss_name, q, k))
            order = list(events)
            good = _call(loss_name, qs[rank], k).item()
            unchecked = _call(loss_name, qs[rank], k, check_finite=False).item()
            out[(loss_name, alg)] = (msg, order, good, unchecked)
    os.environ.pop("DS_INFCL_ALGORITHM", None)
    return out


@pytest.mark.slow
def test_a_bad_rank_raises_everywhere_after_the_forward_and_the_next_call_is_exact():
    results = spawn(_order_worker, 3, None, timeout=180)
    for loss_name in ("infonce", "siglip"):
        want = _reference(loss_name, seed=1)
        for alg in ("gather", "ring"):
            for rank, res in enumerate(results):
                msg, order, good, unchecked = res[(loss_name, alg)]
                what = (loss_name, alg, rank)
                if rank == BAD_RANK:
                    assert msg.startswith(f"query has {len(BAD_ROWS)} of {QUERIES[rank]} rows with NaN or Inf"), (
                        what, msg)
                    assert order == ["forward", "read"], (what, order)  # read after launch, only to count
                else:
                    assert f"rank(s) [{BAD_RANK}] of the process group rejected their local inputs" in msg, (what, msg)
                    assert order == ["forward"], (what, order)  # the verdicts only: no read of values
                assert good == pytest.approx(want, rel=1e-5, abs=1e-6), (what, good, want)
                assert good == unchecked, what


def _scale_bias_worker(rank, world, payload):
    qs, ks = _features(rank, seed=2)
    q, k = qs[rank], ks[rank]
    out = {"scale": _message(lambda: _call("infonce", q, k, scale=torch.tensor(float("inf"))))}
    bias = torch.tensor(float("nan") if rank == 2 else BIAS)
    out["bias"] = _message(lambda: _call("siglip", q, k, bias=bias))
    out["after"] = _call("siglip", q, k).item()
    return out


@pytest.mark.slow
def test_a_bad_scale_everywhere_and_a_bad_bias_on_one_rank():
    want = _reference("siglip", seed=2)
    for rank, res in enumerate(spawn(_scale_bias_worker, 3, None, timeout=120)):
        assert res["scale"] == "scale must be finite, got inf", (rank, res)
        if rank == 2:
            assert res["bias"] == "bias must be finite, got nan", res
        else:
            assert "rank(s) [2] of the process group rejected their local inputs" in res["bias"], (rank, res)
        assert res["after"] == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, res)


def _lse_worker(rank, world, payload):
    """``lse`` (the ring's row and column statistics): a NaN key on rank 2, then a good call."""
    from ds_infcl.loss import lse, ring

    events: list = []
    plain_read = validation._read
    validation._read = lambda *a: events.append("read") or plain_read(*a)
    plain_forward = ring.RingLSEFunction.forward
    ring.RingLSEFunction.forward = staticmethod(lambda *a: events.append("forward") or plain_forward(*a))
    qs, ks = _features(rank, seed=4)
    k = ks[rank].clone()
    if rank == 2:
        k[1, 3] = float("-inf")
    msg = _message(lambda: lse(qs[rank], k, SCALE, backend="torch"))
    order = list(events)
    row, col = lse(qs[rank], ks[rank], SCALE, backend="torch")
    return msg, order, row, col


@pytest.mark.slow
def test_lse_agrees_on_its_checks_too():
    qs, ks = _features(0, seed=4)
    logits = SCALE * torch.cat(qs).double() @ torch.cat(ks).double().T
    want_row, want_col = logits.logsumexp(1).split(QUERIES), logits.logsumexp(0).split(KEYS)
    for rank, (msg, order, row, col) in enumerate(spawn(_lse_worker, 3, None, timeout=120)):
        if rank == 2:
            assert msg.startswith(f"key has 1 of {KEYS[2]} rows with NaN or Inf"), msg
            assert order == ["forward", "read"], order
        else:
            assert "rank(s) [2] of the process group rejected their local inputs" in msg, (rank, msg)
            assert order == ["forward"], (rank, order)
        torch.testing.assert_close(row.double(), want_row[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(col.double(), want_col[rank], rtol=1e-5, atol=1e-5)


def _mixed_worker(rank, world, payload):
    qs, ks = _features(rank, seed=3)
    out = {}
    for loss_name in ("infonce", "siglip"):
        if rank == 0:  # (a trainer-like block on one rank only: its checks are queued, not agreed)
            with validation.deferred_value_checks():
                out[loss_name] = _message(lambda: _call(loss_name, qs[rank], ks[rank]))
        else:
            out[loss_name] = _message(lambda: _call(loss_name, qs[rank], ks[rank]))
    return out


@pytest.mark.slow
def test_ranks_that_would_not_all_agree_stop_with_one_error():
    for rank, res in enumerate(spawn(_mixed_worker, 2, None, timeout=120)):
        for loss_name, msg in res.items():
            assert "disagree on the flags" in msg, (rank, loss_name, msg)


def _agreed(entries):
    pending = validation._AgreedAfterLaunch()
    for query in entries:
        segments = validation._segments(query, None, None, None, True, None)
        pending.add(segments, validation._value_vector(segments, query, None, None, None, None),
                    validation._Context(query.shape[0], None, None, None, 0))
    return pending, pending.flag(torch.device("cpu"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_the_agreement_host_side(device):
    """``flag`` is this rank's verdict (no read); ``agreed`` takes every rank's and the read raises
    this rank's own error, one that names the failed ranks, or nothing; without an agreement the read
    refuses (a loss path that asked for one must post it)."""
    good = torch.ones(4, C, device=device)
    bad = good.clone()
    bad[3, 0] = float("inf")
    for entries, flags, rank, want in (
        ([good, bad], [0, 1, 0], 1, "query has 1 of 4 rows with NaN or Inf"),
        ([good], [0, 1, 1], 0, "rank(s) [1, 2] of the process group rejected their local inputs"),
        ([good], [0, 0], 1, None),
        ([], [0, 0], 0, None),
    ):
        pending, mine = _agreed(entries)
        assert mine.tolist() == [int(flags[rank])], (entries, flags)
        pending.agreed(torch.tensor(flags, device=device), rank)
        got = _message(pending.raise_if_failed)
        assert (got == "no error") if want is None else got.startswith(want), (flags, rank, got)
    with pytest.raises(RuntimeError, match="without agreeing"):
        _agreed([good])[0].raise_if_failed()
