"""Saving trained retrieval encoders as folders that ``SentenceTransformer(path)`` loads, with a
model card naming the loss and the batch (``RetrievalEncoders.save`` calls ``save_encoders``)."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

__all__ = ["save_encoders", "model_card"]


def save_encoders(encoders, path: str, *, loss_name: str = "ds_infcl RetrievalLoss",
                  batch_size: Optional[int] = None, extra: Optional[Dict[str, object]] = None) -> List[str]:
    """Write ``encoders``' sentence-transformers folder(s) (see ``RetrievalEncoders.save``)."""
    info = {"loss": loss_name, "global_batch_size": batch_size, "query_prefix": encoders.query_prefix,
            "document_prefix": encoders.document_prefix, **(extra or {})}
    targets = [(path, encoders.query_model)] if not encoders.separate else [
        (os.path.join(path, "query"), encoders.query_model), (os.path.join(path, "document"), encoders.document_model)]
    written = []
    for target, model in targets:
        os.makedirs(target, exist_ok=True)
        prompts = {}
        if encoders.query_prefix:
            prompts["query"] = encoders.query_prefix
        if encoders.document_prefix:
            prompts["document"] = encoders.document_prefix
        model.prompts = prompts
        model.save(target)
        with open(os.path.join(target, "ds_infcl_training.json"), "w") as f:
            json.dump(info, f, indent=1)
        with open(os.path.join(target, "README.md"), "w") as f:
            f.write(model_card(info, model, encoders.separate, target))
        written.append(target)
    return written


def model_card(info: Dict[str, object], model, separate: bool, target: str) -> str:
    """The README.md of an exported folder: loss, batch, dimension, prefixes, usage."""
    from ds_infcl.adapters.retrieval import _embedding_dim

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
