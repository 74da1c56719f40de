"""The tiled PyTorch path against the materialized reference computed in float64.

Tolerances: float32 within 1e-5 relative; bf16/fp16 within twice the error that plain PyTorch
(the reference run in that dtype) makes against float64, plus a small floor for values that
plain PyTorch happens to get almost exactly right. Where the problem itself is ill-conditioned in
float32 (scale 100 on unnormalized features gives logits in the thousands, so one ulp of a logit
moves a probability by ~1e-4; a scale gradient that is a small difference of large terms), no
float32 computation reaches 1e-5, and the float32 bound becomes twice plain float32 PyTorch's own
error, the same rule as for the half dtypes.
"""

import pytest
import torch

from ds_infcl.ops import LSEOptions, contrastive_loss_reference, lse_reference, tiled_lse
from ds_infcl.loss import contrastive_loss
from tests.ops.accuracy import FP32_RTOL, error_bound, features, rel_err


# (b, m, c): b = 1; b and m not multiples of the tile (16 below); b != m; c in {3, 72, 384}.
SHAPES = [(1, 1, 3), (1, 7, 72), (7, 1, 3), (37, 53, 72), (53, 37, 384), (64, 64, 3), (100, 130, 384)]


def _run_loss(fn, q, k, scale, dtype, upstream):
    """Loss and gradients (query, key, scale) of ``fn`` on fresh leaves cast to ``dtype``."""
    qq = q.clone().to(dtype).requires_grad_()
    kk = k.clone().to(dtype).requires_grad_()
    sdtype = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.tensor(scale, dtype=sdtype, requires_grad=True)
    loss = fn(qq, kk, s)
    (loss * upstream).backward()
    return [loss.detach(), qq.grad, kk.grad, s.grad]


def _labels(b, m, kind, seed=1):
    if kind == "diagonal":
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m, (b,), generator=g)


def _check_against_reference(q, k, scale, labels, symmetric, dtype, upstream=1.0, tile=16):
    # The float64 reference sees exactly the inputs the tested path sees (rounded to dtype).
    q_in, k_in = q.to(dtype).double(), k.to(dtype).double()
    ref = _run_loss(
        lambda a, b, s: contrastive_loss_reference(a, b, s, labels, symmetric=symmetric),
        q_in, k_in, scale, torch.float64, upstream,
    )
    got = _run_loss(
        lambda a, b, s: contrastive_loss(a, b, s, labels, symmetric=symmetric, backend="torch", tile_size=tile),
        q_in, k_in, scale, dtype, upstream,
    )
    plain = _run_loss(
        lambda a, b, s: contrastive_loss_reference(a, b, s, labels, symmetric=symmetric, upcast=False),
        q_in, k_in, scale, dtype, upstream,
    )
    for name, x, p, r in zip(["loss", "dquery", "dkey", "dscale"], got, plain, ref):
        bound = error_bound(dtype, rel_err(p, r))
        assert rel_err(x, r) <= bound, f"{name}: rel err {rel_err(x, r):.2e} > {bound:.2e} (plain {rel_err(p, r):.2e})"


@pytest.mark.parametrize("b,m,c", SHAPES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("label_kind", ["diagonal", "random"])
def test_loss_fp32_matches_fp64_reference(b, m, c, symmetric, label_kind):
    if label_kind == "diagonal" and m < b:
        pytest.skip("diagonal labels need m >= b")
    q, k = features(b, m, c)
    _check_against_reference(q, k, 14.3, _labels(b, m, label_kind), symmetric, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,m,c", [(1, 7, 72), (37, 53, 72), (100, 130, 384)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_loss_half_within_twice_plain_torch_error(dtype, b, m, c, symmetric):
    q, k = features(b, m, c, seed=3)
    _check_against_reference(q, k, 14.3, _labels(b, m, "random"), symmetric, dtype)


@pytest.mark.parametrize("c", [3, 72, 384])
def test_scale_100_unnormalized_features(c):
    # Logits reach the thousands: the LSE must stay finite and exact where exp overflows.
    q, k = features(60, 45, c, normalize=False, seed=4)
    _check_against_reference(q, k, 100.0, _labels(60, 45, "random"), True, torch.float32, upstream=0.37)


def test_upstream_gradient_other_than_one():
    q, k = features(33, 40, 72, seed=5)
    _check_against_reference(q, k, 10.0, None, True, torch.float32, upstream=-2.5)


@pytest.mark.parametrize("exclude_positive", [False, True])
@pytest.mark.parametrize("b,m", [(1, 1), (1, 5), (5, 1), (37, 53), (70, 33)])
def test_lse_vectors_and_arbitrary_upstream_weights(b, m, exclude_positive):
    """The op itself: both LSE vectors, and per-row / per-column upstream weights."""
    q, k = features(b, m, 72, normalize=False, seed=6)
    labels = _labels(b, m, "random")
    g = torch.Generator().manual_seed(7)
    w_row, w_col = torch.randn(b, generator=g, dtype=torch.float64), torch.randn(m, generator=g, dtype=torch.float64)

    def objective(row, col):
        # An all-excluded row or column has LSE -inf and contributes nothing.
        return (torch.where(torch.isfinite(row), row, 0) * w_row).sum() + (
            torch.where(torch.isfinite(col), col, 0) * w_col
        ).sum()

    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    sr = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    row_r, col_r = lse_reference(qr, kr, sr, labels=labels, exclude_positive=exclude_positive)
    objective(row_r, col_r).backward()

    qp, kp = q.float().requires_grad_(), k.float().requires_grad_()
    sp = torch.tensor(3.0, requires_grad=True)
    row_p, col_p = lse_reference(qp, kp, sp, labels=labels, exclude_positive=exclude_positive, upcast=False)
    objective(row_p, col_p).backward()

    qt, kt = q.float().requires_grad_(), k.float().requires_grad_()
    st = torch.tensor(3.0, requires_grad=True)
    row_t, col_t = tiled_lse(
        qt, kt, st, labels, LSEOptions(exclude_positive=exclude_positive, backend="torch", tile_size=16)
    )
    assert row_t.dtype == torch.float32 and col_t.dtype == torch.float32
    assert torch.equal(torch.isinf(row_t), torch.isinf(row_r)) and torch.equal(torch.isinf(col_t), torch.isinf(col_r))
    fin_r, fin_c = torch.isfinite(row_r), torch.isfinite(col_r)
    if fin_r.any():
        assert rel_err(row_t[fin_r], row_r[fin_r]) <= FP32_RTOL
    if fin_c.any():
        assert rel_err(col_t[fin_c], col_r[fin_c]) <= FP32_RTOL
    objective(row_t, col_t).backward()
    for x, p, r in ((qt.grad, qp.grad, qr.grad), (kt.grad, kp.grad, kr.grad), (st.grad, sp.grad, sr.grad)):
        assert torch.isfinite(x).all()
        assert rel_err(x, r) <= error_bound(torch.float32, rel_err(p, r)), (rel_err(x, r), rel_err(p, r))


def test_row_only_op_skips_column_and_float_scale_gets_no_grad():
    q, k = features(9, 11, 3)
    qt = q.float().requires_grad_()
    row, col = tiled_lse(qt, k.float(), 2.0, options=LSEOptions(compute_col=False, backend="torch", tile_size=4))
    assert col is None
    row.sum().backward()
    row_r, _ = lse_reference(q, k, 2.0)
    assert rel_err(row, row_r) <= FP32_RTOL
    assert qt.grad is not None and torch.isfinite(qt.grad).all()


@pytest.mark.parametrize("tile", [1, 3, 16, 4096])
def test_tile_size_does_not_change_the_result(tile):
    q, k = features(20, 17, 8)
    base = contrastive_loss(q.float(), k.float(), 5.0, _labels(20, 17, "random"), symmetric=True, tile_size=2048)
    other = contrastive_loss(q.float(), k.float(), 5.0, _labels(20, 17, "random"), symmetric=True, tile_size=tile)
    assert abs(base.item() - other.item()) <= 1e-5 * abs(base.item())
