"""The OpenCLIP drop-ins (``ds_infcl.adapters.open_clip_loss``) against OpenCLIP's own
``ClipLoss`` / ``SigLipLoss`` in one process: same constructor and forward signatures, same loss
and gradients (features, scale, bias), ``output_dict``, and clear errors for what is not
supported. The multi-rank comparisons are in tests/loss/test_siglip_dist.py and (``ClipLoss``'s
``local_loss`` / ``gather_with_grad``) tests/adapters/test_open_clip_loss_dist.py."""

import inspect

import pytest
import torch

from ds_infcl.adapters import open_clip_loss
from tests.loss.openclip_ref import openclip_loss_module

oc = openclip_loss_module()
pytestmark = pytest.mark.skipif(oc is None, reason="open_clip_torch is not installed")


def _features(b, c, seed):
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1)
    return img, txt


def _run(loss_fn, img, txt, *scalars):
    img, txt = img.clone().requires_grad_(), txt.clone().requires_grad_()
    scalars = [torch.tensor(v, requires_grad=True) for v in scalars]
    loss = loss_fn(img, txt, *scalars)
    (loss * 0.7).backward()
    return [loss.detach(), img.grad, txt.grad] + [s.grad for s in scalars]


@pytest.mark.parametrize("name", ["ClipLoss", "SigLipLoss"])
def test_signatures_match_openclip(name):
    ours, theirs = getattr(open_clip_loss, name), getattr(oc, name)
    for method in ("__init__", "forward"):
        ours_params = list(inspect.signature(getattr(ours, method)).parameters.values())
        theirs_params = list(inspect.signature(getattr(theirs, method)).parameters.values())
        # Every OpenCLIP parameter, in order, with its default; ours may add keyword-only ones.
        positional = [p for p in ours_params if p.kind != p.KEYWORD_ONLY]
        assert [(p.name, p.default) for p in positional] == [(p.name, p.default) for p in theirs_params]


@pytest.mark.parametrize("b", [1, 7, 33])
def test_clip_loss_matches_openclip(b):
    img, txt = _features(b, 24, seed=b)
    for flags in ({}, {"local_loss": True}, {"gather_with_grad": True}, {"local_loss": True, "gather_with_grad": True},
                  {"cache_labels": True}):
        for scalars in ((14.3,), (14.3, 0.5)):  # with a logit bias too (zero gradient)
            ours = _run(open_clip_loss.ClipLoss(**flags), img, txt, *scalars)
            theirs = _run(oc.ClipLoss(**flags), img, txt, *scalars)
            for x, y in zip(ours, theirs):
                torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("b", [1, 7, 33])
def test_siglip_loss_matches_openclip(b):
    img, txt = _features(b, 24, seed=b)
    for impl in (None, "bidir", "shift", "reduce", "gather"):
        ours = _run(open_clip_loss.SigLipLoss(dist_impl=impl), img, txt, 10.0, -10.0)
        theirs = _run(oc.SigLipLoss(dist_impl=impl), img, txt, 10.0, -10.0)
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-6)


def test_output_dict():
    img, txt = _features(5, 8, seed=0)
    out = open_clip_loss.SigLipLoss()(img, txt, torch.tensor(10.0), torch.tensor(-10.0), output_dict=True)
    assert set(out) == {"contrastive_loss"}
    out = open_clip_loss.ClipLoss()(img, txt, torch.tensor(10.0), output_dict=True)
    assert set(out) == {"contrastive_loss"}


def test_errors():
    with pytest.raises(ValueError, match="use_horovod"):
        open_clip_loss.ClipLoss(use_horovod=True)
    with pytest.raises(ValueError, match="do not match the process group"):
        open_clip_loss.SigLipLoss(rank=1, world_size=2)  # no process group in this test
    with pytest.raises(ValueError, match="dist_impl must be one of"):
        open_clip_loss.SigLipLoss(dist_impl="ring")
