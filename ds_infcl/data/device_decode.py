"""JPEG decoding on the GPU (the clip task's ``decode: "gpu"``): loader workers read only the
JPEG headers and draw the crop boxes; the main process decodes a whole batch on the device with
``torchvision.io.decode_jpeg(list, device="cuda")`` (nvjpeg, batched) and crops and resizes it
with torch ops to the ``uint8 [n, 3, S, S]`` pixels ``ClipModel`` normalizes on the device.

Why: at 2,000 samples/s per GPU a PIL decode + bicubic resize costs roughly one core per few
hundred images/s; the GPU does the same work in a fraction of the step, and the workers only move
~20 KB of bytes per image instead of 150 KB of pixels (a 16k batch is ~0.3 GB instead of 2.5 GB
in shared memory).

Stream of one rank::

    workers: ImageTextShards(image_transform=EncodedImages(transform))
        header (PIL, no decode) -> crop box from the transform's seeded RNG (same draws as the CPU path)
        non-JPEG images, or JPEGs without their end marker: decoded here with PIL (the CPU path)
        batch["image"] = packed bytes + offsets + boxes (+ the images decoded here)
    main process: Rebatch(raw batches, batch_size, tally, decoder=JpegBatchDecoder(device))
        decode_jpeg(list, device) in sub-batches  ->  crop_resize (grouped by decoded size)
        a batch that fails as a whole: each image again alone; one that fails alone: PIL on the
        CPU; one PIL cannot decode either: skipped and counted as ``bad_image`` (the CPU path's
        criterion and reason), the batch refilled from the next one
    ThreadedPrefetch: the next batch decoded in a background thread on a side stream while the
        current one trains (``ds_infcl.data.rebatch``)

Resampling differs from the CPU path's PIL bicubic: bilinear (``grid_sample``) after an integer
box prefilter (``avg_pool2d``) when the crop is at least twice the output; the crop regions are
the same. Nothing here imports torchvision at module level (it is not installed on CPU CI).
"""

from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ds_infcl.data.transforms import ImageTransform

__all__ = [
    "EncodedImages",
    "JpegBatchDecoder",
    "crop_resize",
    "gpu_decode_problem",
    "torchvision_decode_jpeg",
]

JPEG_START = b"\xff\xd8"
JPEG_END = b"\xff\xd9"


def gpu_decode_problem() -> Optional[str]:
    """Why JPEGs cannot be decoded on the GPU here (``None`` when they can): torchvision with
    ``torchvision.io.decode_jpeg`` must import and CUDA must be available."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as exn:  # noqa: BLE001 -- any failure to import torchvision means no GPU decode
        return f"torchvision.io.decode_jpeg does not import ({type(exn).__name__}: {exn})"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    return None


class EncodedImages:
    """The workers' side of GPU decoding: an ``image_transform`` for ``ImageTextShards`` that
    passes JPEG bytes with their crop box instead of pixels.

    ``prepare(data)`` reads the header only (PIL ``Image.open`` without ``load``) and draws the
    crop box from ``transform`` (``crop_box`` in training, ``center_box`` otherwise): the same
    RNG, the same draws in the same order as the CPU path for the same stream. Images that are
    not baseline-decodable JPEGs on the device (PNG/WebP, CMYK, no end-of-image marker, which a
    truncated file lacks) are decoded here with the CPU path's transform. A header PIL cannot
    read raises (the dataset counts ``bad_image``).

    Args:
        transform: the CPU path's ``ImageTransform`` with ``output="uint8"``.
    """

    wants_bytes = True

    def __init__(self, transform: ImageTransform):
        if transform.output != "uint8":
            raise ValueError(f"GPU decoding yields uint8 pixels; the transform's output is {transform.output!r}")
        self.transform = transform
        self.image_size = transform.image_size

    def reseed(self, seed: int) -> None:
        self.transform.reseed(seed)

    def prepare(self, data: bytes):
        """``(bytes, box)`` for a JPEG to decode on the device, else a ``uint8 [3, S, S]`` tensor."""
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        width, height = image.size
        device_ok = (image.format == "JPEG" and image.mode in ("RGB", "L") and data[:2] == JPEG_START
                     and JPEG_END in data[-16:])
        if not device_ok:
            image.load()
            return self.transform(image)
        if self.transform.train and self.transform.random_crop_scale is not None:
            box = self.transform.crop_box(width, height)
            if box is None:
                box = (0, 0, width, height)
        else:
            box = self.transform.center_box(width, height)
        return data, box

    def collate(self, items: Sequence[Any]) -> Dict[str, torch.Tensor]:
        """The batch's images packed for the main process (few tensors: each tensor a worker
        sends costs a shared-memory file):

        ``jpeg`` uint8 [total bytes], ``offsets`` int64 [n + 1] (image i is
        ``jpeg[offsets[i]:offsets[i+1]]``, empty where decoded here), ``box`` float32 [n, 4]
        (left, top, right, bottom in the image's pixels), ``decoded`` uint8 [k, 3, S, S] and
        ``decoded_at`` int64 [k] (positions of the images decoded in the worker).
        """
        chunks: List[bytes] = []
        offsets = [0]
        boxes = torch.zeros(len(items), 4, dtype=torch.float32)
        decoded, decoded_at = [], []
        for i, item in enumerate(items):
            if torch.is_tensor(item):
                decoded.append(item)
                decoded_at.append(i)
                offsets.append(offsets[-1])
            else:
                data, box = item
                chunks.append(data)
                offsets.append(offsets[-1] + len(data))
                boxes[i] = torch.tensor(box, dtype=torch.float32)
        s = self.image_size
        return {
            "jpeg": torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8) if chunks
            else torch.zeros(0, dtype=torch.uint8),
            "offsets": torch.tensor(offsets, dtype=torch.long),
            "box": boxes,
            "decoded": torch.stack(decoded) if decoded else torch.zeros(0, 3, s, s, dtype=torch.uint8),
            "decoded_at": torch.tensor(decoded_at, dtype=torch.long),
        }


def crop_resize(images: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Crop each image to its box and resize it to ``size x size``, batched (one
    ``grid_sample``): bilinear, sampling at the output pixels' centres, edges clamped; when every
    crop is at least twice the output, first an ``avg_pool2d`` by that integer factor (a box
    filter against aliasing, as PIL's reducing resize).

    Args:
        images: ``uint8 [g, C, H, W]`` of one size (any device).
        boxes: ``[g, 4]`` (left, top, right, bottom) in pixels, ``right > left``, ``bottom > top``.
        size: output edge.

    Returns:
        ``uint8 [g, C, size, size]`` on the images' device.
    """
    if images.dim() != 4 or boxes.shape != (images.shape[0], 4):
        raise ValueError(f"crop_resize needs images [g, C, H, W] and boxes [g, 4], got {tuple(images.shape)} "
                         f"and {tuple(boxes.shape)}")
    g, _, height, width = images.shape
    if g == 0:
        return images.new_zeros(0, images.shape[1], size, size)
    boxes = boxes.to(dtype=torch.float32)
    side = torch.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    factor = int(float(side.min()) // size)  # boxes come from the host: no device synchronization
    boxes = boxes.to(device=images.device)
    x = images.float()
    if factor >= 2:
        x = F.avg_pool2d(x, factor, ceil_mode=True)
        boxes = boxes / factor
        height, width = x.shape[-2:]
    left, top, right, bottom = boxes.unbind(1)
    theta = torch.zeros(g, 2, 3, device=images.device, dtype=torch.float32)
    # output pixel j samples x = left + (j + 0.5) * (right - left) / size, in grid_sample's [-1, 1]
    theta[:, 0, 0] = (right - left) / width
    theta[:, 0, 2] = (left + right) / width - 1
    theta[:, 1, 1] = (bottom - top) / height
    theta[:, 1, 2] = (top + bottom) / height - 1
    grid = F.affine_grid(theta, [g, x.shape[1], size, size], align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def torchvision_decode_jpeg(device: torch.device) -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    """``decode(list of uint8 byte tensors) -> list of uint8 [3, H, W]`` on ``device`` through
    ``torchvision.io.decode_jpeg`` (RGB, batched on CUDA); raises for the whole list on any bad
    image (torchvision returns no partial result)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(datas: List[torch.Tensor]) -> List[torch.Tensor]:
        out = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return decode


class JpegBatchDecoder:
    """Decodes the packed images of one worker batch (``EncodedImages.collate``) on ``device``.

    Args:
        image_size: output edge ``S``.
        device: where the pixels go (``cuda`` for nvjpeg).
        decode: ``list of byte tensors -> list of uint8 [3, H, W] on device``, raising when any
            fails; default ``torchvision_decode_jpeg(device)`` (tests pass a PIL decoder on CPU).
        decode_batch: images per ``decode`` call (bounds the decoded full-size images held).

    Call: ``decoder(packed) -> (images uint8 [n, 3, S, S] on device, ok bool [n], failures)``:
    ``ok[i]`` is False for an image neither the device nor PIL could decode (its pixels are
    zeros), ``failures`` lists their errors.
    """

    def __init__(self, image_size: int, device, *, decode: Optional[Callable] = None, decode_batch: int = 1024):
        if decode_batch < 1:
            raise ValueError(f"decode_batch must be >= 1, got {decode_batch}")
        self.image_size = int(image_size)
        self.device = torch.device(device)
        self.decode = decode if decode is not None else torchvision_decode_jpeg(self.device)
        self.decode_batch = decode_batch
        self.images_decoded_on_device = 0
        self.images_decoded_on_cpu = 0

    def _decode_all(self, datas: List[torch.Tensor]) -> List[Any]:
        """Decoded image or the exception, per input: the batch at once, else one by one."""
        try:
            return list(self.decode(datas))
        except Exception:  # noqa: BLE001 -- one bad image fails the whole batched call
            pass
        out: List[Any] = []
        for d in datas:
            try:
                out.append(self.decode([d])[0])
            except Exception as exn:  # noqa: BLE001 -- decoders raise many types on corrupt data
                out.append(exn)
        return out

    def _decode_on_cpu(self, data: torch.Tensor, box: Sequence[float]) -> torch.Tensor:
        """PIL's decode of one image the device decoder refused, cropped and resized the same
        way (raises when PIL cannot decode it either)."""
        from PIL import Image

        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
            img.load()
            pixels = torch.from_numpy(np.array(img.convert("RGB"), copy=True)).permute(2, 0, 1)
        return crop_resize(pixels[None], torch.tensor([list(box)]), self.image_size)[0]

    def __call__(self, packed: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, List[str]]:
        offsets, boxes, s = packed["offsets"], packed["box"], self.image_size
        n = offsets.numel() - 1
        out = torch.zeros(n, 3, s, s, dtype=torch.uint8, device=self.device)
        ok = torch.ones(n, dtype=torch.bool)
        failures: List[str] = []
        if packed["decoded_at"].numel():
            out[packed["decoded_at"].to(self.device)] = packed["decoded"].to(self.device, non_blocking=True)
        lengths = offsets[1:] - offsets[:-1]
        todo = torch.nonzero(lengths > 0).flatten().tolist()
        bounds = offsets.tolist()
        jpeg = packed["jpeg"]
        for start in range(0, len(todo), self.decode_batch):
            sub = todo[start:start + self.decode_batch]
            datas = [jpeg[bounds[i]:bounds[i + 1]] for i in sub]
            results = self._decode_all(datas)
            groups: Dict[Tuple[int, ...], List[int]] = {}
            for j, (i, result) in enumerate(zip(sub, results)):
                if torch.is_tensor(result):
                    groups.setdefault(tuple(result.shape), []).append(j)
                    continue
                try:
                    out[i] = self._decode_on_cpu(datas[j], boxes[i].tolist()).to(self.device)
                    self.images_decoded_on_cpu += 1
                except Exception as exn:  # noqa: BLE001 -- PIL raises many types on corrupt data
                    ok[i] = False
                    failures.append(f"image {i}: device: {result!r}; PIL: {exn!r}")
            for members in groups.values():
                rows = [sub[j] for j in members]
                stacked = torch.stack([results[j] for j in members])
                index = torch.tensor(rows, dtype=torch.long)
                out[index.to(self.device)] = crop_resize(stacked, boxes[index], s)
                self.images_decoded_on_device += len(rows)
        return out, ok, failures
