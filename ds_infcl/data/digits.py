"""The built-in data set: scikit-learn's 1,797 handwritten digits as image + caption shards.

The 8x8 images (16 grey levels) are scaled to 0..255, upsampled to ``image_size`` pixels and
encoded as PNG. A fixed, class-stratified split (seeded) keeps ``heldout_fraction`` of every class
out of training. Each image gets one caption drawn from ``CAPTION_TEMPLATES``, naming the digit as
a numeral or a word ("a handwritten 7", "the digit seven", "a photo of the number 7", ...). The
global sample index is the image's row in ``sklearn.datasets.load_digits`` (0..1796).

Zero-shot evaluation asks the model for the class of a held-out image by comparing it with the
prompts ``ZERO_SHOT_TEMPLATES`` x ``CLASS_NAMES`` (numeral and word of each digit, averaged).

Command line::

    python -m ds_infcl.data.digits --out data/digits

writes ``train-{000000..000007}.tar``, ``heldout-000000.tar``, their manifests ``train.json``,
``heldout.json`` and ``digits.json`` (class names, templates, split sizes).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
from typing import Any, Dict, List

import numpy as np

from ds_infcl.data.shards import write_image_text_shards

__all__ = [
    "CLASS_NAMES",
    "CAPTION_TEMPLATES",
    "ZERO_SHOT_TEMPLATES",
    "digits_records",
    "write_digits_shards",
    "read_digits_info",
]

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Each class is named by its numeral and its word; zero-shot prompts average over both.
CLASS_NAMES: List[List[str]] = [[str(d), w] for d, w in enumerate(NUMBER_WORDS)]

# {n}: the numeral, {w}: the word.
CAPTION_TEMPLATES = (
    "a handwritten {n}",
    "a handwritten {w}",
    "the digit {w}",
    "the digit {n}",
    "a photo of the number {n}",
    "a photo of the number {w}",
    "a scan of a handwritten {w}",
    "a small grey image of a {n}",
    "the number {w}, written by hand",
    "a drawing of the digit {n}",
    "someone wrote a {w}",
    "a blurry {n}",
    "{w}",
    "{n}",
)
# Zero-shot prompts: "{}" takes each class name (numeral and word).
ZERO_SHOT_TEMPLATES = ("a handwritten {}", "the digit {}", "a photo of the number {}")


def _encode_png(pixels: np.ndarray, image_size: int) -> bytes:
    from PIL import Image

    image = Image.fromarray(pixels, mode="L")
    if image_size != pixels.shape[0]:
        image = image.resize((image_size, image_size), Image.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _split(targets: np.ndarray, heldout_fraction: float, seed: int):
    """Class-stratified split: ``round(fraction * n_c)`` held-out images per class."""
    rng = np.random.default_rng(seed)
    heldout = []
    for c in np.unique(targets):
        members = np.flatnonzero(targets == c)
        k = int(round(heldout_fraction * len(members)))
        heldout.extend(rng.choice(members, size=k, replace=False).tolist())
    is_heldout = np.zeros(len(targets), dtype=bool)
    is_heldout[heldout] = True
    return np.flatnonzero(~is_heldout), np.flatnonzero(is_heldout)


def digits_records(
    indices, images: np.ndarray, targets: np.ndarray, *, image_size: int, seed: int, split: str
):
    """Shard records of the given rows: PNG bytes, a caption, ``idx``, ``label``, ``split``."""
    rng = random.Random(f"{seed}:captions:{split}")
    for i in indices:
        label = int(targets[i])
        pixels = np.clip(images[i] * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
        template = rng.choice(CAPTION_TEMPLATES)
        caption = template.format(n=label, w=NUMBER_WORDS[label])
        yield {
            "idx": int(i),
            "image": _encode_png(pixels, image_size),
            "ext": "png",
            "caption": caption,
            "label": label,
            "split": split,
        }


def write_digits_shards(
    out_dir: str,
    *,
    image_size: int = 32,
    heldout_fraction: float = 0.2,
    num_train_shards: int = 8,
    seed: int = 0,
) -> Dict[str, Any]:
    """Write the digits shards into ``out_dir`` and return ``digits.json``'s content.

    Args:
        out_dir: output folder (created).
        image_size: PNG edge in pixels (the 8x8 originals are upsampled bilinearly).
        heldout_fraction: share of each class held out of training.
        num_train_shards: the training images are spread evenly over this many shards (enough
            for ranks x workers readers with ``split="shard"``).
        seed: seed of the split and of the caption choice.

    Returns:
        ``{"train": manifest, "heldout": manifest, "class_names", "zero_shot_templates",
        "caption_templates", "image_size", "seed"}`` with absolute ``urls`` in each manifest.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, targets = digits.images, digits.target
    train_idx, heldout_idx = _split(targets, heldout_fraction, seed)
    per_shard = -(-len(train_idx) // num_train_shards)
    common = dict(image_size=image_size, seed=seed)
    train = write_image_text_shards(
        digits_records(train_idx, images, targets, split="train", **common), out_dir,
        prefix="train", samples_per_shard=per_shard, mtime=0,
    )
    heldout = write_image_text_shards(
        digits_records(heldout_idx, images, targets, split="heldout", **common), out_dir,
        prefix="heldout", samples_per_shard=len(heldout_idx), mtime=0,
    )
    info = {
        "train": train,
        "heldout": heldout,
        "class_names": CLASS_NAMES,
        "zero_shot_templates": list(ZERO_SHOT_TEMPLATES),
        "caption_templates": list(CAPTION_TEMPLATES),
        "image_size": image_size,
        "heldout_fraction": heldout_fraction,
        "seed": seed,
    }
    with open(os.path.join(out_dir, "digits.json"), "w") as f:
        json.dump(info, f, indent=1)
    root = os.path.abspath(out_dir)
    for part in ("train", "heldout"):
        info[part]["urls"] = os.path.join(root, info[part]["pattern"])
    return info


def read_digits_info(out_dir: str) -> Dict[str, Any]:
    """``digits.json`` of a folder written by ``write_digits_shards``, with absolute ``urls``."""
    path = os.path.join(out_dir, "digits.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: write the shards first (python -m ds_infcl.data.digits --out {out_dir})"
        )
    with open(path) as f:
        info = json.load(f)
    root = os.path.abspath(out_dir)
    for part in ("train", "heldout"):
        info[part]["urls"] = os.path.join(root, info[part]["pattern"])
    return info


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--num-train-shards", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = write_digits_shards(
        args.out, image_size=args.image_size, heldout_fraction=args.heldout_fraction,
        num_train_shards=args.num_train_shards, seed=args.seed,
    )
    print(
        f"wrote {info['train']['num_samples']} training samples ({info['train']['urls']}) and "
        f"{info['heldout']['num_samples']} held-out samples ({info['heldout']['urls']})"
    )


if __name__ == "__main__":
    main()
