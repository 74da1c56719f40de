"""The single-device SigLIP replayed from CUDA graphs (``ds_infcl.ops.siglip.SigLIPFunction`` over
``ds_infcl.ops.infonce_graph.run_graphed``) against the eager call on the same inputs (skipped
without CUDA).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_siglip_graph_gpu.py

Each case runs three calls of one shape with new inputs each (the first eager, the second
captures the forward, with the value checks where there are no labels to check, and the
backward, the third replays them) and compares the loss and the four gradients with the eager call (``DS_INFCL_CUDA_GRAPH=0``) on the same inputs; then two
forwards and their backwards in reverse order (the backward graph then reloads its inputs). The
kernels are the eager ones: equal to the last bit except where cuBLAS schedules a product
differently under capture (a 16-bit gradient may then move by an ulp); each case prints whether
the results were bitwise equal.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.loss import siglip_loss  # noqa: E402
from ds_infcl.ops import infonce_graph as ig  # noqa: E402
from tests.ops.accuracy import rel_err  # noqa: E402

# (b, m, c, dtype, positives)
CASES = [
    (8192, 8192, 512, torch.bfloat16, "diag"),
    (4096, 4096, 768, torch.bfloat16, "ids"),
    (1000, 3000, 72, torch.float16, "labels"),
    (777, 777, 128, torch.float32, "diag"),
    (1, 5, 64, torch.bfloat16, "labels"),
]


def _inputs(b, m, c, dtype, positives, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(m, c, device="cuda", generator=g), dim=1).to(dtype)
    s = torch.tensor(10.0 + seed, device="cuda")
    t = torch.tensor(-10.0 + seed, device="cuda")
    pos = {}
    if positives == "labels":
        pos["labels"] = torch.randint(0, m, (b,), device="cuda", generator=g)
    elif positives == "ids":
        pos = dict(query_ids=torch.randint(0, b // 2 + 1, (b,), device="cuda", generator=g),
                   key_ids=torch.randint(0, b // 2 + 1, (m,), device="cuda", generator=g))
    return q, k, s, t, pos


def _forward(q, k, s, t, pos):
    q, k, s, t = (x.clone().requires_grad_() for x in (q, k, s, t))
    loss = siglip_loss(q, k, s, t, backend="triton", **pos)  # the default call (check_finite too)
    return loss, (q, k, s, t)


def _grads(loss, leaves):
    (loss * 0.37).backward()
    return [loss.detach()] + [x.grad for x in leaves]


def _compare(got, want, dtype, what):
    bitwise = all(torch.equal(x, y) for x, y in zip(got, want))
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for name, x, y in zip(["loss", "dq", "dk", "dscale", "dbias"], got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}"
        bound = 1e-6 if name in ("loss", "dscale", "dbias") else tol
        assert rel_err(x, y) <= bound, f"{what} {name}: {rel_err(x, y):.1e}"
    return bitwise


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{str(c[3])[6:]}-{c[4]}")
def test_graph_replay_equals_eager(case, monkeypatch):
    b, m, c, dtype, positives = case
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "0")
    eager = [_grads(*_forward(*_inputs(b, m, c, dtype, positives, seed))) for seed in range(3)]
    assert not ig._GRAPHS
    monkeypatch.setattr(ig, "CUDA_GRAPH", "auto")
    graphed = []
    for seed in range(3):
        loss, leaves = _forward(*_inputs(b, m, c, dtype, positives, seed))
        assert type(loss.grad_fn).__name__ == "SigLIPFunctionBackward"
        graphed.append(_grads(loss, leaves))
    tags = sorted(k[0] for k in ig._GRAPHS)
    assert tags == ["siglip_backward", "siglip_forward"], f"the repeated shape was not captured: {tags}"
    graphs = {k[0]: g for k, g in ig._GRAPHS.items()}
    backward, forward = graphs["siglip_backward"], graphs["siglip_forward"]
    assert forward.replays == 2 and backward.replays == 2  # calls 2 and 3
    assert backward.args[0].data_ptr() == forward.args[0].data_ptr()  # read in place
    checked = positives != "labels"  # the value checks (no labels to check) in the forward's graph
    assert forward.kept == ({1, 2} if checked else set())  # the pinned sum and the event
    bitwise = [_compare(gr, eg, dtype, f"call {i + 1}") for i, (gr, eg) in enumerate(zip(graphed, eager))]
    # Interleaved: two forwards, then the backwards in reverse order (the inputs are reloaded).
    losses = [_forward(*_inputs(b, m, c, dtype, positives, seed)) for seed in (1, 2)]
    late = [_grads(*losses[1]), _grads(*losses[0])]
    _compare(late[0], eager[2], dtype, "interleaved 2")
    _compare(late[1], eager[1], dtype, "interleaved 1")
    if checked:
        _replayed_checks_raise(b, m, c, dtype, positives, forward)
        # calls without the check keep graphs of their own
        for seed in range(3):
            q, k, s, t, pos = _inputs(b, m, c, dtype, positives, seed)
            siglip_loss(q, k, s, t, backend="triton", check_finite=False, **pos)
        tags = sorted(key[0] for key in ig._GRAPHS)
        assert tags == ["siglip_backward", "siglip_forward", "siglip_forward"], tags
    print(f"\ngraphed == eager ({b}x{m}x{c} {dtype} {positives}); bitwise: {bitwise}")
    ig.clear_graphs()


def _replayed_checks_raise(b, m, c, dtype, positives, forward):
    """A replay of the checked forward on bad inputs raises the eager call's error, at the call or
    from ``deferred_value_checks``; a good call after it passes."""
    from ds_infcl.ops import validation

    q, k, s, t, pos = _inputs(b, m, c, dtype, positives, 0)
    bad = q.clone()
    bad[[0, b - 1]] = float("nan")
    rows = len({0, b - 1})
    replays = forward.replays
    with pytest.raises(ValueError, match=rf"^query has {rows} of {b} rows with NaN or Inf values"):
        siglip_loss(bad, k, s, t, backend="triton", **pos)
    with pytest.raises(ValueError, match=r"^bias must be finite, got inf"):
        siglip_loss(q, k, s, torch.full_like(t, float("inf")), backend="triton", **pos)
    with validation.deferred_value_checks() as pending:
        loss = siglip_loss(q, k, s, t, backend="triton", **pos)
        siglip_loss(bad, k, s, t, backend="triton", **pos)  # queued, not read
    assert forward.replays == replays + 4
    assert pending.failed().item() == 1 and torch.isfinite(loss)
    with pytest.raises(ValueError, match=rf"^query has {rows} of {b} rows"):
        pending.raise_if_failed()
    assert torch.isfinite(siglip_loss(q, k, s, t, backend="triton", **pos))


def test_large_shapes_stay_eager(monkeypatch):
    """Under ``auto`` only shapes up to MAX_LOGITS are graphed."""
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "auto")
    q, k, s, t, _ = _inputs(16384, 16385, 32, torch.bfloat16, "diag", 0)
    assert q.shape[0] * k.shape[0] > ig.MAX_LOGITS
    for _ in range(3):
        _grads(*_forward(q, k, s, t, {}))
    assert not ig._GRAPHS
    ig.clear_graphs()
