"""Shards round-trip: writer -> pipeline gives back every image, caption, index and label; bad
samples are skipped and counted; the shard writer command reads folders and tables."""

import csv
import json
import os
import tarfile

import numpy as np
import pytest
import torch

from ds_infcl.data import BadSampleTally, ImageTextShards, ImageTransform, expand_shard_urls, read_manifest
from ds_infcl.data.shards import sample_key, write_image_text_shards
from ds_infcl.data.write_shards import main as write_shards_main
from tests.data.conftest import make_records, png_bytes

IDENTITY = dict(image_transform=ImageTransform(4, (0.0,) * 3, (1.0,) * 3))


def _read_all(urls, **kwargs):
    ds = ImageTextShards(urls, batch_size=kwargs.pop("batch_size", 4), shuffle_shards=False, **IDENTITY, **kwargs)
    return ds, list(ds)


def test_manifest_and_brace_pattern(shard_dir, tmp_path):
    assert shard_dir["pattern"] == "train-{000000..000004}.tar"
    assert shard_dir["shard_sizes"] == [5, 5, 5, 5, 3]
    assert shard_dir["num_samples"] == 23
    urls = expand_shard_urls(shard_dir["urls"])
    assert [os.path.basename(u) for u in urls] == [f"train-{i:06d}.tar" for i in range(5)]
    assert all(os.path.exists(u) for u in urls)
    assert read_manifest(str(tmp_path / "shards" / "train.json"))["urls"] == shard_dir["urls"]
    # "::" joins patterns, as webdataset does
    assert len(expand_shard_urls(shard_dir["urls"] + "::" + urls[0])) == 6
    with tarfile.open(urls[0]) as tar:
        assert tar.getnames()[:3] == ["000000000.png", "000000000.txt", "000000000.json"]


def test_round_trip_images_captions_indices_labels(shard_dir):
    records = {r["idx"]: r for r in make_records(23)}
    ds, batches = _read_all(shard_dir["urls"], batch_size=4)
    assert [len(b["text"]) for b in batches] == [4, 4, 4, 4, 4, 3]  # partial last batch kept
    idx = torch.cat([b["idx"] for b in batches]).tolist()
    assert idx == list(range(23))  # no shuffling: shard order, then member order
    for b in batches:
        assert b["image"].dtype == torch.float32 and b["image"].shape[1:] == (3, 4, 4)
        for image, text, i, label in zip(b["image"], b["text"], b["idx"].tolist(), b["label"].tolist()):
            expected = torch.tensor(records[i]["pixels"], dtype=torch.float32).permute(2, 0, 1) / 255
            torch.testing.assert_close(image, expected)
            assert text == f"caption {i}" and label == i % 3
        assert b["bad_samples"] == {}
    assert ds.bad_samples == {}


def test_drop_last_and_tokenizer_hook(shard_dir):
    def tokenize(texts):
        return {"input_ids": torch.tensor([[len(t)] for t in texts])}

    _, batches = _read_all(shard_dir["urls"], batch_size=4, drop_last=True, tokenizer=tokenize)
    assert [len(b["text"]) for b in batches] == [4] * 5
    assert batches[0]["input_ids"].shape == (4, 1)


def test_corrupt_samples_are_skipped_and_counted(tmp_path):
    records = make_records(8)
    records[2]["image"] = b"\x89PNG\r\n\x1a\n this is not a png"  # undecodable image
    records[5]["image"] = records[5]["image"][:30]  # truncated png
    write_image_text_shards(records, str(tmp_path), prefix="bad", samples_per_shard=4)
    # a sample without an image and one with broken json, appended by hand
    with tarfile.open(tmp_path / "bad-000001.tar", "a") as tar:
        for name, data in [(f"{sample_key(100)}.txt", b"caption only"),
                           (f"{sample_key(101)}.png", png_bytes(np.zeros((4, 4, 3), np.uint8))),
                           (f"{sample_key(101)}.txt", b"broken json"),
                           (f"{sample_key(101)}.json", b"{not json")]:
            import io

            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds, batches = _read_all(str(tmp_path / "bad-{000000..000001}.tar"), batch_size=3)
    idx = sorted(torch.cat([b["idx"] for b in batches]).tolist())
    assert idx == [0, 1, 3, 4, 6, 7]
    assert ds.bad_samples == {"bad_image": 2, "missing_image": 1, "bad_json": 1}
    tally = BadSampleTally()
    for b in batches:
        tally.update(b)
    assert tally.counts == ds.bad_samples and tally.total == 4


def test_truncated_shard_is_skipped_and_counted(shard_dir):
    urls = expand_shard_urls(shard_dir["urls"])
    with open(urls[1], "r+b") as f:  # cut the second shard in the middle of a member
        f.truncate(os.path.getsize(urls[1]) // 2 + 100)
    ds, batches = _read_all(shard_dir["urls"], batch_size=4)
    idx = torch.cat([b["idx"] for b in batches]).tolist()
    assert set(range(5)) <= set(idx) and set(range(10, 23)) <= set(idx)  # other shards intact
    assert len(idx) == len(set(idx))
    assert sum(ds.bad_samples.values()) >= 1


def test_index_falls_back_to_numeric_key_and_caption_to_json(tmp_path):
    import io

    with tarfile.open(tmp_path / "plain.tar", "w") as tar:
        for name, data in [("000000042.jpg", _jpeg()), ("000000042.json", json.dumps({"caption": "from json"}).encode()),
                           ("photo_a.png", png_bytes(np.zeros((4, 4, 3), np.uint8))), ("photo_a.txt", b"no index")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    _, batches = _read_all(str(tmp_path / "plain.tar"), batch_size=8)
    assert batches[0]["idx"].tolist() == [42, -1]
    assert batches[0]["text"] == ["from json", "no index"]


def _jpeg():
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((6, 8, 3), 128, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def test_writer_rejects_duplicate_indices(tmp_path):
    records = make_records(3)
    records[2]["idx"] = 0
    with pytest.raises(ValueError, match="duplicate sample index 0"):
        write_image_text_shards(records, str(tmp_path))


def test_write_shards_command_from_folder(tmp_path, capsys):
    src = tmp_path / "pairs"
    (src / "sub").mkdir(parents=True)
    pixels = np.zeros((4, 4, 3), np.uint8)
    (src / "a.png").write_bytes(png_bytes(pixels))
    (src / "a.txt").write_text("first caption")
    (src / "sub" / "b.jpeg").write_bytes(_jpeg())
    (src / "sub" / "b.json").write_text(json.dumps({"caption": "second caption", "label": 1}))
    (src / "c.webp").write_bytes(b"not a webp")
    (src / "c.txt").write_text("corrupt image")
    (src / "d.png").write_bytes(png_bytes(pixels))  # no caption
    write_shards_main(["--folder", str(src), "--out", str(tmp_path / "out"), "--prefix", "f", "--verify",
                       "--start-index", "1000"])
    out = capsys.readouterr().out
    assert "wrote 2 samples" in out and "skipped 2" in out
    _, batches = _read_all(str(tmp_path / "out" / "f-000000.tar"), batch_size=8)
    assert batches[0]["text"] == ["first caption", "second caption"]
    assert batches[0]["idx"].tolist() == [1000, 1003]  # sorted paths: a, c, d, sub/b
    assert batches[0]["label"].tolist() == [-1, 1]


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_write_shards_command_from_table(tmp_path, fmt):
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(5):
        (tmp_path / "img" / f"{i}.png").write_bytes(png_bytes(np.full((4, 4, 3), i, np.uint8)))
        rows.append({"filepath": f"img/{i}.png", "title": f"picture {i}", "label": i})
    rows.append({"filepath": "img/missing.png", "title": "gone", "label": 9})
    table = tmp_path / f"pairs.{fmt}"
    if fmt == "csv":
        with open(table, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["filepath", "title", "label"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        table.write_text("\n".join(json.dumps(r) for r in rows))
    write_shards_main([f"--{fmt}", str(table), "--out", str(tmp_path / "out"), "--samples-per-shard", "2"])
    manifest = read_manifest(str(tmp_path / "out" / "shard.json"))
    assert manifest["shard_sizes"] == [2, 2, 1]
    _, batches = _read_all(manifest["urls"], batch_size=8)
    assert batches[0]["text"] == [f"picture {i}" for i in range(5)]
    assert batches[0]["idx"].tolist() == list(range(5))
    assert batches[0]["image"][3].mul(255).round().unique().tolist() == [3.0]


def test_table_without_known_columns_names_the_option(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("pic,words\na.png,hello\n")
    with pytest.raises(ValueError, match="--image-column"):
        write_shards_main(["--csv", str(table), "--out", str(tmp_path / "o")])
