"""CPU side of SigLIP's CUDA graphs (``ds_infcl.ops.siglip.SigLIPFunction``): which path a call
takes, and that the Function's eager passes equal the custom ops' (values, the four gradients)
on both backends, b = 1, sizes off the tile, rectangular, labels and ids, fp32 and fp16. The
replays themselves: tests/gpu/test_siglip_graph_gpu.py."""

import pytest
import torch

from ds_infcl.loss import siglip_loss
from ds_infcl.ops import infonce_graph as ig
from ds_infcl.ops import siglip as sg
from ds_infcl.ops.siglip import siglip_reference

CASES = [  # (b, m, c, dtype, positives, backend)
    (1, 1, 8, torch.float32, "diag", "torch"),
    (37, 53, 24, torch.float32, "labels", "torch"),
    (19, 11, 16, torch.float32, "ids", "torch"),
    (20, 33, 16, torch.float32, "diag", "triton"),
    (17, 40, 16, torch.float16, "labels", "triton"),
    (9, 9, 16, torch.float16, "ids", "triton"),
]


def _inputs(b, m, c, dtype, positives, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(m, c, generator=g), dim=1).to(dtype)
    pos = {}
    if positives == "labels":
        pos["labels"] = torch.randint(0, m, (b,), generator=g)
    elif positives == "ids":
        pos = dict(query_ids=torch.randint(0, 3, (b,), generator=g), key_ids=torch.randint(0, 3, (m,), generator=g))
    return q, k, pos


def _run(q, k, pos, backend):
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    s = torch.tensor(9.0, requires_grad=True)
    t = torch.tensor(-4.0, requires_grad=True)
    loss = siglip_loss(q, k, s, t, backend=backend, **pos)
    (loss * 0.37).backward()
    return loss.detach(), q.grad, k.grad, s.grad, t.grad, loss.grad_fn


def test_cpu_calls_take_the_custom_op(monkeypatch):
    """Off CUDA no graph may replay: the custom op runs, and nothing enters the graph cache."""
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "1")
    q, k, pos = _inputs(8, 8, 16, torch.float32, "diag")
    for _ in range(3):
        *_, node = _run(q, k, pos, "torch")
        assert "SigLIPFunction" not in type(node).__name__
    assert not ig._GRAPHS and not ig._SEEN


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{str(c[3])[6:]}-{c[4]}-{c[5]}")
def test_function_equals_the_custom_op(case, monkeypatch):
    """The Function (what an eligible CUDA call runs, replayed or not) against the custom op on
    the same inputs (bitwise: the same block functions) and against the float64 reference."""
    b, m, c, dtype, positives, backend = case
    q, k, pos = _inputs(b, m, c, dtype, positives)
    want = _run(q, k, pos, backend)
    monkeypatch.setattr(sg, "graph_eligible", lambda *a: True)  # (run_graphed then runs it eagerly on CPU)
    got = _run(q, k, pos, backend)
    assert type(got[-1]).__name__ == "SigLIPFunctionBackward"
    for name, x, y in zip(("loss", "dq", "dk", "dscale", "dbias"), got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    ref_q, ref_k = q.double().requires_grad_(), k.double().requires_grad_()
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    t = torch.tensor(-4.0, dtype=torch.float64, requires_grad=True)
    ref = siglip_reference(ref_q, ref_k, s, t, **pos)
    (ref * 0.37).backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for name, x, y in zip(("loss", "dq", "dk", "dscale", "dbias"), got, (ref, ref_q.grad, ref_k.grad, s.grad, t.grad)):
        err = (x.double() - y).abs().max().item() / max(y.abs().max().item(), 1e-3)
        assert err <= tol, f"{name}: rel err {err:.2e}"


def test_function_refuses_double_backward(monkeypatch):
    monkeypatch.setattr(sg, "graph_eligible", lambda *a: True)
    q, k, _ = _inputs(4, 4, 8, torch.float32, "diag")
    q.requires_grad_()
    loss = siglip_loss(q, k, 5.0, -1.0, backend="torch")
    with pytest.raises(RuntimeError, match="SigLIP"):
        torch.autograd.grad(loss, q, create_graph=True)


def test_function_checks_values_in_its_own_pass(monkeypatch):
    """The Function path of the default call (no labels) runs the value checks itself, through
    ``PassCheck`` (at the start of the forward, in its graph on CUDA; eager here), with the errors of the
    op path, read at the call or queued in ``deferred_value_checks``; a call with labels checks
    them (and the rest) before, read at once."""
    from ds_infcl.ops import validation

    monkeypatch.setattr(sg, "graph_eligible", lambda *a: True)
    calls = []


    class Counted(sg.PassCheck):
        def __init__(self, *args):
            calls.append(1)
            super().__init__(*args)

    monkeypatch.setattr(sg, "PassCheck", Counted)
    q, k, pos = _inputs(8, 6, 16, torch.float32, "ids")
    bad = q.clone()
    bad[[2, 5], 3] = float("nan")
    with pytest.raises(ValueError, match=r"^query has 2 of 8 rows with NaN or Inf values"):
        siglip_loss(bad, k, 5.0, -1.0, backend="torch", **pos)
    bad_key = k.clone()
    bad_key[1, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"^key has 1 of 6 rows with NaN or Inf values"):
        siglip_loss(q[:6], bad_key, 5.0, -1.0, backend="torch")
    with pytest.raises(ValueError, match=r"^bias must be finite, got nan"):
        siglip_loss(q, k, 5.0, torch.tensor(float("nan")), backend="torch", **pos)
    assert len(calls) == 3
    with validation.deferred_value_checks() as pending:
        loss = siglip_loss(bad, k, 5.0, -1.0, backend="torch", **pos)  # queued, not read
    assert len(calls) == 4 and loss.isnan()
    assert pending.failed().item() == 1
    with pytest.raises(ValueError, match=r"^query has 2 of 8 rows"):
        pending.raise_if_failed()
    # check_finite=False: nothing to check in the Function
    siglip_loss(bad, k, 5.0, -1.0, backend="torch", check_finite=False, **pos)
    assert len(calls) == 4
    # labels: checked before the Function, read at once even in a deferred block
    with pytest.raises(ValueError, match=r"^labels must lie in \[0, 6\)"):
        with validation.deferred_value_checks():
            siglip_loss(q[:4], k, 5.0, -1.0, backend="torch", labels=torch.tensor([0, 1, 6, 2]))
    with pytest.raises(ValueError, match=r"^query has 2 of 8 rows"):
        siglip_loss(bad, torch.cat([k, k]), 5.0, -1.0, backend="torch", labels=torch.arange(8))
    assert len(calls) == 4
    good = siglip_loss(q, k, 5.0, -1.0, backend="torch", **pos)
    assert len(calls) == 5 and torch.isfinite(good)


def test_default_ids_are_made_inside_the_passes(monkeypatch):
    """``siglip_loss_local`` without ids (query i's positive is key i) equals the call with the
    diagonal ids, on the Function path and on the custom op's; a check of labels needs the ids."""
    q, k, _ = _inputs(6, 9, 16, torch.float32, "diag")
    s, t = torch.tensor(7.0), torch.tensor(-3.0)
    ids = sg.siglip_ids(6, 9, q.device)
    want = sg.siglip_loss_local(q, k, s, t, *ids, backend="torch")
    assert torch.equal(sg.siglip_loss_local(q, k, s, t, None, None, backend="torch"), want)
    monkeypatch.setattr(sg, "graph_eligible", lambda *a: True)
    assert torch.equal(sg.siglip_loss_local(q, k, s, t, None, None, backend="torch"), want)
    with pytest.raises(ValueError, match="check_labels needs the query ids"):
        sg.siglip_loss_local(q, k, s, t, None, None, backend="torch", validate=True, check_labels=True)
