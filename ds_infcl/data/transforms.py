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
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["ImageTransform", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "check_crop_scale"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def check_crop_scale(scale: Optional[Sequence[float]]) -> Optional[Tuple[float, float]]:
    """``(lo, hi)`` of a random-resized crop's area range, ``None`` for none.

    Raises:
        ValueError: not two numbers with ``0 < lo <= hi <= 1``.
    """
    if scale is None:
        return None
    try:
        lo, hi = (float(v) for v in scale)
    except (TypeError, ValueError):
        raise ValueError(f"random_crop_scale must be two numbers [lo, hi] (OpenCLIP: [0.9, 1.0]) or null, "
                         f"got {scale!r}") from None
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"random_crop_scale [lo, hi] needs 0 < lo <= hi <= 1 (fractions of the image's area), "
                         f"got {list(scale)}")
    return lo, hi


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
        self.random_crop_scale = check_crop_scale(random_crop_scale)
        self.rng = random.Random(seed)

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, image) -> torch.Tensor:
        from PIL import Image

        image = image.convert("RGB")
        size = self.image_size
        if self.train and self.random_crop_scale is not None:
            box = self.crop_box(*image.size)
            if box is not None:
                image = image.crop(box)
            image = image.resize((size, size), Image.BICUBIC)
        else:
            w, h = image.size
            scale = size / min(w, h)
            new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
            if (new_w, new_h) != (w, h):
                image = image.resize((new_w, new_h), Image.BICUBIC)
            left, top = (new_w - size) // 2, (new_h - size) // 2
            image = image.crop((left, top, left + size, top + size))
        return self.to_tensor(image)

    def to_tensor(self, image) -> torch.Tensor:
        """An RGB PIL image of the output size as the output tensor (``uint8`` or normalized)."""
        array = np.array(image, dtype=np.uint8, copy=True)
        if self.output == "uint8":
            return torch.from_numpy(array).permute(2, 0, 1).contiguous()
        tensor = torch.from_numpy(array).permute(2, 0, 1).to(torch.float32, memory_format=torch.contiguous_format)
        return tensor.mul_(self._scale).sub_(self._offset)

    def crop_box(self, width: int, height: int) -> Optional[Tuple[int, int, int, int]]:
        """The training crop of a ``width x height`` image: ``(left, top, right, bottom)`` in
        pixels, drawn from this transform's RNG (OpenCLIP's ``RandomResizedCrop``: area
        ``random_crop_scale`` of the image, aspect 3/4..4/3, 10 tries), or ``None`` when no try
        fits (the whole image is resized then). The GPU decode path draws its boxes here too, in
        the same order, so both paths crop the same regions."""
        lo, hi = self.random_crop_scale
        for _ in range(10):
            area = width * height * self.rng.uniform(lo, hi)
            aspect = math.exp(self.rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= width and 0 < ch <= height:
                left, top = self.rng.randint(0, width - cw), self.rng.randint(0, height - ch)
                return left, top, left + cw, top + ch
        return None

    def center_box(self, width: int, height: int) -> Tuple[float, float, float, float]:
        """The evaluation crop of a ``width x height`` image in its own pixels: the centred
        square of side ``min(width, height)`` (what resizing the shorter side to
        ``image_size`` and taking the centre crop keeps, up to rounding)."""
        side = min(width, height)
        left, top = (width - side) / 2, (height - side) / 2
        return left, top, left + side, top + side

    def __repr__(self) -> str:
        return (
            f"ImageTransform(image_size={self.image_size}, train={self.train}, "
            f"random_crop_scale={self.random_crop_scale}, output={self.output!r})"
        )
