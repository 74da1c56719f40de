"""Bad shards and bad samples are skipped wherever they are read and counted exactly (issue 13,
item 5): one epoch's samples read plus the samples counted as lost equals the samples written,
for one reader and for several; read_captions skips damaged shards with a warning naming them."""

import io
import json
import logging
import os
import tarfile
import warnings
from types import SimpleNamespace

import pytest

from ds_infcl.data import BadSampleTally, ImageTextShards, ImageTransform, image_text_loader, read_captions
from ds_infcl.data import image_text as image_text_module
from ds_infcl.data.retrieval import MalformedTally, RetrievalExample, iter_retrieval_shards, write_retrieval_shards
from ds_infcl.data.shards import ShardReport, iter_shard_samples, write_image_text_shards
from tests.data.conftest import make_records

TRANSFORM = ImageTransform(4, (0.0,) * 3, (1.0,) * 3)
NUM_WRITTEN = 30  # 6 shards of 5


def _member_offsets(path):
    """Header offset of each member, in order."""
    with tarfile.open(path) as tar:
        return [m.offset for m in tar.getmembers()]


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.fixture
def damaged(tmp_path):
    """Six shards of five samples (idx 0..29), damaged as follows:

    shard 0: intact                         5 read
    shard 1: idx 6 undecodable image, idx 7 without a caption      3 read, 2 bad samples
    shard 2: cut in the middle of idx 12's image                   2 read, 3 lost
    shard 3: not a tar file at all                                 0 read, 5 lost
    shard 4: cut at the member boundary before idx 23 (tarfile's own reader ends there quietly)
                                                                   3 read, 2 lost
    shard 5: intact                         5 read
    """
    out = tmp_path / "shards"
    records = make_records(NUM_WRITTEN)
    records[6]["image"] = b"\x89PNG\r\n\x1a\n not a png at all"
    write_image_text_shards(records, str(out), prefix="train", samples_per_shard=5, mtime=0)
    shard = [str(out / f"train-{i:06d}.tar") for i in range(6)]
    # idx 7 without its caption: no .txt member, no "caption" in the json
    with tarfile.open(shard[1]) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard[1], "w") as tar:
        for m, data in members:
            if m.name == "000000007.txt":
                continue
            if m.name == "000000007.json":
                data = json.dumps({"idx": 7, "label": 1}).encode()
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    offsets = _member_offsets(shard[2])
    with tarfile.open(shard[2]) as tar:
        cut_image = tar.getmember("000000012.png")
    _truncate(shard[2], cut_image.offset_data + 10)
    with open(shard[3], "wb") as f:
        f.write(b"this is not a tar file\n" * 100)
    offsets = _member_offsets(shard[4])
    boundary = offsets[3 * 3]  # the header of idx 23's first member
    _truncate(shard[4], boundary)
    return SimpleNamespace(folder=out, pattern=str(out / "train-{000000..000005}.tar"), shard=shard,
                           cut_image=cut_image, boundary=boundary,
                           read=[0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 20, 21, 22, 25, 26, 27, 28, 29])


def _epoch(urls, world_size, num_workers, monkeypatch, **kwargs):
    """(indices read, summed counts) of one epoch over all ranks and (simulated) workers."""
    read, counts = [], {}
    for rank in range(world_size):
        for worker in range(num_workers):
            info = SimpleNamespace(id=worker, num_workers=num_workers) if num_workers > 1 else None
            monkeypatch.setattr(image_text_module, "get_worker_info", lambda: info)
            ds = ImageTextShards(urls, image_transform=TRANSFORM, rank=rank, world_size=world_size,
                                 **{"batch_size": 2, **kwargs})
            for batch in ds:
                read += batch["idx"].tolist()
            for reason, n in ds.bad_samples.items():
                counts[reason] = counts.get(reason, 0) + n
    return read, counts


@pytest.mark.parametrize("split", ["shard", "sample"])
@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (2, 1), (2, 2)])
def test_read_plus_counted_equals_written(damaged, monkeypatch, split, world_size, num_workers):
    read, counts = _epoch(damaged.pattern, world_size, num_workers, monkeypatch, split=split,
                          shuffle_buffer=4, seed=1)
    assert sorted(read) == damaged.read  # nothing twice, nothing invented
    assert counts == {"bad_image": 1, "missing_caption": 1, "lost_in_bad_shard": 10}
    assert len(read) + sum(counts.values()) == NUM_WRITTEN


def test_warnings_name_the_shard_and_the_byte(damaged, caplog):
    ds = ImageTextShards(damaged.shard, image_transform=TRANSFORM, batch_size=4, shuffle_shards=False)
    with caplog.at_level(logging.WARNING, logger="ds_infcl.data.image_text"):
        list(ds)
    text = caplog.text
    cut, boundary = damaged.cut_image.offset, damaged.boundary
    assert f"damaged shard {damaged.shard[2]} at byte {cut}: member '000000012.png' is cut short" in text
    assert "2 of its 5 samples read, 3 lost" in text
    assert f"damaged shard {damaged.shard[3]} at byte 0: cannot be opened as a tar file" in text
    assert f"damaged shard {damaged.shard[4]} at byte {boundary}: the shard ends without its end-of-archive" in text
    assert f"{damaged.shard[1]}:000000006" in text and f"{damaged.shard[1]}:000000007" in text  # bad samples


def test_unknown_sizes_count_at_least_one_per_bad_shard(damaged, monkeypatch, caplog):
    os.remove(damaged.folder / "train.json")
    with caplog.at_level(logging.WARNING, logger="ds_infcl.data.image_text"):
        read, counts = _epoch(damaged.pattern, 2, 1, monkeypatch)
    assert sorted(read) == damaged.read
    assert counts == {"bad_image": 1, "missing_caption": 1, "bad_tar": 3}
    assert caplog.text.count("the number of samples lost is unknown") == 3


def test_clean_shard_shorter_than_its_size_is_counted(damaged, monkeypatch):
    (damaged.folder / "sizes.json").write_text(json.dumps({"train-000005.tar": 8}))
    read, counts = _epoch(damaged.shard[5], 1, 1, monkeypatch)
    assert len(read) == 5 and counts == {"missing_from_shard": 3}


def test_real_workers_carry_the_counts(damaged):
    ds = ImageTextShards(damaged.pattern, image_transform=TRANSFORM, batch_size=3)
    tally, read = BadSampleTally(), 0
    for batch in image_text_loader(ds, num_workers=2):
        tally.update(batch)
        read += len(batch["idx"])
    assert tally.counts == {"bad_image": 1, "missing_caption": 1, "lost_in_bad_shard": 10}
    assert read + tally.total == NUM_WRITTEN


def test_drop_last_counts_the_dropped_samples(damaged, monkeypatch):
    read, counts = _epoch(damaged.pattern, 1, 1, monkeypatch, drop_last=True, batch_size=4)
    assert len(read) == 16 and counts["dropped_last_batch"] == 2
    assert len(read) + sum(counts.values()) == NUM_WRITTEN


def test_read_captions_skips_damaged_shards(damaged, caplog):
    reports = []
    with caplog.at_level(logging.WARNING, logger="ds_infcl.data.image_text"):
        captions = read_captions(damaged.pattern, damaged=reports)
    expected = [f"caption {i}" for i in damaged.read + [6] if i != 7]  # idx 6's caption is fine
    assert sorted(captions) == sorted(expected)
    assert [r.url for r in reports] == [damaged.shard[2], damaged.shard[3], damaged.shard[4]]
    for r in reports:
        assert f"damaged shard {r.url} at byte {r.offset}" in caplog.text
    assert reports[2].offset == damaged.boundary


def test_shard_reader_reports_where_it_stopped(damaged):
    report = ShardReport(damaged.shard[4])
    keys = [s["__key__"] for s in iter_shard_samples(damaged.shard[4], report)]
    assert keys == ["000000020", "000000021", "000000022"]
    assert report.num_samples == 3 and report.offset == damaged.boundary and report.damaged
    # tarfile itself ends quietly at that boundary: the damage would go unnoticed
    with tarfile.open(damaged.shard[4]) as tar:
        assert len(tar.getmembers()) == 9
    clean = ShardReport(damaged.shard[0])
    assert len(list(iter_shard_samples(damaged.shard[0], clean))) == 5 and not clean.damaged


def test_retrieval_shards_count_the_examples_a_damaged_shard_lost(tmp_path):
    examples = [RetrievalExample(f"query {i}", [f"pos {i}"]) for i in range(12)]
    write_retrieval_shards(examples, str(tmp_path), prefix="rt", samples_per_shard=4, mtime=0)
    shard = str(tmp_path / "rt-000001.tar")
    _truncate(shard, _member_offsets(shard)[1])  # keep idx 4, lose 5, 6, 7
    tally = MalformedTally()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(iter_retrieval_shards(str(tmp_path / "rt-{000000..000002}.tar"), tally=tally))
    assert [e.idx for e in got] == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    assert tally.counts == {"lost in damaged shard": 3} and len(got) + tally.total == 12
    assert any(f"{shard} at byte" in str(w.message) for w in caught)
    os.remove(tmp_path / "rt.json")  # without the manifest the loss is unknown: counted once
    tally = MalformedTally()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        list(iter_retrieval_shards(str(tmp_path / "rt-{000000..000002}.tar"), tally=tally))
    assert tally.counts == {"unreadable shard": 1}


@pytest.mark.parametrize("sizes_known", [True, False])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_damaged_shard_is_counted_and_warned_about_once_per_run(damaged, monkeypatch, caplog, sizes_known,
                                                                  world_size):
    """An endless stream reads every shard once per epoch: a damaged shard used to be counted (and
    warned about) at every read, so its loss grew with the number of epochs. Bad samples are
    skipped each time they are read; a shard's damage counts once."""
    if not sizes_known:
        os.remove(damaged.folder / "train.json")
    with caplog.at_level(logging.WARNING, logger="ds_infcl.data.image_text"):
        counts = {}
        for rank in range(world_size):
            monkeypatch.setattr(image_text_module, "get_worker_info", lambda: None)
            ds = ImageTextShards(damaged.pattern, image_transform=TRANSFORM, rank=rank, world_size=world_size,
                                 batch_size=1, repeat=True, seed=3)
            stream = iter(ds)
            for _ in range(4 * len(damaged.read) // world_size):  # about four epochs
                next(stream)
            for reason, n in ds.bad_samples.items():
                counts[reason] = counts.get(reason, 0) + n
    shard_counts = {k: v for k, v in counts.items() if k in ("lost_in_bad_shard", "bad_tar")}
    assert shard_counts == ({"lost_in_bad_shard": 10} if sizes_known else {"bad_tar": 3}), counts
    assert counts["bad_image"] >= 2 * world_size  # bad samples: at every read
    for shard in damaged.shard[2:5]:
        assert caplog.text.count(f"damaged shard {shard} ") == 1, caplog.text


def test_a_resampled_reader_counts_a_damaged_shard_once(damaged):
    ds = ImageTextShards(damaged.pattern, image_transform=TRANSFORM, batch_size=1, resampled=True, seed=0)
    stream = iter(ds)
    for _ in range(120):  # about 40 draws of 6 shards: each damaged one drawn several times
        next(stream)
    assert ds.bad_samples["lost_in_bad_shard"] == 10 and ds.bad_samples["bad_image"] > 1, ds.bad_samples
