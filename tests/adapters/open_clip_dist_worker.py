"""The worker of tests/adapters/test_open_clip_loss_dist.py (importable by the spawned ranks): the
drop-in ``ClipLoss`` and OpenCLIP's own on the same ranks, for each combination of flags."""

from __future__ import annotations

import itertools

import torch

FLAGS = [dict(local_loss=l, gather_with_grad=g, cache_labels=c)
         for (l, g), c in zip(itertools.product((False, True), (False, True)), (False, True, True, False))]


def global_features(world, b, c, seed):
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(world * b, c, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(world * b, c, generator=g), dim=1)
    return img, txt


def _step(loss_fn, img, txt, scale, upstream):
    img, txt = img.clone().requires_grad_(), txt.clone().requires_grad_()
    s = torch.tensor(scale, requires_grad=True)
    loss = loss_fn(img, txt, s)
    (loss * upstream).backward()
    return dict(loss=loss.item(), dimg=img.grad, dtxt=txt.grad, ds=s.grad.item())


def worker(rank, world, payload):
    from ds_infcl.adapters.open_clip_loss import ClipLoss
    from tests.loss.openclip_ref import openclip_loss_module

    oc = openclip_loss_module()
    b, c = payload["b"], payload["c"]
    out = []
    for n, flags in enumerate(FLAGS):
        img, txt = global_features(world, b, c, seed=n)
        img, txt = img[rank * b:(rank + 1) * b], txt[rank * b:(rank + 1) * b]
        ours = _step(ClipLoss(**flags, rank=rank, world_size=world), img, txt, 11.0, 0.7)
        theirs = _step(oc.ClipLoss(**flags, rank=rank, world_size=world), img, txt, 11.0, 0.7)
        out.append(dict(flags=flags, ours=ours, theirs=theirs))
    return out
