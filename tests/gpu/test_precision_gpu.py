"""torch's precision rules on a CUDA GPU (Triton kernels), ``ds_infcl.ops.precision``.

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_precision_gpu.py

- Under ``torch.autocast("cuda", dtype=torch.bfloat16)`` float32 features give the loss and the
  gradients of the same call on bf16 features outside autocast (the same kernels on the same
  operands: equal up to 1e-6 of the largest value, and bit for bit where the GPU's libraries
  are deterministic, which the test prints), gradients in float32; for every loss entry point,
  on odd shapes and on 8,192 x 8,192 x 512 (the Gluon kernels on Hopper).
- With float32 features, ``torch.backends.cuda.matmul.allow_tf32`` changes the result (the
  kernels honour it: TF32 dots), both results are close to the float64 reference (full float32
  within 1e-5, TF32 within 2e-3 relative), and ``DS_INFCL_ALLOW_TF32=0`` pins the kernels' full
  float32 (the loss value equals the TF32-off one).
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.adapters.open_clip_loss import ClipLoss  # noqa: E402
from ds_infcl.loss import clip_loss, contrastive_loss, lse, siglip_loss  # noqa: E402
from ds_infcl.loss.retrieval import retrieval_loss  # noqa: E402
from ds_infcl.ops import contrastive_loss_reference  # noqa: E402
from ds_infcl.ops.siglip import siglip_reference  # noqa: E402
from tests.ops.accuracy import features, rel_err  # noqa: E402

BF16 = torch.bfloat16


def _labels(b, m):
    if b == m:
        return None
    return torch.randint(0, m, (b,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))


def _loss(name, q, k, s, t, labels):
    if name == "clip_loss":
        return clip_loss(q, k, s) if labels is None else contrastive_loss(q, k, s, labels, symmetric=True)
    if name == "contrastive_loss":
        return contrastive_loss(q, k, s, labels)
    if name == "lse":
        row, col = lse(q, k, s, labels=labels, exclude_positive=labels is not None)
        return row.mean() + 0.5 * col.mean()
    if name == "siglip_loss":
        return siglip_loss(q, k, s, t, labels)
    if name == "retrieval_loss":
        key_ids = torch.arange(k.shape[0], device="cuda")
        key_ids[-1] = key_ids[0]
        return retrieval_loss(q, k, s, labels, key_ids=key_ids)
    if name == "open_clip.ClipLoss":
        return ClipLoss()(q, k, s)
    raise ValueError(name)


def _run(name, q, k, labels, autocast):
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    s = torch.tensor(14.3, device="cuda", requires_grad=True)
    t = torch.tensor(-10.0, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=BF16, enabled=autocast):
        loss = _loss(name, q, k, s, t, labels)
    loss.backward()
    return [loss.detach(), q.grad, k.grad, s.grad, t.grad]


NAMES = ["clip_loss", "contrastive_loss", "lse", "siglip_loss", "retrieval_loss", "open_clip.ClipLoss"]


@pytest.mark.parametrize("b, m", [(1, 1), (1000, 1000), (777, 1500), (8192, 8192)])
@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_equals_bf16_features(name, b, m):
    if name == "open_clip.ClipLoss" and b != m:
        pytest.skip("OpenCLIP's ClipLoss pairs one text per image")
    q, k = (x.float() for x in features(b, m, 512 if b == 8192 else 72, seed=b + m, device="cuda"))
    labels = _labels(b, m)
    got = _run(name, q, k, labels, autocast=True)
    want = _run(name, q.to(BF16), k.to(BF16), labels, autocast=False)
    exact = True
    for what, g, w in zip(("loss", "dq", "dk", "dscale", "dbias"), got, want):
        if w is None:
            assert g is None or not g.any(), what
            continue
        assert g.dtype == torch.float32, f"{what} in {g.dtype}"
        w = w.float()
        if torch.equal(g, w):
            continue
        exact = False
        tol = 1e-6 * max(w.abs().max().item(), 1e-6)
        assert (g - w).abs().max().item() <= tol, f"{name} {b}x{m} {what}: {(g - w).abs().max().item():.3g} > {tol:.3g}"
    print(f"{name} {b}x{m}: {'bit for bit' if exact else 'within 1e-6'}")


def _fp32_run(name, q, k, tf32: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return _run(name, q, k, None, autocast=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _reference(name, q, k):
    q = q.double().requires_grad_(True)
    k = k.double().requires_grad_(True)
    s = torch.tensor(14.3, device="cuda", dtype=torch.float64, requires_grad=True)
    t = torch.tensor(-10.0, device="cuda", dtype=torch.float64, requires_grad=True)
    if name == "clip_loss":
        loss = contrastive_loss_reference(q, k, s, symmetric=True)
    else:
        loss = siglip_reference(q, k, s, t)
    loss.backward()
    return [loss.detach(), q.grad, k.grad, s.grad, t.grad if name == "siglip_loss" else None]


@pytest.mark.parametrize("name", ["clip_loss", "siglip_loss"])
def test_tf32_flag_is_honoured_and_both_are_close_to_float64(name, monkeypatch):
    monkeypatch.delenv("DS_INFCL_ALLOW_TF32", raising=False)
    q, k = (x.float() for x in features(4096, 4096, 512, seed=11, device="cuda"))
    ref = _reference(name, q, k)
    off = _fp32_run(name, q, k, tf32=False)
    on = _fp32_run(name, q, k, tf32=True)
    # The loss value comes from the Triton kernels alone (the backward's cuBLAS products follow the
    # flag by themselves): it changes only if the kernels honour the flag.
    assert not torch.equal(on[0], off[0]), "TF32 on gave the full-float32 loss: the kernels ignore the flag"
    for what, o, t, r in zip(("loss", "dq", "dk", "dscale", "dbias"), off, on, ref):
        if r is None:
            continue
        e_off, e_on = rel_err(o, r), rel_err(t, r)
        print(f"{name} {what}: float32 {e_off:.2e}, TF32 {e_on:.2e}")
        assert e_off <= 1e-5, f"{what}: full float32 rel err {e_off:.2e}"
        assert e_on <= 2e-3, f"{what}: TF32 rel err {e_on:.2e}"
    # DS_INFCL_ALLOW_TF32=0 pins the Triton kernels' full float32 whatever torch says: the loss
    # value (Triton kernels only) is the TF32-off one (the backward's cuBLAS products follow torch).
    monkeypatch.setenv("DS_INFCL_ALLOW_TF32", "0")
    pinned = _fp32_run(name, q, k, tf32=True)
    assert torch.equal(pinned[0], off[0])
