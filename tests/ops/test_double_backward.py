"""The fused single-device ops are differentiable once: a second derivative (create_graph=True,
e.g. a gradient penalty through the loss) raises one clear error instead of an obscure in-place
error (torch backend) or silently missing terms (Triton kernels build no graph)."""

import pytest
import torch

from ds_infcl.ops import LSEOptions, tiled_lse
from ds_infcl.loss import contrastive_loss


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_second_derivative_is_a_clear_error(backend):
    q = torch.nn.functional.normalize(torch.randn(6, 8), dim=1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(6, 8), dim=1).requires_grad_()
    scale = torch.tensor(5.0, requires_grad=True)
    loss = contrastive_loss(q, k, scale, symmetric=True, backend=backend)
    with pytest.raises(RuntimeError, match=r"the fused InfoNCE is differentiable once.*create_graph"):
        torch.autograd.grad(loss, q, create_graph=True)
    row, col = tiled_lse(q, k, scale, options=LSEOptions(compute_col=True, backend=backend))
    with pytest.raises(RuntimeError, match=r"the fused lse is differentiable once"):
        torch.autograd.grad(row.sum() + col.sum(), q, create_graph=True)
    # once, as usual
    (g,) = torch.autograd.grad(contrastive_loss(q, k, scale, symmetric=True, backend=backend), q)
    assert torch.isfinite(g).all()
