"""Image preprocessing for the towers: PIL image -> normalized ``[3, H, W]`` float tensor, or the
resized ``uint8`` pixels for the towers to normalize on the device (a quarter of the host memory
and of the host-to-device traffic: a 32k batch of 224 px images is 4.9 GB in uint8, 19.7 GB in
float32).

The model's config holds ``image_size``, ``image_mean`` and ``image_std``; the task builds the
transform from them and hands it to the pipeline (the data package never imports a model).
"""

from __future__ import annotations

import math
import random
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["ImageTransform", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageTransform:
    """Resize, crop and normalize a PIL image, as CLIP's preprocessing does.

    Evaluation (``train=False``): resize the shorter side to ``image_size`` (bicubic) and take the
    center crop. Training with ``random_crop_scale=(lo, hi)``: a random-resized crop of ``lo..hi``
    of the area (aspect 3/4..4/3), as OpenCLIP's training transform; ``None`` trains on the
    evaluation transform.

    Args:
        image_size: output edge in pixels.
        mean, std: per-channel normalization (3 values each).
        train: use the random crop (needs ``random_crop_scale``).
        random_crop_scale: area range of the random-resized crop.
        seed: seed of the crop RNG (per process; pipelines reseed it per worker).
        output: ``"float32"`` (normalized) or ``"uint8"`` (pixels as they are after resize and
            crop; ``ClipModel`` normalizes ``uint8`` input on the device with the same mean/std).

    Call: ``transform(pil_image) -> tensor [3, image_size, image_size]`` of dtype ``output``.
    """

    def __init__(
        self,
        image_size: int,
        mean: Sequence[float] = OPENAI_CLIP_MEAN,
        std: Sequence[float] = OPENAI_CLIP_STD,
        *,
        train: bool = False,
        random_crop_scale: Optional[Sequence[float]] = None,
        seed: int = 0,
        output: str = "float32",
    ):
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need 3 values each, got {mean} and {std}")
        if output not in ("float32", "uint8"):
            raise ValueError(f"output must be 'float32' or 'uint8', got {output!r}")
        self.output = output
        self.image_size = int(image_size)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        # (x / 255 - mean) / std as one multiply-subtract on the uint8 values
        self._scale = 1.0 / (255.0 * self.std)
        self._offset = self.mean / self.std
        self.train = train
        self.random_crop_scale = tuple(random_crop_scale) if random_crop_scale else None
        self.rng = random.Random(seed)

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, image) -> torch.Tensor:
        from PIL import Image

        image = image.convert("RGB")
        size = self.image_size
        if self.train and self.random_crop_scale is not None:
            image = self._random_resized_crop(image).resize((size, size), Image.BICUBIC)
        else:
            w, h = image.size
            scale = size / min(w, h)
            new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
            if (new_w, new_h) != (w, h):
                image = image.resize((new_w, new_h), Image.BICUBIC)
            left, top = (new_w - size) // 2, (new_h - size) // 2
            image = image.crop((left, top, left + size, top + size))
        array = np.array(image, dtype=np.uint8, copy=True)
        if self.output == "uint8":
            return torch.from_numpy(array).permute(2, 0, 1).contiguous()
        tensor = torch.from_numpy(array).permute(2, 0, 1).to(torch.float32, memory_format=torch.contiguous_format)
        return tensor.mul_(self._scale).sub_(self._offset)

    def _random_resized_crop(self, image):
        w, h = image.size
        lo, hi = self.random_crop_scale
        for _ in range(10):
            area = w * h * self.rng.uniform(lo, hi)
            aspect = math.exp(self.rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                left, top = self.rng.randint(0, w - cw), self.rng.randint(0, h - ch)
                return image.crop((left, top, left + cw, top + ch))
        return image

    def __repr__(self) -> str:
        return (
            f"ImageTransform(image_size={self.image_size}, train={self.train}, "
            f"random_crop_scale={self.random_crop_scale}, output={self.output!r})"
        )
