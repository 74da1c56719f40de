"""Linear memory: the tiled path at b = m = 32,768, c = 64 on CPU (materialized logits: 4 GiB).

Runs in a fresh subprocess so that the peak resident set (VmHWM) measures this computation only.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from ds_infcl.loss import contrastive_loss

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    torch.manual_seed(0)
    # Warm up the code path on a tiny problem so that lazily loaded kernels are already counted.
    contrastive_loss(torch.randn(8, 64, requires_grad=True), torch.randn(8, 64), 10.0, symmetric=True).backward()
    b = 32768
    q = torch.nn.functional.normalize(torch.randn(b, 64), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(b, 64), dim=-1).requires_grad_()
    s = torch.tensor(14.3, requires_grad=True)
    # Inputs and their gradients are part of the baseline (the contract counts memory beyond them).
    q.grad, k.grad = torch.zeros_like(q), torch.zeros_like(k)
    base = status("VmRSS")
    loss = contrastive_loss(q, k, s, symmetric=True, backend="torch")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    print(status("VmHWM") - base)
    """
)


@pytest.mark.slow
def test_tiled_path_peak_memory_is_linear():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.strip().splitlines()[-1])
    assert extra < 256 * 2**20, f"peak RSS grew by {extra / 2**20:.0f} MiB (limit 256 MiB)"
