"""The fused distributed InfoNCE on NCCL across the GPUs of one host (skipped with fewer than 2
GPUs): ``labels=None`` against explicit diagonal labels and the float64 reference, both
algorithms, Triton, bf16 and fp32 (see ``ring_fused_nccl_worker.py``, which torchrun runs); and the
default call's input checks agreed by every rank after its forward is queued, with no synchronizing
operation (``agreed_checks_nccl_worker.py``).

    python -m pytest -q -s tests/gpu/test_ring_fused_nccl.py
"""

import os

from tests.gpu.nccl_runner import NEEDS_TWO_GPUS, run_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_fused_nccl_worker.py")
AGREED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agreed_checks_nccl_worker.py")


@NEEDS_TWO_GPUS
def test_fused_infonce_on_nccl_matches_reference():
    run_worker(WORKER)


@NEEDS_TWO_GPUS
def test_default_call_agrees_on_its_checks_without_a_sync():
    run_worker(AGREED)
