"""Where the time goes at a small batch (CUDA): launcher-level vs loss-level, and a profile.

    python tests/gpu/probe_small.py [b] [c]
"""

import sys

import torch
import triton

from ds_infcl.loss import contrastive_loss
from ds_infcl.ops import triton_lse as T

b = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
c = int(sys.argv[2]) if len(sys.argv) > 2 else 512
q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).bfloat16().requires_grad_()
k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).bfloat16().requires_grad_()
s = torch.tensor(14.3, device="cuda", requires_grad=True)
bench = lambda f: triton.testing.do_bench(f, warmup=20, rep=200, return_mode="median")  # noqa: E731
row, col = T.lse_forward_triton(q.detach(), k.detach(), 14.3)
gr, gc = torch.full_like(row, 1 / b), torch.full_like(col, 1 / b)
print(f"# b={b} c={c}: ideal fwd+bwd {8 * b * b * c / 773e12 * 1e3:.3f} ms at 773 TFLOP/s")
print(f"launcher fwd {bench(lambda: T.lse_forward_triton(q.detach(), k.detach(), 14.3)):.3f} ms")
print(f"launcher bwd {bench(lambda: T.lse_backward_triton(q.detach(), k.detach(), 14.3, row, col, gr, gc)):.3f} ms")


def step():
    contrastive_loss(q, k, s, symmetric=True, backend="triton", check_finite=False).backward()


print(f"loss fwd+bwd {bench(step):.3f} ms")
g = torch.cuda.CUDAGraph()
step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
