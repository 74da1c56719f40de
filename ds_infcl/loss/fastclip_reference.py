"""FastCLIP materialized, for tests: one step by direct ``exp`` of the ``[N, N]`` logits in the
inputs' dtype (use float64), no LSE, no ring."""

from __future__ import annotations

import torch

__all__ = ["fastclip_reference"]

_F32 = torch.float32




def fastclip_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    version: str,
    tau,
    log_u1_old: torch.Tensor,
    log_u2_old: torch.Tensor,
    gamma: float,
    eps: float,
    rho: float = 0.0,
):
    """One step of FastCLIP materialized: ``g`` by direct ``exp`` of the ``[N, N]`` logits (use
    float64 inputs), the u update, and two differentiable objectives.

    ``tau`` is a 0-dim tensor (v0, v1, v3) or a pair of ``[N]`` tensors (v2); make them require
    grad to get temperature gradients.

    Returns a dict: ``g1, g2`` (``[N]``), ``u1, u2`` (updated), ``value`` (the objective with u),
    ``model_objective`` whose autograd gradient with respect to the features is the FCCO
    estimator and, for a global tau, with respect to tau the exact temperature gradient
    (v0: Eq. 8, v3: Eq. 10), and for v2 ``tau_objective``, whose gradient with respect to
    ``tau1_i`` is sample i's Eq. (9).
    """
    n = query.shape[0]
    sim = query @ key.T
    diag = sim.diagonal()
    off = ~torch.eye(n, dtype=torch.bool, device=sim.device)
    if version == "v2":
        t1, t2 = tau
        e1 = torch.exp((sim - diag[:, None]) / t1[:, None])  # rows: image i vs texts j
        e2 = torch.exp((sim - diag[None, :]) / t2[None, :])  # cols: text j vs images i
    else:
        e1 = torch.exp((sim - diag[:, None]) / tau)
        e2 = torch.exp((sim - diag[None, :]) / tau)
    g1 = (e1 * off).sum(dim=1) / (n - 1)
    g2 = (e2 * off).sum(dim=0) / (n - 1)

    def upd(log_u_old, g):
        u_old = log_u_old.exp()
        u = (1 - gamma) * u_old + gamma * g.detach()
        return torch.where(torch.isneginf(log_u_old), g.detach(), u)

    u1, u2 = upd(log_u1_old, g1), upd(log_u2_old, g2)
    le1, le2 = torch.log(eps + u1), torch.log(eps + u2)
    frac1, frac2 = g1 / (eps + u1), g2 / (eps + u2)  # gradient-carrying g / (eps + u)
    out = dict(g1=g1.detach(), g2=g2.detach(), u1=u1, u2=u2)
    if version == "v2":
        t1d, t2d = t1.detach(), t2.detach()
        out["value"] = ((t1d * (le1 + rho)).sum() + (t2d * (le2 + rho)).sum()) / n
        out["model_objective"] = ((t1d * frac1).sum() + (t2d * frac2).sum()) / n
        # d/dtau1_i of tau1_i (log(eps + u1_i) + rho) + tau1_i * g1_i(tau1_i) / (eps + u1_i)
        # with tau1_i held fixed in the second factor's prefactor:
        out["tau_objective"] = ((t1 * (le1 + rho)).sum() + (t1d * frac1).sum()
                                + (t2 * (le2 + rho)).sum() + (t2d * frac2).sum())
        return out
    mean_le = (le1.sum() + le2.sum()) / n
    weighted = (frac1.sum() + frac2.sum()) / n
    if version == "v0":
        out["value"] = mean_le
        out["model_objective"] = weighted
    elif version == "v1":
        out["value"] = tau.detach() * mean_le
        out["model_objective"] = tau.detach() * weighted
    elif version == "v3":
        out["value"] = tau.detach() * mean_le + 2 * rho * tau.detach()
        out["model_objective"] = tau.detach() * weighted + tau * (mean_le + 2 * rho)
    else:
        raise ValueError(f"unknown version {version!r}")
    return out
