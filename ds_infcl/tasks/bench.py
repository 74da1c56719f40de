"""``bench_clip``: a CLIP-sized task for throughput and maximum-batch benchmarks.

Towers are random-initialized ``transformers`` CLIP models built from configs (no download):
``vit-b-16`` is OpenCLIP's ViT-B/16 (image: 224 px, patch 16, width 768, 12 layers; text:
context 77, width 512, 12 layers; embedding 512), ``vit-l-14`` OpenCLIP's ViT-L/14 (image: patch 14, width
1024, 24 layers; text: width 768, 12 layers; embedding 768), ``tiny`` a few-kB version for CPU
smoke tests.

Inputs are generated *on the device from the global sample indices*: a batch on the host is just
``[b]`` int64 indices, and the towers turn a chunk's indices into pixels and token ids on the
device: token ids are an integer hash of (index, position), an image is one of ``NOISE_IMAGES``
fixed noise images chosen by its index (deterministic, so GradCache's replay sees the same inputs).
Nothing is read back to the host: a host read of an index (to seed a generator, as this task once
did) waits for the device once per chunk and tower, and the device then idles while the host
launches the next tower's kernels; the benchmark would charge that idle time to the training step.
Host memory therefore does not limit the batch: what is measured is the device memory of the
towers (one chunk at a time with GradCache), the features, and the loss.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator

import torch
from torch import nn

from ds_infcl.tasks.base import Batch, Task, register_task

__all__ = ["BenchClipTask", "ARCHS", "hashed_ints", "NOISE_IMAGES"]

NOISE_IMAGES = 97  # distinct generated images of bench_clip (prime, so index strides rarely repeat one)
_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64's odd constants, signed


def hashed_ints(index: torch.Tensor, n: int, high: int, salt: int = 0) -> torch.Tensor:
    """``[len(index), n]`` int64 in ``[0, high)``: a hash of ``(index, column, salt)`` computed on
    ``index``'s device (int64 arithmetic wraps; arithmetic shifts mix as well as logical ones here).
    Deterministic, no generator, no host read."""
    offset = (salt * _MIX[2]) % 2**64
    offset = offset - 2**64 if offset >= 2**63 else offset  # the int64 it wraps to
    x = index.long()[:, None] * n + torch.arange(n, device=index.device) + offset
    x = x * _MIX[0]
    x = (x ^ (x >> 30)) * _MIX[1]
    x = (x ^ (x >> 27)) * _MIX[2]
    return (x ^ (x >> 31)).remainder(high)

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
        self._noise_bank: Dict[Any, torch.Tensor] = {}

    def _noise(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[NOISE_IMAGES, 3, size, size]`` standard normal images, made once per device and dtype
        from a fixed seed (a plain attribute, not a buffer: no parameter, no checkpoint entry)."""
        key = (device, dtype)
        if key not in self._noise_bank:
            g = torch.Generator(device=device)
            g.manual_seed(20261127)
            shape = (NOISE_IMAGES, 3, self.image_size, self.image_size)
            self._noise_bank[key] = torch.randn(shape, generator=g, device=device).to(dtype)
        return self._noise_bank[key]

    def encode_query(self, index: torch.Tensor) -> torch.Tensor:
        dtype = next(self.vision.parameters()).dtype
        pixels = self._noise(index.device, dtype)[index.remainder(NOISE_IMAGES)]
        out = self.vision(pixel_values=pixels).image_embeds
        return nn.functional.normalize(out, dim=-1)

    def encode_key(self, index: torch.Tensor) -> torch.Tensor:
        ids = hashed_ints(index, self.context, self.vocab - 1, salt=1)
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
