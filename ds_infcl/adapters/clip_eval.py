"""CLIP evaluation: zero-shot classification and image-text retrieval recall@k.

The metrics are pure functions of embeddings (testable on hand-built vectors);
``evaluate_encoders`` (any two encoders) and ``evaluate_clip`` (a ``ClipModel``) run a model over
held-out batches and call them.

- Zero-shot: every class is described by prompts (templates x class names, e.g. "a handwritten
  {}" x ("7", "seven")); the class embedding is the renormalized mean of its unit-norm prompt
  embeddings (CLIP's prompt ensembling); an image's prediction is the class of highest cosine.
- Recall@k: image-to-text, the share of images with at least one positive text among the k
  most similar texts; text-to-image, the share of texts with a positive image among the top k.
  A tie with a negative counts against the positive (a constant model scores 0, not 1).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

__all__ = [
    "zero_shot_classifier",
    "build_zero_shot_classifier",
    "zero_shot_accuracy",
    "retrieval_recall",
    "evaluate_encoders",
    "evaluate_clip",
]

ClassNames = Sequence[Union[str, Sequence[str]]]


def zero_shot_classifier(prompt_features: Sequence[torch.Tensor]) -> torch.Tensor:
    """Class embeddings ``[C, d]`` from each class's prompt embeddings (``[P_c, d]`` each).

    Each prompt embedding is L2-normalized, the class's mean is taken and normalized again.
    """
    rows = [F.normalize(F.normalize(p.float(), dim=-1).mean(dim=0), dim=-1) for p in prompt_features]
    return torch.stack(rows)


def class_prompts(class_names: ClassNames, templates: Sequence[str]) -> List[List[str]]:
    """``[[template.format(name) for name in names_of_c for template in templates] for c]``.

    A class is named by one string or by several synonyms (all used).
    """
    prompts = []
    for names in class_names:
        names = [names] if isinstance(names, str) else list(names)
        prompts.append([t.format(n) for n in names for t in templates])
    return prompts


@torch.no_grad()
def build_zero_shot_classifier(
    encode_text: Callable[[List[str]], torch.Tensor], class_names: ClassNames, templates: Sequence[str]
) -> torch.Tensor:
    """``[C, d]`` classifier from a text encoder (``list[str] -> [n, d]``), names and templates."""
    if not templates or not class_names:
        raise ValueError("need at least one class name and one template")
    prompts = class_prompts(class_names, templates)
    flat = [p for ps in prompts for p in ps]
    features = encode_text(flat)
    per_class, start = [], 0
    for ps in prompts:
        per_class.append(features[start:start + len(ps)])
        start += len(ps)
    return zero_shot_classifier(per_class)


def zero_shot_accuracy(
    image_features: torch.Tensor, classifier: torch.Tensor, labels: torch.Tensor, topk: Sequence[int] = (1, 5)
) -> Dict[str, float]:
    """Top-k accuracy of cosine classification.

    Args:
        image_features: ``[n, d]`` (normalized here).
        classifier: ``[C, d]`` class embeddings.
        labels: ``[n]`` true class indices.
        topk: the k values; a k above ``C`` is reported as k = C (always 1.0).

    Returns: ``{"top1": float, "top5": float, ...}``.
    """
    if image_features.shape[0] != labels.shape[0]:
        raise ValueError(f"{image_features.shape[0]} images but {labels.shape[0]} labels")
    logits = F.normalize(image_features.float(), dim=-1) @ F.normalize(classifier.float(), dim=-1).T
    num_classes = classifier.shape[0]
    out = {}
    for k in topk:
        top = logits.topk(min(k, num_classes), dim=1).indices
        out[f"top{k}"] = (top == labels.view(-1, 1)).any(dim=1).float().mean().item()
    return out


def _first_positive_rank(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Per row: the number of negatives scoring at least as high as the best positive
    (``inf`` for a row without positives)."""
    best = scores.masked_fill(~positive, -math.inf).max(dim=1, keepdim=True).values
    ahead = ((scores >= best) & ~positive).sum(dim=1).float()
    return torch.where(positive.any(dim=1), ahead, torch.full_like(ahead, math.inf))


def retrieval_recall(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: Optional[torch.Tensor] = None,
    *,
    positives: Optional[torch.Tensor] = None,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 4096,
) -> Dict[str, float]:
    """Image-to-text and text-to-image recall@k.

    Args:
        image_features: ``[n, d]``.
        text_features: ``[m, d]``.
        text_to_image: ``[m]`` index of each text's image (default ``arange(m)``, one caption per
            image); ignored when ``positives`` is given.
        positives: ``[n, m]`` bool, which texts match which images (e.g. same class label).
        ks: the k values.
        chunk_size: rows of the similarity matrix held at once.

    Returns: ``{"image_to_text_R@1": ..., "text_to_image_R@1": ..., ...}`` in [0, 1].
    """
    img = F.normalize(image_features.float(), dim=-1)
    txt = F.normalize(text_features.float(), dim=-1)
    n, m = img.shape[0], txt.shape[0]
    if positives is None:
        if text_to_image is None:
            if n != m:
                raise ValueError(f"{n} images and {m} texts: give text_to_image or positives")
            text_to_image = torch.arange(m)
        text_to_image = text_to_image.to(torch.long)
        if text_to_image.shape != (m,) or (m and (text_to_image.min() < 0 or text_to_image.max() >= n)):
            raise ValueError(f"text_to_image must be [m={m}] indices in [0, {n})")
        positives = torch.zeros(n, m, dtype=torch.bool)
        positives[text_to_image, torch.arange(m)] = True
    if positives.shape != (n, m):
        raise ValueError(f"positives must be [{n}, {m}], got {list(positives.shape)}")
    positives = positives.to(torch.bool)
    i2t = torch.cat([
        _first_positive_rank(img[s:s + chunk_size] @ txt.T, positives[s:s + chunk_size])
        for s in range(0, n, chunk_size)
    ])
    t2i = torch.cat([
        _first_positive_rank(txt[s:s + chunk_size] @ img.T, positives[:, s:s + chunk_size].T)
        for s in range(0, m, chunk_size)
    ])
    out = {}
    for k in ks:
        out[f"image_to_text_R@{k}"] = (i2t < k).float().mean().item()
        out[f"text_to_image_R@{k}"] = (t2i < k).float().mean().item()
    return out


@torch.no_grad()
def evaluate_encoders(
    encode_image: Callable[[torch.Tensor], torch.Tensor],
    encode_text: Callable[[List[str]], torch.Tensor],
    batches: Iterable[Dict],
    *,
    class_names: Optional[ClassNames] = None,
    templates: Optional[Sequence[str]] = None,
    ks: Sequence[int] = (1, 5, 10),
) -> Dict[str, float]:
    """Zero-shot accuracy and recall@k of two encoders on held-out ``batches``.

    Args:
        encode_image: ``images [b, 3, H, W] -> features [b, d]``.
        encode_text: ``captions (list of str) -> features [n, d]``.
        batches: dicts with ``image`` ``[b, 3, H, W]`` and ``text`` (captions); ``label`` ``[b]``
            (class index, -1 unknown) enables zero-shot accuracy and label-level recall.
        class_names, templates: zero-shot prompts; zero-shot is skipped without them.
        ks: recall cut-offs.

    Returns: ``zero_shot_top1``/``zero_shot_top5`` (over images with a label), instance recall
    ``image_to_text_R@k``/``text_to_image_R@k`` (each image's own caption is its positive) and,
    with labels, ``label_image_to_text_R@k``/``label_text_to_image_R@k`` (any caption of the same
    class is a positive: the meaningful recall when captions only name the class), plus
    ``num_images``.
    """
    image_features, text_features, labels = [], [], []
    for batch in batches:
        image_features.append(encode_image(batch["image"]).float().cpu())
        text_features.append(encode_text(list(batch["text"])).float().cpu())
        labels.append(torch.as_tensor(batch.get("label", [-1] * len(batch["text"]))).cpu())
    if not image_features:
        raise ValueError("no evaluation batches")
    img, txt, lab = torch.cat(image_features), torch.cat(text_features), torch.cat(labels)
    metrics: Dict[str, float] = {"num_images": float(img.shape[0])}
    metrics.update(retrieval_recall(img, txt, ks=ks))
    known = lab >= 0
    if known.any():
        kl = lab[known]
        positives = kl.view(-1, 1) == kl.view(1, -1)
        label_recall = retrieval_recall(img[known], txt[known], positives=positives, ks=ks)
        metrics.update({f"label_{k}": v for k, v in label_recall.items()})
        if class_names is not None and templates is not None:
            classifier = build_zero_shot_classifier(
                lambda texts: encode_text(texts).float().cpu(), class_names, templates
            )
            acc = zero_shot_accuracy(img[known], classifier, kl, topk=(1, 5))
            metrics.update({f"zero_shot_{k}": v for k, v in acc.items()})
    return metrics


@torch.no_grad()
def evaluate_clip(
    model,
    batches: Iterable[Dict],
    tokenizer,
    *,
    class_names: Optional[ClassNames] = None,
    templates: Optional[Sequence[str]] = None,
    ks: Sequence[int] = (1, 5, 10),
    device: Union[str, torch.device] = "cpu",
) -> Dict[str, float]:
    """``evaluate_encoders`` with a ``ClipModel`` (in eval mode for the call) and its tokenizer."""
    was_training = model.training
    model.eval()

    def encode_text(texts: List[str]) -> torch.Tensor:
        t = tokenizer(texts)
        return model.encode_text(t["input_ids"].to(device), t["attention_mask"].to(device))

    try:
        return evaluate_encoders(
            lambda images: model.encode_image(images.to(device)), encode_text, batches,
            class_names=class_names, templates=templates, ks=ks,
        )
    finally:
        model.train(was_training)
