"""A user's training step with our losses under ``torch.compile(fullgraph=True)``, on CPU.

The single-device losses and the LSE op are torch.library custom ops
(``ds_infcl::infonce_forward`` / ``infonce_backward``, ``ds_infcl::siglip_forward`` /
``siglip_backward``, ``ds_infcl::lse_forward`` / ``lse_backward``) with fake implementations, so
the compiler traces a step that calls them at default arguments without a graph break: the shape checks run while tracing, the value checks (``check_finite=True`` by
default, labels in range) inside the forward op at every call. Each compiled step must give the
loss and the gradients (towers and logit scale) of the same step run eagerly, and of the
materialized float64 reference. Before the ops, tracing stopped at the finiteness check's
readback (``GuardOnDataDependentSymNode``).
"""

import os

import pytest
import torch

from ds_infcl.loss import ContrastiveLoss, SigLIPLoss, clip_loss, contrastive_loss, lse, siglip_loss
from ds_infcl.ops import contrastive_loss_reference, lse_reference
from ds_infcl.ops.siglip import siglip_reference

import torch._dynamo as dynamo

LOSS_BACKENDS = ["auto"]  # "auto" is the torch backend on CPU: the default a user gets
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    from ds_infcl.ops import triton_lse  # noqa: F401  (triton is in the CI pin set: a broken import fails)

    LOSS_BACKENDS.append("triton")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()  # every test compiles the same step code: no cache limit, no stale guards
    yield
    dynamo.reset()


class Towers(torch.nn.Module):
    """Two small linear towers (an odd batch, a feature dim off any tile) and a loss."""

    def __init__(self, loss_name: str, backend: str):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(12, 24)
        self.text = torch.nn.Linear(10, 24)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.3))
        self.bias = torch.nn.Parameter(torch.tensor(-1.5))
        self.loss_name = loss_name
        self.backend = backend
        if loss_name == "ContrastiveLoss":
            self.module = ContrastiveLoss(backend=backend)
        elif loss_name == "SigLIPLoss":
            self.module = SigLIPLoss(backend=backend, init_logit_bias=-1.5)

    def features(self, x, y):
        q = torch.nn.functional.normalize(self.image(x), dim=1)
        return q, torch.nn.functional.normalize(self.text(y), dim=1)

    def forward(self, x, y, labels=None):
        q, k = self.features(x, y)
        s = self.logit_scale.exp()
        b = self.backend
        if self.loss_name == "contrastive_loss":
            return contrastive_loss(q, k, s, labels, backend=b)
        if self.loss_name == "clip_loss":
            return clip_loss(q, k, s, backend=b)
        if self.loss_name == "siglip_loss":
            return siglip_loss(q, k, s, self.bias, labels, backend=b)
        return self.module(q, k, labels)

    def reference(self, x, y, labels=None):
        q, k = self.features(x, y)
        q, k = q.double(), k.double()
        if self.loss_name in ("contrastive_loss", "clip_loss", "ContrastiveLoss"):
            s = (self.module.scale if self.loss_name == "ContrastiveLoss" else self.logit_scale.exp()).double()
            return contrastive_loss_reference(q, k, s, labels, symmetric=self.loss_name != "contrastive_loss")
        if self.loss_name == "siglip_loss":
            return siglip_reference(q, k, self.logit_scale.exp().double(), self.bias.double(), labels=labels)
        return siglip_reference(q, k, self.module.scale.double(), self.module.logit_bias.double(), labels=labels)


def _loss_and_grads(model, step, *inputs):
    model.zero_grad(set_to_none=True)
    loss = step(*inputs)
    (loss * 0.7).backward()  # an upstream gradient other than 1
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _inputs(b=13, m=13):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 12, generator=g), torch.randn(m, 10, generator=g)


LOSSES = ["contrastive_loss", "clip_loss", "siglip_loss", "ContrastiveLoss", "SigLIPLoss"]


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("loss_name", LOSSES)
def test_compiled_step_matches_eager_and_reference(loss_name, backend):
    model = Towers(loss_name, backend)
    x, y = _inputs()
    eager_loss, eager_grads = _loss_and_grads(model, model, x, y)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = _loss_and_grads(model, compiled, x, y)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == eager_grads.keys() and len(grads) >= 5, grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # ... and both are the loss and gradients of the materialized float64 reference
    model.zero_grad(set_to_none=True)
    ref = model.reference(x, y)
    (ref * 0.7).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].double(), p.grad.double(), rtol=1e-4, atol=1e-5, msg=name)


def test_inductor_compiles_the_step():
    """Inductor (C++ code for the towers around the ops), labels with a repeat, hard negatives
    (m > b). One case: the first inductor compile of a process takes most of this file's time."""
    model = Towers("contrastive_loss", "auto")
    x, y = _inputs(b=9, m=14)
    labels = torch.tensor([3, 0, 13, 7, 7, 1, 9, 2, 11])
    eager_loss, eager_grads = _loss_and_grads(model, model, x, y, labels)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    loss, grads = _loss_and_grads(model, compiled, x, y, labels)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_batch_size_may_change_between_steps():
    """A smaller last batch: the compiled step follows (one recompile, then sizes are symbolic)."""
    for loss_name in ("clip_loss", "siglip_loss"):
        dynamo.reset()
        model = Towers(loss_name, "auto")
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for b in (13, 9, 6):
            x, y = _inputs(b, b)
            loss, grads = _loss_and_grads(model, compiled, x, y)
            eager_loss, eager_grads = _loss_and_grads(model, model, x, y)
            torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
            for name in grads:
                torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
def test_compiled_lse_matches_eager_and_reference(backend):
    """The LSE op itself (``ds_infcl.loss.lse``), with and without the positives excluded."""
    g = torch.Generator().manual_seed(3)
    q0, k0 = torch.randn(11, 16, generator=g), torch.randn(14, 16, generator=g)
    labels = torch.tensor([2, 0, 13, 7, 7, 1, 9, 2, 11, 4, 5])
    wr, wc = torch.randn(11, generator=g), torch.randn(14, generator=g)

    def step(q, k, s, exclude_positive):
        row, col = lse(q, k, s, labels=labels, exclude_positive=exclude_positive, backend=backend)
        return (row * wr).sum() + (col * wc).sum()

    for exclude_positive in (False, True):
        dynamo.reset()
        results = []
        for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
            q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
            s = torch.tensor(3.0, requires_grad=True)
            out = fn(q, k, s, exclude_positive)
            out.backward()
            results.append([out.detach(), q.grad, k.grad, s.grad])
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        row_r, col_r = lse_reference(q0.double(), k0.double(), 3.0, labels=labels, exclude_positive=exclude_positive)
        want = (row_r * wr.double()).sum() + (col_r * wc.double()).sum()
        torch.testing.assert_close(results[1][0].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_name", ["contrastive_loss", "siglip_loss"])
def test_compiled_step_still_checks_values(loss_name):
    """The value checks run inside the compiled step at every call, with the eager errors."""
    model = Towers(loss_name, "auto")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, y = _inputs()
    compiled(x, y)  # compiles and runs on good inputs
    x_bad = x.clone()
    x_bad[[2, 5]] = float("nan")
    with pytest.raises(ValueError, match=r"query has 2 of 13 rows with NaN or Inf"):
        compiled(x_bad, y)
    y_bad = y.clone()
    y_bad[4, 0] = float("inf")
    with pytest.raises(ValueError, match=r"key has 1 of 13 rows with NaN or Inf"):
        compiled(x, y_bad)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 13\).*from 0 to 13"):
        compiled(x, y, torch.tensor([0] * 12 + [13]))
    with torch.no_grad():
        model.logit_scale.fill_(float("nan"))
    with pytest.raises(ValueError, match="scale must be finite"):
        compiled(x, y)


def test_compiled_step_checks_shapes_while_tracing():
    """Shape errors are found while tracing: with ``fullgraph=True`` torch's error carries our
    message; without, the ValueError itself comes out (the step runs eagerly up to it)."""
    model = Towers("contrastive_loss", "auto")
    x, y = _inputs(b=13, m=5)
    message = "needs at least as many keys as queries; got 13 queries and 5 keys: pass labels"
    with pytest.raises(Exception, match=message):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x, y)
    dynamo.reset()
    with pytest.raises(ValueError, match=message):
        torch.compile(model, backend="aot_eager")(x, y)


def test_custom_ops_pass_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch of the six ops."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(7, 24, generator=g, requires_grad=True)
    k = torch.randn(9, 24, generator=g, requires_grad=True)
    s = torch.tensor(4.0, requires_grad=True)
    t = torch.tensor(-2.0, requires_grad=True)
    labels = torch.tensor([0, 8, 3, 3, 1, 5, 6])
    ops = torch.ops.ds_infcl
    for symmetric in (False, True):
        torch.library.opcheck(ops.infonce_forward.default, (q, k, s, labels, symmetric, "torch", None, True, True))
        torch.library.opcheck(ops.infonce_forward.default, (q, k, s, None, symmetric, "torch", 4, False, True))
    _, row, col = ops.infonce_forward(q, k, s, labels, True, "torch", None, False, True)
    torch.library.opcheck(ops.infonce_backward.default,
                          (torch.tensor(0.5), q.detach(), k.detach(), s.detach(), labels, row, col, True, "torch", None))
    qid, kid = labels, torch.arange(9)
    torch.library.opcheck(ops.siglip_forward.default, (q, k, s, t, qid, kid, "torch", None, True, True, True))
    for compute_col in (False, True):
        torch.library.opcheck(ops.lse_forward.default, (q, k, s, labels, True, compute_col, "torch", 4, True, True))
    row, col = ops.lse_forward(q, k, s, labels, True, True, "torch", None, False, True)
    torch.library.opcheck(ops.lse_backward.default, (torch.randn(7, generator=g), torch.randn(9, generator=g),
                                                     q.detach(), k.detach(), s.detach(), labels, row.detach(),
                                                     col.detach(), True, "torch", None))
    torch.library.opcheck(ops.siglip_backward.default,
                          (torch.tensor(0.5), q.detach(), k.detach(), s.detach(), t.detach(), qid, kid, "torch", 4))
