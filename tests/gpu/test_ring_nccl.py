"""The ring loss on NCCL across the GPUs of one host (skipped with fewer than 2 GPUs): every rank's
loss and its data-parallel-mean gradients against the float64 reference of the global batch, for
the Triton and torch backends, bf16 and fp32, unequal per-rank sizes, one direction with hard
negatives and symmetric (see ``ring_nccl_worker.py``, which torchrun runs).

    python -m pytest -q -s tests/gpu/test_ring_nccl.py
"""

import os

from tests.gpu.nccl_runner import NEEDS_TWO_GPUS, run_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_nccl_worker.py")


@NEEDS_TWO_GPUS
def test_ring_on_nccl_matches_reference():
    run_worker(WORKER)
