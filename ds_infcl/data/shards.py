"""Writing image + caption webdataset shards, and their manifest.

A sample in a shard is the group of tar members sharing one key::

    000001234.png    the image bytes, as given (jpg, png or webp)
    000001234.txt    the caption, UTF-8
    000001234.json   {"idx": 1234, "caption": ..., plus any metadata such as "label"}

The key is the sample's *global index*, zero-padded to 9 digits, and ``idx`` repeats it in the
json: a stable index over the whole data set that survives shuffling, resampling and splitting.
FastCLIP-style losses keep per-sample state keyed by it.

Next to the shards, ``<prefix>.json`` records the brace pattern of the shard names, the number of
samples per shard and in total (``read_manifest`` turns it into absolute URLs).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from typing import Any, Dict, Iterable, List, Optional

__all__ = [
    "IMAGE_EXTENSIONS",
    "normalize_image_ext",
    "sample_key",
    "write_image_text_shards",
    "read_manifest",
    "brace_pattern",
]

IMAGE_EXTENSIONS = ("jpg", "png", "webp")
_EXT_ALIASES = {"jpeg": "jpg", "jpg": "jpg", "png": "png", "webp": "webp"}
KEY_DIGITS = 9


def normalize_image_ext(ext: str) -> str:
    """``'.JPEG' -> 'jpg'``; ``ValueError`` listing the supported extensions otherwise."""
    e = ext.lower().lstrip(".")
    if e not in _EXT_ALIASES:
        raise ValueError(f"unsupported image extension {ext!r}; supported: jpg, jpeg, png, webp")
    return _EXT_ALIASES[e]


def sample_key(idx: int) -> str:
    """The tar key of global index ``idx`` (``1234 -> '000001234'``)."""
    if idx < 0:
        raise ValueError(f"sample index must be >= 0, got {idx}")
    return f"{idx:0{KEY_DIGITS}d}"


def brace_pattern(prefix: str, num_shards: int) -> str:
    """Shard names as one brace pattern: ``train-{000000..000007}.tar`` (no braces for one)."""
    if num_shards == 1:
        return f"{prefix}-000000.tar"
    return f"{prefix}-{{000000..{num_shards - 1:06d}}}.tar"


def _add_member(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = mtime
    info.mode = 0o444
    tar.addfile(info, io.BytesIO(data))


def write_image_text_shards(
    records: Iterable[Dict[str, Any]],
    out_dir: str,
    *,
    prefix: str = "shard",
    samples_per_shard: int = 1000,
    mtime: Optional[float] = None,
) -> Dict[str, Any]:
    """Write ``records`` into tar shards ``<out_dir>/<prefix>-000000.tar, ...`` and a manifest.

    Args:
        records: dicts with ``idx`` (global index, unique, >= 0), ``image`` (encoded bytes),
            ``ext`` (``jpg``/``jpeg``/``png``/``webp``), ``caption`` (str); every other key goes
            into the sample's json (e.g. ``label``).
        out_dir: created if missing.
        prefix: shard file prefix (``train``, ``heldout``, ...).
        samples_per_shard: maximum samples in a shard.
        mtime: tar member time (default: now); fix it for byte-identical shards.

    Returns:
        The manifest (also written to ``<out_dir>/<prefix>.json``): ``pattern`` (brace pattern of
        the shard names, relative to ``out_dir``), ``num_samples``, ``shard_sizes``.

    Raises:
        ValueError: a record misses a field, repeats an index or has an unsupported extension.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    os.makedirs(out_dir, exist_ok=True)
    mtime = time.time() if mtime is None else mtime
    seen = set()
    shard_sizes: List[int] = []
    tar = None
    try:
        for record in records:
            missing = [k for k in ("idx", "image", "ext", "caption") if k not in record]
            if missing:
                raise ValueError(f"record is missing {missing}: keys {sorted(record)}")
            idx = int(record["idx"])
            if idx in seen:
                raise ValueError(f"duplicate sample index {idx}")
            seen.add(idx)
            if tar is None or shard_sizes[-1] >= samples_per_shard:
                if tar is not None:
                    tar.close()
                name = os.path.join(out_dir, f"{prefix}-{len(shard_sizes):06d}.tar")
                tar = tarfile.open(name, "w")
                shard_sizes.append(0)
            key = sample_key(idx)
            ext = normalize_image_ext(record["ext"])
            caption = str(record["caption"])
            meta = {k: v for k, v in record.items() if k not in ("image", "ext")}
            meta["idx"] = idx
            _add_member(tar, f"{key}.{ext}", bytes(record["image"]), mtime)
            _add_member(tar, f"{key}.txt", caption.encode("utf-8"), mtime)
            _add_member(tar, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"), mtime)
            shard_sizes[-1] += 1
    finally:
        if tar is not None:
            tar.close()
    if not shard_sizes:
        raise ValueError("no records to write")
    manifest = {
        "pattern": brace_pattern(prefix, len(shard_sizes)),
        "num_samples": sum(shard_sizes),
        "shard_sizes": shard_sizes,
    }
    with open(os.path.join(out_dir, f"{prefix}.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(path: str) -> Dict[str, Any]:
    """Load ``<prefix>.json``; adds ``urls``, the pattern made absolute (a brace pattern string)."""
    with open(path) as f:
        manifest = json.load(f)
    manifest["urls"] = os.path.join(os.path.dirname(os.path.abspath(path)), manifest["pattern"])
    return manifest
