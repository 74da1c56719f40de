"""Named CLIP architectures, OpenCLIP style: look one up by name, or give a JSON file of your own.

An architecture is a small dict::

    {"embed_dim": 512,
     "vision": {"image_size": 224, "patch_size": 16, "width": 768, "layers": 12, "heads": 12},
     "text": {"context_length": 77, "width": 512, "layers": 12, "heads": 8},
     "image_mean": [...], "image_std": [...]}            # optional, default OpenAI CLIP's

``width`` is the hidden size, ``mlp_ratio`` (default 4) sets the MLP width, ``act`` the activation
(default ``quick_gelu``, as OpenAI's CLIP), ``vision.pool`` the image pooling (``cls``, default,
or ``mean`` of the patch tokens; see ``ClipModel``). They become ``transformers.CLIPVisionConfig`` and
``CLIPTextConfig`` (``to_hf_configs``); the text vocabulary size comes from the tokenizer.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict

__all__ = ["CLIP_ARCHITECTURES", "get_architecture", "to_hf_configs"]

_OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]


def _arch(embed_dim, image_size, patch_size, v_width, v_layers, v_heads, ctx, t_width, t_layers, t_heads,
          pool="cls", **extra):
    return {
        "embed_dim": embed_dim,
        "vision": {"image_size": image_size, "patch_size": patch_size, "width": v_width,
                   "layers": v_layers, "heads": v_heads, "pool": pool},
        "text": {"context_length": ctx, "width": t_width, "layers": t_layers, "heads": t_heads},
        **extra,
    }


CLIP_ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    # The built-in digits demo: 16x16 grey digits (replicated to RGB), 4x4 patches, short captions;
    # mean-pooled patch tokens (a from-scratch CLS output starts image-independent).
    "digits-tiny": _arch(64, 16, 4, 64, 2, 4, 16, 64, 2, 4, pool="mean",
                         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
    # Tests and smoke runs.
    "tiny": _arch(32, 32, 8, 32, 1, 2, 16, 32, 1, 2),
    "small": _arch(256, 64, 8, 256, 4, 4, 32, 256, 4, 4),
    # OpenCLIP / OpenAI sizes.
    "ViT-B-32": _arch(512, 224, 32, 768, 12, 12, 77, 512, 12, 8),
    "ViT-B-16": _arch(512, 224, 16, 768, 12, 12, 77, 512, 12, 8),
    "ViT-L-14": _arch(768, 224, 14, 1024, 24, 16, 77, 768, 12, 12),
}


def get_architecture(name_or_path: str) -> Dict[str, Any]:
    """A copy of the named architecture, or the content of a JSON file path.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name_or_path in CLIP_ARCHITECTURES:
        return copy.deepcopy(CLIP_ARCHITECTURES[name_or_path])
    if name_or_path.endswith(".json") and os.path.exists(name_or_path):
        with open(name_or_path) as f:
            arch = json.load(f)
        for key in ("embed_dim", "vision", "text"):
            if key not in arch:
                raise ValueError(f"architecture file {name_or_path!r} lacks {key!r}")
        return arch
    raise ValueError(
        f"unknown CLIP architecture {name_or_path!r}; choose one of {sorted(CLIP_ARCHITECTURES)} "
        f"or give a path to a JSON file"
    )


def to_hf_configs(arch: Dict[str, Any], *, vocab_size: int, pad_token_id: int, bos_token_id: int,
                  eos_token_id: int):
    """``(CLIPVisionConfig, CLIPTextConfig)`` of an architecture dict and the tokenizer's ids."""
    from transformers import CLIPTextConfig, CLIPVisionConfig

    v, t = arch["vision"], arch["text"]
    vision = CLIPVisionConfig(
        hidden_size=v["width"],
        intermediate_size=int(v["width"] * v.get("mlp_ratio", 4)),
        num_hidden_layers=v["layers"],
        num_attention_heads=v["heads"],
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        hidden_act=v.get("act", "quick_gelu"),
        projection_dim=arch["embed_dim"],
    )
    text = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=t["width"],
        intermediate_size=int(t["width"] * t.get("mlp_ratio", 4)),
        num_hidden_layers=t["layers"],
        num_attention_heads=t["heads"],
        max_position_embeddings=t["context_length"],
        hidden_act=t.get("act", "quick_gelu"),
        projection_dim=arch["embed_dim"],
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    return vision, text


def image_stats(arch: Dict[str, Any]):
    """``(mean, std)`` of the architecture's image normalization."""
    return list(arch.get("image_mean", _OPENAI_MEAN)), list(arch.get("image_std", _OPENAI_STD))
