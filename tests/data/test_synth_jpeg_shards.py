"""The synthetic JPEG shards (img2dataset layout) that the data-path benchmark reads."""

import io
import json
import os
import tarfile

import pytest

from ds_infcl.data import resolve_shards
from ds_infcl.data.synth_jpeg_shards import main, render_sample, write_synth_jpeg_shards


def test_layout_sizes_and_determinism(tmp_path):
    from PIL import Image

    one = write_synth_jpeg_shards(str(tmp_path / "a"), num_samples=7, samples_per_shard=3, image_size=40)
    two = write_synth_jpeg_shards(str(tmp_path / "b"), num_samples=7, samples_per_shard=3, image_size=40,
                                  processes=2)
    assert one["sizes"] == two["sizes"] == {"00000.tar": 3, "00001.tar": 3, "00002.tar": 1}
    for name in one["sizes"]:  # one process per shard writes the same bytes as one process for all
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert json.loads((tmp_path / "a" / "sizes.json").read_text()) == one["sizes"]
    assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".")]  # no partial shard left
    shards = resolve_shards(str(tmp_path / "a"), count=False)
    assert shards.sizes == [3, 3, 1]  # the loader takes the sizes from sizes.json
    with tarfile.open(tmp_path / "a" / "00001.tar") as tar:
        names = tar.getnames()
        assert names[:3] == ["000000003.jpg", "000000003.txt", "000000003.json"]
        meta = json.loads(tar.extractfile("000000004.json").read())
        image = Image.open(io.BytesIO(tar.extractfile("000000004.jpg").read()))
        caption = tar.extractfile("000000004.txt").read().decode()
    assert meta["key"] == "000000004" and meta["caption"] == caption and meta["status"] == "success"
    assert (meta["width"], meta["height"]) == image.size == (40, 40) and image.format == "JPEG"
    with pytest.raises(ValueError, match="samples_per_shard must be >= 1"):
        write_synth_jpeg_shards(str(tmp_path / "c"), num_samples=3, samples_per_shard=0)


def test_images_are_distinct_and_sized_like_web_jpegs_at_256px():
    samples = [render_sample(i, image_size=256) for i in range(6)]
    sizes = [len(data) for data, _ in samples]
    assert all(10_000 < n < 40_000 for n in sizes), sizes  # img2dataset's 256 px JPEGs: ~15-30 KB
    assert len({data for data, _ in samples}) == 6 and len({c for _, c in samples}) == 6
    assert render_sample(3, image_size=256) == samples[3]  # a function of the index and the seed
    assert render_sample(3, image_size=256, seed=1) != samples[3]


def test_command_line(tmp_path, capsys):
    main(["--out", str(tmp_path / "s"), "--num-samples", "4", "--samples-per-shard", "2", "--image-size", "32",
          "--processes", "2"])
    assert "wrote 4 samples in 2 shards" in capsys.readouterr().out
