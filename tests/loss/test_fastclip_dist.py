"""FastCLIP on 2, 3 and 4 gloo ranks (the ring) equals one process on the global batch: per step
the loss on every rank, the feature gradients after the data-parallel mean, the temperature(s)
and the u state, identical (bitwise) on all ranks."""

from __future__ import annotations

import pytest
import torch

from tests.ring.ring_harness import spawn

pytestmark = pytest.mark.slow

NUM_SAMPLES = 13
SIZES = {2: [3, 5], 3: [2, 4, 3], 4: [2, 0, 3, 2]}  # unequal; one rank empty at 4
VERSIONS = ("v0", "v1", "v2", "v3")
STATE = ("log_u1", "log_u2", "tau", "tau_count", "tau1", "tau2", "tau1_m", "tau2_v")


def _step_data(step, total):
    g = torch.Generator().manual_seed(100 + step)
    q = torch.nn.functional.normalize(torch.randn(total, 6, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(total, 6, generator=g), dim=1)
    idx = torch.randperm(NUM_SAMPLES, generator=g)[:total]
    return q, k, idx


def run_steps(version, sizes, rank, group=None):
    """Three steps (epochs 0, 1, 3 of a 4-epoch cosine schedule) on rank ``rank``'s slice."""
    from ds_infcl.loss.fastclip import FastCLIPLoss

    m = FastCLIPLoss(NUM_SAMPLES, version=version, backend="torch", tile_size=2, group=group,
                     gamma_decay_epochs=4, eps=1e-8)
    total = sum(sizes)
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    out = []
    for step, epoch in enumerate((0, 1, 3)):
        q, k, idx = _step_data(step, total)
        qq = q[start:stop].clone().requires_grad_(True)
        kk = k[start:stop].clone().requires_grad_(True)
        loss = m(qq, kk, idx[start:stop], epoch=epoch)
        loss.backward()
        state = {n: getattr(m, n).clone() for n in STATE if hasattr(m, n)}
        out.append(dict(loss=loss.item(), dq=qq.grad, dk=kk.grad, state=state))
    return out


def worker(rank, world, payload):
    return {v: run_steps(v, SIZES[world], rank) for v in VERSIONS}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_equal_single_process(world):
    sizes = SIZES[world]
    results = spawn(worker, world, timeout=150)
    for version in VERSIONS:
        single = run_steps(version, [sum(sizes)], 0)
        for step, ref in enumerate(single):
            what = f"{version} step {step} ({world} ranks)"
            for rank, res in enumerate(results):
                got = res[version][step]
                start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
                assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), what
                # Rank r holds W x its share of the gradient: the data-parallel mean is exact.
                for name in ("dq", "dk"):
                    want = ref[name][start:stop]
                    if want.numel() == 0:  # the empty rank
                        assert got[name] is None or got[name].numel() == 0, what
                        continue
                    err = (got[name] / world - want).abs().max().item()
                    assert err <= 2e-5 * max(ref[name].abs().max().item(), 1e-6), f"{what} {name}"
                for name, t in got["state"].items():
                    base = results[0][version][step]["state"][name]
                    assert torch.equal(t, base), f"{what}: {name} differs between ranks"
                    finite = torch.isfinite(ref["state"][name])
                    assert torch.equal(finite, torch.isfinite(t)), f"{what}: {name} support"
                    err = (t[finite].double() - ref["state"][name][finite].double()).abs().max()
                    assert err <= 1e-4 * (1 + ref["state"][name][finite].abs().max()), f"{what}: {name}"


def bad_input_worker(rank, world, payload):
    """Rank 1 passes an out-of-range index (or NaN features): every rank must raise, none hang."""
    import time

    from ds_infcl.loss.fastclip import FastCLIPLoss

    m = FastCLIPLoss(NUM_SAMPLES, version="v3", backend="torch")
    q, k, idx = _step_data(0, 4)
    idx = idx.clone()
    if rank == 1 and payload == "index":
        idx[0] = NUM_SAMPLES + 5
    if rank == 1 and payload == "nan":
        q = q.clone()
        q[1, 0] = float("nan")
    start = time.monotonic()
    try:
        m(q, k, idx)
    except ValueError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("what", ["index", "nan"])
def test_bad_input_on_one_rank_raises_everywhere(what):
    results = spawn(bad_input_worker, 2, payload=what, timeout=60)
    assert all(r["error"] for r in results), results
    expected = "out of range" if what == "index" else "non-finite|NaN"
    assert any(word in results[1]["error"] for word in expected.split("|")), results[1]
    assert all(r["seconds"] < 30 for r in results)
