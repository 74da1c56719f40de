"""CPU side of the single-device InfoNCE's Function (``ds_infcl.ops.infonce.InfoNCEFunction``, what
an eligible CUDA call runs, replayed from CUDA graphs or not): its eager passes equal the custom
ops' bitwise (loss and gradients) on both backends, b = 1, sizes off the tile, rectangular, labels,
one direction and symmetric, fp32 and fp16; and the default call's value checks, which it runs
itself where there are no labels to check. The replays: tests/gpu/test_infonce_graph_gpu.py."""

import importlib
import os

import pytest
import torch

from ds_infcl.loss import contrastive_loss
from ds_infcl.ops import contrastive_loss_reference
from ds_infcl.ops import validation

infonce = importlib.import_module("ds_infcl.ops.infonce")

BACKENDS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET", "0") == "1" else [])
CASES = [  # (b, m, c, dtype, symmetric, labels)
    (1, 1, 8, torch.float32, True, False),
    (37, 53, 24, torch.float32, False, True),
    (20, 33, 16, torch.float32, True, False),
    (17, 40, 16, torch.float16, True, True),
    (9, 9, 16, torch.float16, False, False),
]


def _inputs(b, m, c, dtype, labels, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(m, c, generator=g), dim=1).to(dtype)
    lab = torch.randint(0, m, (b,), generator=g) if labels else None
    return q, k, lab


def _run(q, k, lab, symmetric, backend):
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    s = torch.tensor(9.0, requires_grad=True)
    loss = contrastive_loss(q, k, s, lab, symmetric=symmetric, backend=backend)
    (loss * 0.37).backward()
    return loss.detach(), q.grad, k.grad, s.grad, loss.grad_fn


@pytest.mark.parametrize("case,backend", [(c, be) for c in CASES for be in BACKENDS
                                          if c[3] == torch.float32 or be == "triton"],  # (fp16: the interpreter's)
                         ids=lambda x: x if isinstance(x, str) else f"{x[0]}x{x[1]}x{x[2]}-{str(x[3])[6:]}-"
                         f"{'sym' if x[4] else 'one'}{'-labels' if x[5] else ''}")
def test_function_equals_the_custom_op(case, backend, monkeypatch):
    b, m, c, dtype, symmetric, labels = case
    q, k, lab = _inputs(b, m, c, dtype, labels)
    want = _run(q, k, lab, symmetric, backend)
    assert "InfoNCEFunction" not in type(want[-1]).__name__
    monkeypatch.setattr(infonce, "graph_eligible", lambda *a: True)  # (run_graphed then runs it eagerly on CPU)
    got = _run(q, k, lab, symmetric, backend)
    assert type(got[-1]).__name__ == "InfoNCEFunctionBackward"
    for name, x, y in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    ref_q, ref_k = q.double().requires_grad_(), k.double().requires_grad_()
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    ref = contrastive_loss_reference(ref_q, ref_k, s, lab, symmetric=symmetric)
    (ref * 0.37).backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for name, x, y in zip(("loss", "dq", "dk", "dscale"), got, (ref, ref_q.grad, ref_k.grad, s.grad)):
        err = (x.double() - y).abs().max().item() / max(y.abs().max().item(), 1e-3)
        assert err <= tol, f"{name}: rel err {err:.2e}"


def test_function_checks_values_in_its_own_pass(monkeypatch):
    """The default call without labels runs its value checks in the Function, through
    ``PassCheck`` (at the start of the forward, in its graph on CUDA; eager here), with the errors of the
    other paths, read at the call or queued in ``deferred_value_checks``; with labels, or with
    ``check_finite=False``, the checks stay before the call."""
    monkeypatch.setattr(infonce, "graph_eligible", lambda *a: True)
    calls = []


    class Counted(infonce.PassCheck):
        def __init__(self, *args):
            calls.append(1)
            super().__init__(*args)

    monkeypatch.setattr(infonce, "PassCheck", Counted)
    q, k, _ = _inputs(8, 10, 16, torch.float32, False)
    bad = q.clone()
    bad[[0, 7], 5] = float("inf")
    with pytest.raises(ValueError, match=r"^query has 2 of 8 rows with NaN or Inf values"):
        contrastive_loss(bad, k, 5.0, symmetric=True)
    with pytest.raises(ValueError, match=r"^scale must be finite, got nan"):
        contrastive_loss(q, k, torch.tensor(float("nan")))
    assert len(calls) == 2
    with validation.deferred_value_checks() as pending:
        loss = contrastive_loss(q, k.clone().fill_(float("nan")), 5.0)
    assert len(calls) == 3 and loss.isnan() and pending.failed().item() == 1
    with pytest.raises(ValueError, match=r"^key has 10 of 10 rows"):
        pending.raise_if_failed()
    contrastive_loss(bad, k, 5.0, check_finite=False)
    with pytest.raises(ValueError, match=r"^labels must lie in \[0, 10\)"):
        with validation.deferred_value_checks():  # labels index the keys: read at once
            contrastive_loss(q, k, 5.0, torch.tensor([0, 1, 2, 3, 4, 5, 6, 10]))
    with pytest.raises(ValueError, match=r"^query has 2 of 8 rows"):
        contrastive_loss(bad, k, 5.0, torch.arange(8))
    assert len(calls) == 3
    good = contrastive_loss(q, k, 5.0, symmetric=True)
    assert len(calls) == 4 and torch.isfinite(good)
