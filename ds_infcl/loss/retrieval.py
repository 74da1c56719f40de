"""Retrieval InfoNCE over the global batch with false-negative masking (``RetrievalLoss``).

Per rank, ``b`` queries and ``m`` keys (positives then hard negatives, any order), ``labels[i]``
the local index of query i's positive. The loss is InfoNCE over the global batch (every key of
every rank is a candidate), scale 20 by default (``temperature=0.05``), with an optional
document-to-query term over the positive keys.

False-negative masking: a key whose text equals one of query i's positives is left out of query
i's softmax (and, with the symmetric term, query i is left out of that key's column). Texts are
compared through 64-bit ids (``ds_infcl.adapters.retrieval.text_ids``: a hash of the string, or of
the token ids in the sentence-transformers loss). The masked loss is an exact composition over
``ds_infcl.loss.lse``::

    row'_i = log( exp(row_i) - sum_{j in F_i} exp(x_ij) )
           = row_i + log1p( -exp( logsumexp_{j in F_i} x_ij - row_i ) )

where ``F_i`` is the (small) set of masked keys; ``x_ij`` of those pairs are recomputed from the
embeddings (gathered with gradients across ranks when the pair crosses ranks, through the ring
package's collectives; only the rows in a masked pair travel). Nothing of size ``b x M`` is
formed: pairs are found by sorting ids. The subtraction loses precision only when the masked keys
hold almost all of a row's probability mass; the fused alternative (an ``exclude_ids`` mask inside
the LSE op) is described in docs/retrieval.md.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ds_infcl.loss.functional import contrastive_loss, lse
from ds_infcl.ring import all_gather_blocks, all_gather_with_grad, global_sum_with_grad, resolve_group

__all__ = ["false_negative_pairs", "retrieval_loss", "RetrievalLoss", "keys_and_labels"]


def _resolve_group(group):
    """``(group, world, rank)``; ``None`` means the loss's default group (DeepSpeed's data-parallel
    group under DeepSpeed, else the world) when torch.distributed is up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    group = resolve_group(group)
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


# ----------------------------------------------------------------------------------------------
# False-negative pairs
# ----------------------------------------------------------------------------------------------


def false_negative_pairs(
    key_ids: torch.Tensor, positive_ids: torch.Tensor, label_cols: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pairs ``(i, j)`` with ``key_ids[j]`` among ``positive_ids[i]`` and ``j != label_cols[i]``.

    Args:
        key_ids: ``[M]`` int64 key ids.
        positive_ids: ``[B, P]`` int64 ids of each query's positive texts (repeat an id to pad).
        label_cols: ``[B]`` the column of each query's own positive (never masked).

    Returns:
        ``rows [n], cols [n]`` (int64, unique pairs, sorted by row then column), found by sorting:
        O((B P + M) log M) time, no ``B x M`` mask.
    """
    device = key_ids.device
    if key_ids.numel() == 0 or positive_ids.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    B, P = positive_ids.shape
    sorted_ids, order = torch.sort(key_ids)
    flat = positive_ids.reshape(-1)
    lo = torch.searchsorted(sorted_ids, flat, right=False)
    hi = torch.searchsorted(sorted_ids, flat, right=True)
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    rows = torch.repeat_interleave(torch.arange(B, device=device).repeat_interleave(P), counts)
    starts = torch.repeat_interleave(lo, counts)
    within = torch.arange(total, device=device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    cols = order[starts + within]
    keep = cols != label_cols[rows]
    rows, cols = rows[keep], cols[keep]
    if rows.numel() == 0:
        return rows, cols
    code = torch.unique(rows * key_ids.shape[0] + cols)
    return code // key_ids.shape[0], code % key_ids.shape[0]


def _masked_lse_correction(lse_vec: torch.Tensor, masked_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log(exp(lse_vec) - sum_{pairs} exp(x))`` minus ``lse_vec``, per entry of ``lse_vec``.

    ``masked_logits [n]`` belong to entries ``index [n]``; entries with no pair get 0."""
    n = lse_vec.shape[0]
    mx = torch.full((n,), float("-inf"), device=lse_vec.device, dtype=torch.float32)
    mx = mx.scatter_reduce(0, index, masked_logits.detach(), reduce="amax", include_self=True)
    has = torch.isfinite(mx)
    shift = torch.where(has, mx, torch.zeros_like(mx))
    ssum = torch.zeros(n, device=lse_vec.device, dtype=torch.float32).index_add(
        0, index, torch.exp(masked_logits - shift[index])
    )
    masked_lse = torch.where(has, shift + torch.log(ssum.clamp_min(1e-38)), torch.full_like(mx, -1e30))
    # fraction of the softmax mass held by the masked keys; strictly < 1 because the positive is kept
    frac = torch.exp((masked_lse - lse_vec).clamp(max=0.0)).clamp(max=1.0 - 1e-7)
    return torch.where(has, torch.log1p(-frac), torch.zeros_like(frac))


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


def retrieval_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    scale,
    labels: Optional[torch.Tensor] = None,
    *,
    key_ids: Optional[torch.Tensor] = None,
    positive_ids: Optional[torch.Tensor] = None,
    symmetric: bool = False,
    group=None,
    backend: str = "auto",
    tile_size: Optional[int] = None,
) -> torch.Tensor:
    """Global-batch InfoNCE for retrieval, with false-negative masking when ids are given.

    Args:
        query: ``[b, c]`` local query embeddings.
        key: ``[m, c]`` local key embeddings (positives and hard negatives, any order).
        scale: ``1 / temperature`` (float or tensor).
        labels: ``[b]`` local index of each query's positive key (default ``arange(b)``).
        key_ids: ``[m]`` int64 text ids of the keys; ``None`` disables masking.
        positive_ids: ``[b, P]`` int64 ids of all texts that are positives of query i (default
            the id of its labelled key); a key with one of these ids is never a negative of i.
        symmetric: add the document-to-query term over the positive keys (halved sum, as in
            ``contrastive_loss(symmetric=True)``).
        group: data-parallel group (``None``: the default group when distributed).
        backend, tile_size: passed to the LSE op.

    Returns:
        0-dim float32 global loss (the same on every rank); after the data-parallel mean of the
        gradients every parameter gets the gradient of the global-batch loss.
    """
    group, world, rank = _resolve_group(group)
    b, m = query.shape[0], key.shape[0]
    labels = torch.arange(b, device=query.device) if labels is None else labels.to(query.device).long()
    if key_ids is None:
        return contrastive_loss(
            query, key, scale, labels, symmetric=symmetric, backend=backend, group=group, tile_size=tile_size
        )
    if key_ids.shape != (m,):
        raise ValueError(f"key_ids must have shape [m]=[{m}], got {tuple(key_ids.shape)}")
    key_ids = key_ids.to(query.device).long()
    if positive_ids is None:
        positive_ids = key_ids[labels].unsqueeze(1)
    positive_ids = positive_ids.to(query.device).long()
    if positive_ids.dim() != 2 or positive_ids.shape[0] != b or positive_ids.shape[1] < 1:
        raise ValueError(f"positive_ids must have shape [b, P] with b={b}, P >= 1, got {tuple(positive_ids.shape)}")
    if world > 1:  # the same P on every rank (pad by repeating the first id)
        import torch.distributed as dist

        width = torch.tensor([positive_ids.shape[1]], device=query.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        if int(width) > positive_ids.shape[1]:
            pad = positive_ids[:, :1].expand(-1, int(width) - positive_ids.shape[1])
            positive_ids = torch.cat([positive_ids, pad], 1)

    # global ids, sizes and positive columns (small int exchanges; the same pairs on every rank)
    all_key_ids = all_gather_blocks(key_ids, group)
    all_pos_ids = all_gather_blocks(positive_ids, group)
    all_labels = all_gather_blocks(labels, group)
    key_sizes = [t.shape[0] for t in all_key_ids]
    query_sizes = [t.shape[0] for t in all_labels]
    key_off = [sum(key_sizes[:r]) for r in range(world)]
    q_off = [sum(query_sizes[:r]) for r in range(world)]
    pos_ids_g = torch.cat(all_pos_ids)
    label_cols_g = torch.cat([l + o for l, o in zip(all_labels, key_off)])
    rows_g, cols_g = false_negative_pairs(torch.cat(all_key_ids), pos_ids_g, label_cols_g)
    if rows_g.numel() == 0:  # nothing to mask anywhere: the plain loss
        return contrastive_loss(
            query, key, scale, labels, symmetric=symmetric, backend=backend, group=group, tile_size=tile_size
        )
    num_queries = sum(query_sizes)
    scale_t = scale if torch.is_tensor(scale) else torch.tensor(float(scale), device=query.device)
    scale_t = scale_t.to(device=query.device, dtype=torch.float32).reshape(())

    row_lse, col_lse = lse(query, key, scale_t, compute_col=symmetric, backend=backend, group=group,
                           tile_size=tile_size)
    pos = scale_t * (query.float() * key[labels].float()).sum(1)

    # the rows taking part in a masked pair travel (with gradients); everything else stays
    need_q = torch.unique(rows_g)
    need_k = torch.unique(cols_g)
    my_q = need_q[(need_q >= q_off[rank]) & (need_q < q_off[rank] + b)] - q_off[rank]
    my_k = need_k[(need_k >= key_off[rank]) & (need_k < key_off[rank] + m)] - key_off[rank]
    nq = [int(((need_q >= q_off[r]) & (need_q < q_off[r] + query_sizes[r])).sum()) for r in range(world)]
    nk = [int(((need_k >= key_off[r]) & (need_k < key_off[r] + key_sizes[r])).sum()) for r in range(world)]
    q_rows = all_gather_with_grad(query[my_q], nq, rank, group, reduce="all_reduce")
    k_rows = all_gather_with_grad(key[my_k], nk, rank, group, reduce="all_reduce")
    # position of global query/key index within the gathered rows (need_* is sorted by rank)
    q_pos = torch.searchsorted(need_q, rows_g)
    k_pos = torch.searchsorted(need_k, cols_g)

    # Every rank builds the same graph (no data-dependent branches, gathered rows always used),
    # so the collectives of the backward run in the same order everywhere.
    share = (row_lse - pos).sum() + 0.0 * (q_rows.float().sum() + k_rows.float().sum())
    # row direction: pairs whose query lives here (possibly none)
    mine = (rows_g >= q_off[rank]) & (rows_g < q_off[rank] + b)
    x = scale_t * (q_rows[q_pos[mine]].float() * k_rows[k_pos[mine]].float()).sum(1)
    share = share + _masked_lse_correction(row_lse, x, rows_g[mine] - q_off[rank]).sum()
    share = share / num_queries
    if symmetric:
        col_term = (col_lse[labels] - pos).sum()
        # column direction: pairs whose key is the positive of a query that lives here
        is_pos_col = torch.isin(cols_g, labels + key_off[rank])
        x = scale_t * (q_rows[q_pos[is_pos_col]].float() * k_rows[k_pos[is_pos_col]].float()).sum(1)
        corr = _masked_lse_correction(col_lse, x, cols_g[is_pos_col] - key_off[rank])
        col_term = col_term + corr[labels].sum()
        share = (share + col_term / num_queries) / 2
    return global_sum_with_grad(share, world, group)


class RetrievalLoss(nn.Module):
    """One-direction retrieval InfoNCE over the global batch, with false-negative masking.

    Args:
        scale: logit multiplier, 20 by default (sentence-transformers' MNRL default).
        temperature: alternative to ``scale`` (``scale = 1 / temperature``).
        symmetric: add the document-to-query term over the positive keys.
        mask_false_negatives: use ``key_ids`` / ``positive_ids`` when given.
        learnable_scale: make ``log(scale)`` a parameter (off by default for retrieval).
        group, backend, tile_size: see ``ds_infcl.loss.contrastive_loss``.

    Inputs: ``query [b, c]``, ``key [m, c]``, ``labels [b]``, optional ``key_ids [m]`` and
    ``positive_ids [b, P]`` (int64 text ids).

    Relations: with ``scale=20``, normalized embeddings, one rank and no repeated texts it equals
    sentence-transformers' ``MultipleNegativesRankingLoss``; ``symmetric=True`` equals
    ``MultipleNegativesSymmetricRankingLoss`` (without hard negatives).

    Example::

        loss_fn = RetrievalLoss(scale=20.0)
        loss = loss_fn(q, k, labels, key_ids=text_ids(key_texts))
    """

    def __init__(
        self,
        scale: Optional[float] = None,
        *,
        temperature: Optional[float] = None,
        symmetric: bool = False,
        mask_false_negatives: bool = True,
        learnable_scale: bool = False,
        group=None,
        backend: str = "auto",
        tile_size: Optional[int] = None,
    ):
        super().__init__()
        if scale is not None and temperature is not None:
            raise ValueError("give either scale or temperature, not both")
        if temperature is not None:
            if temperature <= 0:
                raise ValueError(f"temperature must be > 0, got {temperature}")
            scale = 1.0 / temperature
        scale = 20.0 if scale is None else float(scale)
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        value = torch.tensor(scale).log()
        if learnable_scale:
            self.logit_scale = nn.Parameter(value)
        else:
            self.register_buffer("logit_scale", value)
        self.symmetric = symmetric
        self.mask_false_negatives = mask_false_negatives
        self.group = group
        self.backend = backend
        self.tile_size = tile_size

    @property
    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp()

    def forward(self, query, key, labels=None, key_ids=None, positive_ids=None):
        if not self.mask_false_negatives:
            key_ids = positive_ids = None
        scale = self.scale if isinstance(self.logit_scale, nn.Parameter) else float(self.scale)
        return retrieval_loss(
            query, key, scale, labels, key_ids=key_ids, positive_ids=positive_ids,
            symmetric=self.symmetric, group=self.group, backend=self.backend, tile_size=self.tile_size,
        )

    def extra_repr(self) -> str:
        return (f"scale={float(self.scale):.4g}, symmetric={self.symmetric}, "
                f"mask_false_negatives={self.mask_false_negatives}")


def keys_and_labels(num_queries: int, num_negatives: int, layout: str = "grouped_by_column"):
    """Labels of a local key set built from positives and ``num_negatives`` negatives per query.

    ``"grouped_by_column"``: keys ``[P_0..P_{b-1}, N1_0..N1_{b-1}, ...]`` (sentence-transformers'
    order), labels ``arange(b)``. ``"grouped_by_query"``: keys ``[P_0, N_0.., P_1, N_1.., ...]``
    (the trainer's Batch order), labels ``arange(b) * (1 + num_negatives)``. Both give the same
    loss; mixing them up (the P N N interleaving bug) does not.
    """
    if layout == "grouped_by_column":
        return torch.arange(num_queries)
    if layout == "grouped_by_query":
        return torch.arange(num_queries) * (1 + num_negatives)
    raise ValueError(f"layout must be 'grouped_by_column' or 'grouped_by_query', got {layout!r}")
