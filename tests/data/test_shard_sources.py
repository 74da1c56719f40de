"""Shard sources without a manifest (issue 13, item 2): a folder, a brace pattern, a '::'-joined
string or a list of those; each shard's sample count from sizes.json, else the manifest, else
counted once from the tar headers and cached in sizes.json; clear errors for sources that name
nothing."""

import io
import json
import logging
import os
import tarfile

import pytest

from ds_infcl.data import ImageTextShards, ImageTransform, ShardList, resolve_shards
from ds_infcl.data import shards as shards_module
from ds_infcl.data.shards import write_image_text_shards
from tests.data.conftest import make_records

TRANSFORM = ImageTransform(4, (0.0,) * 3, (1.0,) * 3)


@pytest.fixture
def folder(tmp_path):
    """23 samples in train-000000..000004.tar (5, 5, 5, 5, 3) with the writer's train.json."""
    out = tmp_path / "shards"
    write_image_text_shards(make_records(23), str(out), prefix="train", samples_per_shard=5, mtime=0)
    (out / "README.txt").write_text("not a shard")
    return out


def names(folder, *ids):
    return [str(folder / f"train-{i:06d}.tar") for i in ids]


def test_folder_pattern_joined_and_list(folder):
    whole = resolve_shards(str(folder))
    assert whole.urls == names(folder, 0, 1, 2, 3, 4)  # every *.tar, sorted
    assert whole.sizes == [5, 5, 5, 5, 3] and whole.num_samples == 23
    assert set(whole.sizes_from) == {str(folder / "train.json")}  # our manifest
    assert resolve_shards(folder).urls == whole.urls  # a PathLike folder
    assert resolve_shards(str(folder / "train-{000000..000004}.tar")).urls == whole.urls
    joined = resolve_shards(names(folder, 4)[0] + "::" + str(folder / "train-{000000..000001}.tar"))
    assert joined.urls == names(folder, 4, 0, 1) and joined.sizes == [3, 5, 5] and joined.num_samples == 13
    listed = resolve_shards([str(folder / "train-{000002..000003}.tar"), str(folder)])
    assert listed.urls == names(folder, 2, 3, 0, 1, 2, 3, 4)
    assert list(listed) == listed.urls and len(listed) == 7 and listed.size_of(names(folder, 4)[0]) == 3
    assert resolve_shards(whole) is whole


def test_sizes_json_comes_first(folder):
    (folder / "sizes.json").write_text(json.dumps({"train-000001.tar": 7}))
    got = resolve_shards(str(folder))
    assert got.sizes == [5, 7, 5, 5, 3]
    assert got.sizes_from[1] == str(folder / "sizes.json") and got.sizes_from[0] == str(folder / "train.json")


def test_counted_once_and_cached_in_sizes_json(folder, caplog):
    os.remove(folder / "train.json")
    # a member without an image (caption only) is not a sample
    with tarfile.open(folder / "train-000004.tar", "a") as tar:
        info = tarfile.TarInfo("000000999.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"orph"))
    with caplog.at_level(logging.INFO, logger="ds_infcl.data.shards"):
        counted = resolve_shards(str(folder))
    assert counted.sizes == [5, 5, 5, 5, 3] and counted.num_samples == 23
    assert counted.sizes_from == ["counted"] * 5
    assert "counting the samples of 5 shard(s)" in caplog.text
    assert json.loads((folder / "sizes.json").read_text()) == {  # OpenCLIP's format
        "train-000000.tar": 5, "train-000001.tar": 5, "train-000002.tar": 5, "train-000003.tar": 5,
        "train-000004.tar": 3,
    }
    again = resolve_shards(str(folder / "train-{000003..000004}.tar"))
    assert again.sizes == [5, 3] and set(again.sizes_from) == {str(folder / "sizes.json")}


def test_counts_kept_in_memory_when_the_folder_is_not_writable(folder, monkeypatch, caplog):
    os.remove(folder / "train.json")

    def refuse(path, obj):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shards_module, "_write_json_atomic", refuse)
    with caplog.at_level(logging.INFO, logger="ds_infcl.data.shards"):
        counted = resolve_shards(str(folder))
    assert counted.sizes == [5, 5, 5, 5, 3] and counted.sizes_from == ["counted"] * 5
    assert not (folder / "sizes.json").exists()
    assert f"cannot write {folder / 'sizes.json'}" in caplog.text and "kept in memory" in caplog.text


def test_damaged_shard_has_no_count_and_the_given_total_stands_in(folder, caplog):
    os.remove(folder / "train.json")
    shard = folder / "train-000002.tar"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with caplog.at_level(logging.INFO, logger="ds_infcl.data.shards"):
        got = resolve_shards(str(folder))
    assert got.sizes == [5, 5, None, 5, 3] and got.num_samples is None
    assert f"shard {shard} at byte" in caplog.text
    assert not (folder / "sizes.json").exists()  # never cache a count that might be short
    assert resolve_shards(str(folder), num_samples=23).num_samples == 23
    assert resolve_shards(str(folder), count=False).sizes == [None] * 5


def test_remote_sources_are_neither_checked_nor_counted():
    got = resolve_shards("pipe:curl -s https://example.invalid/s-{0..2}.tar", num_samples=300)
    assert len(got.urls) == 3 and got.sizes == [None] * 3 and got.num_samples == 300


def test_what_a_shard_source_can_be_in_every_error(tmp_path, folder):
    help_text = "a shard source is a folder"
    with pytest.raises(ValueError, match=f"{tmp_path / 'nope'}.* does not exist; {help_text}"):
        resolve_shards(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"the folder {tmp_path / 'empty'} holds no .tar file; {help_text}"):
        resolve_shards(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"names 5 of 10 files that do not exist, first '.*train-000005.tar'"):
        resolve_shards(str(folder / "train-{000000..000009}.tar"))
    with pytest.raises(ValueError, match=f"empty list; {help_text}"):
        resolve_shards([])
    with pytest.raises(ValueError, match="empty shard source"):
        resolve_shards(str(folder) + "::")
    # the pipeline takes the same sources and refuses the same way, before reading anything
    with pytest.raises(ValueError, match="first '.*train-000005.tar'"):
        ImageTextShards(str(folder / "train-{000000..000009}.tar"), image_transform=TRANSFORM, batch_size=2)


def test_pipeline_reads_a_folder_and_a_shard_list(folder):
    ds = ImageTextShards(str(folder), image_transform=TRANSFORM, batch_size=100, shuffle_shards=False)
    assert ds.shard_sizes == dict(zip(names(folder, 0, 1, 2, 3, 4), [5, 5, 5, 5, 3]))
    (batch,) = list(ds)
    assert batch["idx"].tolist() == list(range(23))
    os.remove(folder / "train.json")
    shards = resolve_shards(str(folder))
    assert isinstance(shards, ShardList)
    ds = ImageTextShards(shards, image_transform=TRANSFORM, batch_size=100, shuffle_shards=False)
    assert ds.shard_sizes == dict(zip(names(folder, 0, 1, 2, 3, 4), [5, 5, 5, 5, 3]))
    assert list(ds)[0]["idx"].tolist() == list(range(23))
