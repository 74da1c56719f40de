"""FastCLIP's building blocks: the inner learning rate schedule, the u estimator's update in log
space, and the temperature optimizers (Proc. 4 with weight decay 0), vectorized over any number of
entries. Pure functions of tensors: the tests check them against float64 directly.
"""

from __future__ import annotations

import math

import torch

__all__ = ["inner_lr", "log_inner", "update_log_u", "log_eps_plus"]

_F32 = torch.float32




def inner_lr(
    epoch: int,
    *,
    schedule: str = "cosine",
    gamma: float = 0.6,
    gamma_min: float = 0.2,
    decay_epochs: int = 18,
) -> float:
    """The inner learning rate ``gamma`` of epoch ``epoch`` (0-based).

    ``"cosine"``: ``0.5 * (1 + cos(pi * min(epoch, E) / E)) * (1 - gamma_min) + gamma_min``: 1 in
    epoch 0, ``gamma_min`` from epoch ``E = decay_epochs`` on, constant within an epoch.
    ``"constant"``: ``gamma`` always (SogCLR, iSogCLR).
    """
    if schedule == "constant":
        return float(gamma)
    if schedule != "cosine":
        raise ValueError(f'gamma_schedule must be "cosine" or "constant", got {schedule!r}')
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if decay_epochs <= 0:
        return float(gamma_min)
    e = min(int(epoch), int(decay_epochs))
    return 0.5 * (1.0 + math.cos(math.pi * e / decay_epochs)) * (1.0 - gamma_min) + gamma_min


def log_inner(lse_vec: torch.Tensor, pos: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """``log g = lse - pos - log(N - 1)``: the log of the mean of ``exp(x_ij - x_ii)`` over the
    ``N - 1`` negatives, from an LSE that excludes the positive. Finite for any finite input."""
    return lse_vec - pos - math.log(num_pairs - 1)


def update_log_u(log_u: torch.Tensor, log_g: torch.Tensor, gamma: float) -> torch.Tensor:
    """``log((1 - gamma) u + gamma g)`` from ``log u`` and ``log g``, stably; ``log u = -inf``
    (never seen) gives ``log g``."""
    log_g = log_g.to(log_u.dtype)
    if gamma >= 1.0:
        return log_g.clone()
    mixed = torch.logaddexp(log_u + math.log1p(-gamma), log_g + math.log(gamma))
    return torch.where(torch.isneginf(log_u), log_g, mixed)


def log_eps_plus(log_u: torch.Tensor, eps: float) -> torch.Tensor:
    """``log(eps + u)`` from ``log u`` (``eps > 0``)."""
    return torch.logaddexp(log_u, torch.full_like(log_u, math.log(eps)))


# --------------------------------------------------------------------------------------------
# Temperature optimizers (Proc. 4 with weight decay 0), vectorized over any number of entries
# --------------------------------------------------------------------------------------------


def _optimizer_step(tau, grad, m, v, count, *, kind, lr, betas, adam_eps, momentum):
    """One update of ``tau`` (in place) from ``grad``; ``m``, ``v``, ``count`` are updated too.

    ``adamw``: Proc. 4 lines 13-16 with bias correction by ``count`` (per entry); LAMB with the
    trust ratio fixed to 1 for the temperature (as the paper does, after EVA-CLIP) is the same.
    ``lion``: lines 10-12. ``sgdm``: lines 1-2.
    """
    b1, b2 = betas
    if kind == "adamw":
        count += 1
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m_hat = m / (1 - b1 ** count)
        v_hat = v / (1 - b2 ** count)
        tau.sub_(lr * m_hat / (v_hat.sqrt() + adam_eps))
    elif kind == "lion":
        count += 1
        c = m * b1 + grad * (1 - b1)
        tau.sub_(lr * torch.sign(c))
        m.mul_(b2).add_(grad, alpha=1 - b2)
    elif kind == "sgdm":
        count += 1
        m.mul_(momentum).add_(grad)
        tau.sub_(lr * m)
    else:  # pragma: no cover - validated in the constructor
        raise ValueError(kind)
