"""The public loss API: module, functional, registry, and the documented errors on bad input."""

import math

import pytest
import torch

import ds_infcl.loss
from ds_infcl.loss import (
    ContrastiveLoss,
    available_loss_impls,
    clip_loss,
    contrastive_loss,
    lse,
)
from ds_infcl.ops import contrastive_loss_reference, lse_reference


def _qk(b=6, m=6, c=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, c, generator=g).to(dtype), torch.randn(m, c, generator=g).to(dtype)


def test_module_learnable_scale_init_clamp_and_grad():
    loss_fn = ContrastiveLoss(symmetric=True)
    assert isinstance(loss_fn.logit_scale, torch.nn.Parameter)
    assert loss_fn.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    q, k = _qk()
    q.requires_grad_()
    loss = loss_fn(q, k)
    ref = contrastive_loss_reference(q.double(), k.double(), 1 / 0.07, symmetric=True)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    loss.backward()
    # d loss / d logit_scale = scale * d loss / d scale
    s = torch.tensor(1 / 0.07, dtype=torch.float64, requires_grad=True)
    contrastive_loss_reference(q.detach().double(), k.double(), s, symmetric=True).backward()
    assert loss_fn.logit_scale.grad.item() == pytest.approx((s.grad * s).item(), rel=1e-5)

    with torch.no_grad():
        loss_fn.logit_scale.fill_(10.0)  # above log(100): clamped in the forward
    assert loss_fn.scale.item() == pytest.approx(100.0, rel=1e-6)
    loss_fn.logit_scale.grad = None
    loss_fn(q, k).backward()
    assert loss_fn.logit_scale.grad.item() == 0.0  # the clamp is active


def test_fixed_scale_module_and_clip_functional():
    loss_fn = ContrastiveLoss(symmetric=False, learnable_scale=False, init_logit_scale=math.log(20.0))
    assert not any(p.requires_grad for p in loss_fn.parameters())
    q, k = _qk(4, 9)
    ref = contrastive_loss_reference(q.double(), k.double(), 20.0)
    assert loss_fn(q, k).item() == pytest.approx(ref.item(), rel=1e-5)
    assert clip_loss(q, k[:4], 5.0).item() == pytest.approx(
        contrastive_loss_reference(q.double(), k[:4].double(), 5.0, symmetric=True).item(), rel=1e-5
    )


def test_the_default_module_is_the_clip_loss():
    # ContrastiveLoss() is the symmetric CLIP loss; ds_infcl.loss has no ClipLoss of its own (the
    # package's only ClipLoss is the OpenCLIP drop-in, ds_infcl.adapters.open_clip_loss.ClipLoss).
    loss_fn = ContrastiveLoss()
    assert loss_fn.symmetric
    q, k = _qk(5, 5)
    ref = contrastive_loss_reference(q.double(), k.double(), 1 / 0.07, symmetric=True)
    assert loss_fn(q, k).item() == pytest.approx(ref.item(), rel=1e-5)
    assert not hasattr(ds_infcl.loss, "ClipLoss") and "ClipLoss" not in ds_infcl.loss.__all__


def test_functional_lse_matches_reference():
    q, k = _qk(5, 7, 3)
    row, col = lse(q, k, 2.0)
    row_r, col_r = lse_reference(q.double(), k.double(), 2.0)
    torch.testing.assert_close(row.double(), row_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(col.double(), col_r, rtol=1e-6, atol=1e-6)


def test_registry_lists_infcl_and_rejects_unknown():
    assert "infcl" in available_loss_impls()
    with pytest.raises(ValueError, match="unknown loss implementation 'nope'; choose one of"):
        contrastive_loss(*_qk(), 1.0, impl="nope")
    with pytest.raises(ValueError, match="unknown loss implementation"):
        ContrastiveLoss(impl="nope")
    with pytest.raises(ValueError, match="backend must be one of"):
        ContrastiveLoss(backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        contrastive_loss(*_qk(), 1.0, backend="cuda")


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend=\"triton\""):
        contrastive_loss(*_qk(), 1.0, backend="triton")


# ---- input validation: every bad input gets a ValueError that says what is wrong ----

BAD_INPUTS = [
    ("query 1-D", lambda: (torch.randn(8), torch.randn(4, 8), None), "query must be 2-D"),
    ("key 3-D", lambda: (torch.randn(4, 8), torch.randn(4, 2, 4), None), "key must be 2-D"),
    ("dims differ", lambda: (torch.randn(4, 8), torch.randn(4, 9), None), "feature dims differ"),
    ("dtypes differ", lambda: (torch.randn(4, 8), torch.randn(4, 8).half(), None), "dtypes differ"),
    ("int dtype", lambda: (torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64), None), "supported dtypes"),
    ("float64", lambda: (torch.randn(4, 8).double(), torch.randn(4, 8).double(), None), "supported dtypes"),
    ("empty query", lambda: (torch.randn(0, 8), torch.randn(4, 8), None), "query is empty"),
    ("empty key", lambda: (torch.randn(4, 8), torch.randn(0, 8), torch.zeros(4, dtype=torch.long)), "key is empty"),
    ("zero dim", lambda: (torch.randn(4, 0), torch.randn(4, 0), None), "feature dim is 0"),
    ("label too big", lambda: (torch.randn(4, 8), torch.randn(5, 8), torch.tensor([0, 1, 2, 5])), r"labels must lie in \[0, 5\)"),
    ("label negative", lambda: (torch.randn(4, 8), torch.randn(5, 8), torch.tensor([0, -1, 2, 3])), r"labels must lie in"),
    ("label shape", lambda: (torch.randn(4, 8), torch.randn(5, 8), torch.tensor([0, 1])), r"labels must have shape \[4\]"),
    ("label float", lambda: (torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4)), "integer tensor"),
    ("fewer keys, no labels", lambda: (torch.randn(4, 8), torch.randn(3, 8), None), "pass labels"),
]


@pytest.mark.parametrize("name,make,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_value_error(name, make, match):
    q, k, labels = make()
    with pytest.raises(ValueError, match=match):
        contrastive_loss(q, k, 1.0, labels)


def test_non_finite_rows_are_counted():
    q, k = _qk(6, 6)
    q[1, 0] = float("nan")
    q[4, 3] = float("inf")
    with pytest.raises(ValueError, match="query has 2 of 6 rows with NaN or Inf"):
        contrastive_loss(q, k, 1.0)
    k[0] = float("-inf")
    with pytest.raises(ValueError, match="key has 1 of 6 rows"):
        lse(q.nan_to_num(), k, 1.0)


@pytest.mark.parametrize("scale,match", [(float("nan"), "scale must be finite"), (torch.ones(2), "one-element"), ("1", "float or a tensor")])
def test_bad_scale(scale, match):
    with pytest.raises(ValueError, match=match):
        contrastive_loss(*_qk(), scale)


@pytest.mark.parametrize("tile_size", [0, -1, -5, 2.5, True])
def test_bad_tile_size_is_a_value_error(tile_size):
    """A tile edge below 1 used to tile nothing: -inf statistics and zero gradients, no error."""
    from ds_infcl.loss import SigLIPLoss, siglip_loss

    q, k = torch.randn(6, 4), torch.randn(6, 4)
    match = "tile_size must be a positive integer"
    with pytest.raises(ValueError, match=match):
        contrastive_loss(q, k, 10.0, tile_size=tile_size, backend="torch")
    with pytest.raises(ValueError, match=match):
        lse(q, k, 10.0, tile_size=tile_size, backend="torch")
    with pytest.raises(ValueError, match=match):
        siglip_loss(q, k, 10.0, -10.0, tile_size=tile_size, backend="torch")
    with pytest.raises(ValueError, match=match):
        ContrastiveLoss(tile_size=tile_size)
    with pytest.raises(ValueError, match=match):
        SigLIPLoss(tile_size=tile_size)
    # A positive edge smaller than the batch is fine (several tiles) and exact.
    ref = contrastive_loss(q, k, 10.0, backend="torch")
    torch.testing.assert_close(contrastive_loss(q, k, 10.0, tile_size=1, backend="torch"), ref)
