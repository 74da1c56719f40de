"""The single-device SigLIP op (``ds_infcl.ops.siglip``): both backends (Triton under
TRITON_INTERPRET=1 on CPU) against the float64 materialized reference.

Value and the four gradients (query, key, scale, bias) with an upstream gradient other than 1, on
odd shapes (b = 1, sizes off the 32-wide interpreter tiles, b != m both ways), with the diagonal,
labels with repeats, several positives per query through ids, and large ``|s x + t|``. fp32 within
1e-5 relative; fp16/bf16 within twice plain PyTorch's own error in that dtype, or within 1.5x the
error that exact arithmetic on the rounded 16-bit inputs has (the floor no implementation can go
under: the scale gradient sums sigmoid terms of both signs, and plain PyTorch's error on it is
sometimes below that floor by a lucky cancellation).
"""

import math
import os

import pytest
import torch

from ds_infcl.ops.siglip import (
    siglip_backward,
    siglip_forward,
    siglip_ids,
    siglip_loss_local,
    siglip_reference,
)
from tests.ops.accuracy import error_bound, features, rel_err

BACKENDS = ["torch"]
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # triton is pinned (requirements-ci.txt): a failing import is an error, not a skipped backend
    from ds_infcl.ops import triton_lse, triton_siglip  # noqa: F401

    BACKENDS.append("triton")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    if "triton" in BACKENDS:  # several backward blocks (ragged) at test sizes
        monkeypatch.setattr(triton_lse, "CHUNK_ROWS", 32)
        monkeypatch.setattr(triton_lse, "CHUNK_ROWS_FP32", 32)
        monkeypatch.setattr(triton_lse, "CHUNK_COLS", 64)


def _dtypes(backend):
    # bf16 only on the torch path: the interpreter's bf16 dot is wrong (tests/gpu covers it).
    return [torch.float32, torch.float16] + ([torch.bfloat16] if backend == "torch" else [])


def _positives(kind, b, m, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind == "diag":
        return {}
    if kind == "labels":  # repeats: a key that is the positive of several queries
        return {"labels": torch.randint(0, m, (b,), generator=g)}
    # ids: 5 classes, so each query has several positive keys (and some none when m is small)
    return {"query_ids": torch.randint(0, 5, (b,), generator=g), "key_ids": torch.randint(0, 5, (m,), generator=g)}


def _run(fn, q, k, scale, bias, work, upstream=0.37):
    qq = q.detach().to(work).clone().requires_grad_()
    kk = k.detach().to(work).clone().requires_grad_()
    f = torch.float64 if work == torch.float64 else torch.float32
    ss = torch.tensor(scale, dtype=f, requires_grad=True)
    tt = torch.tensor(bias, dtype=f, requires_grad=True)
    loss = fn(qq, kk, ss, tt)
    (loss * upstream).backward()
    return [loss.detach(), qq.grad, kk.grad, ss.grad, tt.grad]


def _ours(backend, pos, tile_size=None):
    def fn(q, k, s, t):
        qid, kid = siglip_ids(q.shape[0], k.shape[0], q.device, **pos)
        return siglip_loss_local(q, k, s, t, qid, kid, backend=backend, tile_size=tile_size)
    return fn


def _reference(pos, upcast=True):
    return lambda q, k, s, t: siglip_reference(q, k, s, t, upcast=upcast, **pos)


CASES = [(1, 1, "diag"), (1, 7, "labels"), (37, 53, "diag"), (45, 38, "labels"), (70, 33, "ids"),
         (33, 100, "ids")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,m,kind", CASES)
def test_matches_float64_reference(backend, b, m, kind):
    q, k = features(b, m, 72, seed=b + m)
    pos = _positives(kind, b, m)
    scale, bias = 10.0, -10.0
    ref = _run(_reference(pos), q, k, scale, bias, torch.float64)
    for dtype in _dtypes(backend):
        got = _run(_ours(backend, pos, tile_size=16), q, k, scale, bias, dtype)
        plain = floor = None
        if dtype != torch.float32:
            plain = _run(_reference(pos, upcast=False), q, k, scale, bias, dtype)
            floor = _run(_reference(pos), q.to(dtype).double(), k.to(dtype).double(), scale, bias, torch.float64)
        for i, name in enumerate(("loss", "dq", "dk", "dscale", "dbias")):
            err = rel_err(got[i], ref[i])
            bound = error_bound(dtype, 0.0 if plain is None else rel_err(plain[i], ref[i]))
            if floor is not None:
                bound = max(bound, 1.5 * rel_err(floor[i], ref[i]) + 1e-6)
            assert err <= bound, f"{backend} {dtype} {name}: rel err {err:.2e} > {bound:.2e}"
            assert got[i].dtype == (dtype if i in (1, 2) else torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_are_stable(backend):
    # Unnormalized features and scale 100: |s x + t| in the hundreds; softplus must neither
    # overflow nor lose the small negative terms.
    q, k = features(19, 41, 8, normalize=False, seed=5)
    pos = {"labels": torch.arange(19) * 2}
    ref = _run(_reference(pos), q, k, 100.0, -10.0, torch.float64)
    got = _run(_ours(backend, pos, tile_size=16), q, k, 100.0, -10.0, torch.float32)
    for i in range(5):
        assert torch.isfinite(got[i]).all()
        assert rel_err(got[i], ref[i]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_terms_are_accurate(backend):
    # SigLIP's start (t = -10): every negative term is ~4.5e-5; log(1 + exp(x)) in float32
    # would lose ~0.1% of each. The loss must stay within fp32 rounding of the reference.
    q, k = features(64, 64, 16, seed=11)
    ref = _run(_reference({}), q, k, 1.0, -10.0, torch.float64)[0]
    got = _run(_ours(backend, {}, tile_size=32), q, k, 1.0, -10.0, torch.float32)[0]
    assert rel_err(got, ref) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_functions_float32_accumulators(backend):
    # The ring's unit of work: float32 dq/dk (no out_dtype), the block sum not divided by B.
    q, k = features(40, 29, 24, seed=2)
    qid, kid = siglip_ids(40, 29, q.device, labels=torch.arange(40) % 29)
    s, t = torch.tensor(7.0), torch.tensor(-3.0)
    total = siglip_forward(q.float(), k.float(), s, t, qid, kid, backend=backend, tile_size=16)
    want = siglip_reference(q, k, 7.0, -3.0, labels=torch.arange(40) % 29) * 40
    assert rel_err(total, want) <= 1e-5
    dq, dk, ds, dt = siglip_backward(q.float(), k.float(), s, t, qid, kid, torch.tensor(0.5),
                                     backend=backend, tile_size=16)
    assert dq.dtype == dk.dtype == torch.float32
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    ss, tt = torch.tensor(7.0, dtype=torch.float64, requires_grad=True), torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    (siglip_reference(qq, kk, ss, tt, labels=torch.arange(40) % 29) * 40 * 0.5).backward()
    for got, ref in ((dq, qq.grad), (dk, kk.grad), (ds, ss.grad), (dt, tt.grad)):
        assert rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_accumulates_unscaled(backend, dtype):
    # The ring's form: G @ k and G^T @ q added into the caller's float32 accumulators (which hold
    # something already) without the factor s; ragged blocks of G (the fixture's 32 x 64 blocks).
    b, m, s, t, w = 45, 70, 7.0, -3.0, 0.75  # w near 1: fp16 G keeps its range
    q, k = features(b, m, 24, seed=4)
    q, k = q.to(dtype), k.to(dtype)
    labels = torch.randint(0, m, (b,), generator=torch.Generator().manual_seed(1))
    qid, kid = siglip_ids(b, m, q.device, labels=labels)
    g = torch.Generator().manual_seed(6)
    dq0, dk0 = torch.randn(b, 24, generator=g), torch.randn(m, 24, generator=g)
    dq_acc, dk_acc = dq0.clone(), dk0.clone()
    out = siglip_backward(q, k, torch.tensor(s), torch.tensor(t), qid, kid, torch.tensor(w), backend=backend,
                          tile_size=16, accumulate=(dq_acc, dk_acc))
    assert out[0] is dq_acc and out[1] is dk_acc
    qq, kk = q.double().requires_grad_(), k.double().requires_grad_()
    ss = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    tt = torch.tensor(t, dtype=torch.float64, requires_grad=True)
    (siglip_reference(qq, kk, ss, tt, labels=labels) * b * w).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: G is stored in fp16 on the Triton path
    pairs = ((dq_acc - dq0, qq.grad / s), (dk_acc - dk0, kk.grad / s), (out[2], ss.grad), (out[3], tt.grad))
    for got, ref in pairs:
        assert rel_err(got, ref) <= tol
    with pytest.raises(ValueError, match="out_dtype or accumulate"):
        siglip_backward(q, k, torch.tensor(s), torch.tensor(t), qid, kid, torch.tensor(w), backend=backend,
                        out_dtype=dtype, accumulate=(dq_acc, dk_acc))


def test_reference_matches_definition():
    # The reference itself, against the pairwise definition written out with loops.
    q, k = features(4, 5, 3, seed=9)
    labels = torch.tensor([1, 0, 4, 1])
    s, t = 3.0, -1.5
    want = 0.0
    for i in range(4):
        for j in range(5):
            z = 1.0 if labels[i] == j else -1.0
            x = s * float(q[i] @ k[j]) + t
            want += -math.log(1 / (1 + math.exp(-z * x)))
    assert abs(siglip_reference(q, k, s, t, labels=labels).item() - want / 4) < 1e-12
