# Over 500 lines on purpose: the reader, search, metrics and command of one BEIR evaluation, run as one module.
"""Evaluation of a dense retriever on a BEIR-format folder: NDCG@10, MRR@10, Recall@100.

A BEIR folder holds ``corpus.jsonl`` (``{"_id", "title", "text"}`` per line), ``queries.jsonl``
(``{"_id", "text"}``) and ``qrels/<split>.tsv`` (header ``query-id<TAB>corpus-id<TAB>score``;
graded relevance, a score of 0 or below is "judged not relevant").

Pieces, each usable alone:

- :func:`load_beir` reads and validates a folder (``file:line`` in every ``ValueError``) and
  counts what it cannot use: qrels that name unknown query or document ids, queries of the split
  without any relevant document (skipped, as they have no defined NDCG or recall).
- :func:`exact_search` is the exact top-k by dot product over corpus chunks with a running top-k
  (memory ``O(Q * (chunk + k))``, never ``[Q, D]``), on the embeddings' device; faiss's
  ``IndexFlatIP`` when asked for and installed.
- :func:`beir_metrics` computes the metrics from ranked document ids and graded qrels.
- :func:`evaluate_beir` embeds the queries and documents with an encoder that has
  ``embed_queries(texts, batch_size)`` / ``embed_documents(texts, batch_size)``
  (:class:`ds_infcl.adapters.retrieval.RetrievalEncoders`, or :class:`TokenizingEmbedder` over
  the trainer's towers), searches and scores.
- ``python -m ds_infcl.adapters.beir_eval --model PATH --data FOLDER`` does all of it and prints a
  table.

Metric definitions (those of pytrec_eval / trec_eval 9.0.4+ as BEIR calls them, and BEIR's own
MRR), for one query with graded judgments ``rel(d)`` and ranking ``d_1, d_2, ...``:

- ``NDCG@k = DCG@k / IDCG@k`` with ``DCG@k = sum_{r<=k} g(d_r) / log2(r + 1)``, gain
  ``g(d) = rel(d)`` if ``rel(d) > 0`` else 0 (linear gains, not ``2^rel - 1``), and ``IDCG@k``
  the same sum over all judged grades of the query sorted in descending order (judged documents
  that were not retrieved count),
- ``MRR@k = 1 / r`` for the first ``r <= k`` with ``rel(d_r) > 0``, else 0,
- ``Recall@k = |{r <= k : rel(d_r) > 0}| / |{d : rel(d) > 0}|`` (the denominator is the number
  of relevant documents even when it exceeds k),

each averaged over the queries that have at least one relevant document.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "HEADLINE_METRICS",
    "BeirData",
    "load_beir",
    "exact_search",
    "beir_metrics",
    "TokenizingEmbedder",
    "evaluate_beir",
    "load_encoder",
    "format_table",
    "main",
]

HEADLINE_METRICS = ("ndcg@10", "mrr@10", "recall@100")
_ALWAYS_KS = (10, 100)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


@dataclass
class BeirData:
    """One split of a BEIR folder, validated.

    ``query_ids`` / ``query_texts`` are the queries that are evaluated: those of the split with at
    least one relevant document, in ``queries.jsonl`` order. ``qrels[qid][doc_id]`` is the graded
    judgment. ``document_texts[i]`` is ``title + " " + text`` (just ``text`` without a title).
    ``counts`` says what was read and what could not be used (see :func:`load_beir`).
    """

    folder: str
    split: str
    document_ids: List[str]
    document_texts: List[str]
    query_ids: List[str]
    query_texts: List[str]
    qrels: Dict[str, Dict[str, int]]
    counts: Dict[str, int] = field(default_factory=dict)


def _utf8_lines(path: str) -> Iterator[Tuple[int, str]]:
    """``(line_no, text)`` per line, each line decoded on its own so that a byte that is not UTF-8
    raises a ValueError naming ``file:line`` (not a buffer offset); a byte-order mark is accepted."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}); save the file as UTF-8") from None


def _read_jsonl(path: str, kind: str, require_title: bool) -> Tuple[List[str], List[str], List[str]]:
    """``(ids, texts, titles)`` of a corpus or queries file; a ValueError names ``file:line``."""
    ids: List[str] = []
    texts: List[str] = []
    titles: List[str] = []
    first_line: Dict[str, int] = {}
    for line_no, line in _utf8_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line of "
                             f"{kind} must be one JSON object") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        doc_id = row.get("_id")
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
            raise ValueError(f"{where}: '_id' must be a non-empty string (or an integer), got {doc_id!r}")
        doc_id = str(doc_id)
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string, got {text!r}")
        title = row.get("title") if require_title else None
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise ValueError(f"{where}: 'title' must be a string or absent, got {title!r}")
        if doc_id in first_line:
            raise ValueError(f"{where}: _id {doc_id!r} repeats the one of line {first_line[doc_id]}; "
                             "ids must be unique")
        first_line[doc_id] = line_no
        ids.append(doc_id)
        texts.append(text)
        titles.append(title)
    return ids, texts, titles


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _parse_grade(value: str, where: str) -> int:
    try:
        grade = float(value)
    except ValueError:
        grade = float("nan")
    if not math.isfinite(grade) or grade != int(grade):
        raise ValueError(f"{where}: score must be an integer relevance grade, got {value!r}")
    return int(grade)


def _read_qrels(path: str) -> Tuple[Dict[str, Dict[str, int]], int]:
    """``(qrels, num_lines)``; a first line whose score is not a number is the header; a
    ValueError names ``file:line``."""
    qrels: Dict[str, Dict[str, int]] = {}
    seen_at: Dict[Tuple[str, str], int] = {}
    num = 0
    for line_no, line in _utf8_lines(path):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(f"{where}: expected 3 tab-separated fields (query-id, corpus-id, score), "
                             f"got {len(parts)}: {line[:80]!r}")
        qid, doc_id, score = (p.strip() for p in parts)
        if line_no == 1 and not _is_number(score):
            continue  # the header (``query-id corpus-id score`` in BEIR; any names accepted)
        if not qid or not doc_id:
            raise ValueError(f"{where}: empty query-id or corpus-id")
        grade = _parse_grade(score, where)
        key = (qid, doc_id)
        if key in seen_at:
            if qrels[qid][doc_id] != grade:
                raise ValueError(f"{where}: ({qid!r}, {doc_id!r}) graded {grade}, but line {seen_at[key]} "
                                 f"graded it {qrels[qid][doc_id]}; keep one judgment per pair")
            continue
        seen_at[key] = line_no
        qrels.setdefault(qid, {})[doc_id] = grade
        num += 1
    return qrels, num


def load_beir(folder: str, split: str = "test", *, drop_unknown_documents: bool = False) -> BeirData:
    """Read and validate one split of a BEIR folder.

    Args:
        folder: holds ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.
        split: the qrels file's name without ``.tsv``.
        drop_unknown_documents: drop judgments of documents that are not in the corpus. By default
            they are kept, as pytrec_eval (which never sees the corpus) keeps them: they cannot be
            retrieved but count in the ideal DCG and in the recall denominator, so numbers stay
            comparable with published BEIR results. Either way they are counted.

    Returns:
        :class:`BeirData`; ``counts`` holds ``num_documents``, ``num_queries`` (evaluated),
        ``num_qrels`` (distinct judgment lines), ``skipped_queries_without_relevant`` (queries of
        the split whose judgments are all ``<= 0``, or whose relevant documents were dropped),
        ``unknown_query_qrels`` (judgment lines naming a query id that is not in queries.jsonl,
        dropped), ``unknown_document_qrels`` (lines naming a document id that is not in the
        corpus) and ``queries_not_in_split`` (queries.jsonl entries without judgments in this
        split; normal when queries.jsonl serves several splits). Nonzero ``unknown_*`` counts
        are also warned.

    Raises:
        ValueError: a missing file (the message lists the splits that exist), a malformed line
            (``file:line``), a repeated id, conflicting judgments of one pair, or a split without
            a single evaluable query.
    """
    if not os.path.isdir(folder):
        raise ValueError(f"BEIR folder {folder!r} is not a directory; it must hold corpus.jsonl, queries.jsonl "
                         "and qrels/<split>.tsv")
    corpus_path = os.path.join(folder, "corpus.jsonl")
    queries_path = os.path.join(folder, "queries.jsonl")
    qrels_path = os.path.join(folder, "qrels", f"{split}.tsv")
    for path, what in ((corpus_path, 'one {"_id", "title", "text"} object per line'),
                       (queries_path, 'one {"_id", "text"} object per line')):
        if not os.path.isfile(path):
            raise ValueError(f"BEIR folder {folder!r} has no {os.path.basename(path)} ({what})")
    if not os.path.isfile(qrels_path):
        qrels_dir = os.path.join(folder, "qrels")
        splits = sorted(n[:-4] for n in os.listdir(qrels_dir) if n.endswith(".tsv")) if os.path.isdir(qrels_dir) else []
        raise ValueError(f"BEIR folder {folder!r} has no qrels/{split}.tsv; splits found: "
                         f"{', '.join(splits) if splits else 'none (no qrels/*.tsv)'}; pass split=<one of them>")

    doc_ids, doc_texts, titles = _read_jsonl(corpus_path, "corpus.jsonl", require_title=True)
    if not doc_ids:
        raise ValueError(f"{corpus_path} holds no documents")
    query_ids_all, query_texts_all, _ = _read_jsonl(queries_path, "queries.jsonl", require_title=False)
    qrels_all, num_qrels = _read_qrels(qrels_path)

    known_docs = set(doc_ids)
    known_queries = set(query_ids_all)
    unknown_query_lines = sum(len(docs) for qid, docs in qrels_all.items() if qid not in known_queries)
    unknown_doc_lines = 0
    qrels: Dict[str, Dict[str, int]] = {}
    for qid, docs in qrels_all.items():
        if qid not in known_queries:
            continue
        unknown = [d for d in docs if d not in known_docs]
        unknown_doc_lines += len(unknown)
        if drop_unknown_documents:
            docs = {d: g for d, g in docs.items() if d in known_docs}
        qrels[qid] = docs

    evaluated = {qid for qid, docs in qrels.items() if any(g > 0 for g in docs.values())}
    query_ids = [q for q in query_ids_all if q in evaluated]
    query_texts = [t for q, t in zip(query_ids_all, query_texts_all) if q in evaluated]
    counts = {
        "num_documents": len(doc_ids),
        "num_queries": len(query_ids),
        "num_qrels": num_qrels,
        "skipped_queries_without_relevant": len(qrels) - len(evaluated),
        "unknown_query_qrels": unknown_query_lines,
        "unknown_document_qrels": unknown_doc_lines,
        "queries_not_in_split": sum(1 for q in query_ids_all if q not in qrels_all),
    }
    if unknown_query_lines or unknown_doc_lines:
        what = "dropped" if drop_unknown_documents else "kept as unretrievable judgments, as pytrec_eval does"
        warnings.warn(f"{qrels_path}: {unknown_query_lines} judgment lines name query ids not in queries.jsonl "
                      f"(dropped) and {unknown_doc_lines} name document ids not in corpus.jsonl ({what})",
                      stacklevel=2)
    if not query_ids:
        raise ValueError(f"{qrels_path}: no query of split {split!r} has a relevant document (score > 0) "
                         f"among the queries of queries.jsonl; counts: {counts}")
    texts = [f"{title} {text}" if title else text for title, text in zip(titles, doc_texts)]
    return BeirData(folder=folder, split=split, document_ids=doc_ids, document_texts=texts,
                    query_ids=query_ids, query_texts=query_texts,
                    qrels={q: qrels[q] for q in query_ids}, counts=counts)


# ----------------------------------------------------------------------------------------------
# Search
# ----------------------------------------------------------------------------------------------


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _faiss_search(q_emb: torch.Tensor, d_emb: torch.Tensor, k: int, chunk_size: int):
    try:
        import faiss
    except ImportError:
        raise ImportError("use_faiss=True needs the faiss package (pip install faiss-cpu, or faiss-gpu); "
                          "or pass use_faiss=False for the chunked exact search in torch") from None
    index = faiss.IndexFlatIP(d_emb.shape[1])
    for start in range(0, d_emb.shape[0], chunk_size):
        index.add(d_emb[start : start + chunk_size].detach().float().cpu().contiguous().numpy())
    scores, idx = index.search(q_emb.detach().float().cpu().contiguous().numpy(), k)
    return (torch.as_tensor(scores, dtype=torch.float32).to(q_emb.device),
            torch.as_tensor(idx, dtype=torch.long).to(q_emb.device))


@torch.no_grad()
def exact_search(
    q_emb: torch.Tensor,
    d_emb: torch.Tensor,
    k: int,
    chunk_size: int = 50_000,
    *,
    query_chunk_size: Optional[int] = None,
    use_faiss: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` highest dot products ``q . d`` of every query, best first.

    Args:
        q_emb: ``[Q, c]`` query embeddings.
        d_emb: ``[D, c]`` document embeddings, same device and feature size.
        k: results per query; ``k > D`` gives all ``D`` documents.
        chunk_size: documents scored at a time; a running top-k of ``[Q, k]`` is merged with
            each chunk's top-k, so memory is ``O(Q' * (chunk_size + k))`` and no ``[Q, D]``
            matrix exists.
        query_chunk_size: queries scored at a time (``Q'`` above; default all).
        use_faiss: search a faiss ``IndexFlatIP`` (exact inner product, on the CPU) instead.
            Raises ImportError when faiss is not installed.

    Returns:
        ``(scores [Q, min(k, D)], indices [Q, min(k, D)])`` on ``q_emb``'s device; scores in
        float32 (float64 for float64 inputs; 16-bit embeddings are upcast chunk by chunk).
        Equal scores come in an unspecified order.

    Raises:
        ValueError: shapes, devices, an empty corpus, non-finite embeddings, ``k`` or a chunk
            size below 1.
    """
    if q_emb.dim() != 2 or d_emb.dim() != 2:
        raise ValueError(f"q_emb and d_emb must be 2-D [n, c], got shapes {tuple(q_emb.shape)} and {tuple(d_emb.shape)}")
    if q_emb.shape[1] != d_emb.shape[1]:
        raise ValueError(f"queries have {q_emb.shape[1]} features but documents {d_emb.shape[1]}; "
                         "embed both with the same model")
    if q_emb.device != d_emb.device:
        raise ValueError(f"q_emb is on {q_emb.device} but d_emb on {d_emb.device}; move both to one device")
    _check_positive_int("k", k)
    _check_positive_int("chunk_size", chunk_size)
    if query_chunk_size is not None:
        _check_positive_int("query_chunk_size", query_chunk_size)
    if d_emb.shape[0] == 0:
        raise ValueError("d_emb holds no documents; the corpus must not be empty")
    for name, emb in (("q_emb", q_emb), ("d_emb", d_emb)):
        if not emb.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {emb.dtype}")
        bad = int((~torch.isfinite(emb).all(dim=1)).sum())
        if bad:
            raise ValueError(f"{name}: {bad} of {emb.shape[0]} rows hold NaN or Inf")
    k = min(k, d_emb.shape[0])
    if use_faiss:
        return _faiss_search(q_emb, d_emb, k, chunk_size)

    dtype = torch.promote_types(torch.promote_types(q_emb.dtype, d_emb.dtype), torch.float32)
    num_q = q_emb.shape[0]
    q_step = query_chunk_size or max(num_q, 1)
    all_scores, all_idx = [], []
    for q_start in range(0, max(num_q, 1), q_step):
        q = q_emb[q_start : q_start + q_step].to(dtype)
        best_s = q.new_empty((q.shape[0], 0))
        best_i = torch.empty((q.shape[0], 0), dtype=torch.long, device=q.device)
        for start in range(0, d_emb.shape[0], chunk_size):
            scores = q @ d_emb[start : start + chunk_size].to(dtype).T  # [Q', chunk]
            s, i = scores.topk(min(k, scores.shape[1]), dim=1)
            merged_s = torch.cat([best_s, s], dim=1)
            merged_i = torch.cat([best_i, i + start], dim=1)
            best_s, order = merged_s.topk(min(k, merged_s.shape[1]), dim=1)
            best_i = merged_i.gather(1, order)
        all_scores.append(best_s)
        all_idx.append(best_i)
    return torch.cat(all_scores), torch.cat(all_idx)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def _metric_ks(ks: Sequence[int]) -> List[int]:
    for k in ks:
        _check_positive_int("every k in ks", k)
    return sorted(set(ks) | set(_ALWAYS_KS))


def beir_metrics(
    ranked: Mapping[str, Sequence[str]],
    qrels: Mapping[str, Mapping[str, int]],
    ks: Sequence[int] = (1, 10, 100),
) -> Dict[str, float]:
    """Mean ``ndcg@k``, ``mrr@k`` and ``recall@k`` for every k in ``ks`` plus 10 and 100.

    Args:
        ranked: query id -> retrieved document ids, best first (any length; a list shorter than
            k simply retrieves nothing more).
        qrels: query id -> document id -> graded relevance (``> 0`` relevant; ``<= 0`` judged
            not relevant, gain 0).
        ks: cut-offs besides 10 and 100.

    Definitions are in the module docstring (pytrec_eval's ``ndcg_cut`` and ``recall``, BEIR's
    MRR). Queries of ``qrels`` without a relevant document are left out of the means (pytrec_eval
    would average a 0 in); queries of ``ranked`` without judgments are ignored.

    Raises:
        ValueError: no query with a relevant document, a judged query missing from ``ranked``, or
            a document id twice in one ranking.
    """
    cutoffs = _metric_ks(ks)
    queries = [q for q, docs in qrels.items() if any(g > 0 for g in docs.values())]
    if not queries:
        raise ValueError("qrels hold no query with a relevant document (score > 0)")
    missing = [q for q in queries if q not in ranked]
    if missing:
        raise ValueError(f"ranked lacks {len(missing)} of the {len(queries)} judged queries "
                         f"(e.g. {missing[:3]}); give every query of qrels a ranking")
    sums = {f"{name}@{k}": 0.0 for name in ("ndcg", "mrr", "recall") for k in cutoffs}
    for qid in queries:
        judged = qrels[qid]
        docs = list(ranked[qid])
        if len(set(docs)) != len(docs):
            raise ValueError(f"the ranking of query {qid!r} lists a document more than once")
        gains = [max(judged.get(d, 0), 0) for d in docs]
        ideal = sorted((g for g in judged.values() if g > 0), reverse=True)
        num_relevant = len(ideal)
        first_hit = next((r for r, g in enumerate(gains, 1) if g > 0), None)
        for k in cutoffs:
            dcg = sum(g / math.log2(r + 1) for r, g in enumerate(gains[:k], 1) if g > 0)
            idcg = sum(g / math.log2(r + 1) for r, g in enumerate(ideal[:k], 1))
            sums[f"ndcg@{k}"] += dcg / idcg
            sums[f"mrr@{k}"] += 1.0 / first_hit if first_hit is not None and first_hit <= k else 0.0
            sums[f"recall@{k}"] += sum(1 for g in gains[:k] if g > 0) / num_relevant
    return {name: total / len(queries) for name, total in sums.items()}


# ----------------------------------------------------------------------------------------------
# Encoders and the end-to-end evaluation
# ----------------------------------------------------------------------------------------------


class TokenizingEmbedder:
    """``embed_queries`` / ``embed_documents`` over an encoder of tokenized features.

    Args:
        encoder: has ``encode_query(features)`` and ``encode_key(features)`` returning ``[n, c]``
            (the trainer's ``Encoder`` that ``Task.evaluate`` receives, or ``RetrievalEncoders``).
        tokenizers: has ``tokenize_queries(texts)`` / ``tokenize_documents(texts)`` (a
            ``RetrievalEncoders``; they add the prefixes).

    Embeddings come back in float32 on the CPU, in the order of the texts.
    """

    def __init__(self, encoder, tokenizers):
        self.encoder = encoder
        self.tokenizers = tokenizers

    def _embed(self, texts: Sequence[str], batch_size: int, query: bool) -> torch.Tensor:
        tokenize = self.tokenizers.tokenize_queries if query else self.tokenizers.tokenize_documents
        encode = self.encoder.encode_query if query else self.encoder.encode_key
        parts = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                features = {k: v for k, v in tokenize(list(texts[start : start + batch_size])).items() if torch.is_tensor(v)}
                parts.append(encode(features).float().cpu())
        return torch.cat(parts)

    def embed_queries(self, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        return self._embed(texts, batch_size, query=True)

    def embed_documents(self, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        return self._embed(texts, batch_size, query=False)


def _embed_with_progress(embed, texts: Sequence[str], batch_size: int, desc: str, progress: bool,
                         device: Optional[torch.device]) -> torch.Tensor:
    """Embed in batches of ``batch_size`` texts, longest first (least padding per batch, and the
    bar's first estimates are the slow ones), back in the texts' order."""
    from tqdm import tqdm

    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    parts = []
    with tqdm(total=len(texts), desc=desc, unit="text", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        for start in range(0, len(texts), batch_size):
            batch = [texts[i] for i in order[start : start + batch_size]]
            emb = embed(batch, batch_size)
            if emb.dim() != 2 or emb.shape[0] != len(batch):
                raise ValueError(f"{desc}: the encoder returned shape {tuple(emb.shape)} for {len(batch)} texts; "
                                 "expected [n, c]")
            parts.append(emb.detach().to(device) if device is not None else emb.detach())
            bar.update(len(batch))
    emb = torch.cat(parts)
    inverse = torch.empty(len(texts), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(texts))
    return emb[inverse.to(emb.device)]


def evaluate_beir(
    encoder,
    data: Union[str, BeirData],
    *,
    split: str = "test",
    batch_size: int = 128,
    ks: Sequence[int] = (1, 10, 100),
    chunk_size: int = 50_000,
    query_chunk_size: Optional[int] = None,
    use_faiss: bool = False,
    ignore_identical_ids: bool = True,
    device: Optional[Union[str, torch.device]] = None,
    progress: bool = True,
) -> Dict[str, float]:
    """Embed a BEIR split, search it exactly, and score the rankings.

    Args:
        encoder: has ``embed_queries(texts, batch_size)`` and ``embed_documents(texts,
            batch_size)`` returning ``[n, c]`` tensors (``RetrievalEncoders``, whose prefixes
            apply; :class:`TokenizingEmbedder` for the trainer's towers).
        data: a BEIR folder (read with :func:`load_beir`) or an already loaded :class:`BeirData`
            (load once, evaluate many times).
        split: the qrels split when ``data`` is a folder.
        batch_size: texts per encoder call; texts are sorted by length (longest first) across
            the whole corpus, so each batch pads to similar lengths. A tqdm bar counts texts.
        ks: cut-offs besides 10 and 100 (see :func:`beir_metrics`).
        chunk_size, query_chunk_size, use_faiss: see :func:`exact_search`.
        ignore_identical_ids: never rank a document whose id equals the query's id (BEIR's
            default, for ArguAna and Quora, where a query is also a document).
        device: where embeddings are kept and searched (default: where the encoder returns them).
        progress: show the progress bars.

    Returns:
        a flat dict: the metrics of :func:`beir_metrics` (floats) and ``data.counts`` (ints).
    """
    _check_positive_int("batch_size", batch_size)
    cutoffs = _metric_ks(ks)
    if isinstance(data, str):
        data = load_beir(data, split)
    elif not isinstance(data, BeirData):
        raise ValueError(f"data must be a BEIR folder path or a BeirData from load_beir, got {type(data).__name__}")
    for name in ("embed_queries", "embed_documents"):
        if not callable(getattr(encoder, name, None)):
            raise ValueError(f"encoder has no {name}(texts, batch_size); pass RetrievalEncoders or wrap the towers "
                             "in TokenizingEmbedder(encoder, towers)")
    device = torch.device(device) if device is not None else None
    d_emb = _embed_with_progress(encoder.embed_documents, data.document_texts, batch_size, "documents", progress, device)
    q_emb = _embed_with_progress(encoder.embed_queries, data.query_texts, batch_size, "queries", progress, device)
    q_emb = q_emb.to(d_emb.device)

    k = max(cutoffs)
    doc_position = {d: i for i, d in enumerate(data.document_ids)}
    self_hits = ignore_identical_ids and any(q in doc_position for q in data.query_ids)
    _, idx = exact_search(q_emb, d_emb, k + 1 if self_hits else k, chunk_size,
                          query_chunk_size=query_chunk_size, use_faiss=use_faiss)
    ranked: Dict[str, List[str]] = {}
    for qid, row in zip(data.query_ids, idx.tolist()):
        docs = [data.document_ids[i] for i in row]
        if self_hits:
            docs = [d for d in docs if d != qid]
        ranked[qid] = docs[:k]
    metrics: Dict[str, float] = dict(beir_metrics(ranked, data.qrels, cutoffs))
    metrics.update(data.counts)
    return metrics


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


class _TwoTowers:
    """Separate query and document towers (the ``query/`` and ``document/`` folders that
    ``RetrievalEncoders.save`` writes for ``separate=True``)."""

    def __init__(self, query_encoders, document_encoders):
        self.query_encoders = query_encoders
        self.document_encoders = document_encoders
        self.query_prefix = query_encoders.query_prefix
        self.document_prefix = document_encoders.document_prefix

    def embed_queries(self, texts, batch_size=128):
        return self.query_encoders.embed_queries(texts, batch_size)

    def embed_documents(self, texts, batch_size=128):
        return self.document_encoders.embed_documents(texts, batch_size)


def _saved_prompts(path: str) -> Dict[str, str]:
    config = os.path.join(path, "config_sentence_transformers.json")
    if not os.path.isfile(config):
        return {}
    with open(config, encoding="utf-8") as f:
        prompts = json.load(f).get("prompts") or {}
    return {k: v for k, v in prompts.items() if isinstance(v, str)}


def load_encoder(path: str, *, query_prefix: Optional[str] = None, document_prefix: Optional[str] = None,
                 max_seq_length: Optional[int] = None, device: str = "cpu", dtype: Optional[torch.dtype] = None):
    """``RetrievalEncoders`` of a model folder for evaluation (``embed_queries`` /
    ``embed_documents``), on ``device``, in ``dtype``, in eval mode.

    A folder with ``query/`` and ``document/`` sub-folders (separate towers, as
    ``RetrievalEncoders.save`` writes them) loads both. A prefix left as ``None`` is the folder's
    saved ``query`` / ``document`` prompt (what ds_infcl exports), else empty.
    """
    from ds_infcl.adapters.retrieval import RetrievalEncoders

    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory (a sentence-transformers or transformers folder)")
    two = all(os.path.isdir(os.path.join(path, side)) for side in ("query", "document")) and not any(
        os.path.isfile(os.path.join(path, n)) for n in ("modules.json", "config.json"))
    folders = {"query": os.path.join(path, "query"), "document": os.path.join(path, "document")} if two else \
        {"query": path, "document": path}
    prompts = {side: _saved_prompts(folder).get(side, "") for side, folder in folders.items()}
    qp = prompts["query"] if query_prefix is None else query_prefix
    dp = prompts["document"] if document_prefix is None else document_prefix

    def build(folder):
        enc = RetrievalEncoders(folder, query_prefix=qp, document_prefix=dp, max_seq_length=max_seq_length)
        enc.to(device=device, dtype=dtype) if dtype is not None else enc.to(device)
        return enc.eval()

    if two:
        return _TwoTowers(build(folders["query"]), build(folders["document"]))
    return build(path)


def format_table(metrics: Mapping[str, float]) -> str:
    """A small text table: one row per cut-off, NDCG / MRR / Recall columns, then the counts."""
    cutoffs = sorted({int(k.split("@")[1]) for k in metrics if k.startswith("ndcg@")})
    lines = [f"{'k':>5}  {'NDCG@k':>8}  {'MRR@k':>8}  {'Recall@k':>8}"]
    for k in cutoffs:
        lines.append(f"{k:>5}  {metrics[f'ndcg@{k}']:>8.4f}  {metrics[f'mrr@{k}']:>8.4f}  {metrics[f'recall@{k}']:>8.4f}")
    counts = [f"{k} {metrics[k]}" for k in metrics if "@" not in k]
    if counts:
        lines.append("counts: " + ", ".join(counts))
    return "\n".join(lines)


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m ds_infcl.adapters.beir_eval",
        description="Evaluate a dense retriever (sentence-transformers or transformers folder) on a BEIR folder: "
                    "NDCG@10, MRR@10, Recall@100 by exact dot-product search.")
    p.add_argument("--model", required=True, help="model folder (sentence-transformers, transformers, or a ds_infcl "
                                                  "export with query/ and document/ towers)")
    p.add_argument("--data", required=True, help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv")
    p.add_argument("--split", default="test", help="qrels split (default: test)")
    p.add_argument("--batch-size", type=int, default=128, help="texts per encoder call (default: 128)")
    p.add_argument("--query-prefix", default=None, help="text before every query (default: the folder's saved "
                                                        "'query' prompt, else none)")
    p.add_argument("--document-prefix", default=None, help="text before every document (default: the folder's "
                                                           "saved 'document' prompt, else none)")
    p.add_argument("--max-seq-length", type=int, default=None, help="truncation length (default: the model's)")
    p.add_argument("--k", type=int, nargs="*", default=[1, 10, 100], help="cut-offs besides 10 and 100")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: float32)")
    p.add_argument("--corpus-chunk-size", type=int, default=50_000, help="documents scored at a time (default: 50000)")
    p.add_argument("--faiss", action="store_true", help="search with faiss IndexFlatIP (needs faiss installed)")
    p.add_argument("--keep-identical-ids", action="store_true",
                   help="also rank a document whose id equals the query id (BEIR ignores it by default)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    try:
        data = load_beir(args.data, args.split)
        encoder = load_encoder(args.model, query_prefix=args.query_prefix, document_prefix=args.document_prefix,
                               max_seq_length=args.max_seq_length, device=device, dtype=dtype)
        results = evaluate_beir(encoder, data, batch_size=args.batch_size, ks=args.k,
                                chunk_size=args.corpus_chunk_size, use_faiss=args.faiss,
                                ignore_identical_ids=not args.keep_identical_ids, progress=not args.no_progress)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{os.path.basename(os.path.normpath(args.data))} ({args.split}): {data.counts['num_queries']} queries, "
          f"{data.counts['num_documents']} documents; query prefix {encoder.query_prefix!r}, "
          f"document prefix {encoder.document_prefix!r}")
    print(format_table(results))
    if args.out:
        report = {"model": args.model, "data": args.data, "split": args.split,
                  "query_prefix": encoder.query_prefix, "document_prefix": encoder.document_prefix,
                  "batch_size": args.batch_size, "dtype": args.dtype, "results": results}
        out_dir = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(out_dir, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
