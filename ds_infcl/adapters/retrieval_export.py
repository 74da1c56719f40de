"""Saving trained retrieval encoders as folders that ``SentenceTransformer(path)`` loads, with a
model card naming the loss and the batch (``RetrievalEncoders.save`` calls ``save_encoders``).

LoRA towers (``RetrievalEncoders(lora=...)``) are saved twice in each folder: the transformer with
the adapters merged into its weights (a plain ``transformers`` model, so the folder loads with
``SentenceTransformer(path)`` and no peft), and the adapter alone in ``adapter/``
(``peft.PeftModel.from_pretrained(base_model, path + "/adapter")``).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Dict, List, Optional

import torch

__all__ = ["save_encoders", "model_card", "merged_state_dict", "save_merged", "st_embedding_dim", "ADAPTER_FOLDER"]

ADAPTER_FOLDER = "adapter"


def st_embedding_dim(model) -> int:
    """The embedding dimension of a sentence-transformers model or module (its
    ``get_embedding_dimension`` or, in older releases, ``get_sentence_embedding_dimension`` /
    ``get_word_embedding_dimension``). ``ds_infcl.adapters.retrieval`` imports it from here."""
    for name in ("get_embedding_dimension", "get_sentence_embedding_dimension", "get_word_embedding_dimension"):
        if hasattr(model, name):
            return getattr(model, name)()
    raise ValueError(f"cannot tell the embedding dimension of {type(model).__name__}")


def _is_lora(model) -> bool:
    """Whether ``model``'s transformer is wrapped by peft."""
    return len(model) > 0 and hasattr(getattr(model[0], "model", None), "peft_config")


def save_encoders(encoders, path: str, *, loss_name: str = "ds_infcl RetrievalLoss",
                  batch_size: Optional[int] = None, extra: Optional[Dict[str, object]] = None) -> List[str]:
    """Write ``encoders``' sentence-transformers folder(s) (see ``RetrievalEncoders.save``)."""
    info = {"loss": loss_name, "global_batch_size": batch_size, "query_prefix": encoders.query_prefix,
            "document_prefix": encoders.document_prefix}
    for key in ("query_template", "document_template", "task_description", "lora"):
        if getattr(encoders, key, None) is not None:
            info[key] = getattr(encoders, key)
    if getattr(encoders, "append_eos", False):
        info["append_eos"] = True  # the saved tokenizer appends it
    if getattr(encoders, "lora", None) is not None:
        info["adapter"] = f"{ADAPTER_FOLDER}/ (peft.PeftModel.from_pretrained(base_model, <folder>/{ADAPTER_FOLDER}))"
    info.update(extra or {})
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
        if _is_lora(model):
            save_merged(model, target)
            model[0].model.save_pretrained(os.path.join(target, ADAPTER_FOLDER))
        else:
            model.save(target)
        with open(os.path.join(target, "ds_infcl_training.json"), "w") as f:
            json.dump(info, f, indent=1)
        with open(os.path.join(target, "README.md"), "w") as f:
            f.write(model_card(info, model, encoders.separate, target))
        written.append(target)
    return written


def merged_state_dict(peft_model) -> Dict[str, torch.Tensor]:
    """The state dict of ``peft_model``'s base model with every active LoRA adapter merged in.

    Keys are the plain model's (``...q_proj.weight``, not ``...q_proj.base_layer.weight``; no
    ``lora_*`` entries). A merged weight is ``W + delta`` with peft's own delta
    (``get_delta_weight``: ``alpha / r * B @ A`` for a linear layer), summed in float32 and
    stored in ``W``'s dtype. Nothing in ``peft_model`` changes; the extra memory is one copy of
    the adapted weights only.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    merged: Dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if module.merged:
            raise ValueError(f"{name}: the adapter is already merged into the weights (peft merge_adapter); "
                             "unmerge it (unmerge_adapter()) before saving")
        weight = module.get_base_layer().weight
        total = weight.detach().float()
        for adapter in module.active_adapters:
            if adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {}):
                total = total + module.get_delta_weight(adapter).detach().float()
        merged[f"{name}.weight"] = total.to(weight.dtype)
    out: Dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        parts = key.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        clean = ".".join(part for part in parts if part != "base_layer")
        out[clean] = merged.get(clean, value)
    missing = sorted(set(merged) - set(out))
    if missing:
        raise ValueError(f"merged LoRA weights {missing[:3]} have no place in the base model's state dict")
    return out


def save_merged(model, target: str) -> None:
    """Save the sentence-transformers ``model`` whose transformer is a peft LoRA model as a plain
    sentence-transformers folder with the adapters merged (``merged_state_dict``)."""
    transformer = model[0]
    peft_model = transformer.model
    base = peft_model.get_base_model()
    state = merged_state_dict(peft_model)
    # The Transformer module saves its model with model.save_pretrained(folder): for the time of the
    # save it holds the unwrapped base model, whose save_pretrained writes the merged tensors.
    transformer.model = base
    base.save_pretrained = functools.partial(type(base).save_pretrained, base, state_dict=state)
    try:
        model.save(target)
    finally:
        del base.save_pretrained
        transformer.model = peft_model


def model_card(info: Dict[str, object], model, separate: bool, target: str) -> str:
    """The README.md of an exported folder: loss, batch, dimension, prefixes, usage."""
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
        f"- Embedding dimension: {st_embedding_dim(model)}",
        f"- Query prefix: {info['query_prefix']!r}; document prefix: {info['document_prefix']!r}",
    ]
    for k, v in info.items():
        if k not in ("loss", "global_batch_size", "query_prefix", "document_prefix"):
            lines.append(f"- {k}: {v!r}" if isinstance(v, str) and "\n" in v else f"- {k}: {v}")
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
