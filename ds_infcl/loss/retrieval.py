# Over 500 lines on purpose: the masked global loss, its Matryoshka form and their module share one mask plan.
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

Matryoshka (``matryoshka_retrieval_loss``, ``RetrievalLoss(matryoshka_dims=...)``): the weighted
sum of this loss over nested prefixes ``x[:, :d_1], x[:, :d_2], ...`` (``d_1 > d_2 > ...``) of
the same embeddings, each prefix L2-normalized again for cosine similarity (as
sentence-transformers' ``MatryoshkaLoss`` does). Each term is exact over the global batch and masked the same way; the
masked pairs are found and their rows gathered once for all prefixes.
``ds_infcl.loss.retrieval_reference.retrieval_loss_reference`` is the materialized float64
reference of both (it imports the Matryoshka checks from ``ds_infcl.loss.matryoshka``, never this module).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from ds_infcl.loss.functional import contrastive_loss, lse
from ds_infcl.loss.matryoshka import check_matryoshka, matryoshka_options, matryoshka_prefix  # noqa: F401 (re-exported)
from ds_infcl.loss.registry import LossSettings, register_loss_module
from ds_infcl.ops.precision import follows_autocast
from ds_infcl.ring import (
    agree_on_input_errors,
    all_gather_blocks,
    all_gather_with_grad,
    global_sum_with_grad,
    resolve_group,
)

__all__ = [
    "false_negative_pairs",
    "retrieval_loss",
    "matryoshka_retrieval_loss",
    "check_matryoshka",
    "matryoshka_options",
    "RetrievalLoss",
    "keys_and_labels",
]


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


class _MaskPlan:
    """Where the false-negative pairs of a global batch are: the pairs ``(rows_g, cols_g)`` in
    global query/key indices, which local rows take part, and (``rows()``) the gathered rows (full
    width, with gradients) that the masked logits are recomputed from. Built once per call, shared
    by every Matryoshka dimension."""

    def __init__(self, query, key, labels, rows_g, cols_g, query_sizes, key_sizes, world, rank, group):
        b, m = query.shape[0], key.shape[0]
        q_off = sum(query_sizes[:rank])
        k_off = sum(key_sizes[:rank])
        q_starts = [sum(query_sizes[:r]) for r in range(world)]
        k_starts = [sum(key_sizes[:r]) for r in range(world)]
        self.num_queries = sum(query_sizes)
        # the rows taking part in a masked pair travel (with gradients); everything else stays
        need_q = torch.unique(rows_g)
        need_k = torch.unique(cols_g)
        my_q = need_q[(need_q >= q_off) & (need_q < q_off + b)] - q_off
        my_k = need_k[(need_k >= k_off) & (need_k < k_off + m)] - k_off
        nq = [int(((need_q >= q_starts[r]) & (need_q < q_starts[r] + query_sizes[r])).sum()) for r in range(world)]
        nk = [int(((need_k >= k_starts[r]) & (need_k < k_starts[r] + key_sizes[r])).sum()) for r in range(world)]
        self._gather_args = (query, my_q, nq, key, my_k, nk, rank, group)
        self._rows = None
        # position of global query/key index within the gathered rows (need_* is sorted by rank)
        q_pos = torch.searchsorted(need_q, rows_g)
        k_pos = torch.searchsorted(need_k, cols_g)
        # row direction: pairs whose query lives here (possibly none)
        mine = (rows_g >= q_off) & (rows_g < q_off + b)
        self.row_q, self.row_k, self.row_index = q_pos[mine], k_pos[mine], rows_g[mine] - q_off
        # column direction: pairs whose key is the positive of a query that lives here
        is_pos_col = torch.isin(cols_g, labels + k_off)
        self.col_q, self.col_k, self.col_index = q_pos[is_pos_col], k_pos[is_pos_col], cols_g[is_pos_col] - k_off

    def rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The gathered query and key rows of the masked pairs (gathered on the first call, after
        the first LSE, so the single-prefix loss builds its graph in the order it always did)."""
        if self._rows is None:
            query, my_q, nq, key, my_k, nk, rank, group = self._gather_args
            self._rows = (all_gather_with_grad(query[my_q], nq, rank, group, reduce="all_reduce"),
                          all_gather_with_grad(key[my_k], nk, rank, group, reduce="all_reduce"))
        return self._rows


def _mask_plan(query, key, labels, key_ids, positive_ids, group, world, rank) -> Optional[_MaskPlan]:
    """The false-negative plan of the global batch, or ``None`` when no pair is masked anywhere
    (then every rank takes the plain loss path). Validates ``key_ids`` and ``positive_ids``."""
    b, m = query.shape[0], key.shape[0]
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
    label_cols_g = torch.cat([l + o for l, o in zip(all_labels, key_off)])
    rows_g, cols_g = false_negative_pairs(torch.cat(all_key_ids), torch.cat(all_pos_ids), label_cols_g)
    if rows_g.numel() == 0:
        return None
    return _MaskPlan(query, key, labels, rows_g, cols_g, query_sizes, key_sizes, world, rank, group)


def _masked_share(query, key, prefix, scale_t, labels, plan: _MaskPlan, *, first, symmetric, group, backend,
                  tile_size) -> torch.Tensor:
    """This rank's share of the masked loss on ``prefix(query)``, ``prefix(key)`` (the shares of
    all ranks add up to the global loss); ``prefix`` maps full-width rows to the width scored."""
    query, key = prefix(query), prefix(key)
    row_lse, col_lse = lse(query, key, scale_t, compute_col=symmetric, backend=backend, group=group,
                           tile_size=tile_size)
    pos = scale_t * (query.float() * key[labels].float()).sum(1)
    q_full, k_full = plan.rows()
    share = (row_lse - pos).sum()
    if first:
        # Every rank builds the same graph (no data-dependent branches, gathered rows always
        # used), so the collectives of the backward run in the same order everywhere.
        share = share + 0.0 * (q_full.float().sum() + k_full.float().sum())
    q_rows, k_rows = prefix(q_full), prefix(k_full)
    x = scale_t * (q_rows[plan.row_q].float() * k_rows[plan.row_k].float()).sum(1)
    share = share + _masked_lse_correction(row_lse, x, plan.row_index).sum()
    share = share / plan.num_queries
    if symmetric:
        col_term = (col_lse[labels] - pos).sum()
        x = scale_t * (q_rows[plan.col_q].float() * k_rows[plan.col_k].float()).sum(1)
        corr = _masked_lse_correction(col_lse, x, plan.col_index)
        col_term = col_term + corr[labels].sum()
        share = (share + col_term / plan.num_queries) / 2
    return share


def _retrieval_loss_over_prefixes(query, key, scale, labels, key_ids, positive_ids, prefixes, *, symmetric,
                                  group, backend, tile_size) -> torch.Tensor:
    """``sum_i w_i * loss(prefix_i(query), prefix_i(key))`` for ``prefixes = [(fn_i, w_i), ...]``;
    the false-negative pairs are found and their rows gathered once for all prefixes."""
    group, world, rank = _resolve_group(group)
    b = query.shape[0]
    labels = torch.arange(b, device=query.device) if labels is None else labels.to(query.device).long()
    plan = None
    if key_ids is not None:
        plan = _mask_plan(query, key, labels, key_ids, positive_ids, group, world, rank)
    if plan is None:  # no masking asked for, or nothing to mask anywhere: the plain loss per prefix
        total = None
        for fn, weight in prefixes:
            term = contrastive_loss(fn(query), fn(key), scale, labels, symmetric=symmetric, backend=backend,
                                    group=group, tile_size=tile_size)
            term = term if weight == 1.0 else weight * term
            total = term if total is None else total + term
        return total
    scale_t = scale if torch.is_tensor(scale) else torch.tensor(float(scale), device=query.device)
    scale_t = scale_t.to(device=query.device, dtype=torch.float32).reshape(())
    total = None
    for i, (fn, weight) in enumerate(prefixes):
        share = _masked_share(query, key, fn, scale_t, labels, plan, first=i == 0, symmetric=symmetric,
                              group=group, backend=backend, tile_size=tile_size)
        share = share if weight == 1.0 else weight * share
        total = share if total is None else total + share
    return global_sum_with_grad(total, world, group)


@follows_autocast("query", "key")
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
        query: ``[b, c]`` local query embeddings (under autocast computed in autocast's dtype,
            docs/loss.md "Precision").
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
    return _retrieval_loss_over_prefixes(
        query, key, scale, labels, key_ids, positive_ids, [(lambda x: x, 1.0)], symmetric=symmetric,
        group=group, backend=backend, tile_size=tile_size,
    )


@follows_autocast("query", "key")
def matryoshka_retrieval_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    scale,
    labels: Optional[torch.Tensor] = None,
    *,
    matryoshka_dims: Sequence[int],
    matryoshka_weights: Optional[Sequence[float]] = None,
    normalize: bool = True,
    key_ids: Optional[torch.Tensor] = None,
    positive_ids: Optional[torch.Tensor] = None,
    symmetric: bool = False,
    group=None,
    backend: str = "auto",
    tile_size: Optional[int] = None,
) -> torch.Tensor:
    """Matryoshka retrieval loss: the weighted sum of ``retrieval_loss`` over nested prefixes.

    With dims ``d_1 > d_2 > ...`` and weights ``w_i``::

        L = sum_i w_i * retrieval_loss(P_i(query), P_i(key), scale, labels, ...)
        P_i(x) = normalize(x[:, :d_i])   if normalize else   x[:, :d_i]

    Each term is the exact global-batch InfoNCE of ``retrieval_loss`` (tiled LSE, ring across
    ranks), with the same false-negative masking; the pairs to mask are found, and their rows
    gathered, once for all dims. The embeddings are computed once by the caller: gradients of all
    terms meet in ``query`` and ``key``.

    This is sentence-transformers' ``MatryoshkaLoss(model, MultipleNegativesRankingLoss(model),
    matryoshka_dims, matryoshka_weights)`` when ``normalize=True`` (it truncates, then
    L2-normalizes each prefix; the full dimension is re-normalized too, a no-op up to rounding on
    normalized embeddings), with ``scale`` 20, one rank and no repeated texts.

    Args:
        query: ``[b, c]`` local query embeddings.
        key: ``[m, c]`` local key embeddings (positives and hard negatives, any order).
        scale: ``1 / temperature`` (float, or a tensor that receives a gradient), the same for every
            dim.
        labels: ``[b]`` local index of each query's positive key (default ``arange(b)``).
        matryoshka_dims: distinct prefix lengths, largest first, each ``<= c`` (e.g.
            ``[768, 512, 256, 128, 64]``; include ``c`` to train the full embedding too).
        matryoshka_weights: one finite weight ``>= 0`` per dim (default all 1).
        normalize: L2-normalize each prefix (cosine similarity). False scores prefixes by their
            dot product (no normalization anywhere).
        key_ids, positive_ids, symmetric, group, backend, tile_size: as in ``retrieval_loss``.

    Shapes:
        ``query [b, c]``, ``key [m, c]``, ``labels [b]``, ``key_ids [m]``, ``positive_ids [b, P]``.

    Returns:
        0-dim float32 global loss (the same on every rank); after the data-parallel mean of the
        gradients every parameter gets the gradient of the global-batch loss.

    Raises:
        ValueError: dims empty, not positive integers, duplicated, not descending, or above ``c``;
            weights of the wrong length, negative or not finite; the errors of ``retrieval_loss``.
    """
    group_r, _, _ = _resolve_group(group)
    with agree_on_input_errors(group_r):  # a rank's bad input stops every rank (no hang)
        if query.dim() != 2:
            raise ValueError(f"query must be [b, c], got shape {tuple(query.shape)}")
        dims, weights = check_matryoshka(matryoshka_dims, matryoshka_weights, query.shape[1])
    prefixes = [(functools.partial(matryoshka_prefix, dim=d, normalize=normalize), w) for d, w in zip(dims, weights)]
    return _retrieval_loss_over_prefixes(
        query, key, scale, labels, key_ids, positive_ids, prefixes, symmetric=symmetric, group=group,
        backend=backend, tile_size=tile_size,
    )


class RetrievalLoss(nn.Module):
    """One-direction retrieval InfoNCE over the global batch, with false-negative masking.

    Args:
        scale: logit multiplier, 20 by default (sentence-transformers' MNRL default).
        temperature: alternative to ``scale`` (``scale = 1 / temperature``).
        symmetric: add the document-to-query term over the positive keys.
        mask_false_negatives: use ``key_ids`` / ``positive_ids`` when given.
        learnable_scale: make ``log(scale)`` a parameter (off by default for retrieval).
        matryoshka_dims: nested prefix lengths, largest first (e.g. ``[768, 256, 64]``); the loss
            becomes ``sum_i w_i * loss(prefix_i)`` (``matryoshka_retrieval_loss``). ``None``: the
            plain loss on the full embedding.
        matryoshka_weights: one weight per dim (default all 1).
        matryoshka_normalize: L2-normalize each prefix (cosine; default True, what
            sentence-transformers' ``MatryoshkaLoss`` does). Set False for dot-product models whose
            embeddings are not normalized.
        group, backend, tile_size: see ``ds_infcl.loss.contrastive_loss``.

    Inputs: ``query [b, c]``, ``key [m, c]``, ``labels [b]``, optional ``key_ids [m]`` and
    ``positive_ids [b, P]`` (int64 text ids).

    Relations: with ``scale=20``, normalized embeddings, one rank and no repeated texts it equals
    sentence-transformers' ``MultipleNegativesRankingLoss``; ``symmetric=True`` equals
    ``MultipleNegativesSymmetricRankingLoss`` (without hard negatives); with ``matryoshka_dims``
    it equals ``MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), matryoshka_dims,
    matryoshka_weights)``.

    Example::

        loss_fn = RetrievalLoss(scale=20.0, matryoshka_dims=[384, 128, 32])
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
        matryoshka_dims: Optional[Sequence[int]] = None,
        matryoshka_weights: Optional[Sequence[float]] = None,
        matryoshka_normalize: bool = True,
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
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_options(matryoshka_dims, matryoshka_weights)
        self.matryoshka_normalize = bool(matryoshka_normalize)
        self._warned_partial = False
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
        if self.matryoshka_dims is None:
            return retrieval_loss(
                query, key, scale, labels, key_ids=key_ids, positive_ids=positive_ids,
                symmetric=self.symmetric, group=self.group, backend=self.backend, tile_size=self.tile_size,
            )
        if not self._warned_partial and query.dim() == 2 and self.matryoshka_dims[0] < query.shape[1]:
            self._warned_partial = True
            warnings.warn(f"matryoshka_dims {list(self.matryoshka_dims)} leave out the full embedding dimension "
                          f"{query.shape[1]}: the full embedding is trained only through its prefixes; add "
                          f"{query.shape[1]} as the first dim to train it too", stacklevel=2)
        return matryoshka_retrieval_loss(
            query, key, scale, labels, matryoshka_dims=self.matryoshka_dims,
            matryoshka_weights=self.matryoshka_weights, normalize=self.matryoshka_normalize, key_ids=key_ids,
            positive_ids=positive_ids, symmetric=self.symmetric, group=self.group, backend=self.backend,
            tile_size=self.tile_size,
        )

    def extra_repr(self) -> str:
        text = (f"scale={float(self.scale.detach()):.4g}, symmetric={self.symmetric}, "
                f"mask_false_negatives={self.mask_false_negatives}")
        if self.matryoshka_dims is not None:
            text += (f", matryoshka_dims={list(self.matryoshka_dims)}, "
                     f"matryoshka_weights={list(self.matryoshka_weights)}, "
                     f"matryoshka_normalize={self.matryoshka_normalize}")
        return text


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



def _build_retrieval_loss(settings: LossSettings) -> RetrievalLoss:
    """``RetrievalLoss`` from the task's defaults (``scale``, ``symmetric``, ``learnable_scale``,
    ``mask_false_negatives``, ``matryoshka_normalize``) overridden by the config: ``symmetric``,
    ``learnable_scale``, ``init_logit_scale`` (``scale = exp(init_logit_scale)``),
    ``matryoshka_dims`` and ``matryoshka_weights``."""
    kwargs = dict(settings.defaults)
    config = settings.config
    kwargs.update({key: config[key] for key in ("symmetric", "learnable_scale", "matryoshka_dims", "matryoshka_weights")
                   if key in config})
    if "init_logit_scale" in config:
        kwargs["scale"] = math.exp(config["init_logit_scale"])
    return RetrievalLoss(**settings.placement(), **kwargs)


register_loss_module("retrieval", _build_retrieval_loss, features=("directed",))  # built by the retrieval task itself
