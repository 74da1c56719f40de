"""Realistic JPEG webdataset shards in img2dataset's layout, rendered locally (no download): the
data for measuring the image data path (``python -m ds_infcl.bench.data``) on a machine without
network.

Every sample is drawn from its global index and the seed alone (so any shard can be rewritten, in
any order, on any machine): a two-colour gradient with a smooth texture, 3-8 filled shapes and
lines, the index written in white, and Gaussian pixel noise; encoded by PIL as a JPEG of quality
90. At 256 px the files are ~15-30 KB, as web images that img2dataset resized to 256 are, so the
bytes read and the decode cost are realistic (uniform noise would give ~90 KB, flat shapes ~5 KB).

Layout (img2dataset's ``webdataset`` output)::

    00000.tar  000000000.jpg  000000000.txt  000000000.json  000000001.jpg ...
    00001.tar  ...
    sizes.json {"00000.tar": 10000, ...}    (OpenCLIP's file; the loader counts losses with it)

``json``: ``key`` (the 9-digit key), ``caption``, ``width``, ``height``, ``original_width``,
``original_height``, ``status: "success"``, ``url`` (a made-up ``synthetic://`` one), ``sha256`` of
the JPEG. The key is the global index (``shard * samples_per_shard + i``), which the loader reads
as the sample index. Point the clip task at the folder (``data_dir``) or a brace pattern.

Command line (one process per shard; ~15 ms per 256 px sample per process on an H100 host's cores)::

    python -m ds_infcl.data.synth_jpeg_shards --out data/jpeg256 --num-samples 200000 \\
        --samples-per-shard 5000 --image-size 256 --processes 16
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile
import time
from multiprocessing import Pool
from typing import Any, Dict, List, Tuple

import numpy as np

from ds_infcl.data.shards import SIZES_FILE, sample_key

__all__ = ["render_sample", "write_jpeg_shard", "write_synth_jpeg_shards", "main"]

_COLOURS = {"red": (210, 40, 40), "green": (40, 170, 70), "blue": (50, 80, 215), "yellow": (235, 210, 50),
            "purple": (135, 60, 165), "orange": (240, 140, 30), "white": (240, 240, 240), "black": (20, 20, 20),
            "teal": (30, 150, 150), "pink": (235, 130, 170)}
_SHAPES = ("circle", "square", "triangle", "line")
_CAPTIONS = ("{n} {c} {s}s on a {b} background", "a picture of {n} shapes, mostly {c} {s}s", "{c} {s} and friends, #{i}",
             "an abstract drawing with a {c} {s} over {b} tones", "number {i}: {n} {c} {s}s")


def _jpeg(pixels: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def render_sample(idx: int, *, image_size: int = 256, seed: int = 0, quality: int = 90) -> Tuple[bytes, str]:
    """``(jpeg bytes, caption)`` of global index ``idx`` (a function of ``idx`` and ``seed``)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng([seed, idx])
    size = image_size
    names = list(_COLOURS)
    bg0, bg1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    ramp = np.cos(angle) * t[None, :] + np.sin(angle) * t[:, None]
    ramp = (ramp - ramp.min()) / max(float(ramp.max() - ramp.min()), 1e-6)
    pixels = bg0 * (1 - ramp[..., None]) + bg1 * ramp[..., None]
    coarse = rng.standard_normal((max(size // 16, 2), max(size // 16, 2), 3), dtype=np.float32) * 40 + 128
    texture = Image.fromarray(coarse.clip(0, 255).astype(np.uint8)).resize((size, size), Image.BICUBIC)
    pixels = pixels + (np.asarray(texture, dtype=np.float32) - 128) * rng.uniform(0.3, 1.0)
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    num_shapes = int(rng.integers(3, 9))
    main_colour, main_shape = names[int(rng.integers(len(names)))], _SHAPES[int(rng.integers(len(_SHAPES)))]
    for k in range(num_shapes):
        shape = main_shape if k == 0 else _SHAPES[int(rng.integers(len(_SHAPES)))]
        colour = _COLOURS[main_colour] if k == 0 else tuple(int(v) for v in rng.integers(0, 256, 3))
        x0, y0 = (int(v) for v in rng.integers(-size // 4, size, 2))
        dx, dy = (int(v) for v in rng.integers(max(size // 8, 1), max(size // 2, 2), 2))
        if shape == "circle":
            draw.ellipse([x0, y0, x0 + dx, y0 + dy], fill=colour)
        elif shape == "square":
            draw.rectangle([x0, y0, x0 + dx, y0 + dy], fill=colour)
        elif shape == "triangle":
            draw.polygon([tuple(int(v) for v in rng.integers(0, size, 2)) for _ in range(3)], fill=colour)
        else:
            draw.line([tuple(int(v) for v in rng.integers(0, size, 2)) for _ in range(4)], fill=colour,
                      width=int(rng.integers(2, 8)))
    draw.text((int(rng.integers(0, max(size - 60, 1))), int(rng.integers(0, max(size - 16, 1)))), f"#{idx}",
              fill=(255, 255, 255), font=ImageFont.load_default())
    noisy = np.asarray(image, dtype=np.float32)
    noisy = noisy + rng.standard_normal(noisy.shape, dtype=np.float32) * rng.uniform(4.0, 10.0)
    data = _jpeg(noisy.clip(0, 255).astype(np.uint8), quality)
    background = names[int(rng.integers(len(names)))]
    caption = _CAPTIONS[int(rng.integers(len(_CAPTIONS)))].format(
        n=num_shapes, c=main_colour, s=main_shape, b=background, i=idx)
    return data, caption


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    tar.addfile(info, io.BytesIO(data))


def write_jpeg_shard(path: str, start: int, stop: int, *, image_size: int = 256, seed: int = 0,
                     quality: int = 90) -> int:
    """Write samples ``start..stop-1`` as one tar at ``path`` (through a temporary name, so a
    killed writer leaves no partial shard under the final name); returns the sample count."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.part")
    with tarfile.open(tmp, "w") as tar:
        for idx in range(start, stop):
            data, caption = render_sample(idx, image_size=image_size, seed=seed, quality=quality)
            key = sample_key(idx)
            meta = {"key": key, "caption": caption, "width": image_size, "height": image_size,
                    "original_width": image_size, "original_height": image_size, "status": "success",
                    "error_message": None, "url": f"synthetic://{seed}/{key}.jpg",
                    "sha256": hashlib.sha256(data).hexdigest()}
            _add(tar, f"{key}.jpg", data)
            _add(tar, f"{key}.txt", caption.encode("utf-8"))
            _add(tar, f"{key}.json", json.dumps(meta).encode("utf-8"))
    os.replace(tmp, path)
    return stop - start


def _write_job(job) -> Tuple[str, int]:
    path, start, stop, image_size, seed, quality = job
    return os.path.basename(path), write_jpeg_shard(path, start, stop, image_size=image_size, seed=seed,
                                                    quality=quality)


def write_synth_jpeg_shards(out_dir: str, *, num_samples: int, samples_per_shard: int = 10000,
                            image_size: int = 256, seed: int = 0, quality: int = 90,
                            processes: int = 1) -> Dict[str, Any]:
    """Write ``num_samples`` samples as shards ``00000.tar, ...`` of ``samples_per_shard`` (the
    last one shorter) and ``sizes.json``; ``processes`` shards are written at once, one process
    each. Returns ``{"sizes": {name: n}, "num_samples", "bytes", "seconds"}``.

    Raises:
        ValueError: a count or size below 1, a quality outside 1..100, or ``out_dir`` holding
            ``.tar`` files this call would not rewrite (an earlier, larger run's shards: a folder
            is read as every ``.tar`` in it).
    """
    for name, value in (("num_samples", num_samples), ("samples_per_shard", samples_per_shard),
                        ("image_size", image_size), ("processes", processes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality}")
    os.makedirs(out_dir, exist_ok=True)
    jobs = [(os.path.join(out_dir, f"{shard:05d}.tar"), start, min(start + samples_per_shard, num_samples),
             image_size, seed, quality)
            for shard, start in enumerate(range(0, num_samples, samples_per_shard))]
    names = {os.path.basename(job[0]) for job in jobs}
    stale = sorted(n for n in os.listdir(out_dir) if n.endswith(".tar") and n not in names)
    if stale:
        raise ValueError(
            f"{out_dir} already holds shards this run would not rewrite ({', '.join(stale[:5])}"
            f"{', ...' if len(stale) > 5 else ''}): they would be read with the new ones; remove them or "
            "write to an empty folder"
        )
    t0 = time.time()
    if processes > 1 and len(jobs) > 1:
        with Pool(min(processes, len(jobs))) as pool:
            done: List[Tuple[str, int]] = pool.map(_write_job, jobs, chunksize=1)
    else:
        done = [_write_job(job) for job in jobs]
    sizes = dict(done)
    with open(os.path.join(out_dir, SIZES_FILE), "w") as f:
        json.dump(sizes, f, indent=1)
    total_bytes = sum(os.path.getsize(os.path.join(out_dir, name)) for name in sizes)
    return {"sizes": sizes, "num_samples": sum(sizes.values()), "bytes": total_bytes, "seconds": time.time() - t0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.data.synth_jpeg_shards",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--num-samples", type=int, required=True)
    p.add_argument("--samples-per-shard", type=int, default=10000, help="img2dataset's default: 10000")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (PIL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="shards written at once")
    args = p.parse_args(argv)
    info = write_synth_jpeg_shards(args.out, num_samples=args.num_samples, samples_per_shard=args.samples_per_shard,
                                   image_size=args.image_size, seed=args.seed, quality=args.quality,
                                   processes=args.processes)
    n = info["num_samples"]
    print(f"wrote {n} samples in {len(info['sizes'])} shards to {args.out} in {info['seconds']:.1f} s "
          f"({n / max(info['seconds'], 1e-9):.0f} samples/s, {info['bytes'] / n / 1e3:.1f} KB per sample)")


if __name__ == "__main__":
    main()
