"""Tiny image + caption shards written at test time (OpenCLIP's habit)."""

import io

import numpy as np
import pytest

from ds_infcl.data.shards import write_image_text_shards


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def make_records(num: int, *, size: int = 4, start: int = 0, seed: int = 0):
    """``num`` records with random RGB ``size x size`` PNGs, caption ``"caption <idx>"``,
    label ``idx % 3``."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(start, start + num):
        pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        records.append({
            "idx": i, "image": png_bytes(pixels), "ext": "png", "caption": f"caption {i}",
            "label": i % 3, "pixels": pixels.tolist(),
        })
    return records


@pytest.fixture
def shard_dir(tmp_path):
    """23 samples (idx 0..22) in shards of 5: 5 shards of sizes 5, 5, 5, 5, 3."""
    out = tmp_path / "shards"
    manifest = write_image_text_shards(make_records(23), str(out), prefix="train", samples_per_shard=5)
    manifest["urls"] = str(out / manifest["pattern"])
    return manifest
