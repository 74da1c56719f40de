"""Where the time goes at a small batch (CUDA): host issue time, GPU time, and a profile.

    python tests/gpu/probe_small.py [b] [c]

Prints, for one symmetric loss step (forward + backward, bf16, learnable scale, no input checks):
the launcher-level times, the loss-level time (CUDA events, as ``ds_infcl.bench.loss``), the host
time to issue one step (nothing waits for the GPU, so this is the CPU's share), the GPU time of
the same step replayed from a CUDA graph (no CPU in the way), and the profile's top entries by
self CPU time and by CUDA time.
"""

import sys
import time

import torch
import triton

from ds_infcl.bench.loss import capture_graph
from ds_infcl.loss import contrastive_loss
from ds_infcl.ops import triton_lse as T

b = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
c = int(sys.argv[2]) if len(sys.argv) > 2 else 512
q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).bfloat16().requires_grad_()
k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).bfloat16().requires_grad_()
s = torch.tensor(14.3, device="cuda", requires_grad=True)
bench = lambda f: triton.testing.do_bench(f, warmup=20, rep=200, return_mode="median")  # noqa: E731
row, col = T.lse_forward_triton(q.detach(), k.detach(), s)
gr, gc, gp = torch.full_like(row, 0.5 / b), torch.full_like(col, 0.5 / b), torch.full_like(row, -1 / b)
print(f"# {torch.cuda.get_device_name()} b={b} c={c}: ideal fwd+bwd {8 * b * b * c / 785e12 * 1e3:.3f} ms at 785 TFLOP/s")
print(f"launcher fwd {bench(lambda: T.lse_forward_triton(q.detach(), k.detach(), s)):.3f} ms")
print(f"launcher bwd {bench(lambda: T.lse_backward_triton(q.detach(), k.detach(), s, row, col, gr, gc, grad_pos=gp, out_dtype=q.dtype)):.3f} ms")


def step():
    q.grad = k.grad = s.grad = None
    contrastive_loss(q, k, s, symmetric=True, backend="triton", check_finite=False).backward()


print(f"loss fwd+bwd (events) {bench(step):.3f} ms")


def host_ms(fn, n=25):
    """Median host time to issue ``fn`` (nothing in it waits for the GPU)."""
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(ts)[n // 2] * 1e3


tiny = torch.zeros(4, 8, device="cuda")
fac = torch.ones(1, device="cuda")
loss = contrastive_loss(q, k, s, symmetric=True, backend="triton", check_finite=False)
layers = {
    "aten op (tiny mul_)": lambda: tiny.mul_(1.0),
    "bare Triton launch (tiny _scale_out)": lambda: T._scale_out(tiny, fac, tiny, None, None, 0, 32),
    "lse_forward_triton": lambda: T.lse_forward_triton(q.detach(), k.detach(), s),
    "infonce_forward_triton": lambda: T.infonce_forward_triton(q.detach(), k.detach(), s, symmetric=True),
    "lse_backward_triton (loss weights)": lambda: T.lse_backward_triton(
        q.detach(), k.detach(), s, row, col, gr, gc, grad_pos=gp, out_dtype=q.dtype),
    "contrastive_loss forward": lambda: contrastive_loss(q, k, s, symmetric=True, backend="triton", check_finite=False),
    "loss.backward (retain_graph)": lambda: loss.backward(retain_graph=True),
}
for name, fn in layers.items():
    fn()
    print(f"host time {name}: {host_ms(fn):.3f} ms")
issue = []
for _ in range(30):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    issue.append((time.perf_counter() - t0) * 1e3)
torch.cuda.synchronize()
print(f"host time to issue one step: median {sorted(issue)[15]:.3f} ms")

# The same step from a CUDA graph: the GPU's own time, without the host.
try:
    graph = capture_graph(step)
    print(f"GPU time of one step (graph replay) {bench(graph.replay):.3f} ms")
except Exception as err:  # capture can fail on older stacks; the rest of the probe still stands
    print(f"graph capture failed: {type(err).__name__}: {str(err)[:200]}")

step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=50))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))
