"""``Rebatch`` accounting: over worker batches of uneven sizes (an epoch's short last batches
included), with a device decoder that rejects some images, every sample is either in exactly one
output batch, counted as ``bad_image``, or counted as ``dropped_last_batch``; deferred counts
(``defer_counts``, the clip task's setting) add up to the same totals as immediate ones."""

import pytest
import torch

from ds_infcl.data.image_text import BadSampleTally
from ds_infcl.data.rebatch import Rebatch


def _raw(sizes, bad_every):
    start = 0
    for r, n in enumerate(sizes):
        idx = torch.arange(start, start + n)
        yield {"image": {"idx": idx}, "idx": idx, "text": [f"t{i}" for i in idx.tolist()],
               "bad_samples": {"bad_json": r}, "reader": 0}
        start += n


def _decoder(bad_every):
    def decode(packed):
        idx = packed["idx"]
        ok = (idx % bad_every) != 0
        return idx.float()[:, None] * 10, ok, [f"image {i}" for i in idx[~ok].tolist()]
    return decode


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("sizes,batch_size", [([3, 5, 1, 4, 2, 7, 3], 4), ([6, 6, 2, 6, 6, 2], 5), ([1] * 9, 3),
                                              ([4, 0, 4], 4)])
def test_every_sample_is_trained_bad_or_dropped_once(sizes, batch_size, defer):
    tally = BadSampleTally()
    rebatch = Rebatch(_raw(sizes, 4), batch_size, tally, decoder=_decoder(4), defer_counts=defer)
    out = []
    for b in rebatch:
        rebatch.count(b)
        assert len(b["idx"]) == len(b["text"]) == len(b["image"]) == batch_size
        assert torch.equal(b["image"][:, 0], b["idx"].float() * 10)  # images stay with their samples
        assert b["text"] == [f"t{i}" for i in b["idx"].tolist()]
        out.extend(b["idx"].tolist())
    total = sum(sizes)
    bad = [i for i in range(total) if i % 4 == 0]
    assert len(out) == len(set(out)) and out == sorted(out)
    dropped = sorted(set(range(total)) - set(out) - set(bad))
    assert not set(out) & set(bad) and all(i > max(out) for i in dropped)  # only the tail is dropped
    counts = tally.counts
    assert counts.get("bad_image", 0) == len(bad)
    assert counts.get("dropped_last_batch", 0) == len(dropped) < batch_size
    assert counts["bad_json"] == len(sizes) - 1  # the reader's last running count
