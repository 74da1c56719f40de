"""Write image + caption webdataset shards from a folder of pairs or a csv/jsonl table.

Usage::

    # a folder of pairs: photos/cat.jpg + photos/cat.txt (or cat.json with a "caption" field)
    python -m ds_infcl.data.write_shards --folder photos --out shards/ --prefix train

    # a table of image paths (relative to the table's folder, or absolute) and captions
    python -m ds_infcl.data.write_shards --csv pairs.csv --out shards/ \\
        --image-column filepath --caption-column title
    python -m ds_infcl.data.write_shards --jsonl pairs.jsonl --out shards/

Samples are numbered ``--start-index``, ``--start-index + 1``, ... in input order (sorted paths
for a folder, row order for a table, after ``--shuffle``): that number is the global sample index
stored in every shard (see ``ds_infcl.data.shards``). Image bytes are copied as they are; with
``--verify`` each image is decoded first. Missing images, missing captions and (with
``--verify``) undecodable images are skipped, counted and reported.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ds_infcl.data.shards import normalize_image_ext, write_image_text_shards

__all__ = ["pairs_from_folder", "pairs_from_table", "write_shards", "main"]

_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
_IMAGE_COLUMNS = ("image", "filepath", "path", "file", "image_path", "url")
_CAPTION_COLUMNS = ("caption", "text", "title", "txt")

Pair = Tuple[str, Optional[str], Dict[str, Any]]  # (image path, caption or None, extra metadata)


def pairs_from_folder(folder: str) -> List[Pair]:
    """``(image, caption, {})`` for every image under ``folder`` (recursive, sorted by path).

    The caption is the same-stem ``.txt`` file, else the ``caption`` field of a same-stem
    ``.json`` (whose other fields become metadata); ``None`` when neither exists.
    """
    pairs: List[Pair] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            stem, suffix = os.path.splitext(name)
            if suffix.lower() not in _IMAGE_SUFFIXES:
                continue
            base = os.path.join(root, stem)
            caption, meta = None, {}
            if os.path.exists(base + ".txt"):
                with open(base + ".txt", encoding="utf-8") as f:
                    caption = f.read().strip()
            elif os.path.exists(base + ".json"):
                with open(base + ".json", encoding="utf-8") as f:
                    meta = json.load(f)
                caption = meta.pop("caption", None)
            pairs.append((os.path.join(root, name), caption, meta))
    return pairs


def _pick_column(columns, wanted: Optional[str], candidates, what: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"{what} column {wanted!r} not in the table's columns {list(columns)}")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise ValueError(
        f"no {what} column among {list(columns)}; name it with --{what}-column "
        f"(looked for {list(candidates)})"
    )


def pairs_from_table(
    path: str, *, image_column: Optional[str] = None, caption_column: Optional[str] = None
) -> List[Pair]:
    """``(image, caption, metadata)`` per row of a ``.csv``/``.tsv`` or ``.jsonl`` file.

    Relative image paths are relative to the table's folder; the other columns become metadata.
    """
    lower = path.lower()
    with open(path, encoding="utf-8", newline="") as f:
        if lower.endswith((".jsonl", ".json")):
            rows = [json.loads(line) for line in f if line.strip()]
        elif lower.endswith((".csv", ".tsv")):
            rows = list(csv.DictReader(f, delimiter="\t" if lower.endswith(".tsv") else ","))
        else:
            raise ValueError(f"table {path!r} must end in .csv, .tsv or .jsonl")
    if not rows:
        raise ValueError(f"table {path!r} has no rows")
    image_col = _pick_column(rows[0].keys(), image_column, _IMAGE_COLUMNS, "image")
    caption_col = _pick_column(rows[0].keys(), caption_column, _CAPTION_COLUMNS, "caption")
    root = os.path.dirname(os.path.abspath(path))
    pairs: List[Pair] = []
    for row in rows:
        image = os.path.join(root, str(row[image_col]))  # join keeps an absolute path
        caption = row.get(caption_col)
        meta = {k: v for k, v in row.items() if k not in (image_col, caption_col)}
        pairs.append((image, None if caption in (None, "") else str(caption), meta))
    return pairs


def _records(pairs: List[Pair], start_index: int, verify: bool, skipped: Dict[str, int]) -> Iterator[dict]:
    def skip(reason: str, detail: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1
        print(f"skipping {detail}: {reason}", file=sys.stderr)

    for offset, (image_path, caption, meta) in enumerate(pairs):
        if caption is None or not caption.strip():
            skip("missing_caption", image_path)
            continue
        try:
            ext = normalize_image_ext(os.path.splitext(image_path)[1])
            with open(image_path, "rb") as f:
                data = f.read()
        except (OSError, ValueError) as exn:
            skip("missing_image", f"{image_path} ({exn})")
            continue
        if verify:
            import io

            from PIL import Image

            try:
                with Image.open(io.BytesIO(data)) as img:
                    img.load()
            except Exception as exn:  # noqa: BLE001 -- PIL raises many types on corrupt data
                skip("bad_image", f"{image_path} ({exn!r})")
                continue
        yield {**meta, "idx": start_index + offset, "image": data, "ext": ext, "caption": caption}


def write_shards(
    pairs: List[Pair],
    out_dir: str,
    *,
    prefix: str = "shard",
    samples_per_shard: int = 1000,
    start_index: int = 0,
    shuffle: bool = False,
    seed: int = 0,
    verify: bool = False,
) -> Dict[str, Any]:
    """Write ``pairs`` as shards; returns the manifest plus ``skipped`` (``{reason: count}``).

    A skipped pair keeps its number: indices are ``start_index + position`` in the (shuffled)
    input, so they do not move when a bad file is fixed and the shards are written again.
    """
    pairs = list(pairs)
    if shuffle:
        random.Random(seed).shuffle(pairs)
    skipped: Dict[str, int] = {}
    manifest = write_image_text_shards(
        _records(pairs, start_index, verify, skipped), out_dir, prefix=prefix,
        samples_per_shard=samples_per_shard,
    )
    manifest["skipped"] = skipped
    return manifest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Write image + caption webdataset shards.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--folder", help="folder of image files with same-stem .txt/.json captions")
    source.add_argument("--csv", help="csv/tsv table of image paths and captions")
    source.add_argument("--jsonl", help="jsonl table of image paths and captions")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--prefix", default="shard", help="shard name prefix (default: shard)")
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument("--image-column", default=None, help="table column with image paths")
    parser.add_argument("--caption-column", default=None, help="table column with captions")
    parser.add_argument("--start-index", type=int, default=0, help="global index of the first pair")
    parser.add_argument("--shuffle", action="store_true", help="shuffle the pairs before writing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="decode every image, skip bad ones")
    args = parser.parse_args(argv)
    if args.folder:
        pairs = pairs_from_folder(args.folder)
    else:
        pairs = pairs_from_table(
            args.csv or args.jsonl, image_column=args.image_column, caption_column=args.caption_column
        )
    manifest = write_shards(
        pairs, args.out, prefix=args.prefix, samples_per_shard=args.samples_per_shard,
        start_index=args.start_index, shuffle=args.shuffle, seed=args.seed, verify=args.verify,
    )
    skipped = manifest["skipped"]
    print(
        f"wrote {manifest['num_samples']} samples in {len(manifest['shard_sizes'])} shards: "
        f"{os.path.join(args.out, manifest['pattern'])}; skipped {sum(skipped.values())} {skipped}"
    )


if __name__ == "__main__":
    main()
