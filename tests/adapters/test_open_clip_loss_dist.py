"""The drop-in ``ClipLoss`` (ds_infcl.adapters.open_clip_loss) against OpenCLIP's own ``ClipLoss``
on 2 and 3 gloo ranks, for every combination of ``local_loss`` and ``gather_with_grad``: the same
loss on every rank (OpenCLIP's local mean with ``local_loss=True``, the global loss without) and
the same per-rank gradients of the image and text features and of the scale. It used to ignore
both flags (the global loss and the exact gradients whatever they said)."""

import pytest
import torch

from tests.adapters.open_clip_dist_worker import FLAGS, worker
from tests.loss.openclip_ref import openclip_loss_module
from tests.ring.ring_harness import spawn

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(openclip_loss_module() is None, reason="open_clip_torch is not installed")]


@pytest.mark.parametrize("world", [2, 3])
def test_flags_match_openclip_on_every_rank(world):
    results = spawn(worker, world, {"b": 5, "c": 12}, timeout=180)
    for n, flags in enumerate(FLAGS):
        for rank, res in enumerate(results):
            ours, theirs = res[n]["ours"], res[n]["theirs"]
            what = f"{flags}, rank {rank} of {world}"
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), what
            torch.testing.assert_close(ours["dimg"], theirs["dimg"], rtol=1e-4, atol=1e-6, msg=what)
            torch.testing.assert_close(ours["dtxt"], theirs["dtxt"], rtol=1e-4, atol=1e-6, msg=what)
            assert ours["ds"] == pytest.approx(theirs["ds"], rel=1e-4, abs=1e-6), what
        # The flags differ where OpenCLIP's do: local means per rank, gradients that are not the
        # exact ones unless both flags are set (so a drop-in that ignored them could not pass).
        losses = [res[n]["theirs"]["loss"] for res in results]
        assert (max(losses) - min(losses) > 1e-3) == flags["local_loss"], (flags, losses)
