"""The clip task's data report is exact with ``worker_batch_size`` and a prefetch thread: the bad
samples it reports after ``k`` batches are those of the batches handed to the trainer, not of the
raw batches the prefetch thread read ahead (which vary with its timing)."""

import time

import pytest

from ds_infcl.tasks.clip import ClipTask
from tests.data.test_device_decode import DAMAGED_STREAM, damaged_images, write


@pytest.fixture(scope="module")
def damaged_pattern(tmp_path_factory):
    bad = damaged_images()
    return write(tmp_path_factory.mktemp("damaged") / "s", [bad[n] for n in DAMAGED_STREAM], per_shard=7)


def _report_after(pattern, k, prefetch, settle):
    task = ClipTask(None, train_shards=pattern, arch="tiny", tokenizer_kind="bpe", vocab_size=100,
                    shuffle_buffer=0, worker_batch_size=3, prefetch_batches=prefetch)
    task.build_towers()
    stream = task.batches(rank=0, world_size=1, local_batch_size=4, start_step=0, seed=3)
    taken = [next(stream)["sample_index"].tolist() for _ in range(k)]
    time.sleep(settle)  # the prefetch thread runs ahead as far as its queue lets it
    report = task.data_report()
    stream.close()
    return taken, report


@pytest.mark.parametrize("k", [1, 2, 3])
def test_bad_sample_counts_do_not_include_batches_read_ahead(damaged_pattern, k):
    inline = _report_after(damaged_pattern, k, prefetch=0, settle=0.0)
    ahead = _report_after(damaged_pattern, k, prefetch=2, settle=0.5)
    assert ahead[0] == inline[0]  # the same batches
    assert ahead[1] == inline[1]
