"""The fused single-device InfoNCE (``ds_infcl.ops.infonce``) and the op pieces it adds: the
positive-logit term of the LSE backward, gradients written in the inputs' dtype, and the
positive logits themselves. Both backends (Triton under TRITON_INTERPRET=1 on CPU) against the
float64 reference, on odd shapes: b = 1, sizes off the tile, b != m both ways, hard negatives,
repeated labels (a key that is the positive of several queries), upstream gradient != 1.
"""

import os

import pytest
import torch

from ds_infcl.ops import (
    LSEOptions,
    contrastive_loss_reference,
    infonce_loss,
    logits_reference,
    lse_backward,
    lse_forward,
    lse_reference,
    positive_logits_forward,
)
from tests.ops.accuracy import error_bound, features, rel_err

BACKENDS = ["torch"]
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # triton is pinned (requirements-ci.txt): a failing import is an error, not a skipped backend
    from ds_infcl.ops import triton_lse

    BACKENDS.append("triton")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    if "triton" in BACKENDS:  # several backward blocks and forward splits at test sizes
        monkeypatch.setattr(triton_lse, "CHUNK_ROWS", 32)
        monkeypatch.setattr(triton_lse, "CHUNK_ROWS_FP32", 32)
        monkeypatch.setattr(triton_lse, "CHUNK_COLS", 64)


def _dtypes(backend):
    # bf16 only on the torch path: the interpreter's bf16 dot is wrong (tests/gpu covers it).
    return [torch.float32, torch.float16] + ([torch.bfloat16] if backend == "torch" else [])


def _loss_and_grads(fn, q, k, scale, work, upstream=0.37):
    qq = q.detach().to(work).clone().requires_grad_()
    kk = k.detach().to(work).clone().requires_grad_()
    ss = torch.tensor(scale, dtype=torch.float64 if work == torch.float64 else torch.float32, requires_grad=True)
    loss = fn(qq, kk, ss)
    (loss * upstream).backward()
    return [loss.detach(), qq.grad, kk.grad, ss.grad]


# (b, m, labels): b = 1; off-tile sizes; hard negatives (m > b); labels with repeats; m < b.
CASES = [(1, 1, None), (1, 7, "random"), (37, 53, None), (45, 38, "random"), (33, 100, "hard"),
         (70, 33, "random")]


def _labels(kind, b, m):
    if kind is None:
        return None
    if kind == "hard":  # query i's positive is key 3 i (two hard negatives after it)
        return torch.arange(b) * 3
    return torch.randint(0, m, (b,), generator=torch.Generator().manual_seed(b + m))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("b,m,label_kind", CASES)
def test_fused_infonce_matches_fp64(backend, symmetric, b, m, label_kind):
    labels = _labels(label_kind, b, m)
    for dtype in _dtypes(backend):
        q, k = features(b, m, 72, seed=b * m)
        q, k = q.to(dtype).double(), k.to(dtype).double()
        ref = _loss_and_grads(
            lambda a, bb, s: contrastive_loss_reference(a, bb, s, labels, symmetric=symmetric), q, k, 14.3,
            torch.float64)
        plain = _loss_and_grads(
            lambda a, bb, s: contrastive_loss_reference(a, bb, s, labels, symmetric=symmetric, upcast=False),
            q, k, 14.3, dtype)
        got = _loss_and_grads(
            lambda a, bb, s: infonce_loss(a, bb, s, labels, symmetric=symmetric, backend=backend), q, k, 14.3,
            dtype)
        assert got[1].dtype == got[2].dtype == dtype, "gradients come back in the inputs' dtype"
        for name, x, p, r in zip(["loss", "dquery", "dkey", "dscale"], got, plain, ref):
            assert torch.isfinite(x).all(), name
            err, bound = rel_err(x, r), error_bound(dtype, rel_err(p, r))
            assert err <= bound, f"{dtype} {name}: rel err {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_infonce_scale_100_unnormalized(backend):
    # Logits in the thousands: the positive term inside G must cancel exactly where P ~ 1.
    q, k = features(45, 38, 72, normalize=False, seed=4)
    labels = _labels("random", 45, 38)
    ref = _loss_and_grads(lambda a, bb, s: contrastive_loss_reference(a, bb, s, labels, symmetric=True),
                          q, k, 100.0, torch.float64)
    plain = _loss_and_grads(
        lambda a, bb, s: contrastive_loss_reference(a, bb, s, labels, symmetric=True, upcast=False),
        q, k, 100.0, torch.float32)
    got = _loss_and_grads(lambda a, bb, s: infonce_loss(a, bb, s, labels, symmetric=True, backend=backend),
                          q, k, 100.0, torch.float32)
    for name, x, p, r in zip(["loss", "dquery", "dkey", "dscale"], got, plain, ref):
        err, bound = rel_err(x, r), error_bound(torch.float32, rel_err(p, r))
        assert err <= bound, f"{name}: rel err {err:.2e} > {bound:.2e}"


def _op_objective_grads(q, k, scale, wr, wc, wp, labels, exclude_positive):
    """Float64 gradients of sum(wr * row) + sum(wc * col) + sum(wp * pos) by autograd."""
    qq, kk = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ss = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    row, col = lse_reference(qq, kk, ss, labels=labels, exclude_positive=exclude_positive)
    lab = torch.arange(q.shape[0]) if labels is None else labels
    pos = logits_reference(qq, kk, ss)[torch.arange(q.shape[0]), lab]
    fin = lambda v: torch.where(torch.isfinite(v), v, torch.zeros_like(v))  # noqa: E731
    (((fin(row) * wr).sum() + (fin(col) * wc).sum()) + (pos * wp).sum()).backward()
    return qq.grad, kk.grad, ss.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exclude_positive", [False, True])
@pytest.mark.parametrize("out_dtype", [None, "input"])
@pytest.mark.parametrize("b,m", [(1, 5), (45, 38), (33, 100)])
def test_backward_positive_term_and_out_dtype(backend, exclude_positive, out_dtype, b, m):
    q, k = features(b, m, 72, seed=3)
    labels = _labels("random", b, m)
    g = torch.Generator().manual_seed(5)
    wr, wc, wp = (torch.randn(n, generator=g, dtype=torch.float64) for n in (b, m, b))
    ref = _op_objective_grads(q, k, 6.0, wr, wc, wp, labels, exclude_positive)
    for dtype in (torch.float32, torch.float16):
        qd, kd = q.to(dtype), k.to(dtype)
        want = _op_objective_grads(qd.double(), kd.double(), 6.0, wr, wc, wp, labels, exclude_positive)
        row, col = lse_forward(qd, kd, 6.0, labels, LSEOptions(exclude_positive=exclude_positive, backend=backend))
        dq, dk, ds = lse_backward(
            qd, kd, torch.tensor(6.0), row, col, wr.float(), wc.float(), labels=labels, grad_pos=wp.float(),
            options=LSEOptions(exclude_positive=exclude_positive, out_dtype=dtype if out_dtype == "input" else None,
                               backend=backend),
        )
        expect = dtype if out_dtype == "input" else torch.float32
        assert dq.dtype == dk.dtype == expect and ds.dtype == torch.float32
        # fp32 within 1e-5 of the float64 result on the same inputs; fp16 within its rounding.
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        for name, x, r in zip(["dquery", "dkey", "dscale"], (dq, dk, ds), want):
            assert rel_err(x, r) <= tol, f"{dtype} {name}: rel err {rel_err(x, r):.2e}"
        if dtype == torch.float32:
            for x, r in zip((dq, dk, ds), ref):
                assert rel_err(x, r) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,m,c,kind", [(1, 1, 3, None), (45, 38, 72, "random"), (33, 100, 130, "hard")])
def test_positive_logits(backend, b, m, c, kind):
    q, k = features(b, m, c, normalize=False, seed=9)
    labels = _labels(kind, b, m)
    lab = torch.arange(b) if labels is None else labels
    want = logits_reference(q, k, 3.5)[torch.arange(b), lab]
    got = positive_logits_forward(q.float(), k.float(), torch.tensor(3.5), labels, LSEOptions(backend=backend))
    assert got.dtype == torch.float32 and got.shape == (b,)
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_key_tower_and_float_scale(backend):
    # Keys without grad, a float scale: only dquery flows, and it matches the reference.
    q, k = features(37, 53, 72, seed=11)
    qq = q.float().requires_grad_()
    loss = infonce_loss(qq, k.float(), torch.tensor(9.0), None, symmetric=True, backend=backend)
    loss.backward()
    qr = q.clone().requires_grad_()
    contrastive_loss_reference(qr, k, 9.0, symmetric=True).backward()
    assert rel_err(qq.grad, qr.grad) <= 1e-5
