"""Materialized reference: the specification every fast path is tested against.

Logits ``x = scale * query @ key.T`` are built in full (``b * m`` memory), then the row and column
log-sum-exp vectors and the InfoNCE losses follow by plain autograd. Tests and benchmarks import
these functions; nothing on a fast path does.

With ``upcast=True`` the computation runs in float32 (float64 if the inputs are float64); with
``upcast=False`` it runs in the inputs' own dtype, which is "plain PyTorch in that dtype", the
yardstick for the tolerance of the fast paths in bf16/fp16.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = ["logits_reference", "lse_reference", "contrastive_loss_reference"]


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    if not upcast:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _default_labels(query: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    if labels is None:
        return torch.arange(query.shape[0], device=query.device)
    return labels


def logits_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    upcast: bool = True,
) -> torch.Tensor:
    """``[b, m]`` logits ``scale * query @ key.T``; excluded positives are ``-inf``."""
    dtype = _compute_dtype(query.dtype, upcast)
    x = (query.to(dtype) @ key.to(dtype).T) * (scale.to(dtype) if torch.is_tensor(scale) else scale)
    if exclude_positive:
        lab = _default_labels(query, labels)
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[torch.arange(x.shape[0], device=x.device), lab] = True
        x = x.masked_fill(mask, float("-inf"))
    return x


def lse_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    upcast: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row LSE ``[b]`` and column LSE ``[m]`` of the materialized logits."""
    x = logits_reference(
        query, key, scale, labels=labels, exclude_positive=exclude_positive, upcast=upcast
    )
    return torch.logsumexp(x, dim=1), torch.logsumexp(x, dim=0)


def contrastive_loss_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    symmetric: bool = False,
    upcast: bool = True,
) -> torch.Tensor:
    """InfoNCE over materialized logits (the textbook loss, as CLIP writes it).

    One direction: ``mean_i (row_lse_i - x_{i, labels_i})`` (cross-entropy of each query against
    all keys). Symmetric: the mean of that and the key-to-query cross-entropy of each query's
    positive key against all queries, ``mean_i (col_lse_{labels_i} - x_{i, labels_i})``.
    """
    lab = _default_labels(query, labels)
    x = logits_reference(query, key, scale, upcast=upcast)
    loss = torch.nn.functional.cross_entropy(x, lab)
    if symmetric:
        col_lse = torch.logsumexp(x, dim=0)
        pos = x[torch.arange(x.shape[0], device=x.device), lab]
        loss = (loss + (col_lse[lab] - pos).mean()) / 2
    return loss
