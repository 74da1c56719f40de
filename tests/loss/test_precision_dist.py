"""The precision rule across 2 gloo ranks (``ds_infcl.ops.precision``): under autocast, float32
features give exactly the loss and gradients of the same call on the features cast to autocast's
dtype, on the gather path and on the ring (pinned with ``DS_INFCL_ALGORITHM``), with unequal
per-rank sizes (one rank holds a single query): InfoNCE symmetric and with hard negatives,
``lse``, SigLIP with its bias, the retrieval loss with false-negative masking across ranks, and
OpenCLIP's ``ClipLoss`` drop-in as its trainer runs it. The torch backend under bf16 autocast, the
Triton kernels (interpreter) under fp16 autocast, whose bf16 dots the interpreter gets wrong.
Gradients come back in float32."""

from __future__ import annotations

import pytest
import torch

from tests.ring.ring_harness import spawn

pytestmark = pytest.mark.slow

SIZES = (5, 1)  # queries per rank: unequal, one rank with a single query
ALGORITHMS = ("gather", "ring")
CASES = ("clip", "hard_negatives", "lse", "siglip", "retrieval", "open_clip")


def _features(rank: int, c: int = 24):
    """This rank's float32 queries ``[b, c]`` and keys ``[2b, c]`` (positives, then hard negatives)."""
    g = torch.Generator().manual_seed(10 + rank)
    b = SIZES[rank]
    q = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(2 * b, c, generator=g), dim=1)
    return q, k


def _loss(case, q, k, s, t, backend, rank, world):
    from ds_infcl.adapters.open_clip_loss import ClipLoss
    from ds_infcl.loss import contrastive_loss, lse, siglip_loss
    from ds_infcl.loss.retrieval import retrieval_loss

    b = q.shape[0]
    kw = dict(backend=backend)
    if case == "clip":
        return contrastive_loss(q, k[:b], s, symmetric=True, **kw)
    if case == "hard_negatives":
        return contrastive_loss(q, k, s, torch.arange(b), **kw)
    if case == "lse":
        row, col = lse(q, k, s, **kw)
        return row.sum() + 0.5 * col.sum()
    if case == "siglip":
        return siglip_loss(q, k[:b], s, t, **kw)
    if case == "retrieval":  # every rank's last negative repeats rank 0's first positive: masked
        key_ids = torch.arange(2 * b) + 100 * rank
        key_ids[-1] = 0
        return retrieval_loss(q, k, s, key_ids=key_ids, symmetric=True, **kw)
    if case == "open_clip":
        return ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world, **kw)(q, k[:b], s)
    raise ValueError(case)


def _run(case, q, k, autocast_dtype, backend, rank, world):
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    s = torch.tensor(14.3, requires_grad=True)
    t = torch.tensor(-2.5, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = _loss(case, q, k, s, t, backend, rank, world)
    loss.backward()
    return [loss.detach(), q.grad, k.grad, s.grad, t.grad]


def worker(rank, world, payload):
    from ds_infcl import settings
    from ds_infcl.loss import ring

    q, k = _features(rank)
    out = {}
    for backend, dtype in payload["settings"]:
        for algorithm in ALGORITHMS:
            with settings.override("DS_INFCL_ALGORITHM", algorithm):
                for case in payload["cases"]:
                    got = _run(case, q, k, dtype, backend, rank, world)
                    used = ring.last_algorithm() if case in ("clip", "hard_negatives") else None
                    want = _run(case, q.to(dtype), k.to(dtype), None, backend, rank, world)
                    out[(backend, str(dtype), algorithm, case)] = dict(got=got, want=want, used=used)
    return out


@pytest.mark.parametrize("backend, dtype", [("torch", torch.bfloat16), ("triton", torch.float16)])
def test_two_ranks_under_autocast_equal_the_cast_features(backend, dtype):
    cases = CASES if backend == "torch" else ("clip", "siglip", "open_clip")  # (the interpreter's time)
    results = spawn(worker, 2, {"settings": [(backend, dtype)], "cases": cases}, timeout=300)
    for rank, res in enumerate(results):
        for (be, dt, algorithm, case), r in res.items():
            what = f"rank {rank}, {be}, {dt}, {algorithm}, {case}"
            if r["used"] is not None:
                assert r["used"] == algorithm, what
            got, want = r["got"], r["want"]
            assert torch.equal(got[0], want[0]), f"{what}: loss {got[0].item()!r} != {want[0].item()!r}"
            for name, g, w in zip(("dq", "dk", "dscale", "dbias"), got[1:], want[1:]):
                if w is None:
                    assert g is None, f"{what}: {name}"
                    continue
                assert g.dtype == torch.float32, f"{what}: {name} in {g.dtype}"
                assert torch.equal(g, w.float()), f"{what}: {name} max diff {(g - w.float()).abs().max().item():.3g}"
