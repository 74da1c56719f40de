"""Materialized float64 reference of the retrieval loss (plain and Matryoshka), for tests and
small batches: the full ``[B, M]`` logits, masked pairs set to ``-inf``."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ds_infcl.loss.matryoshka import check_matryoshka, matryoshka_prefix

__all__ = ["retrieval_loss_reference"]


def retrieval_loss_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    scale,
    labels: Optional[torch.Tensor] = None,
    *,
    key_ids: Optional[torch.Tensor] = None,
    positive_ids: Optional[torch.Tensor] = None,
    symmetric: bool = False,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
    normalize: bool = True,
) -> torch.Tensor:
    """Materialized float64 reference of ``retrieval_loss`` / ``matryoshka_retrieval_loss`` on one
    process (pass the gathered global batch and global labels).

    Forms the full ``[B, M]`` logits of each prefix, sets masked pairs to ``-inf`` (a key whose id
    is among query i's ``positive_ids``, other than i's labelled key) and takes log-softmax
    cross-entropies. For tests and small batches only: memory is ``O(B M)``.
    """
    q64, k64 = query.double(), key.double()
    b = q64.shape[0]
    lab = torch.arange(b, device=q64.device) if labels is None else labels.to(q64.device).long()
    s = scale.double() if torch.is_tensor(scale) else float(scale)
    mask = torch.zeros(b, k64.shape[0], dtype=torch.bool, device=q64.device)
    if key_ids is not None:
        ids = key_ids.to(q64.device).long()
        pos_ids = ids[lab][:, None] if positive_ids is None else positive_ids.to(q64.device).long()
        mask = (ids[None, :, None] == pos_ids[:, None, :]).any(-1)
        mask[torch.arange(b), lab] = False
    if matryoshka_dims is None:
        terms = [(q64, k64, 1.0)]
    else:
        dims, weights = check_matryoshka(matryoshka_dims, matryoshka_weights, q64.shape[1])
        terms = [(matryoshka_prefix(q64, d, normalize), matryoshka_prefix(k64, d, normalize), w) for d, w in zip(dims, weights)]
    total = torch.zeros((), dtype=torch.float64, device=q64.device)
    for q, k, w in terms:
        x = s * q @ k.T
        xm = x.masked_fill(mask, float("-inf"))
        pos = x[torch.arange(b), lab]
        loss = (torch.logsumexp(xm, 1) - pos).mean()
        if symmetric:
            loss = (loss + (torch.logsumexp(xm, 0)[lab] - pos).mean()) / 2
        total = total + w * loss
    return total
