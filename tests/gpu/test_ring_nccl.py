"""The ring loss on NCCL across the GPUs of one host (skipped with fewer than 2 GPUs): every rank's
loss and its data-parallel-mean gradients against the float64 reference of the global batch, for
the Triton and torch backends, bf16 and fp32, unequal per-rank sizes, one direction with hard
negatives and symmetric (see ``ring_nccl_worker.py``, which torchrun runs).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_ring_nccl.py
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs 2 CUDA GPUs and TRITON_INTERPRET=0", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_nccl_worker.py")


def test_ring_on_nccl_matches_reference():
    n = min(torch.cuda.device_count(), 4)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER],
        capture_output=True, text=True, timeout=600,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
