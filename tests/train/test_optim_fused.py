"""The torch Adam that DeepSpeed builds with ``torch_adam``: ``fused=True`` where the optimizer
states live on a GPU, ``foreach=True`` on the CPU (or with optimizer offload), a user's choice
kept, and a log line naming the Adam in use."""

import pytest
import torch

import ds_infcl.train.optim as optim
from ds_infcl.train.optim import prepare_optimizer


def _params(ds):
    return ds["optimizer"]["params"]


def test_cuda_fallback_is_fused(monkeypatch):
    monkeypatch.setattr(optim, "_fused_adam_buildable", lambda cfg: False)
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "cuda")
    assert _params(ds)["fused"] is True and "foreach" not in _params(ds)
    assert notes[-1] == "optimizer AdamW: torch.optim.AdamW(fused=True)"
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}}, "cuda")
    assert notes[-1] == "optimizer Adam: torch.optim.Adam(fused=True)"
    monkeypatch.setattr(optim, "_fused_adam_buildable", lambda cfg: True)
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {}}}, "cuda")
    assert _params(ds) == {} and notes[-1] == "optimizer AdamW: DeepSpeed's FusedAdam"


def test_cpu_and_offload_use_foreach_and_user_choice_is_kept():
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {}}}, "cpu")
    assert _params(ds) == {"torch_adam": True, "foreach": True}
    assert notes[-1] == "optimizer AdamW: torch.optim.AdamW(foreach=True)"
    offload = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert _params(prepare_optimizer(offload, "cuda")[0])["foreach"] is True
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": False}}}, "cuda")
    assert "fused" not in _params(ds) and notes[-1] == "optimizer AdamW: torch.optim.AdamW(foreach=False)"


@pytest.mark.parametrize("accelerator", ["cpu", "cuda"])
def test_deepspeed_builds_the_torch_optimizer_from_these_params(monkeypatch, accelerator):
    """The params reach torch.optim.AdamW the way DeepSpeed passes them (``foreach`` popped and
    given as a keyword, the rest as they are); CPU tensors stand in for the GPU's (torch has a
    fused CPU AdamW) and step like the plain loop."""
    monkeypatch.setattr(optim, "_fused_adam_buildable", lambda cfg: False)
    ds, _, _ = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.1}}}, accelerator)
    params = dict(_params(ds))
    params.pop("torch_adam")
    foreach = params.pop("foreach", None)
    w = torch.nn.Parameter(torch.linspace(-1, 1, 10))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = torch.optim.AdamW([w], **params, foreach=foreach)
    plain = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1, foreach=False)
    for step in range(3):
        for p in (w, ref):
            p.grad = torch.cos(p.detach() * (step + 1))
        opt.step()
        plain.step()
    torch.testing.assert_close(w.detach(), ref.detach())
