"""Webdataset pipeline for image + caption shards: split, shuffle, decode (skipping and counting
bad samples), batch.

Stream of one reader (a rank's DataLoader worker; with ``num_workers=0`` the rank itself)::

    shard list (brace patterns)                       expand_shard_urls
      -> this reader's shards, epoch by epoch          split="shard": shards[slot::num_slots]
         (or shards drawn with replacement)            resampled=True
      -> tar members grouped into samples              webdataset's tarfile_samples
      -> this reader's samples                         split="sample": position % num_slots
      -> shuffle buffer                                shuffle_buffer
      -> decode image + caption + index                bad samples skipped and counted
      -> batches                                       dict of tensors

``slot = rank * num_workers + worker_id`` and ``num_slots = world_size * num_workers``. With
``split="shard"`` every shard of an epoch goes to exactly one reader; with ``split="sample"``
every reader reads every shard and keeps every ``num_slots``-th sample (for data sets with fewer
shards than readers). Either way an epoch covers each sample exactly once over all readers, no
duplicates, no gaps, and the assignment does not depend on which samples fail to decode.

Batches are dicts::

    image        float32 [n, 3, H, W]   from ``image_transform``
    text         list of n captions
    idx          int64 [n]              stable global sample index (-1 where the shard has none)
    label        int64 [n]              json "label" where present, else -1
    input_ids, attention_mask, ...      what ``tokenizer(text)`` returns, when one is given
    bad_samples  {reason: count}        this reader's running count of skipped samples
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = ["expand_shard_urls", "read_captions", "ImageTextShards", "BadSampleTally", "image_text_loader"]

logger = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
SPLITS = ("shard", "sample")


def expand_shard_urls(urls: Union[str, Sequence[str]]) -> List[str]:
    """Expand brace patterns: ``"a-{000..002}.tar::b.tar"`` or a list of such strings."""
    from webdataset.shardlists import expand_urls

    if isinstance(urls, str):
        urls = [urls]
    result: List[str] = []
    for u in urls:
        result.extend(expand_urls(str(u)))
    if not result:
        raise ValueError(f"no shards in {urls!r}")
    return result


def read_captions(urls: Union[str, Sequence[str]], caption_key: str = "txt") -> List[str]:
    """All captions of the shards, in shard order, without decoding images (to train a
    tokenizer). Unreadable members are skipped."""
    import tarfile

    captions: List[str] = []
    suffix = "." + caption_key
    for url in expand_shard_urls(urls):
        with tarfile.open(url) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(suffix):
                    try:
                        captions.append(tar.extractfile(member).read().decode("utf-8").strip())
                    except (OSError, UnicodeDecodeError, tarfile.TarError):
                        continue
    return captions


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
        urls: shard URLs or brace patterns (``"/data/train-{000000..000099}.tar"``, several
            joined by ``::`` or in a list).
        image_transform: ``PIL.Image -> tensor [3, H, W]`` (see ``ImageTransform``).
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
        drop_last: drop a final partial batch of a finite stream.
        seed: base seed of the shard permutation, the shuffle buffer and the resampling.
        epoch: epoch of the next iteration (``set_epoch``), as with ``DistributedSampler``.
        caption_key: tar member holding the caption (``txt``); without it the json's
            ``caption`` field is used.

    Raises:
        ValueError: unknown ``split``, a rank with no shard in ``split="shard"`` mode.
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
        self.urls = expand_shard_urls(urls)
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

    def _count(self, reason: str, detail: Any = None) -> None:
        self.bad_samples[reason] = self.bad_samples.get(reason, 0) + 1
        n = sum(self.bad_samples.values())
        if n <= 10 or n & (n - 1) == 0:  # log the first few, then at powers of two
            logger.warning("skipped a bad sample (%s): %s [%d skipped so far]", reason, detail, n)

    def _tar_handler(self, exn: Exception) -> bool:
        self._count("bad_tar", repr(exn)[:200])
        return True

    def _samples(self, slot: int, num_slots: int) -> Iterator[Dict[str, Any]]:
        from webdataset.tariterators import tarfile_samples

        samples = tarfile_samples(self._shard_stream(slot, num_slots), handler=self._tar_handler)
        if self.split == "sample" and not self.resampled:
            # Every reader sees the same stream; positions partition it (across epochs too).
            for position, sample in enumerate(samples):
                if position % num_slots == slot:
                    yield sample
            return
        yield from samples

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
            "image": torch.stack(images),
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
        if pending is not None:
            pending["bad_samples"] = dict(self.bad_samples)
            yield pending


class BadSampleTally:
    """Sums the running skip counts of all readers seen in batches (``update(batch)``).

    ``counts`` is ``{reason: n}``, ``total`` their sum. Counts are those of the readers of this
    rank; an all-reduce of ``total`` gives the global number.
    """

    def __init__(self):
        self._by_reader: Dict[int, Dict[str, int]] = {}

    def update(self, batch: Dict[str, Any]) -> None:
        self._by_reader[int(batch["reader"])] = dict(batch["bad_samples"])

    @property
    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for counts in self._by_reader.values():
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
