"""Splitting by rank and by DataLoader worker: every epoch covers each sample exactly once over
all readers (no duplicates, no gaps), in shard and sample mode, finite and endless; resampling
and the shuffle buffer are deterministic under a seed."""

from collections import Counter
from itertools import islice
from types import SimpleNamespace

import pytest
import torch

from ds_infcl.data import ImageTextShards, ImageTransform, image_text_loader
from ds_infcl.data import image_text as image_text_module

TRANSFORM = ImageTransform(4, (0.0,) * 3, (1.0,) * 3)
NUM_SAMPLES = 23  # the shard_dir fixture: shards of 5, 5, 5, 5, 3


def _reader_indices(urls, rank, world_size, worker, num_workers, monkeypatch, take=None, **kwargs):
    """Indices one reader (rank, worker) yields, with the worker simulated in-process."""
    info = SimpleNamespace(id=worker, num_workers=num_workers) if num_workers > 1 else None
    monkeypatch.setattr(image_text_module, "get_worker_info", lambda: info)
    ds = ImageTextShards(urls, image_transform=TRANSFORM, batch_size=1, rank=rank, world_size=world_size, **kwargs)
    batches = iter(ds) if take is None else islice(iter(ds), take)
    return [int(b["idx"]) for b in batches]


@pytest.mark.parametrize("split", ["shard", "sample"])
@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("shuffle_buffer", [0, 7])
def test_one_epoch_no_duplicates_no_gaps(shard_dir, monkeypatch, split, world_size, num_workers, shuffle_buffer):
    seen = []
    for rank in range(world_size):
        for worker in range(num_workers):
            seen += _reader_indices(
                shard_dir["urls"], rank, world_size, worker, num_workers, monkeypatch,
                split=split, shuffle_buffer=shuffle_buffer, seed=3,
            )
    assert sorted(seen) == list(range(NUM_SAMPLES))


def test_sample_split_serves_more_readers_than_shards(shard_dir, monkeypatch):
    # 5 shards, 4 ranks x 2 workers = 8 readers: shard mode would leave readers empty
    per_reader = [
        _reader_indices(shard_dir["urls"], r, 4, w, 2, monkeypatch, split="sample")
        for r in range(4) for w in range(2)
    ]
    assert sorted(sum(per_reader, [])) == list(range(NUM_SAMPLES))
    assert all(len(p) in (2, 3) for p in per_reader)  # balanced: 23 = 7 x 3 + 2


def test_shard_split_refuses_more_ranks_than_shards(shard_dir):
    with pytest.raises(ValueError, match="cannot feed 6 ranks"):
        ImageTextShards(shard_dir["urls"], image_transform=TRANSFORM, batch_size=1, rank=0, world_size=6)


def test_repeat_covers_every_epoch_exactly_once(shard_dir, monkeypatch):
    # sample mode with 2 ranks x 2 workers: over 3 epochs, reader k takes 3 * 23 / 4 samples
    # (rounded per reader), and the union holds every index exactly 3 times.
    num_slots, epochs = 4, 3
    total = NUM_SAMPLES * epochs
    takes = [total // num_slots + (1 if s < total % num_slots else 0) for s in range(num_slots)]
    seen = []
    for rank in range(2):
        for worker in range(2):
            slot = rank * 2 + worker
            seen += _reader_indices(
                shard_dir["urls"], rank, 2, worker, 2, monkeypatch, take=takes[slot],
                split="sample", repeat=True,
            )
    assert Counter(seen) == {i: epochs for i in range(NUM_SAMPLES)}


def test_repeat_reshuffles_shards_each_epoch(shard_dir, monkeypatch):
    first_two_epochs = _reader_indices(
        shard_dir["urls"], 0, 1, 0, 1, monkeypatch, take=2 * NUM_SAMPLES, repeat=True, seed=1
    )
    epoch0, epoch1 = first_two_epochs[:NUM_SAMPLES], first_two_epochs[NUM_SAMPLES:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(NUM_SAMPLES))
    assert epoch0 != epoch1


def test_set_epoch_changes_the_order_deterministically(shard_dir, monkeypatch):
    def order(epoch):
        monkeypatch.setattr(image_text_module, "get_worker_info", lambda: None)
        ds = ImageTextShards(shard_dir["urls"], image_transform=TRANSFORM, batch_size=1, shuffle_buffer=10, seed=5)
        ds.set_epoch(epoch)
        return [int(b["idx"]) for b in ds]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(1)) == list(range(NUM_SAMPLES))


def test_resampled_is_endless_seeded_and_differs_between_readers(shard_dir, monkeypatch):
    def stream(rank, seed):
        return _reader_indices(shard_dir["urls"], rank, 2, 0, 1, monkeypatch, take=60, resampled=True, seed=seed)

    a = stream(0, seed=0)
    assert len(a) == 60  # more than one epoch: endless
    assert a == stream(0, seed=0)
    assert a != stream(1, seed=0)
    assert a != stream(0, seed=1)
    assert set(a) <= set(range(NUM_SAMPLES))


def test_real_dataloader_workers(shard_dir):
    """Two worker processes per rank, two ranks: the union of all batches is the data set."""
    seen, readers = [], set()
    for rank in range(2):
        ds = ImageTextShards(shard_dir["urls"], image_transform=TRANSFORM, batch_size=2, rank=rank, world_size=2)
        for batch in image_text_loader(ds, num_workers=2):
            seen += batch["idx"].tolist()
            readers.add(batch["reader"])
            assert isinstance(batch["image"], torch.Tensor) and batch["bad_samples"] == {}
    assert sorted(seen) == list(range(NUM_SAMPLES))
    assert readers == {0, 1, 2, 3}
