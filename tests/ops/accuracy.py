"""Inputs and error measures shared by the tests of the tiled path and of the Triton kernels."""

import torch

FP32_RTOL = 1e-5


def features(b, m, c, *, normalize=True, seed=0, device="cpu"):
    """Float64 queries ``[b, c]`` and keys ``[m, c]`` on ``device`` (unit rows unless
    ``normalize=False``), drawn there by a generator of that device seeded with ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, c, device=device, generator=g, dtype=torch.float64)
    k = torch.randn(m, c, device=device, generator=g, dtype=torch.float64)
    if normalize:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    return q, k


def rel_err(x, ref):
    """Relative error in norm; a reference that is exactly zero (m = 1: every probability is 1)
    is compared on an absolute floor of 1e-6 per element instead."""
    x, ref = x.double(), ref.double()
    floor = 1e-6 * ref.numel() ** 0.5 / FP32_RTOL
    return ((x - ref).norm() / ref.norm().clamp_min(floor)).item()


def error_bound(dtype, plain_err):
    """fp32: 1e-5, or twice plain float32 PyTorch's error where that is worse; half dtypes: twice
    plain PyTorch's error in that dtype plus a small floor."""
    if dtype == torch.float32:
        return max(FP32_RTOL, 2 * plain_err)
    return 2 * plain_err + 1e-4
