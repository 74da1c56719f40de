"""``bench_clip``: a CLIP-sized task for throughput and maximum-batch benchmarks.

Towers are random-initialized ``transformers`` CLIP models built from configs (no download):
``vit-b-16`` is OpenCLIP's ViT-B/16 (image: 224 px, patch 16, width 768, 12 layers; text:
context 77, width 512, 12 layers; embedding 512), ``vit-l-14`` OpenCLIP's ViT-L/14 (image: patch 14, width
1024, 24 layers; text: width 768, 12 layers; embedding 768), ``tiny`` a few-kB version for CPU
smoke tests.

Inputs are generated *on the device from the global sample indices*: a batch on the host is just
``[b]`` int64 indices, and the towers turn a chunk's indices into pixels and token ids with a
generator seeded by the first index (deterministic, so GradCache's replay sees the same inputs).
Host memory therefore does not limit the batch: what is measured is the device memory of the
towers (one chunk at a time with GradCache), the features, and the loss.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator

import torch
from torch import nn

from ds_infcl.tasks.base import Batch, Task, register_task

__all__ = ["BenchClipTask", "ARCHS"]

ARCHS: Dict[str, Dict[str, Any]] = {
    "vit-b-16": {
        "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=224, patch_size=16, projection_dim=512),
        "text": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                     max_position_embeddings=77, vocab_size=49408, projection_dim=512),
    },
    "vit-l-14": {
        "vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=224, patch_size=14, projection_dim=768),
        "text": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     max_position_embeddings=77, vocab_size=49408, projection_dim=768),
    },
    "tiny": {
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=32, patch_size=8, projection_dim=16),
        "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     max_position_embeddings=16, vocab_size=1000, projection_dim=16),
    },
}


class _GeneratedClipTowers(nn.Module):
    def __init__(self, arch: str, attn_implementation: str):
        super().__init__()
        from transformers import (
            CLIPTextConfig,
            CLIPTextModelWithProjection,
            CLIPVisionConfig,
            CLIPVisionModelWithProjection,
        )

        spec = ARCHS[arch]
        vcfg = CLIPVisionConfig(**spec["vision"])
        tcfg = CLIPTextConfig(**spec["text"], eos_token_id=spec["text"]["vocab_size"] - 1)
        for c in (vcfg, tcfg):
            c._attn_implementation = attn_implementation
        self.vision = CLIPVisionModelWithProjection(vcfg)
        self.text = CLIPTextModelWithProjection(tcfg)
        self.image_size = vcfg.image_size
        self.context = tcfg.max_position_embeddings
        self.vocab = tcfg.vocab_size

    def _generator(self, index: torch.Tensor, device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(int(index[0]) * 2654435761 % (2**61))
        return g

    def encode_query(self, index: torch.Tensor) -> torch.Tensor:
        dtype = next(self.vision.parameters()).dtype
        g = self._generator(index, index.device)
        pixels = torch.randn(len(index), 3, self.image_size, self.image_size, generator=g, device=index.device)
        out = self.vision(pixel_values=pixels.to(dtype)).image_embeds
        return nn.functional.normalize(out, dim=-1)

    def encode_key(self, index: torch.Tensor) -> torch.Tensor:
        g = self._generator(index + 1, index.device)
        ids = torch.randint(0, self.vocab - 1, (len(index), self.context), generator=g, device=index.device)
        ids[:, -1] = self.vocab - 1  # EOS last: the pooled token
        out = self.text(input_ids=ids).text_embeds
        return nn.functional.normalize(out, dim=-1)


class BenchClipTask(Task):
    """Random-init CLIP towers on generated inputs (see the module docstring).

    Args:
        arch: ``"vit-b-16"``, ``"vit-l-14"`` or ``"tiny"``.
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
    """

    name = "bench_clip"

    def __init__(self, arch: str = "vit-b-16", attn_implementation: str = "sdpa"):
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
        self.arch = arch
        self.attn_implementation = attn_implementation

    def build_towers(self) -> nn.Module:
        return _GeneratedClipTowers(self.arch, self.attn_implementation)

    def loss_defaults(self) -> Dict[str, Any]:
        return {"symmetric": True, "init_logit_scale": math.log(1 / 0.07), "learnable_scale": True}

    def batches(self, *, rank, world_size, local_batch_size, start_step, seed) -> Iterator[Batch]:
        step = start_step
        while True:
            start = step * local_batch_size * world_size + rank * local_batch_size
            index = torch.arange(start, start + local_batch_size, dtype=torch.long)
            yield Batch(query_inputs=index, key_inputs=index, sample_index=index)
            step += 1


@register_task("bench_clip")
def _bench_clip(**kwargs) -> Task:
    return BenchClipTask(**kwargs)
