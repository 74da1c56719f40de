"""Generated image + caption shards of any size, for throughput runs and smoke tests.

Each sample is a coloured shape on a noisy background, drawn from its global index alone (so any
shard can be regenerated, in any order, on any machine), encoded as JPEG like web-crawled data,
with a caption naming colour and shape ("a red circle", "a photo of a blue square", ...). The
``colour x shape`` pairs are the classes, so the data is learnable and zero-shot evaluation works.

Command line::

    python -m ds_infcl.data.synthetic --out /data/synth --num-train 200000 --num-heldout 2000 \\
        --image-size 224 --samples-per-shard 5000 --workers 16

writes ``train-*.tar``, ``heldout-*.tar``, their manifests and ``zero_shot.json`` (class names and
templates; ``ClipTask`` reads it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from multiprocessing import Pool
from typing import Any, Dict, List

import numpy as np

from ds_infcl.data.shards import brace_pattern, write_image_text_shards

__all__ = ["COLOURS", "SHAPES", "synthetic_record", "write_synthetic_shards"]

COLOURS = {
    "red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (235, 215, 40),
    "purple": (140, 50, 170), "orange": (245, 140, 20), "white": (245, 245, 245), "black": (15, 15, 15),
}
SHAPES = ("square", "circle", "triangle", "stripe")
CAPTION_TEMPLATES = ("a {c} {s}", "a photo of a {c} {s}", "a {s} in {c}", "one {c} {s} on a noisy background")
ZERO_SHOT_TEMPLATES = ("a {}", "a photo of a {}")


def _mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    cy, cx = rng.uniform(0.3, 0.7, size=2)
    r = rng.uniform(0.15, 0.3)
    if shape == "square":
        return (np.abs(yy - cy) < r) & (np.abs(xx - cx) < r)
    if shape == "circle":
        return (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
    if shape == "triangle":
        return (yy > cy - r) & (yy < cy + r) & (np.abs(xx - cx) < (yy - (cy - r)) / 2)
    return np.abs(np.sin((xx + yy) * np.pi * rng.uniform(3, 6))) > 0.7  # stripes


def synthetic_record(idx: int, *, image_size: int, seed: int = 0) -> Dict[str, Any]:
    """The sample of global index ``idx``: ``{"idx", "image" (JPEG bytes), "ext", "caption", "label"}``."""
    from PIL import Image

    rng = np.random.default_rng([seed, idx])
    num_colours = len(COLOURS)
    label = int(rng.integers(num_colours * len(SHAPES)))
    colour = list(COLOURS)[label % num_colours]
    shape = SHAPES[label // num_colours]
    image = rng.integers(60, 160, size=(image_size, image_size, 3)).astype(np.uint8)
    image[_mask(shape, image_size, rng)] = COLOURS[colour]
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=90)
    caption = CAPTION_TEMPLATES[int(rng.integers(len(CAPTION_TEMPLATES)))].format(c=colour, s=shape)
    return {"idx": idx, "image": buf.getvalue(), "ext": "jpg", "caption": caption, "label": label}


def _write_one(job) -> int:
    out_dir, prefix, shard, start, stop, image_size, seed = job
    records = (synthetic_record(i, image_size=image_size, seed=seed) for i in range(start, stop))
    # one shard per call: write it under its final name
    tmp_prefix = f".{prefix}-part{shard:06d}"
    write_image_text_shards(records, out_dir, prefix=tmp_prefix, samples_per_shard=stop - start, mtime=0)
    os.replace(os.path.join(out_dir, f"{tmp_prefix}-000000.tar"), os.path.join(out_dir, f"{prefix}-{shard:06d}.tar"))
    os.remove(os.path.join(out_dir, f"{tmp_prefix}.json"))
    return stop - start


def _write_split(out_dir, prefix, start, num, samples_per_shard, image_size, seed, workers) -> Dict[str, Any]:
    jobs = []
    for shard, s in enumerate(range(start, start + num, samples_per_shard)):
        jobs.append((out_dir, prefix, shard, s, min(s + samples_per_shard, start + num), image_size, seed))
    if workers > 1:
        with Pool(workers) as pool:
            sizes = pool.map(_write_one, jobs)
    else:
        sizes = [_write_one(j) for j in jobs]
    manifest = {"pattern": brace_pattern(prefix, len(sizes)), "num_samples": sum(sizes), "shard_sizes": sizes}
    with open(os.path.join(out_dir, f"{prefix}.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def write_synthetic_shards(
    out_dir: str,
    *,
    num_train: int,
    num_heldout: int = 1000,
    image_size: int = 224,
    samples_per_shard: int = 5000,
    seed: int = 0,
    workers: int = 1,
) -> Dict[str, Any]:
    """Write ``train`` (indices ``0..num_train-1``) and ``heldout`` (the next ``num_heldout``)
    shards and ``zero_shot.json``; returns ``{"train": manifest, "heldout": manifest}``."""
    if num_train < 1 or num_heldout < 0:
        raise ValueError(f"need num_train >= 1 and num_heldout >= 0, got {num_train}, {num_heldout}")
    os.makedirs(out_dir, exist_ok=True)
    info = {"train": _write_split(out_dir, "train", 0, num_train, samples_per_shard, image_size, seed, workers)}
    if num_heldout:
        info["heldout"] = _write_split(
            out_dir, "heldout", num_train, num_heldout, samples_per_shard, image_size, seed, workers
        )
    class_names: List[str] = [f"{c} {s}" for s in SHAPES for c in COLOURS]
    with open(os.path.join(out_dir, "zero_shot.json"), "w") as f:
        json.dump({"class_names": class_names, "templates": list(ZERO_SHOT_TEMPLATES)}, f, indent=1)
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-train", type=int, required=True)
    p.add_argument("--num-heldout", type=int, default=1000)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--samples-per-shard", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="processes writing shards in parallel")
    args = p.parse_args(argv)
    info = write_synthetic_shards(
        args.out, num_train=args.num_train, num_heldout=args.num_heldout, image_size=args.image_size,
        samples_per_shard=args.samples_per_shard, seed=args.seed, workers=args.workers,
    )
    print({k: (v["pattern"], v["num_samples"]) for k, v in info.items()})


if __name__ == "__main__":
    main()
