"""No host synchronization inside the GradCache chunk loop (issue 16), on a CUDA GPU:

    python -m pytest -q -s tests/gpu/test_step_syncs_gpu.py

With ``torch.cuda.set_sync_debug_mode("warn")`` every operation that makes the host wait for the
device (an ``.item()``, a ``bool`` of a device tensor, a blocking copy) warns. A step of 2 chunks
and a step of 8 chunks over the same local batch must warn the same number of times: what a step
synchronizes (the loss read back once, the loss's input checks) does not depend on the number of
chunks, so nothing inside the loop over chunks waits for the GPU. The stand-in engine of
``tests/train/test_steps.py`` keeps DeepSpeed's own work out of the count.
"""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ds_infcl.loss import ContrastiveLoss  # noqa: E402
from ds_infcl.tasks.synthetic import SyntheticTask  # noqa: E402
from ds_infcl.train.model import ContrastiveModel  # noqa: E402
from ds_infcl.train.steps import grad_cache_step  # noqa: E402
from tests.train.test_steps import FakeEngine  # noqa: E402

DEVICE = torch.device("cuda")
LOCAL = 64


def _syncs(num_chunks: int, copy_stream: bool) -> int:
    torch.manual_seed(0)
    task = SyntheticTask()
    model = ContrastiveModel(task.build_towers(), ContrastiveLoss(symmetric=True, impl="infcl")).to(DEVICE)
    batch = next(task.batches(rank=0, world_size=1, local_batch_size=LOCAL, start_step=0, seed=0))
    batch = batch.map(lambda t: t.pin_memory())
    chunk = LOCAL // num_chunks
    # Warm-up step: kernel compilation, allocator growth, lazy CUDA state.
    grad_cache_step(FakeEngine(model, num_chunks), batch, chunk, DEVICE, copy_stream=copy_stream)
    torch.cuda.synchronize()
    engine = FakeEngine(model, num_chunks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            grad_cache_step(engine, batch, chunk, DEVICE, copy_stream=copy_stream)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize("copy_stream", [True, False])
def test_syncs_do_not_grow_with_the_chunks(copy_stream):
    # The first counted step of a process sees one more synchronization than every later one (on an
    # H200, torch 2.11: 4 then 3, with either chunk count first), a once-per-process cost that a
    # warm-up step of the same model does not absorb; count after one discarded measurement.
    _syncs(4, copy_stream)
    few, many = _syncs(2, copy_stream), _syncs(8, copy_stream)
    print(f"copy_stream={copy_stream}: {few} synchronizing operations with 2 chunks, {many} with 8")
    assert few == many, (few, many)
    assert few >= 1  # the loss is read back once: the count sees synchronizations at all
