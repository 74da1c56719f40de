"""Webdataset pipeline for image + caption shards: split, shuffle, decode (skipping and counting
bad samples), batch.

Stream of one reader (a rank's DataLoader worker; with ``num_workers=0`` the rank itself)::

    shard list and sizes (folder, brace patterns)     resolve_shards
      -> this reader's shards, epoch by epoch          split="shard": shards[slot::num_slots]
         (or shards drawn with replacement)            resampled=True
      -> tar members grouped into samples              shards.iter_shard_samples (damage counted)
      -> this reader's samples                         split="sample": position % num_slots
      -> shuffle buffer                                shuffle_buffer
      -> decode image + caption + index                bad samples skipped and counted
      -> batches                                       dict of tensors

``slot = rank * num_workers + worker_id`` and ``num_slots = world_size * num_workers``. With
``split="shard"`` every shard of an epoch goes to exactly one reader; with ``split="sample"``
every reader reads every shard and keeps every ``num_slots``-th sample (for data sets with fewer
shards than readers). Either way an epoch covers each sample exactly once over all readers, no
duplicates, no gaps, and the assignment does not depend on which samples fail to decode.

Nothing is lost silently: a sample that cannot be decoded is skipped and counted by its reason
(``bad_image``, ``bad_json``, ``bad_caption``, ``missing_caption``, ``missing_image``); a damaged
shard (truncated, not a tar, a member cut short) is read up to the damage and the samples it cost
are counted: exactly (``lost_in_bad_shard``: the shard's known size minus the samples that came
out of it) when ``sizes.json`` or the manifest gives its size, else as one ``bad_tar`` with a
warning that says the number lost is unknown. A shard that reads cleanly but holds fewer samples
than its size says counts the difference as ``missing_from_shard``; a final partial batch that
``drop_last`` drops counts as ``dropped_last_batch``. So over one epoch of all readers,
``samples yielded + sum of the counts == samples in the shards`` whenever the sizes are known.
A shard's damage is counted and warned about once per run, not on every read: in the stream's
first epoch (with ``resampled=True``, the first time each reader draws it); bad samples are
counted each time they are read.

Batches are dicts::

    image        float32 [n, 3, H, W]   from ``image_transform`` (its ``collate`` when it has one:
                                        ``EncodedImages`` packs JPEG bytes for GPU decoding)
    text         list of n captions
    idx          int64 [n]              stable global sample index (-1 where the shard has none)
    label        int64 [n]              json "label" where present, else -1
    input_ids, attention_mask, ...      what ``tokenizer(text)`` returns, when one is given
    bad_samples  {reason: count}        this reader's running count of skipped or lost samples
    reader       int                    the reader's slot

``BadSampleTally`` sums the running counts of all readers of a rank from the batches it sees
(each DataLoader worker is a separate process, so counts have to travel with the data); the last
batch of a finite stream carries the reader's final counts.
"""

from __future__ import annotations

import io
import json
import logging
import random
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ds_infcl.data.shards import (
    SAMPLE_IMAGE_EXTS,
    ShardList,
    ShardReport,
    expand_shard_source,
    iter_shard_samples,
    resolve_shards,
)

__all__ = ["expand_shard_urls", "read_captions", "ImageTextShards", "BadSampleTally", "image_text_loader"]

logger = logging.getLogger(__name__)

IMAGE_KEYS = SAMPLE_IMAGE_EXTS
SPLITS = ("shard", "sample")


def expand_shard_urls(urls: Union[str, Sequence[str], ShardList]) -> List[str]:
    """The shard list of a shard source: folders (every ``*.tar`` in them, sorted), brace
    patterns (``"a-{000..002}.tar::b.tar"``), or a list of those. Files are not checked for
    existence (``resolve_shards`` checks them and adds the sample counts).

    Raises:
        ValueError: an empty source, or a folder without ``.tar`` files.
    """
    return expand_shard_source(urls, check=False)


def read_captions(
    urls: Union[str, Sequence[str], ShardList],
    caption_key: str = "txt",
    *,
    damaged: Optional[List[ShardReport]] = None,
) -> List[str]:
    """All captions of the shards, in shard order, without decoding images (to train a
    tokenizer): the ``caption_key`` member, else the json's ``caption`` (as ``ImageTextShards``
    reads them).

    A damaged shard (not a tar, truncated, a member cut short) is read up to the damage and the
    rest of it skipped, with a warning naming the shard and the byte offset; its report is
    appended to ``damaged`` when a list is given. A caption that is not UTF-8 is skipped.

    Raises:
        ValueError: the source names shards or folders that do not exist (``resolve_shards``).
    """
    captions: List[str] = []
    for url in expand_shard_source(urls, check=True):
        report = ShardReport(url)
        for sample in iter_shard_samples(url, report, read=(caption_key, "json")):
            caption = _caption(sample, caption_key)
            if caption is not None:
                captions.append(caption)
        if report.damaged:
            logger.warning("read_captions: skipped the rest of the damaged shard %s (%d samples read before it)",
                           report.where(), report.num_samples)
            if damaged is not None:
                damaged.append(report)
    return captions


def _caption(sample: Dict[str, Any], caption_key: str) -> Optional[str]:
    """The caption of a raw sample (``caption_key`` member, else json ``caption``), ``None`` if
    it has none or it cannot be decoded."""
    try:
        if sample.get(caption_key) is not None:
            return sample[caption_key].decode("utf-8").strip()
        if sample.get("json") is not None:
            meta = json.loads(sample["json"])
            if isinstance(meta, dict) and isinstance(meta.get("caption"), str):
                return meta["caption"].strip()
    except (UnicodeDecodeError, ValueError):
        return None
    return None


def _as_int(value: Any) -> int:
    """An int field of the json, -1 when absent or not an integer."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _rng(*parts) -> random.Random:
    # String seeds are hashed with SHA-512: the same on every run, process and platform.
    return random.Random(":".join(str(p) for p in parts))


class ImageTextShards(IterableDataset):
    """Image + caption batches from webdataset shards, for one rank (and its DataLoader workers).

    Args:
        urls: a shard source: a folder of ``.tar`` shards, brace patterns
            (``"/data/train-{000000..000099}.tar"``, several joined by ``::``), a list of those,
            or a ``ShardList`` from ``resolve_shards`` (which brings counted sizes). The
            shards' sample counts come from ``sizes.json`` or the manifest when present (never
            counted here); with them, samples lost in a damaged shard are counted exactly.
        image_transform: ``PIL.Image -> tensor [3, H, W]`` (see ``ImageTransform``), or one with
            ``wants_bytes``, ``prepare(bytes)`` and ``collate(items)`` that defers decoding
            (``device_decode.EncodedImages``: a ``prepare`` that raises counts ``bad_image``).
        batch_size: samples per batch (per rank).
        tokenizer: optional ``list[str] -> dict of tensors`` merged into each batch.
        rank, world_size: this rank among the data-parallel ranks.
        split: ``"shard"`` (each shard to one reader) or ``"sample"`` (each reader reads all
            shards and keeps every ``num_slots``-th sample).
        shuffle_shards: permute the shard order every epoch (the same permutation on all readers).
        shuffle_buffer: samples held for shuffling; 0 or 1 keeps the stream order.
        repeat: endless stream, epoch after epoch (each epoch a new shard permutation).
        resampled: endless stream of shards drawn with replacement, independently per reader
            (OpenCLIP's ``--dataset-resampled``); ignores ``split`` and ``shuffle_shards``.
        drop_last: drop a final partial batch of a finite stream (counted as
            ``dropped_last_batch``).
        seed: base seed of the shard permutation, the shuffle buffer and the resampling.
        epoch: epoch of the next iteration (``set_epoch``), as with ``DistributedSampler``.
        caption_key: tar member holding the caption (``txt``); without it the json's
            ``caption`` field is used.

    Raises:
        ValueError: unknown ``split``, a rank with no shard in ``split="shard"`` mode, a shard
            source naming folders or files that do not exist.
    """

    def __init__(
        self,
        urls: Union[str, Sequence[str]],
        *,
        image_transform: Callable,
        batch_size: int,
        tokenizer: Optional[Callable[[List[str]], Dict[str, torch.Tensor]]] = None,
        rank: int = 0,
        world_size: int = 1,
        split: str = "shard",
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        repeat: bool = False,
        resampled: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        epoch: int = 0,
        caption_key: str = "txt",
    ):
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        shards = resolve_shards(urls, count=False)
        self.urls = list(shards.urls)
        # samples per shard where known: what lets a damaged shard's loss be counted exactly
        self.shard_sizes: Dict[str, int] = {u: n for u, n in zip(shards.urls, shards.sizes) if n is not None}
        if split == "shard" and not resampled and len(self.urls) < world_size:
            raise ValueError(
                f"{len(self.urls)} shards cannot feed {world_size} ranks with split='shard' "
                f"(a rank would get no data): write more shards, use split='sample' or resampled=True"
            )
        self.image_transform = image_transform
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.rank, self.world_size = rank, world_size
        self.split = split
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = shuffle_buffer
        self.repeat = repeat
        self.resampled = resampled
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = epoch
        self.caption_key = caption_key
        # Running counts of skipped samples of the reader in *this* process (num_workers=0).
        self.bad_samples: Dict[str, int] = {}
        self._shards_counted: set = set()  # resampled: shards whose damage this reader counted

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # -- the stages -------------------------------------------------------------------------------

    def _slot(self):
        info = get_worker_info()
        num_workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * num_workers + worker_id, self.world_size * num_workers

    def _epoch_shards(self, epoch: int) -> List[str]:
        shards = list(self.urls)
        if self.shuffle_shards:
            _rng(self.seed, "shards", epoch).shuffle(shards)
        return shards

    def _shard_stream(self, slot: int, num_slots: int) -> Iterator[Dict[str, Any]]:
        """Dicts ``{"url", "epoch"}`` in the order this reader opens them."""
        if self.resampled:
            rng = _rng(self.seed, "resample", self.epoch, slot)
            while True:
                yield {"url": rng.choice(self.urls), "epoch": self.epoch}
        epoch = self.epoch
        while True:
            shards = self._epoch_shards(epoch)
            mine = shards[slot::num_slots] if self.split == "shard" else shards
            if not mine:
                logger.warning(
                    "reader %d of %d has no shard (%d shards): it yields nothing",
                    slot, num_slots, len(shards),
                )
                return
            for url in mine:
                yield {"url": url, "epoch": epoch}
            if not self.repeat:
                return
            epoch += 1

    def _add(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.bad_samples[reason] = self.bad_samples.get(reason, 0) + n

    def _count(self, reason: str, detail: Any = None) -> None:
        self._add(reason)
        n = sum(self.bad_samples.values())
        if n <= 10 or n & (n - 1) == 0:  # log the first few, then at powers of two
            logger.warning("skipped a bad sample (%s): %s [%d skipped so far]", reason, detail, n)

    def _shard_loss(self, report: ShardReport) -> Tuple[str, int, Optional[str]]:
        """``(reason, n, message)``: the samples of a finished shard that never came out of it
        (all readers together), ``n = 0`` when none; ``message`` is ``None`` when all is well."""
        expected = self.shard_sizes.get(report.url)
        if expected is None:
            if not report.damaged:
                return "", 0, None
            return "bad_tar", 1, (
                f"damaged shard {report.where()}: skipped the rest of it after {report.num_samples} samples; "
                f"the number of samples lost is unknown (no sizes.json or manifest gives the shard's size), "
                f"counted as 1 bad_tar"
            )
        missing = expected - report.num_samples
        if report.damaged:
            return "lost_in_bad_shard", max(missing, 0), (
                f"damaged shard {report.where()}: {report.num_samples} of its {expected} samples read, "
                f"{max(missing, 0)} lost (counted as lost_in_bad_shard)"
            )
        if missing > 0:
            return "missing_from_shard", missing, (
                f"shard {report.url} holds {report.num_samples} samples but its size is {expected}: "
                f"{missing} counted as missing_from_shard (a stale sizes.json or manifest?)"
            )
        if missing < 0:
            return "", 0, (
                f"shard {report.url} holds {report.num_samples} samples, more than its size {expected} "
                f"(a stale sizes.json or manifest?)"
            )
        return "", 0, None

    def _first_read(self, shard: Dict[str, Any]) -> bool:
        """Whether this read of a shard counts (and warns about) its damage: once per run, in the
        stream's first epoch (each shard to one reader; ``split="sample"``: each reader its share),
        or with resampling the first time this reader draws it."""
        if not self.resampled:
            return shard["epoch"] == self.epoch
        if shard["url"] in self._shards_counted:
            return False
        self._shards_counted.add(shard["url"])
        return True

    def _samples(self, slot: int, num_slots: int) -> Iterator[Dict[str, Any]]:
        sample_split = self.split == "sample" and not self.resampled
        position = 0  # sample split: every reader sees the same stream; positions partition it
        for shard in self._shard_stream(slot, num_slots):
            report = ShardReport(shard["url"])
            for sample in iter_shard_samples(shard["url"], report, sample_exts=IMAGE_KEYS):
                if sample_split:
                    position += 1
                    if (position - 1) % num_slots != slot:
                        continue
                yield sample
            reason, lost, message = self._shard_loss(report)
            if not self._first_read(shard):  # counted (and warned about) at its first read
                reason, lost, message = "", 0, None
            if sample_split:
                # The lost samples take the positions they would have had: each reader counts
                # its share, so the readers' counts add up to the loss (and later shards keep
                # their partition).
                mine = len(range(position + (slot - position) % num_slots, position + lost, num_slots))
                position += lost
                if message is not None and slot == 0:
                    logger.warning("%s [every reader reads this shard; each counts its share]", message)
                lost = mine
            elif message is not None:
                logger.warning("%s", message)
            self._add(reason, lost)

    def _shuffled(self, samples: Iterator, slot: int) -> Iterator:
        if self.shuffle_buffer <= 1:
            yield from samples
            return
        rng = _rng(self.seed, "buffer", self.epoch, slot)
        buffer: List = []
        for sample in samples:
            if len(buffer) < self.shuffle_buffer:
                buffer.append(sample)
                continue
            i = rng.randrange(len(buffer))
            buffer[i], sample = sample, buffer[i]
            yield sample
        rng.shuffle(buffer)
        yield from buffer

    def decode(self, sample: Dict[str, Any]):
        """``(image, caption, idx, label)`` of a raw tar sample, or ``None`` (counted) if bad."""
        from PIL import Image

        key = sample.get("__key__", "?")
        where = f"{sample.get('__url__', '?')}:{key}"
        meta: Dict[str, Any] = {}
        if "json" in sample:
            try:
                meta = json.loads(sample["json"])
                if not isinstance(meta, dict):
                    raise ValueError("json is not an object")
            except Exception as exn:  # noqa: BLE001 -- any malformed json is a bad sample
                self._count("bad_json", f"{where}: {exn!r}")
                return None
        if self.caption_key in sample:
            try:
                caption = sample[self.caption_key].decode("utf-8").strip()
            except UnicodeDecodeError as exn:
                self._count("bad_caption", f"{where}: {exn!r}")
                return None
        elif isinstance(meta.get("caption"), str):
            caption = meta["caption"].strip()
        else:
            self._count("missing_caption", where)
            return None
        image_key = next((k for k in IMAGE_KEYS if k in sample), None)
        if image_key is None:
            self._count("missing_image", f"{where} has {sorted(k for k in sample if not k.startswith('__'))}")
            return None
        try:
            if getattr(self.image_transform, "wants_bytes", False):  # decoded later, on the GPU
                image = self.image_transform.prepare(sample[image_key])
            else:
                with Image.open(io.BytesIO(sample[image_key])) as img:
                    img.load()
                    image = self.image_transform(img)
        except Exception as exn:  # noqa: BLE001 -- PIL raises many types on corrupt data
            self._count("bad_image", f"{where}: {exn!r}")
            return None
        idx = _as_int(meta.get("idx"))
        if idx < 0 and key.isdigit():
            idx = int(key)
        return image, caption, idx, _as_int(meta.get("label"))

    def collate(self, items: List[tuple], slot: int) -> Dict[str, Any]:
        images, captions, idxs, labels = zip(*items)
        batch: Dict[str, Any] = {
            "image": self.image_transform.collate(images) if hasattr(self.image_transform, "collate")
            else torch.stack(images),
            "text": list(captions),
            "idx": torch.tensor(idxs, dtype=torch.long),
            "label": torch.tensor(labels, dtype=torch.long),
        }
        if self.tokenizer is not None:
            batch.update(self.tokenizer(batch["text"]))
        batch["bad_samples"] = dict(self.bad_samples)
        batch["reader"] = slot
        return batch

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        slot, num_slots = self._slot()
        if hasattr(self.image_transform, "reseed"):
            self.image_transform.reseed(hash((self.seed, self.epoch, slot)))
        # One batch is held back so that the last batch of a finite stream carries the final
        # counts, bad samples after it included.
        items: List[tuple] = []
        pending = None
        for sample in self._shuffled(self._samples(slot, num_slots), slot):
            item = self.decode(sample)
            if item is None:
                continue
            items.append(item)
            if len(items) == self.batch_size:
                if pending is not None:
                    yield pending
                pending, items = self.collate(items, slot), []
        if items and not self.drop_last:
            if pending is not None:
                yield pending
            pending = self.collate(items, slot)
        elif items:
            self._add("dropped_last_batch", len(items))
        if pending is not None:
            pending["bad_samples"] = dict(self.bad_samples)
            yield pending


class BadSampleTally:
    """Sums the running skip counts of all readers seen in batches (``update(batch)``), plus
    the samples this process skipped itself (``add``: images the GPU decode could not decode).

    ``counts`` is ``{reason: n}``, ``total`` their sum. Counts are those of the readers of this
    rank; an all-reduce of ``total`` gives the global number.
    """

    def __init__(self):
        self._by_reader: Dict[int, Dict[str, int]] = {}
        self._here: Dict[str, int] = {}
        self._lock = threading.Lock()  # the GPU decode's prefetch thread updates it

    def update(self, batch: Dict[str, Any]) -> None:
        with self._lock:
            self._by_reader[int(batch["reader"])] = dict(batch["bad_samples"])

    def add(self, reason: str, n: int = 1) -> None:
        """Count ``n`` samples skipped in this process (the GPU decode's ``bad_image``)."""
        if n > 0:
            with self._lock:
                self._here[reason] = self._here.get(reason, 0) + n

    @property
    def counts(self) -> Dict[str, int]:
        with self._lock:
            out: Dict[str, int] = dict(self._here)
            readers = list(self._by_reader.values())
        for counts in readers:
            for reason, n in counts.items():
                out[reason] = out.get(reason, 0) + n
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def image_text_loader(dataset: ImageTextShards, num_workers: int = 0, **kwargs) -> DataLoader:
    """A DataLoader over the dataset's batches (``batch_size=None``: batching is the dataset's)."""
    return DataLoader(
        dataset, batch_size=None, num_workers=num_workers,
        persistent_workers=num_workers > 0 and dataset.repeat, **kwargs,
    )
