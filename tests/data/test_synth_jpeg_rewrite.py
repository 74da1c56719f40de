"""``write_synth_jpeg_shards`` into a folder that already holds shards: a rerun of the same size
rewrites them, but a smaller run must not leave the earlier run's extra shards beside its
``sizes.json`` (a folder is read as every ``.tar`` in it: they would train, or be benchmarked,
silently, with their own image size)."""

import os

import pytest

from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards


def test_a_smaller_rewrite_refuses_to_leave_stale_shards(tmp_path):
    out = str(tmp_path / "s")
    write_synth_jpeg_shards(out, num_samples=6, samples_per_shard=2, image_size=16)
    again = write_synth_jpeg_shards(out, num_samples=6, samples_per_shard=2, image_size=16)  # same layout: fine
    assert again["num_samples"] == 6
    with pytest.raises(ValueError, match="00002.tar"):
        write_synth_jpeg_shards(out, num_samples=2, samples_per_shard=2, image_size=16)
    assert sorted(n for n in os.listdir(out) if n.endswith(".tar")) == ["00000.tar", "00001.tar", "00002.tar"]
