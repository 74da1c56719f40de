"""Every loss follows torch's precision rules as a matmul does (``ds_infcl.ops.precision``).

Under ``torch.autocast`` float32 features must give exactly what the same loss gives on the
features cast to autocast's dtype outside autocast: the same value, bit for bit, and the same
gradients (returned in float32, the caller's dtype), also when ``backward()`` runs inside the
autocast region. Before the shared rule the torch backend ran its tile matmuls under autocast on
float32 operands (bf16 logits: 5e-3 off in the gradients at b = 37) and the Triton backend
ignored autocast altogether (float32 kernels). The Triton kernels run under the interpreter here,
whose bf16 dot products are wrong, so they are checked under fp16 autocast (CPU autocast takes
fp16 in torch 2.13); the torch backend under bf16 and fp16.

Outside autocast, float32 features use TF32 dot products in the Triton kernels where torch's
``torch.backends.cuda.matmul.allow_tf32`` allows them (``DS_INFCL_ALLOW_TF32`` pins it), and
a cached CUDA graph is keyed by that choice.
"""

from __future__ import annotations

import pytest
import torch

from ds_infcl.adapters.open_clip_loss import ClipLoss, SigLipLoss
from ds_infcl.loss import (
    ContrastiveLoss, SigLIPLoss, build_fastclip_loss, cast_for_autocast, clip_loss, contrastive_loss,
    follows_autocast, lse, siglip_loss,
)
from ds_infcl.loss.retrieval import RetrievalLoss, matryoshka_retrieval_loss, retrieval_loss
from ds_infcl.ops import precision
from tests.ops.accuracy import features

BF16, FP16 = torch.bfloat16, torch.float16
# (backend, autocast dtype): the interpreter's bf16 dot is wrong, so Triton is checked under fp16.
SETTINGS = [("torch", BF16), ("torch", FP16), ("triton", FP16)]
# (b, m): one query, sizes off the tiles (the interpreter's are 32, the torch tile is set to 16
# below), rectangular with hard negatives.
SHAPES = [(1, 1), (37, 37), (19, 53)]


def _labels(b, m):
    return None if b == m else torch.randint(0, m, (b,), generator=torch.Generator().manual_seed(b))


def _call(name, q, k, s, t, labels, backend):
    """One loss by name on features ``q [b, c]``, ``k [m, c]``, scale tensor ``s``, bias ``t``."""
    kw = dict(backend=backend, tile_size=16) if backend == "torch" else dict(backend=backend)
    b, m = q.shape[0], k.shape[0]
    if name == "contrastive_loss":
        return contrastive_loss(q, k, s, labels, **kw)
    if name == "clip_loss":
        return clip_loss(q, k, s, **kw) if b == m else contrastive_loss(q, k, s, labels, symmetric=True, **kw)
    if name == "lse":
        row, col = lse(q, k, s, labels=labels, exclude_positive=True, **kw)
        return row.sum() + 0.5 * col.sum()
    if name == "siglip_loss":
        return siglip_loss(q, k, s, t, labels, **kw)
    if name == "retrieval_loss":  # hard negatives, with a repeated key masked as a false negative
        key_ids = torch.arange(m)
        key_ids[-1] = key_ids[0]
        return retrieval_loss(q, k, s, labels, key_ids=key_ids, symmetric=b <= m, **kw)
    if name == "matryoshka_retrieval_loss":
        return matryoshka_retrieval_loss(q, k, s, labels, matryoshka_dims=[24, 8], **kw)
    raise ValueError(name)


FUNCTIONALS = ["contrastive_loss", "clip_loss", "lse", "siglip_loss", "retrieval_loss", "matryoshka_retrieval_loss"]


def _run(fn, q, k, autocast_dtype, inside):
    """``fn(q, k, s, t)`` on leaf copies of ``q`` / ``k``, under autocast of ``autocast_dtype``
    (``None``: none), ``backward()`` inside the region when ``inside``; the loss and the
    gradients of the features, the scale and the bias."""
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    s = torch.tensor(14.3, requires_grad=True)
    t = torch.tensor(-2.5, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype or BF16, enabled=autocast_dtype is not None):
        loss = fn(q, k, s, t)
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    return loss.detach(), q.grad, k.grad, s.grad, t.grad


def _assert_same_as_cast_inputs(fn, b, m, autocast_dtype, inside=False):
    q, k = (x.float() for x in features(b, m, 24, seed=b + m))
    loss, dq, dk, ds, dt = _run(fn, q, k, autocast_dtype, inside)
    want = _run(fn, q.to(autocast_dtype), k.to(autocast_dtype), None, False)
    assert loss.dtype == torch.float32 and dq.dtype == torch.float32 and dk.dtype == torch.float32
    assert torch.equal(loss, want[0]), f"loss {loss.item()!r} != {want[0].item()!r} on {autocast_dtype} inputs"
    for name, g, w in (("dq", dq, want[1]), ("dk", dk, want[2]), ("dscale", ds, want[3]), ("dbias", dt, want[4])):
        if w is None:
            assert g is None or not g.any(), name
            continue
        assert torch.equal(g, w.float()), f"{name}: max diff {(g - w.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("backend, autocast_dtype", SETTINGS)
@pytest.mark.parametrize("b, m", SHAPES)
@pytest.mark.parametrize("name", FUNCTIONALS)
def test_functional_under_autocast_is_the_loss_of_the_cast_features(name, b, m, backend, autocast_dtype):
    labels = _labels(b, m)
    _assert_same_as_cast_inputs(lambda q, k, s, t: _call(name, q, k, s, t, labels, backend), b, m,
                                autocast_dtype)


@pytest.mark.parametrize("backend, autocast_dtype", SETTINGS)
@pytest.mark.parametrize("name", ["clip_loss", "siglip_loss", "lse"])
def test_backward_inside_the_autocast_region(name, backend, autocast_dtype):
    """The op bodies run with autocast off in the backward too (the torch backend's tile matmuls
    would otherwise run in autocast's dtype on the recomputed float32 operands)."""
    _assert_same_as_cast_inputs(lambda q, k, s, t: _call(name, q, k, s, t, None, backend), 37, 37,
                                autocast_dtype, inside=True)


def _modules(backend):
    kw = dict(backend=backend)
    return {
        "ContrastiveLoss": lambda: (lambda mod: lambda q, k, s, t: mod(q, k))(ContrastiveLoss(**kw)),
        "SigLIPLoss": lambda: (lambda mod: lambda q, k, s, t: mod(q, k))(SigLIPLoss(**kw)),
        "RetrievalLoss": lambda: (lambda mod: lambda q, k, s, t: mod(q, k, key_ids=torch.arange(k.shape[0])))(
            RetrievalLoss(scale=20.0, symmetric=True, **kw)),
        "open_clip.ClipLoss": lambda: (lambda mod: lambda q, k, s, t: mod(q, k, s, t))(ClipLoss(**kw)),
        "open_clip.SigLipLoss": lambda: (lambda mod: lambda q, k, s, t: mod(q, k, s, t))(SigLipLoss(**kw)),
        "FastCLIPLoss": lambda: (lambda mod: lambda q, k, s, t: mod(q, k, torch.arange(q.shape[0]), update=False))(
            build_fastclip_loss("fastclip_v3", 64, backend=backend)),
    }


@pytest.mark.parametrize("backend, autocast_dtype", [("torch", BF16), ("triton", FP16)])
@pytest.mark.parametrize("name", list(_modules("torch")))
def test_modules_and_drop_ins_under_autocast(name, backend, autocast_dtype):
    fn = _modules(backend)[name]()
    _assert_same_as_cast_inputs(fn, 37, 37, autocast_dtype)


def test_compiled_loss_under_autocast_is_the_eager_one():
    """torch.compile(fullgraph=True) of a step under autocast: the same numbers as eager (the
    entry's cast and autocast switch trace into the graph; the ops stay opaque)."""
    import torch._dynamo as dynamo

    def step(q, k, s, t):
        return clip_loss(q, k, s) + siglip_loss(q, k, s, t)

    dynamo.reset()
    try:
        q, k = (x.float() for x in features(37, 37, 24, seed=5))
        eager = _run(step, q, k, BF16, False)
        compiled = _run(torch.compile(step, fullgraph=True), q, k, BF16, False)
    finally:
        dynamo.reset()
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


# ---- the helpers -----------------------------------------------------------------------------------


def test_cast_for_autocast_casts_what_autocast_casts():
    x32, x64, ids = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64), torch.arange(3)
    assert cast_for_autocast(x32, None, ids)[0] is x32  # autocast off: unchanged
    with torch.autocast("cpu", dtype=BF16):
        a, none, i, b64, h = cast_for_autocast(x32, None, ids, x64, x32.half())
    assert (a.dtype, none, i.dtype, b64.dtype, h.dtype) == (BF16, None, torch.int64, torch.float64, BF16)
    with torch.autocast("cpu", dtype=BF16):
        assert precision.compute_dtype(x32) == BF16 and precision.compute_dtype(x64) == torch.float64
    assert precision.compute_dtype(x32) == torch.float32


def test_follows_autocast_casts_positional_and_keyword_features():
    seen = []

    @follows_autocast("query", "key")
    def loss(scale_first, query, key=None):
        seen.append((query.dtype, key.dtype, torch.is_autocast_enabled("cpu")))

    x = torch.randn(2, 3)
    with torch.autocast("cpu", dtype=BF16):
        loss(1.0, x, x)
        loss(1.0, query=x, key=x)
    loss(1.0, x, key=x)
    assert seen == [(BF16, BF16, False), (BF16, BF16, False), (torch.float32, torch.float32, False)]


def test_tf32_follows_torch_and_the_setting_pins_it(monkeypatch):
    from ds_infcl.ops import triton_lse

    monkeypatch.delenv("DS_INFCL_ALLOW_TF32", raising=False)
    q = torch.randn(4, 32)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert not precision.tf32_allowed() and triton_lse._kernel_flags(q, 32, 32)["PRECISION"] == 1
        torch.backends.cuda.matmul.allow_tf32 = True
        assert precision.tf32_allowed() and triton_lse._kernel_flags(q, 32, 32)["PRECISION"] == 2
        # 16-bit features: their own tensor-core dots (the interpreter's bf16 upcast: full fp32)
        assert triton_lse._kernel_flags(q.half(), 32, 32)["PRECISION"] == 0
        assert triton_lse._kernel_flags(q.bfloat16(), 32, 32)["PRECISION"] == 1
        assert precision.precision_key((q.bfloat16(), None, q)) is True  # any float32 tensor
        assert precision.precision_key((q.bfloat16(), None)) is False
        monkeypatch.setenv("DS_INFCL_ALLOW_TF32", "0")
        assert not precision.tf32_allowed()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("high")  # torch's other spelling of the same rule
        monkeypatch.delenv("DS_INFCL_ALLOW_TF32")
        assert precision.tf32_allowed()
        monkeypatch.setenv("DS_INFCL_ALLOW_TF32", "1")
        torch.set_float32_matmul_precision("highest")
        assert precision.tf32_allowed()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
        torch.set_float32_matmul_precision("highest" if not before else "high")
