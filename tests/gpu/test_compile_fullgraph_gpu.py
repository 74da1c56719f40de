"""A user's training step with our losses under ``torch.compile(fullgraph=True)`` on a GPU (the
Triton backend, bf16 and fp32 features), against the same step run eagerly (skipped without CUDA).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_compile_fullgraph_gpu.py

The CPU version is tests/ops/test_compile_fullgraph.py. Here the towers run in the features'
dtype, so the compiled towers (inductor's fused kernels) and the eager ones may round differently:
the tolerances are those of the dtype. The compiled step runs the custom ops; the CUDA graphs of
the eager single-device loss (``ds_infcl.ops.infonce_graph``) step aside while the compiler
traces, so none is counted or captured by the compiled calls.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.loss import ContrastiveLoss, SigLIPLoss, clip_loss, contrastive_loss, siglip_loss  # noqa: E402
from ds_infcl.ops import infonce_graph as ig  # noqa: E402
from tests.ops.accuracy import rel_err  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class Towers(torch.nn.Module):
    def __init__(self, loss_name, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(96, 256).to("cuda", dtype)
        self.text = torch.nn.Linear(80, 256).to("cuda", dtype)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6, device="cuda"))
        self.bias = torch.nn.Parameter(torch.tensor(-5.0, device="cuda"))
        self.loss_name = loss_name
        self.module = {"ContrastiveLoss": ContrastiveLoss, "SigLIPLoss": SigLIPLoss}.get(loss_name, lambda: None)()
        if self.module is not None:
            self.module.cuda()

    def forward(self, x, y):
        q = torch.nn.functional.normalize(self.image(x), dim=1)
        k = torch.nn.functional.normalize(self.text(y), dim=1)
        s = self.logit_scale.exp()
        if self.loss_name == "contrastive_loss":
            return contrastive_loss(q, k, s)
        if self.loss_name == "clip_loss":
            return clip_loss(q, k, s)
        if self.loss_name == "siglip_loss":
            return siglip_loss(q, k, s, self.bias)
        return self.module(q, k)


def _loss_and_grads(model, step, x, y):
    model.zero_grad(set_to_none=True)
    loss = step(x, y)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("loss_name", ["contrastive_loss", "clip_loss", "siglip_loss", "ContrastiveLoss",
                                       "SigLIPLoss"])
def test_compiled_step_matches_eager_on_gpu(loss_name, dtype):
    torch._dynamo.reset()
    ig.clear_graphs()
    model = Towers(loss_name, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    b, m = 1000, 1000
    x = torch.randn(b, 96, device="cuda", generator=g, dtype=dtype)
    y = torch.randn(m, 80, device="cuda", generator=g, dtype=dtype)
    compiled = torch.compile(model, fullgraph=True)  # inductor
    for _ in range(3):  # compiles, then runs the compiled step again
        loss, grads = _loss_and_grads(model, compiled, x, y)
    assert not ig._SEEN and not ig._GRAPHS, "the compiled step went through the CUDA-graph path"
    eager_loss, eager_grads = _loss_and_grads(model, model, x, y)
    tol = TOL[dtype]
    assert torch.isfinite(loss) and rel_err(loss, eager_loss) < tol, (float(loss), float(eager_loss))
    assert grads.keys() == eager_grads.keys() and len(grads) >= 5
    for name in grads:
        err = rel_err(grads[name], eager_grads[name])
        print(f"{loss_name} {dtype} {name}: rel err {err:.2e}")
        assert err < tol, (name, err)
    # NaN features: the value check runs inside the compiled step on the GPU too
    x_bad = x.clone()
    x_bad[7] = float("nan")
    with pytest.raises(ValueError, match="query has 1 of 1000 rows with NaN or Inf"):
        compiled(x_bad, y)
