"""Retrieval metrics of held-out queries against a corpus: NDCG@k, MRR@k, Recall@k.

Definitions (binary relevance; the same as sentence-transformers' ``InformationRetrievalEvaluator``,
which a test checks number for number):

- ranking: corpus documents by descending score ``q . d`` (cosine when both are normalized),
- ``MRR@k``: ``1 / rank`` of the first relevant document within the top k, else 0,
- ``NDCG@k``: ``sum_{r<=k, rel} 1/log2(r+1)`` over the ideal value ``sum_{r<=min(k,|rel|)} 1/log2(r+1)``,
- ``Recall@k``: relevant documents in the top k over all relevant documents of the query,

each averaged over the queries. Scores are computed ``corpus_chunk_size`` documents at a time
with a running top-k, so memory is O(queries x (chunk + k)).
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Set

import torch

__all__ = ["retrieval_metrics", "top_k"]

DEFAULT_KS = {"ndcg": (10,), "mrr": (10,), "recall": (1, 10, 100)}


def top_k(query: torch.Tensor, corpus: torch.Tensor, k: int, corpus_chunk_size: int = 50000):
    """``(scores [n, k], indices [n, k])`` of the k best corpus rows per query (dot product)."""
    k = min(k, corpus.shape[0])
    best_s = query.new_full((query.shape[0], 0), float("-inf"))
    best_i = torch.zeros((query.shape[0], 0), dtype=torch.long, device=query.device)
    for start in range(0, corpus.shape[0], corpus_chunk_size):
        scores = query @ corpus[start : start + corpus_chunk_size].T
        s, i = scores.topk(min(k, scores.shape[1]), dim=1)
        best_s, order = torch.cat([best_s, s], 1).topk(min(k, best_s.shape[1] + s.shape[1]), dim=1)
        best_i = torch.cat([best_i, i + start], 1).gather(1, order)
    return best_s, best_i


def retrieval_metrics(
    query_embeddings: torch.Tensor,
    corpus_embeddings: torch.Tensor,
    relevant: Sequence[Set[int]],
    *,
    ndcg_at: Sequence[int] = DEFAULT_KS["ndcg"],
    mrr_at: Sequence[int] = DEFAULT_KS["mrr"],
    recall_at: Sequence[int] = DEFAULT_KS["recall"],
    corpus_chunk_size: int = 50000,
) -> Dict[str, float]:
    """Mean metrics over queries; ``relevant[i]`` is the set of corpus row indices relevant to
    query i (non-empty). Keys: ``ndcg@10``, ``mrr@10``, ``recall@1``, ``recall@10``, ...

    Raises:
        ValueError: mismatched counts, a query without relevant documents, an index out of range.
    """
    n = query_embeddings.shape[0]
    if len(relevant) != n:
        raise ValueError(f"{n} queries but {len(relevant)} relevance sets")
    for i, rel in enumerate(relevant):
        if not rel:
            raise ValueError(f"query {i} has no relevant document")
        if min(rel) < 0 or max(rel) >= corpus_embeddings.shape[0]:
            raise ValueError(f"query {i} has a relevant index outside the corpus of {corpus_embeddings.shape[0]}")
    max_k = max([*ndcg_at, *mrr_at, *recall_at])
    _, idx = top_k(query_embeddings.float(), corpus_embeddings.float(), max_k, corpus_chunk_size)
    idx = idx.tolist()
    out: Dict[str, List[float]] = {}
    for ranked, rel in zip(idx, relevant):
        hits = [1 if d in rel else 0 for d in ranked]
        for k in mrr_at:
            first = next((r for r, h in enumerate(hits[:k]) if h), None)
            out.setdefault(f"mrr@{k}", []).append(0.0 if first is None else 1.0 / (first + 1))
        for k in ndcg_at:
            dcg = sum(h / math.log2(r + 2) for r, h in enumerate(hits[:k]))
            idcg = sum(1.0 / math.log2(r + 2) for r in range(min(k, len(rel))))
            out.setdefault(f"ndcg@{k}", []).append(dcg / idcg)
        for k in recall_at:
            out.setdefault(f"recall@{k}", []).append(sum(hits[:k]) / len(rel))
    return {name: sum(v) / len(v) for name, v in out.items()}
