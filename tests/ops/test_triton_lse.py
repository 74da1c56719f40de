"""The Triton kernels (under TRITON_INTERPRET=1 on CPU) against the float64 reference.

fp32: within 1e-5 relative, or twice plain float32 PyTorch's own error where the problem is
ill-conditioned in float32 (scale 100 on unnormalized features). fp16: within twice the error of
plain PyTorch in fp16 (``lse_reference(upcast=False)``) plus a small floor. bf16 is left to the
GPU script (tests/gpu/test_triton_gpu.py): the interpreter's bf16 dot is wrong.

The interpreter runs 32 x 32 tiles at ~1 ms each, so shapes stay small but odd: b = 1, sizes not
multiples of the tile, b != m, c in {3, 72}; backward blocks and forward splits are shrunk so that
several of each are exercised.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from ds_infcl.ops import LSEOptions, lse_reference, tiled_lse, triton_lse
from tests.ops.accuracy import FP32_RTOL, error_bound, features, rel_err

if os.environ.get("TRITON_INTERPRET", "0") != "1":  # pragma: no cover - set by tests/conftest.py
    pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # Several backward blocks (ragged at the edges of the odd shapes) and forward groups/splits
    # at test sizes. Blocks are multiples of the 32-wide interpreter tiles, as the launcher
    # makes them: the recomputed tiles must sit where the forward's did (bit-identical logits).
    monkeypatch.setattr(triton_lse, "CHUNK_ROWS", 32)
    monkeypatch.setattr(triton_lse, "CHUNK_ROWS_FP32", 32)
    monkeypatch.setattr(triton_lse, "CHUNK_COLS", 64)


def _labels(b, m, seed=1):
    return torch.randint(0, m, (b,), generator=torch.Generator().manual_seed(seed))


def _finite(v):
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v))


def _op_and_grads(q, k, scale, w_row, w_col, *, labels, exclude_positive, upcast, dtype):
    """LSE vectors and gradients of ``sum(w_row * row) + sum(w_col * col)`` by autograd on the
    materialized reference, in float64 (``upcast``) or plainly in ``dtype``."""
    work = torch.float64 if upcast else dtype
    qq = q.detach().to(work).clone().requires_grad_()
    kk = k.detach().to(work).clone().requires_grad_()
    ss = torch.tensor(scale, dtype=torch.float64 if upcast else torch.float32, requires_grad=True)
    row, col = lse_reference(qq, kk, ss, labels=labels, exclude_positive=exclude_positive, upcast=upcast)
    obj = torch.zeros((), dtype=torch.float64)
    if w_row is not None:
        obj = obj + (_finite(row).double() * w_row).sum()
    if w_col is not None:
        obj = obj + (_finite(col).double() * w_col).sum()
    obj.backward()
    return row.detach(), col.detach(), qq.grad, kk.grad, ss.grad


def _check(b, m, c, dtype, *, scale=14.3, labels=None, exclude_positive=False, normalize=True,
           w_row=True, w_col=True, seed=0, external_stats=False):
    q, k = features(b, m, c, normalize=normalize, seed=seed)
    q, k = q.to(dtype), k.to(dtype)  # the reference sees exactly the tested inputs
    g = torch.Generator().manual_seed(seed + 10)
    wr = torch.randn(b, generator=g, dtype=torch.float64) * 0.7 if w_row else None
    wc = torch.randn(m, generator=g, dtype=torch.float64) * 1.3 if w_col else None
    opts = dict(labels=labels, exclude_positive=exclude_positive)
    ref = _op_and_grads(q, k, scale, wr, wc, upcast=True, dtype=dtype, **opts)
    plain = _op_and_grads(q, k, scale, wr, wc, upcast=False, dtype=dtype, **opts)

    row, col = triton_lse.lse_forward_triton(q, k, scale, **opts)
    assert row.dtype == col.dtype == torch.float32 and row.shape == (b,) and col.shape == (m,)
    for name, got, p, r in (("row_lse", row, plain[0], ref[0]), ("col_lse", col, plain[1], ref[1])):
        assert torch.equal(torch.isinf(got), torch.isinf(r)), name
        fin = torch.isfinite(r)
        if fin.any():
            err, bound = rel_err(got[fin], r[fin]), error_bound(dtype, rel_err(p[fin], r[fin]))
            assert err <= bound, f"{name}: rel err {err:.2e} > {bound:.2e}"

    # The backward takes the statistics of the forward (as the autograd Function does) or, as
    # in the ring, statistics computed elsewhere (here the float64 ones).
    stats = (ref[0].float(), ref[1].float()) if external_stats else (row, col)
    dq, dk, ds = triton_lse.lse_backward_triton(
        q, k, scale, *stats,
        None if wr is None else wr.float(), None if wc is None else wc.float(), **opts,
    )
    assert dq.dtype == dk.dtype == ds.dtype == torch.float32 and ds.dim() == 0
    for name, got, p, r in (("dquery", dq, plain[2], ref[2]), ("dkey", dk, plain[3], ref[3]),
                            ("dscale", ds, plain[4], ref[4])):
        assert torch.isfinite(got).all(), name
        err, bound = rel_err(got, r), error_bound(dtype, rel_err(p, r))
        assert err <= bound, f"{name}: rel err {err:.2e} > {bound:.2e} (plain {rel_err(p, r):.2e})"


# (b, m, c): b = 1; sizes off the 32-tile; b != m both ways; c = 3 and 72 (not multiples of BK).
SHAPES = [(1, 1, 3), (1, 7, 72), (7, 1, 3), (37, 53, 72), (70, 33, 3), (33, 100, 72)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,m,c", SHAPES)
def test_both_directions_match_fp64(b, m, c, dtype):
    _check(b, m, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,m", [(1, 1), (5, 1), (37, 53), (70, 33)])
@pytest.mark.parametrize("with_labels", [False, True])
def test_exclude_positive(b, m, dtype, with_labels):
    if not with_labels and m < b:
        pytest.skip("diagonal positives need m >= b")
    labels = _labels(b, m) if with_labels else None
    _check(b, m, 72, dtype, labels=labels, exclude_positive=True, normalize=False, scale=3.0, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_with_external_statistics(dtype):
    _check(33, 100, 72, dtype, external_stats=True, labels=_labels(33, 100), exclude_positive=True)


@pytest.mark.parametrize("w_row,w_col", [(True, False), (False, True)])
def test_one_direction_upstream(w_row, w_col):
    _check(37, 53, 72, torch.float32, labels=_labels(37, 53), exclude_positive=True, w_row=w_row, w_col=w_col)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_100_unnormalized(dtype):
    # Logits reach the thousands (fp32) / hundreds (fp16): LSE must stay finite and exact.
    _check(45, 38, 72, dtype, scale=100.0, normalize=False, labels=_labels(45, 38), seed=4)


def test_all_excluded_row_and_column_give_zero_probability():
    # b = m = 1 with the positive excluded: both LSEs are -inf and every gradient is 0, not NaN.
    q, k = features(1, 1, 72)
    row, col = triton_lse.lse_forward_triton(q.float(), k.float(), 5.0, exclude_positive=True)
    assert torch.isneginf(row).all() and torch.isneginf(col).all()
    dq, dk, ds = triton_lse.lse_backward_triton(
        q.float(), k.float(), 5.0, row, col, torch.ones(1), torch.ones(1), exclude_positive=True
    )
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk)) and ds.item() == 0.0


def test_row_only_forward_and_no_upstream_backward():
    q, k = features(37, 53, 72)
    row, col = triton_lse.lse_forward_triton(q.float(), k.float(), 2.0, compute_col=False)
    assert col is None
    assert rel_err(row, lse_reference(q, k, 2.0)[0]) <= FP32_RTOL
    dq, dk, ds = triton_lse.lse_backward_triton(q.float(), k.float(), 2.0, row, None, None, None)
    assert not dq.any() and not dk.any() and ds.item() == 0.0


@pytest.mark.parametrize("programs_per_sm", [1, 16])
def test_forward_grid_does_not_change_the_result(monkeypatch, programs_per_sm):
    # Other numbers of query groups x key splits merge to the same statistics.
    q, k = features(70, 100, 3, normalize=False, seed=5)
    base = triton_lse.lse_forward_triton(q.float(), k.float(), 4.0)
    monkeypatch.setattr(triton_lse, "PROGRAMS_PER_SM", programs_per_sm)
    other = triton_lse.lse_forward_triton(q.float(), k.float(), 4.0)
    ref = lse_reference(q, k, 4.0)
    for got, want, r in zip(other, base, ref):
        assert rel_err(got, r) <= FP32_RTOL and rel_err(got, want) <= FP32_RTOL


@pytest.mark.parametrize("exclude", [False, True])
def test_forward_column_far_below_its_rows_takes_the_exact_pass(exclude):
    # Every logit of key 5 sits ~140 below the maxima of the rows it meets: its share of the
    # key-major forward's column accumulator underflows (below 2^-80 of the rows' shift), so its
    # key block must take the exact per-tile pass. Without it that column's LSE would be -inf.
    g = torch.Generator().manual_seed(21)
    u = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
    q = torch.nn.functional.normalize(u + 0.05 * torch.randn(70, 16, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(45, 16, generator=g), dim=-1)
    k[7] = u  # a key every query likes: the rows' maxima are high
    k[5] = -u  # a key every query dislikes
    row, col = triton_lse.lse_forward_triton(q, k, 100.0, exclude_positive=exclude)
    x = (q.double() @ k.double().T) * 100.0
    if exclude:
        x[torch.arange(45), torch.arange(45)] = float("-inf")
    assert (x[:, 5].max() - x.max(dim=1).values.min()) < -100  # the premise
    want_row, want_col = torch.logsumexp(x, 1), torch.logsumexp(x, 0)
    assert torch.isfinite(col).all()
    assert (col.double() - want_col).abs().max() <= 1e-4 * want_col.abs().max()
    assert (row.double() - want_row).abs().max() <= 1e-4 * want_row.abs().max()


@pytest.mark.parametrize("b,m", [(65536, 65536), (32768, 65536), (65536, 32768), (65536, 131072),
                                 (16384, 32768), (4096, 65536), (8192, 8192), (1000, 3000), (100, 100)])
@pytest.mark.parametrize("programs", [132, 114, 78])
def test_forward_grid_is_one_wave_and_balanced(b, m, programs):
    # The persistent forward's grid never holds more programs than run at once (a second wave of
    # a few programs doubled the kernel's time where m = 2b), and its busiest program has at most
    # ~10% more tiles than an even share, when there are enough tiles to share.
    nq, nk = -(-b // 128), -(-m // 128)
    groups, splits = triton_lse._forward_grid(nq, nk, b, m, programs)
    per_split = -(-nk // splits)
    assert -(-nk // per_split) == splits  # what the launcher runs
    assert 1 <= groups <= nq and groups * splits <= programs
    busiest = -(-nq // groups) * per_split
    even = nq * nk / programs
    if even >= 16:
        assert busiest <= 1.1 * even, (groups, splits, busiest, even)


def test_autograd_function_with_triton_backend():
    # The differentiable op (ds_infcl.ops.tiled_lse) on backend="triton", upstream grads != 1.
    q, k = features(37, 53, 72, seed=6)
    labels = _labels(37, 53)
    ref = _op_and_grads(q, k, 7.0, torch.full((37,), -2.5, dtype=torch.float64),
                        torch.full((53,), 0.4, dtype=torch.float64), labels=labels,
                        exclude_positive=True, upcast=True, dtype=torch.float32)
    qt, kt = q.float().requires_grad_(), k.float().requires_grad_()
    st = torch.tensor(7.0, requires_grad=True)
    row, col = tiled_lse(qt, kt, st, labels, LSEOptions(exclude_positive=True, backend="triton"))
    ((row * -2.5).sum() + (col * 0.4).sum()).backward()
    for got, want in ((row, ref[0]), (col, ref[1]), (qt.grad, ref[2]), (kt.grad, ref[3]), (st.grad, ref[4])):
        assert rel_err(got, want) <= FP32_RTOL


def test_tf32_follows_torch_unless_pinned(monkeypatch):
    """Unset, the kernels take torch's float32 matmul rule (off by default); the setting pins it
    (tests/ops/test_precision.py checks both ways)."""
    monkeypatch.delenv("DS_INFCL_ALLOW_TF32", raising=False)
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default
    assert not triton_lse.allow_tf32()
    monkeypatch.setenv("DS_INFCL_ALLOW_TF32", "1")
    assert triton_lse.allow_tf32()


def test_gluon_backward_choice(monkeypatch):
    """``DS_INFCL_GLUON``: auto takes the Triton kernel where the Gluon one cannot run (here: the
    interpreter), ``1`` says why it cannot instead of falling back, a bad value is an error."""
    q = torch.zeros(4, 8, dtype=torch.float16)
    monkeypatch.setenv("DS_INFCL_GLUON", "auto")
    assert not triton_lse._use_gluon(q, q)
    monkeypatch.setenv("DS_INFCL_GLUON", "0")
    assert not triton_lse._use_gluon(q, q)
    monkeypatch.setenv("DS_INFCL_GLUON", "1")
    with pytest.raises(RuntimeError, match="Gluon backward cannot run: .*CUDA GPU"):
        triton_lse._use_gluon(q, q)
    with pytest.raises(RuntimeError, match="Gluon forward cannot run: .*CUDA GPU"):
        triton_lse._use_gluon(q, q, "forward")
    monkeypatch.setenv("DS_INFCL_GLUON", "yes")
    with pytest.raises(ValueError, match="DS_INFCL_GLUON must be"):
        triton_lse._use_gluon(q, q)


def _gluon_build_fails(monkeypatch, kernel, module, launcher):
    """Make the Gluon ``kernel`` ("forward" / "backward") look available whose launch ``launcher``
    of ``module`` raises a build error (the other Gluon kernel marked as failed, so that only this
    one is tried); returns the list that counts the attempts."""
    from triton.runtime.errors import OutOfResources

    from ds_infcl.ops import gluon_lse_kernels as gk

    calls = []

    def failing_launch(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(262144, 232448, "shared memory")

    other = "forward" if kernel == "backward" else "backward"
    monkeypatch.setattr(triton_lse, "_use_gluon", lambda q, k, kernel="backward": kernel not in triton_lse._GLUON_FAILED)
    monkeypatch.setattr(triton_lse, "_GLUON_FAILED", {other: "not this test's"})
    monkeypatch.setattr(gk, "make_desc", lambda t, block: None, raising=False)
    monkeypatch.setattr(module, launcher, failing_launch, raising=False)
    return calls


def test_gluon_build_failure_falls_back_to_triton_once(monkeypatch):
    """A Triton release that cannot build the Gluon kernel (its API is experimental) costs a
    warning, once, and the Triton kernel writes G (same tiles and ranges); with
    DS_INFCL_GLUON=1 the build error propagates instead."""
    from triton.runtime.errors import OutOfResources

    from ds_infcl.ops import gluon_lse_kernels as gk

    calls = _gluon_build_fails(monkeypatch, "backward", gk, "launch_g_hopper")
    monkeypatch.setenv("DS_INFCL_TRITON_CHUNK", "256x256")  # the fallback's 128-tiles: one block
    monkeypatch.setenv("DS_INFCL_GLUON", "1")
    q, k = (t.to(torch.float16) for t in features(70, 48, 40, seed=3))  # rows of G: 96 bytes
    row, col = triton_lse.lse_forward_triton(q, k, 3.0)
    g = torch.Generator().manual_seed(5)  # (not the global generator: its state depends on the tests before)
    w_row, w_col = torch.rand(70, generator=g), torch.rand(48, generator=g)
    with pytest.raises(OutOfResources):
        triton_lse.lse_backward_triton(q, k, 3.0, row, col, w_row, w_col)
    monkeypatch.setenv("DS_INFCL_GLUON", "auto")
    with pytest.warns(RuntimeWarning, match="Gluon backward kernel could not be built"):
        dq, dk, ds = triton_lse.lse_backward_triton(q, k, 3.0, row, col, w_row, w_col)
    assert len(calls) == 2 and triton_lse._GLUON_FAILED["backward"].startswith("OutOfResources")
    # _use_gluon now says no; the Triton kernel with the Gluon tiles the fallback took (on the CPU
    # the interpreter's own tiles are 32 x 32, whose one-exponential ranges round an ulp otherwise)
    bm, bn, bk = triton_lse.GLUON_TILES.split(",")[:3]
    monkeypatch.setenv("DS_INFCL_TRITON_BWD", f"{bm},{bn},{bk},8,3")
    ref = triton_lse.lse_backward_triton(q, k, 3.0, row, col, w_row, w_col)
    assert len(calls) == 2
    for got, want in zip((dq, dk, ds), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernel on the same tiles
    qq, kk = q.double().requires_grad_(), k.double().requires_grad_()
    r64, c64 = lse_reference(qq, kk, 3.0)
    ((r64 * w_row.double()).sum() + (c64 * w_col.double()).sum()).backward()
    assert rel_err(dq, qq.grad) <= 2e-3 and rel_err(dk, kk.grad) <= 2e-3  # fp16 G: ~5e-4


def test_gluon_flags_are_distinct_bits():
    from ds_infcl.ops import gluon_lse_kernels as gk

    bits = list(gk.FLAG_BITS.values())
    assert len(set(bits)) == len(bits) and all(b & (b - 1) == 0 for b in bits)
    assert gk.g_flags(HAS_ROW=True, ONE_EXP=True) == gk.FLAG_BITS["HAS_ROW"] | gk.FLAG_BITS["ONE_EXP"]
    assert gk.g_flags() == 0


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="share one dtype"):
        triton_lse.lse_forward_triton(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16), 1.0)
    with pytest.raises(ValueError, match=r"query \[b, c\]"):
        triton_lse.lse_forward_triton(torch.zeros(2, 3), torch.zeros(2, 4), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize,scale", [(True, 14.3), (False, 100.0)])
def test_one_exponential_backward_equals_two(monkeypatch, dtype, normalize, scale):
    # Both directions with one exponential per logit (normalized features: every tile in range)
    # and the two-exponential form (forced, and what scale 100 on unnormalized features falls
    # back to) give the same gradients.
    q, k = features(70, 100, 72, normalize=normalize, seed=12)
    q, k = q.to(dtype), k.to(dtype)
    g = torch.Generator().manual_seed(13)
    wr, wc = torch.randn(70, generator=g) * 0.7, torch.randn(100, generator=g) * 1.3
    row, col = triton_lse.lse_forward_triton(q, k, scale)
    one = triton_lse.lse_backward_triton(q, k, scale, row, col, wr, wc)
    monkeypatch.setattr(triton_lse, "ONE_EXP", False)
    two = triton_lse.lse_backward_triton(q, k, scale, row, col, wr, wc)
    # fp16 stores G rounded to fp16, so the two forms may differ by one fp16 rounding of G.
    tol = 2e-6 if dtype == torch.float32 else 1e-4
    for name, x, y in zip(("dquery", "dkey", "dscale"), one, two):
        assert rel_err(x, y) <= tol, f"{name}: {rel_err(x, y):.2e}"


@pytest.mark.parametrize("b,m,c", [(65536, 65536, 512), (8192, 8192, 512), (262144, 262144, 512),
                                   (65536, 65536, 1024), (4096, 65536, 512), (32768, 32768, 768)])
def test_backward_blocks_fit_the_scratch_budget(b, m, c):
    # The block of G narrows (balanced, tile-aligned) until the scratch of a dtype-out backward
    # fits SCRATCH_BUDGET, where that is reachable; otherwise blocks keep their full size.
    rows, cols = triton_lse._fit_budget(b, m, c, min(b, 8192), min(m, 8192), torch.bfloat16, 256)
    full, chunk = (m, rows) if m <= b else (b, cols)
    scratch = (full + chunk) * c * 4 + rows * cols * 2
    reachable = (full + chunk) * c * 4 + 8192 * triton_lse.MIN_CHUNK_COLS * 2 <= triton_lse.SCRATCH_BUDGET
    assert rows % 256 == 0 and cols % 256 == 0 or (rows, cols) == (min(b, 8192), min(m, 8192))
    if reachable:
        assert scratch <= triton_lse.SCRATCH_BUDGET
    else:
        assert (rows, cols) == (min(b, 8192), min(m, 8192))
    if (b, m, c) == (65536, 65536, 512):  # issue 3's memory target: under 0.25 GiB
        assert scratch < 0.25 * 2**30 and (rows, cols) == (8192, 6144)


@pytest.mark.parametrize("exclude,with_labels", [(False, False), (True, False), (True, True)])
def test_cols_redo_kernel_takes_marked_blocks_exactly(exclude, with_labels):
    """``_lse_fwd_cols_redo_kernel``, the exact second pass behind the Gluon forward: the key
    blocks marked for query group g get their (max, sum) slots [g, j] from g's rows alone (rows
    of query blocks g, g + G, ...), with exclusion; unmarked slots are left as they were."""
    from ds_infcl.ops.triton_lse_kernels import _lse_fwd_cols_redo_kernel

    b, m, c, groups, block = 100, 70, 40, 3, 32  # 4 query blocks in 3 groups, 3 key blocks, c % 32 != 0
    q, k = (t.float() for t in features(b, m, c, seed=9))
    labels = _labels(b, m, seed=4) if with_labels else None
    num_qblocks, num_kblocks = triton_lse.triton.cdiv(b, block), triton_lse.triton.cdiv(m, block)
    redo = torch.zeros(groups * num_kblocks, dtype=torch.int32)
    redo[[0, 4, 8]] = 1  # (g, kb) = (0, 0), (1, 1), (2, 2): the last key block is ragged
    col_max = torch.full((groups, m), 7.0)
    col_sum = torch.full((groups, m), 7.0)
    lab, has_labels = triton_lse._labels_arg(q, labels, exclude)
    _lse_fwd_cols_redo_kernel[(groups, num_kblocks)](
        q, k, lab, redo, col_max, col_sum, triton_lse._scale_arg(5.0, q.device), b, m, c, q.stride(0), k.stride(0),
        num_qblocks, num_kblocks, BLOCK_M=block, BLOCK_N=block, BLOCK_K=32, EXCLUDE=exclude, HAS_LABELS=has_labels,
        num_warps=4, num_stages=1, **triton_lse._kernel_flags(q, c, 32))
    x = 5.0 * q.double() @ k.double().T
    if exclude:
        rows = torch.arange(b) if with_labels else torch.arange(min(b, m))  # the diagonal ends at m
        x[rows, labels if with_labels else rows] = float("-inf")
    for g in range(groups):
        rows = torch.cat([torch.arange(qb * block, min(b, (qb + 1) * block)) for qb in range(g, num_qblocks, groups)])
        want = torch.logsumexp(x[rows], dim=0)
        for kb in range(num_kblocks):
            cols = slice(kb * block, min(m, (kb + 1) * block))
            if redo[g * num_kblocks + kb]:
                got = col_max[g, cols].double() + torch.log(col_sum[g, cols].double())
                fin = torch.isfinite(want[cols])
                assert torch.equal(torch.isfinite(got), fin)
                assert rel_err(got[fin], want[cols][fin]) <= FP32_RTOL
            else:
                assert (col_max[g, cols] == 7.0).all() and (col_sum[g, cols] == 7.0).all()


def test_gluon_forward_build_failure_falls_back_to_triton_once(monkeypatch):
    """As for the backward: a Triton that cannot build the Gluon forward costs one warning, and
    the Triton forward gives the statistics from then on; DS_INFCL_GLUON=1 raises instead."""
    from triton.runtime.errors import OutOfResources

    from ds_infcl.ops import gluon_lse_forward as gf

    calls = _gluon_build_fails(monkeypatch, "forward", gf, "launch_fwd_hopper")
    # The Gluon forward is chosen where the Triton one would run 128-tiles (as on Hopper).
    monkeypatch.setattr(triton_lse, "_pick_config", lambda *args: triton_lse._Config(128, 128, 32, 4, 1))
    q, k = (t.to(torch.float16) for t in features(150, 140, 40, seed=5))
    monkeypatch.setenv("DS_INFCL_GLUON", "1")
    with pytest.raises(OutOfResources):
        triton_lse.lse_forward_triton(q, k, 3.0)
    monkeypatch.setenv("DS_INFCL_GLUON", "auto")
    with pytest.warns(RuntimeWarning, match="Gluon forward kernel could not be built"):
        row, col = triton_lse.lse_forward_triton(q, k, 3.0)
    assert len(calls) == 2 and triton_lse._GLUON_FAILED["forward"].startswith("OutOfResources")
    again = triton_lse.lse_forward_triton(q, k, 3.0)  # _use_gluon now says no: no third attempt
    assert len(calls) == 2
    ref = lse_reference(q.double(), k.double(), 3.0)
    plain = lse_reference(q, k, 3.0, upcast=False)
    for got, rep, want, p in zip((row, col), again, ref, plain):
        torch.testing.assert_close(got, rep)
        assert rel_err(got, want) <= error_bound(torch.float16, rel_err(p, want))


_BROKEN_GLUON = """
import importlib.abc, os, sys
import torch

class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith("triton.experimental.gluon"):
            raise AttributeError("a Gluon API this code does not know")

sys.meta_path.insert(0, Broken())
from ds_infcl.ops import gluon_lse_kernels, triton_lse
print("available", gluon_lse_kernels.AVAILABLE)
os.environ["DS_INFCL_GLUON"] = "1"
q = torch.randn(4, 8)
try:
    triton_lse._use_gluon(q, q)
except RuntimeError as err:
    print(err)
"""


def test_a_gluon_that_fails_to_import_leaves_the_triton_kernels():
    """Gluon is experimental: an import that fails other than with ImportError (a Triton whose
    Gluon API differs) leaves the Triton kernels usable, and DS_INFCL_GLUON=1 names the failure.
    (It raised out of ``import triton_lse``, so backend="triton" was lost with it.)"""
    r = subprocess.run([sys.executable, "-c", _BROKEN_GLUON], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout, r.stdout
    assert "DS_INFCL_GLUON=1, but the Gluon backward cannot run" in r.stdout, r.stdout
    assert "AttributeError: a Gluon API this code does not know" in r.stdout, r.stdout


def test_bad_kernel_switches_stop_the_import():
    """The kernels' on/off switches take '1' or '0'; another value is an error naming the variable,
    not a silent 'off'."""
    r = subprocess.run([sys.executable, "-c", "import ds_infcl.ops.triton_lse"],
                       env=dict(os.environ, DS_INFCL_TRITON_ONE_EXP="yes"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "DS_INFCL_TRITON_ONE_EXP must be '1' (on) or '0' (off), got 'yes'" in r.stderr


@pytest.mark.parametrize("name, value, form", [
    ("DS_INFCL_TRITON_FWD", "128,128,64", "BM,BN,BK,warps,stages[,maxnreg[,programs_per_sm]]"),
    ("DS_INFCL_TRITON_BWD", "64,128,64,4,x", "BM,BN,BK,warps,stages[,maxnreg[,programs_per_sm]]"),
    ("DS_INFCL_TRITON_CHUNK", "8192", "RxC"),
    ("DS_INFCL_GLUON_TILES", "128,0,32,4,2", "BM,BN,BK,stages,consumers[,consumer_regs,producer_regs,maxnreg]"),
    ("DS_INFCL_GLUON_FWD_TILES", "128,128,64,3,1,240,40,232,9", "BM,BN,BK,stages,turns[,consumer_regs,producer_regs,maxnreg]"),
])
def test_bad_tuning_settings_name_their_form(monkeypatch, name, value, form):
    """The tuning overrides of the tiles fail with the variable and the form it takes (they raised
    a bare int() or unpacking error)."""
    from ds_infcl.ops import triton_lse

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {form!r}")):
        if name == "DS_INFCL_TRITON_CHUNK":
            triton_lse._chunks(32)
        elif name.startswith("DS_INFCL_GLUON"):
            triton_lse._gluon_tiles(name, triton_lse.GLUON_TILES)
        else:
            triton_lse._env_config(name)
    monkeypatch.setenv(name, {"DS_INFCL_TRITON_CHUNK": "8192x4096"}.get(name, "128,128,64,8,3,0"))
    if name == "DS_INFCL_TRITON_CHUNK":  # a good value still parses (0: an optional field's default)
        assert triton_lse._chunks(32)[:2] == (8192, 4096)
    elif name.startswith("DS_INFCL_TRITON"):
        assert triton_lse._env_config(name).maxnreg == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,m,c", [(1, 40, 24), (70, 33, 72)])
def test_backward_unscaled_sums_and_dq_add_of_a_second_block(dtype, b, m, c):
    # unscaled=True: the float32 sums before the scaling pass and its factor (fp16: the scale over
    # the power-of-two weight scale). dq_add=(out, sums, g, factor): this block's dq plus g times
    # the other block's, written in out by the pass that scales dq, and dscale of both (the
    # gather path's own block and the other keys' block).
    q, k = (x.to(dtype) for x in features(b, m, c, seed=5))
    _, k2 = (x.to(dtype) for x in features(b, m + 7, c, seed=6))
    s = torch.tensor(9.0)
    row, col = triton_lse.lse_forward_triton(q, k, s)
    _, col2 = triton_lse.lse_forward_triton(q, k2, s)
    w_row = torch.full((b,), 0.3)
    plain = triton_lse.lse_backward_triton(q, k, s, row, col, w_row, torch.linspace(0.1, 0.5, m))
    other = (q, k2, s, row, col2, w_row * 2, torch.linspace(0.2, 0.4, m + 7))
    other_plain = triton_lse.lse_backward_triton(*other)
    sums_q, sums_k, factor = triton_lse.lse_backward_triton(*other, unscaled=True)
    assert factor.shape == () and sums_q.dtype == sums_k.dtype == torch.float32
    assert torch.equal(sums_q * factor, other_plain[0]) and torch.equal(sums_k * factor, other_plain[1])
    ds_other = (sums_q.double() * q.double()).sum() * factor.double() / 9.0
    assert abs(ds_other - other_plain[2].double()) <= 1e-5 * max(1.0, abs(other_plain[2].item()))
    g = torch.tensor(-1.75)
    out = torch.empty(b, c, dtype=dtype)
    got = triton_lse.lse_backward_triton(q, k, s, row, col, w_row, torch.linspace(0.1, 0.5, m),
                                         dq_add=(out, sums_q, g, factor))
    assert got[0] is out and torch.equal(got[1], plain[1])
    want = plain[0].double() + other_plain[0].double() * g.double()
    scale = max(plain[0].abs().max().item(), other_plain[0].abs().max().item() * 1.75)
    # float32 sums, one rounding into dtype (fp32: a few ulps of the sums)
    assert (got[0].double() - want).abs().max() <= torch.finfo(dtype).eps * want.abs().max() + 1e-6 * scale
    want_ds = plain[2].double() + other_plain[2].double() * g.double()
    assert abs(got[2].double() - want_ds) <= 1e-5 * max(1.0, abs(want_ds.item()))
    # a block without keys: only the other block's share
    empty = triton_lse.lse_backward_triton(q, k[:0], s, row, None, w_row, None,
                                           dq_add=(torch.empty_like(out), sums_q, g, factor))
    err = (empty[0].double() - other_plain[0].double() * g.double()).abs().max()
    assert err <= torch.finfo(dtype).eps * scale + 1e-7
    assert abs(empty[2].double() - other_plain[2].double() * g.double()) <= 1e-5 * max(1.0, abs(other_plain[2].item()))
    sums0 = triton_lse.lse_backward_triton(q, k[:0], s, row, None, w_row, None, unscaled=True)
    assert sums0[0].abs().sum() == 0 and sums0[1].shape == (0, c) and sums0[2].item() == 9.0
    with pytest.raises(ValueError, match="out_dtype=None"):
        triton_lse.lse_backward_triton(q, k, s, row, col, w_row, None, out_dtype=dtype, dq_add=(out, sums_q, g, factor))
    with pytest.raises(ValueError, match="cannot go with unscaled"):
        triton_lse.lse_backward_triton(q, k, s, row, col, w_row, None, unscaled=True, dq_add=(out, sums_q, g, factor))
