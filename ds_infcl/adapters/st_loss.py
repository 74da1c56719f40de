"""A sentence-transformers loss on ds_infcl: exact InfoNCE over the global batch, cached.

Drop-in where ``MultipleNegativesRankingLoss`` (MNRL) or ``CachedMultipleNegativesRankingLoss``
(CachedMNRL) would go in a ``SentenceTransformerTrainer``: the same columns (``anchor``,
``positive``, ``negative_1`` .. ``negative_n``), the same ``scale`` (20) and cosine similarity,
and a ``mini_batch_size`` for caching.

What differs:

- **Negatives from every device.** With torch.distributed initialized (DDP or DeepSpeed under the
  trainer), every query is scored against the positives and hard negatives of *all* ranks through
  ds_infcl's tiled LSE and ring (no ``B x M`` logits, no all-gather of embeddings). The returned
  loss is the global loss; after the data-parallel gradient mean every parameter has the
  gradient of the global-batch loss.
- **Caching without a second backward.** Each column is encoded ``mini_batch_size`` rows at a time
  under non-reentrant activation checkpointing: the activations of a chunk are dropped after its
  forward and recomputed, with the same RNG state, when the single backward reaches it. That is
  the work and memory of GradCache (two forwards and one backward, one chunk of activations) and
  its exact gradient, but in one autograd graph. CachedMNRL instead calls ``backward()`` once per
  mini-batch from a hook inside the trainer's backward; DeepSpeed ZeRO 1/2 count a parameter's
  gradient hook once per backward and stop with "Gradient computed twice for this partition".
  Here ZeRO sees one ordinary backward (see docs/retrieval.md).
- **False-negative masking** (default on): a candidate whose token ids equal those of an anchor's
  positive is not a negative of that anchor (duplicate positives in a batch, a hard negative
  identical to the positive). With no repeated texts the loss equals MNRL's.
- **Matryoshka built in** (``matryoshka_dims``): the weighted sum of the loss over nested
  prefixes of the embeddings, from one (cached) forward, each term over the global batch; equals
  ``MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), matryoshka_dims,
  matryoshka_weights)`` on one device. Wrapping this class in ``MatryoshkaLoss`` instead works
  only without caching (``mini_batch_size=None``): with caching, the activation checkpoints
  recompute through the undecorated model and stop with torch's ``CheckpointError``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_infcl.adapters.retrieval import encode_chunked, feature_ids, retrieval_loss
from ds_infcl.loss import cast_for_autocast
from ds_infcl.loss.retrieval import matryoshka_options, matryoshka_retrieval_loss

__all__ = ["InfCLMultipleNegativesRankingLoss"]


def _similarity_name(fn) -> str:
    name = getattr(fn, "__name__", str(fn))
    if name in ("cos_sim", "cosine", "cos"):
        return "cos_sim"
    if name in ("dot_score", "dot"):
        return "dot_score"
    raise ValueError(f"similarity_fct must be cos_sim or dot_score (or their names), got {name!r}")


def _embedding_dimension(model) -> Optional[int]:
    """The model's sentence-embedding dimension when it can tell (else ``None``)."""
    for name in ("get_embedding_dimension", "get_sentence_embedding_dimension"):
        fn = getattr(model, name, None)
        if callable(fn):
            try:
                dim = fn()
            except Exception:  # a model that cannot tell: checked against c at the first step
                return None
            return int(dim) if dim is not None else None
    return None


class InfCLMultipleNegativesRankingLoss(nn.Module):
    """MNRL over the global batch with Inf-CL tiles, GradCache-style caching and masking.

    Args:
        model: the ``SentenceTransformer`` being trained.
        scale: logit multiplier (``1 / temperature``), 20 as in MNRL.
        similarity_fct: ``cos_sim`` (default, embeddings are L2-normalized first) or
            ``dot_score`` (a function from ``sentence_transformers.util`` or its name).
        mini_batch_size: rows encoded at a time with gradients; ``None`` encodes a column at
            once (no caching). Memory for activations is that of one mini-batch.
        gather_across_devices: score against the candidates of all ranks (default True). False
            gives MNRL's per-device loss.
        symmetric: add the document-to-query term over the positives
            (``MultipleNegativesSymmetricRankingLoss``).
        mask_false_negatives: never count a candidate with the same text as the anchor's positive
            as a negative.
        group: process group of the data-parallel ranks (``None``: DeepSpeed's data-parallel
            group when DeepSpeed has a mesh, else the default group).
        backend, tile_size: see ``ds_infcl.loss.lse``.
        matryoshka_dims: nested prefix lengths of the embedding, largest first (e.g.
            ``[384, 256, 128, 64]``), each at most the model's embedding dimension; the loss is the
            weighted sum over the prefixes (``ds_infcl.loss.retrieval.matryoshka_retrieval_loss``).
            ``None`` (default): the plain loss.
        matryoshka_weights: one weight per dim (default all 1).

    With ``similarity_fct=cos_sim`` each prefix is L2-normalized again after truncation, as
    ``MatryoshkaLoss`` does; with ``dot_score`` the prefixes are scored by their plain dot product
    (``MatryoshkaLoss`` normalizes the prefixes whatever the similarity, so it scores cosine there).

    Inputs: ``(anchor, positive)`` pairs or ``(anchor, positive, negative_1, ..., negative_n)``
    tuples; labels are ignored.

    Relations: equals ``MultipleNegativesRankingLoss`` (and ``CachedMultipleNegativesRankingLoss``)
    on one device when no text repeats; with ``gather_across_devices=True`` it equals MNRL on the
    concatenated global batch. With ``matryoshka_dims`` it equals ``MatryoshkaLoss`` wrapped
    around MNRL (the same dims and weights).

    Example::

        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

        model = SentenceTransformer("path/to/all-MiniLM-L6-v2")
        loss = InfCLMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=64)
        trainer = SentenceTransformerTrainer(model=model, train_dataset=ds, loss=loss)
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Any = "cos_sim",
        mini_batch_size: Optional[int] = 32,
        gather_across_devices: bool = True,
        symmetric: bool = False,
        mask_false_negatives: bool = True,
        group=None,
        backend: str = "auto",
        tile_size: Optional[int] = None,
        matryoshka_dims: Optional[List[int]] = None,
        matryoshka_weights: Optional[List[float]] = None,
    ):
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if mini_batch_size is not None and mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1 or None, got {mini_batch_size}")
        self.model = model
        self.scale = float(scale)
        self.similarity = _similarity_name(similarity_fct)
        self.mini_batch_size = mini_batch_size
        self.gather_across_devices = gather_across_devices
        self.symmetric = symmetric
        self.mask_false_negatives = mask_false_negatives
        self.group = group
        self.backend = backend
        self.tile_size = tile_size
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_options(
            matryoshka_dims, matryoshka_weights, None if matryoshka_dims is None else _embedding_dimension(model)
        )
        self._local_group = None

    def _loss_group(self):
        import torch.distributed as dist

        if self.gather_across_devices or not (dist.is_available() and dist.is_initialized()):
            return self.group
        if self._local_group is None:  # a group of one per rank: MNRL's per-device loss
            self._local_group, _ = dist.new_subgroups(group_size=1)
        return self._local_group

    def embed(self, features: Dict[str, Tensor]) -> Tensor:
        emb = encode_chunked(self.model, features, self.mini_batch_size)
        return F.normalize(emb, p=2, dim=-1) if self.similarity == "cos_sim" else emb

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Optional[Tensor] = None) -> Tensor:
        features: List[Dict[str, Tensor]] = list(sentence_features)
        if len(features) < 2:
            raise ValueError(f"expected (anchor, positive[, negative_1, ...]) columns, got {len(features)}")
        embeddings = [self.embed(f) for f in features]
        key_ids = None
        if self.mask_false_negatives:
            key_ids = torch.cat([feature_ids(f) for f in features[1:]]).to(embeddings[0].device)
        return self.compute_loss_from_embeddings(embeddings, labels, key_ids=key_ids)

    def compute_loss_from_embeddings(
        self, embeddings: List[Tensor], labels: Optional[Tensor] = None, *, key_ids: Optional[Tensor] = None
    ) -> Tensor:
        """The loss from per-column embeddings ``[anchor [b, c], positive [b, c], neg_1 [b, c], ...]``.

        Keys are the columns concatenated in order (``P_0..P_{b-1}, N1_0..``) with labels
        ``arange(b)``; ``key_ids [m]`` turn on false-negative masking.
        """
        # Under autocast the loss's products run in autocast's dtype, as autocast runs the score
        # matmul of (Cached)MNRL: the pooled embeddings come out of the model in float32 and are
        # cast once here, before the keys are concatenated (the rule of every loss,
        # ds_infcl.ops.precision; measured on one H200 at 65,536 pairs, MiniLM, bf16 autocast:
        # 0.85 s of float32 loss kernels per step without it, the gap to CachedMNRL).
        embeddings = cast_for_autocast(*embeddings)
        query = embeddings[0]
        b = query.shape[0]
        for i, e in enumerate(embeddings[1:], start=1):
            if e.shape[0] != b:
                raise ValueError(f"column {i} has {e.shape[0]} rows, the anchor column has {b}")
        key = torch.cat(embeddings[1:])
        lab = torch.arange(b, device=query.device)
        if self.matryoshka_dims is not None:
            return matryoshka_retrieval_loss(
                query, key, self.scale, lab, matryoshka_dims=self.matryoshka_dims,
                matryoshka_weights=self.matryoshka_weights, normalize=self.similarity == "cos_sim",
                key_ids=key_ids, symmetric=self.symmetric, group=self._loss_group(), backend=self.backend,
                tile_size=self.tile_size,
            )
        return retrieval_loss(
            query, key, self.scale, lab, key_ids=key_ids, symmetric=self.symmetric,
            group=self._loss_group(), backend=self.backend, tile_size=self.tile_size,
        )

    def get_config_dict(self) -> Dict[str, Any]:
        return {
            "scale": self.scale,
            "similarity_fct": self.similarity,
            "mini_batch_size": self.mini_batch_size,
            "gather_across_devices": self.gather_across_devices,
            "symmetric": self.symmetric,
            "mask_false_negatives": self.mask_false_negatives,
            "matryoshka_dims": None if self.matryoshka_dims is None else list(self.matryoshka_dims),
            "matryoshka_weights": None if self.matryoshka_weights is None else list(self.matryoshka_weights),
        }

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def citation(self) -> str:
        return """
@article{cheng2024infcl,
    title={Breaking the Memory Barrier: Near Infinite Batch Size Scaling for Contrastive Loss},
    author={Cheng, Zesen and Zhang, Hang and Li, Kehan and others},
    journal={arXiv preprint arXiv:2410.17243},
    year={2024}
}
"""
