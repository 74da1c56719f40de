"""The Triton kernels on a CUDA GPU against the float64 reference (skipped without CUDA).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_triton_gpu.py

(tests/conftest.py turns the interpreter on unless the variable is already set.) Odd shapes
(b = 1, 1000, 65,537; b != m), a benchmark shape, bf16/fp16/fp32, both loss kinds, labels, scale in
{1, 14.3, 100}, the op with excluded positives and arbitrary upstream weights. Tolerances: fp32
within 1e-5 relative (or twice plain fp32 torch where that is worse); bf16/fp16 within twice plain
torch's error in that dtype (the materialized reference run in the dtype) plus 1e-4, and for bf16
at least 5e-3 (see ``_bound``). Each case prints its errors, so that the output is the report.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.bench.loss import capture_graph  # noqa: E402
from ds_infcl.loss import contrastive_loss  # noqa: E402
from ds_infcl.ops import contrastive_loss_reference, lse_reference  # noqa: E402
from ds_infcl.ops import triton_lse  # noqa: E402
from tests.ops.accuracy import error_bound, features, rel_err  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bound(dtype, plain):
    if dtype == torch.bfloat16:
        # G is stored once in bf16 (the operand of the dq/dk products): where the two directions'
        # terms nearly cancel against the positive logit outside the op (b = 1, symmetric), that
        # single rounding is about one bf16 ulp of the result.
        return max(error_bound(dtype, plain), 5e-3)
    return error_bound(dtype, plain)


def _loss_and_grads(fn, q, k, scale, dtype, upstream):
    qq = q.detach().to(dtype).clone().requires_grad_()
    kk = k.detach().to(dtype).clone().requires_grad_()
    s = torch.tensor(scale, device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                     requires_grad=True)
    loss = fn(qq, kk, s)
    (loss * upstream).backward()
    return [loss.detach(), qq.grad, kk.grad, s.grad]


def _loss_three_ways(b, m, c, scale, label_kind, symmetric, dt, label_seed):
    """``(got, plain, ref)``: the loss and its gradients from ours (Triton backend) and plain torch
    in ``dt``, and the float64 reference, on the same inputs (rounded to ``dt`` first); labels
    random (seeded by ``label_seed``) or the diagonal. ``got`` runs last, so ``_LAST_KERNELS``
    holds its kernels."""
    q, k = features(b, m, c, seed=b + m + c, device="cuda")
    q, k = q.to(dt).double(), k.to(dt).double()  # every path sees the same inputs
    labels = None
    if label_kind == "random":
        labels = torch.randint(0, m, (b,), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(label_seed))
    ref = _loss_and_grads(lambda a, bb, s: contrastive_loss_reference(a, bb, s, labels, symmetric=symmetric),
                          q, k, scale, torch.float64, 0.37)
    plain = _loss_and_grads(
        lambda a, bb, s: contrastive_loss_reference(a, bb, s, labels, symmetric=symmetric, upcast=False),
        q, k, scale, dt, 0.37)
    got = _loss_and_grads(
        lambda a, bb, s: contrastive_loss(a, bb, s, labels, symmetric=symmetric, backend="triton"),
        q, k, scale, dt, 0.37)
    return got, plain, ref


def _check_loss(label, got, plain, ref, dt):
    """The loss and its gradients (``got``) within ``_bound`` of the float64 reference, with plain
    torch in the same dtype (``plain``) as the yardstick; prints each error (the report)."""
    msgs = []
    for name, x, p, r in zip(["loss", "dq", "dk", "dscale"], got, plain, ref):
        assert torch.isfinite(x).all(), name
        err, pe = rel_err(x, r), rel_err(p, r)
        msgs.append((name, err, pe, err <= _bound(dt, pe)))
    print(f"\n{label}: " + "  ".join(f"{n} {e:.1e} (torch {p:.1e}){'' if ok else ' FAIL'}" for n, e, p, ok in msgs))
    assert all(ok for *_, ok in msgs)


# (b, m, c, scale, labels): b = 1, 1,000 and 65,537; b != m both ways; a benchmark shape.
LOSS_CASES = [
    (1, 1000, 512, 14.3, "random"),
    (1000, 1000, 512, 1.0, "diagonal"),
    (1000, 3001, 768, 100.0, "random"),
    (65537, 4099, 256, 14.3, "random"),
    (4099, 65537, 72, 100.0, "random"),
    (8192, 8192, 512, 14.3, "diagonal"),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("b,m,c,scale,label_kind", LOSS_CASES)
def test_loss_matches_fp64(b, m, c, scale, label_kind, symmetric, dtype):
    dt = DTYPES[dtype]
    got, plain, ref = _loss_three_ways(b, m, c, scale, label_kind, symmetric, dt, label_seed=1)
    _check_loss(f"loss b={b} m={m} c={c} s={scale} {label_kind} sym={symmetric} {dtype}", got, plain, ref, dt)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("b,m,c,scale", [(1, 777, 72, 100.0), (1000, 3001, 512, 14.3), (65537, 1000, 128, 1.0)])
def test_op_exclude_positive_arbitrary_weights(b, m, c, scale, dtype):
    """The op: both LSE vectors and gradients of sum(w_row * row) + sum(w_col * col)."""
    dt = DTYPES[dtype]
    q, k = features(b, m, c, seed=7, device="cuda")
    q, k = q.to(dt), k.to(dt)
    g = torch.Generator(device="cuda").manual_seed(3)
    labels = torch.randint(0, m, (b,), device="cuda", generator=g)
    wr = torch.randn(b, device="cuda", generator=g, dtype=torch.float64)
    wc = torch.randn(m, device="cuda", generator=g, dtype=torch.float64)

    def run(work, upcast):
        qq = q.detach().to(work).clone().requires_grad_()
        kk = k.detach().to(work).clone().requires_grad_()
        ss = torch.tensor(scale, device="cuda", dtype=torch.float64 if upcast else torch.float32, requires_grad=True)
        row, col = lse_reference(qq, kk, ss, labels=labels, exclude_positive=True, upcast=upcast)
        ((row.double() * wr).sum() + (col.double() * wc).sum()).backward()
        return row.detach(), col.detach(), qq.grad, kk.grad, ss.grad

    ref, plain = run(torch.float64, True), run(dt, False)
    row, col = triton_lse.lse_forward_triton(q, k, scale, labels=labels, exclude_positive=True)
    dq, dk, ds = triton_lse.lse_backward_triton(q, k, scale, row, col, wr.float(), wc.float(),
                                                labels=labels, exclude_positive=True)
    msgs = []
    for name, x, p, r in zip(["row", "col", "dq", "dk", "dscale"], (row, col, dq, dk, ds), plain, ref):
        fin = torch.isfinite(r)  # an all-excluded column (b = 1) has LSE -inf
        assert torch.equal(torch.isfinite(x), fin), name
        x, p, r = x[fin], p[fin], r[fin]
        err, pe = rel_err(x, r), rel_err(p, r)
        msgs.append((name, err, pe, err <= _bound(dt, pe)))
    print(f"\nop b={b} m={m} c={c} s={scale} exclude {dtype}: "
          + "  ".join(f"{n} {e:.1e} (torch {p:.1e}){'' if ok else ' FAIL'}" for n, e, p, ok in msgs))
    assert all(ok for *_, ok in msgs)


@pytest.mark.parametrize("check_finite,with_labels,expected", [(False, False, 0), (True, False, 0), (True, True, 1)])
def test_loss_step_host_syncs(check_finite, with_labels, expected):
    """A loss step (forward + backward, learnable scale) never waits for the GPU's queue, except
    for the one readback of explicit labels' range, read before the forward (a label out of range
    would index past the keys). The NaN/Inf check of a call without labels is read after the
    forward is queued, by waiting for an event right after the check's own kernels
    (``checks_read_after_launch``), which is no synchronizing operation in torch's sync debug mode
    (``tests/gpu/test_loss_checks_gpu.py`` holds the same)."""
    import warnings

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8192, 512, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(8192, 512, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    s = torch.tensor(14.3, device="cuda", requires_grad=True)
    labels = torch.randperm(8192, device="cuda", generator=g) if with_labels else None

    def step():
        contrastive_loss(q, k, s, labels, symmetric=True, backend="triton", check_finite=check_finite).backward()

    step()  # compile, and the one-time probe of torch.addmm(out_dtype=...)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Each detected sync warns "called a synchronizing CUDA operation"; the mode itself adds a
    # one-time notice that it is a prototype, which is not a sync.
    syncs = [str(w.message).splitlines()[0] for w in caught
             if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message).lower()]
    print(f"\nhost syncs (check_finite={check_finite}, labels={with_labels}): {len(syncs)} {syncs}")
    assert len(syncs) == expected, syncs


@pytest.mark.parametrize("symmetric", [True, False])
def test_loss_step_is_cuda_graph_capturable(symmetric):
    """A whole loss step (forward + backward, learnable scale, no input checks, diagonal labels)
    captures in a CUDA graph; replayed on new inputs it gives what eager gives on them (the
    small-batch path: the host's launch overhead disappears, as under
    torch.compile(mode="reduce-overhead")). Explicit labels are range-checked on the host, one
    readback per call, which a capture cannot contain."""
    g = torch.Generator(device="cuda").manual_seed(5)
    b, m, c = 8192, 8192 if symmetric else 12288, 512  # one direction: hard negatives after the positives
    q = torch.randn(b, c, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(m, c, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    s = torch.tensor(14.3, device="cuda", requires_grad=True)
    labels = None
    out = {}

    def step():
        q.grad = k.grad = s.grad = None
        loss = contrastive_loss(q, k, s, labels, symmetric=symmetric, backend="triton", check_finite=False)
        loss.backward()
        out["loss"] = loss

    graph = capture_graph(step)
    static = (out["loss"], q.grad, k.grad, s.grad)
    with torch.no_grad():  # new inputs into the captured tensors
        q.copy_(torch.randn(b, c, device="cuda", generator=g))
        k.copy_(torch.randn(m, c, device="cuda", generator=g))
        s.fill_(20.0)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in static]
    step()  # eager on the same inputs
    eager = (out["loss"], q.grad, k.grad, s.grad)
    # Same kernels on the same inputs; only a product that cuBLAS schedules differently under
    # capture could round differently (then a bf16 gradient moves by an ulp here and there).
    for name, x, y in zip(["loss", "dq", "dk", "dscale"], replayed, eager):
        assert rel_err(x, y) <= (1e-6 if name in ("loss", "dscale") else 1e-3), f"{name}: {rel_err(x, y):.1e}"
    print(f"\ngraph replay == eager (symmetric={symmetric}, m={m}): loss {eager[0].item():.5f}")


# The backward's G kernel: Gluon (TMA, warp-specialized, Hopper) and Triton on the same inputs,
# each against the float64 reference. Shapes: rows and columns not multiples of the 128 tiles,
# c not a multiple of the 32-wide K step (TMA zero-fills the tail), m % 8 != 0 (the last block of
# G cannot take a TMA store: the Triton kernel writes it), b = 1, labels with exclusion.
GLUON_CASES = [
    (1, 300, 64, 14.3, "diagonal"),
    (3000, 5000, 520, 14.3, "random"),
    (777, 1003, 200, 100.0, "random"),
    (9000, 9000, 512, 14.3, "diagonal"),
]


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon backward is for Hopper")
@pytest.mark.parametrize("impl", ["gluon", "triton"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("b,m,c,scale,label_kind", GLUON_CASES)
def test_backward_gluon_and_triton_match_fp64(b, m, c, scale, label_kind, dtype, impl, monkeypatch):
    monkeypatch.setenv("DS_INFCL_GLUON", "1" if impl == "gluon" else "0")
    dt = DTYPES[dtype]
    got, plain, ref = _loss_three_ways(b, m, c, scale, label_kind, True, dt, label_seed=2)
    kernel = getattr(triton_lse._LAST_KERNELS["bwd"], "name", "")
    if impl == "gluon" and m % 8 == 0:
        assert kernel == "_lse_bwd_g_hopper_kernel", kernel
    elif impl == "triton":
        assert kernel == "_lse_bwd_g_kernel", kernel
    _check_loss(f"{impl} backward b={b} m={m} c={c} s={scale} {label_kind} {dtype} ({kernel})", got, plain, ref, dt)


# The forward's statistics: Gluon (TMA, two consumer warpgroups, Hopper) and Triton on the same
# inputs, each against the float64 reference. Shapes with at least two 128-tiles per SM (below
# that the Triton kernel's 64-tiles run): b, m not multiples of 128, c not a multiple of the K
# step, b != m both ways, exclusion with the diagonal and with labels.
GLUON_FWD_CASES = [
    (3000, 5000, 520, 14.3, None),
    (5000, 2900, 200, 100.0, "random"),
    (9000, 9000, 512, 14.3, "diagonal"),
    (40000, 2200, 64, 1.0, None),
]


def _lse_check(label, got, want, dt):
    """Row and column LSEs against float64: finite where the reference is, within ``_bound`` of
    plain torch in ``dt`` (``want = (ref, plain)``)."""
    msgs = []
    for name, x, r, p in zip(["row", "col"], got, *want):
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(x), fin), name
        err, pe = rel_err(x[fin], r[fin]), rel_err(p[fin], r[fin])
        msgs.append((name, err, pe, err <= _bound(dt, pe)))
    print(f"\n{label}: " + "  ".join(f"{n} {e:.1e} (torch {p:.1e}){'' if ok else ' FAIL'}" for n, e, p, ok in msgs))
    assert all(ok for *_, ok in msgs)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon forward is for Hopper")
@pytest.mark.parametrize("impl", ["gluon", "triton"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("b,m,c,scale,exclude", GLUON_FWD_CASES)
def test_forward_gluon_and_triton_match_fp64(b, m, c, scale, exclude, dtype, impl, monkeypatch):
    monkeypatch.setenv("DS_INFCL_GLUON", "1" if impl == "gluon" else "0")
    dt = DTYPES[dtype]
    q, k = features(b, m, c, seed=11, device="cuda")
    q, k = q.to(dt), k.to(dt)
    labels = None
    if exclude == "random":
        labels = torch.randint(0, m, (b,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    opts = dict(labels=labels, exclude_positive=exclude is not None)
    ref = lse_reference(q.double(), k.double(), scale, **opts)
    plain = lse_reference(q, k, scale, upcast=False, **opts)
    got = triton_lse.lse_forward_triton(q, k, scale, **opts)
    kernel = getattr(triton_lse._LAST_KERNELS["fwd"], "name", "")
    assert kernel == ("_lse_fwd_hopper_kernel" if impl == "gluon" else "_lse_fwd_kernel"), kernel
    _lse_check(f"{impl} forward b={b} m={m} c={c} s={scale} exclude={exclude} {dtype}", got, (ref, plain), dt)


def _far_below_features(b, m, c=64, seed=5):
    """Unit queries near +e1; keys alternating near +e1 and -e1: at scale 100 the odd columns'
    logits sit ~200 below every row's maximum (their LSEs far below the rows')."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e1 = torch.zeros(c, device="cuda", dtype=torch.float64)
    e1[0] = 1.0
    q = e1 + 0.05 * torch.randn(b, c, device="cuda", generator=g, dtype=torch.float64)
    sign = torch.where(torch.arange(m, device="cuda") % 2 == 0, 1.0, -1.0).double()
    k = sign[:, None] * e1 + 0.05 * torch.randn(m, c, device="cuda", generator=g, dtype=torch.float64)
    return (torch.nn.functional.normalize(t, dim=-1).to(torch.bfloat16) for t in (q, k))


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon forward is for Hopper")
@pytest.mark.parametrize("impl", ["gluon", "triton"])
def test_forward_columns_far_below_the_row_maxima(impl, monkeypatch):
    """Every key block mixes keys along +e1 (logit ~100 for every row) and -e1 (~-100): the odd
    columns' sums are ~e^-200 of the rows' maxima, so both kernels fail their 2^-80 check there
    and take those columns again with per-tile shifts (the Gluon kernel marks them for
    ``_lse_fwd_cols_redo_kernel``). The column LSEs must still be exact."""
    monkeypatch.setenv("DS_INFCL_GLUON", "1" if impl == "gluon" else "0")
    q, k = _far_below_features(4096, 4096)
    ref = lse_reference(q.double(), k.double(), 100.0)
    plain = lse_reference(q, k, 100.0, upcast=False)
    got = triton_lse.lse_forward_triton(q, k, 100.0)
    assert (ref[1][1::2] < ref[0].min() - 150).all()  # the case: odd columns far below every row
    _lse_check(f"{impl} forward, columns e^-200 below the rows", got, (ref, plain), torch.bfloat16)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon backward is for Hopper")
@pytest.mark.parametrize("impl", ["gluon", "triton"])
def test_backward_two_exponential_tiles(impl, monkeypatch):
    """The symmetric backward where rows' and columns' LSEs lie ~200 apart (``_far_below_features``):
    every tile is outside the one-exponential range and takes two exponentials (the Gluon kernel's
    ``_g_two_exp_g``, column half by column half). Gradients against float64."""
    monkeypatch.setenv("DS_INFCL_GLUON", "1" if impl == "gluon" else "0")
    q, k = _far_below_features(3000, 4096)
    q, k = q.double(), k.double()
    ref = _loss_and_grads(lambda a, bb, s: contrastive_loss_reference(a, bb, s, None, symmetric=True),
                          q, k, 100.0, torch.float64, 0.37)
    plain = _loss_and_grads(lambda a, bb, s: contrastive_loss_reference(a, bb, s, None, symmetric=True, upcast=False),
                            q, k, 100.0, torch.bfloat16, 0.37)
    got = _loss_and_grads(lambda a, bb, s: contrastive_loss(a, bb, s, None, symmetric=True, backend="triton"),
                          q, k, 100.0, torch.bfloat16, 0.37)
    kernel = getattr(triton_lse._LAST_KERNELS["bwd"], "name", "")
    assert kernel == ("_lse_bwd_g_hopper_kernel" if impl == "gluon" else "_lse_bwd_g_kernel"), kernel
    _check_loss(f"{impl} backward, two-exponential tiles", got, plain, ref, torch.bfloat16)
