"""The fused distributed InfoNCE on NCCL across the GPUs of one host (skipped with fewer than 2
GPUs): ``labels=None`` against explicit diagonal labels and the float64 reference, both
algorithms, Triton, bf16 and fp32 (see ``ring_fused_nccl_worker.py``, which torchrun runs).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_ring_fused_nccl.py
"""

import os
import subprocess
import sys

import pytest
import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or _INTERPRET:
    pytest.skip("needs 2 CUDA GPUs and TRITON_INTERPRET=0", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_fused_nccl_worker.py")


def test_fused_infonce_on_nccl_matches_reference():
    n = min(torch.cuda.device_count(), 4)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER],
        capture_output=True, text=True, timeout=600,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
