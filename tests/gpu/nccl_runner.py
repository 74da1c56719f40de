"""Run a torchrun worker script on every GPU of this host (up to 4) for the NCCL tests.

The workers run in their own processes with ``TRITON_INTERPRET=0`` whatever the test session set
(tests/conftest.py turns the interpreter on for the CPU suite), so ``python -m pytest tests/gpu``
runs them on a GPU machine as it is."""

import os
import subprocess
import sys

import pytest
import torch

NEEDS_TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def run_worker(worker: str, timeout: int = 600) -> None:
    """torchrun ``worker`` on min(GPUs, 4) processes; fails with its output on a non-zero exit."""
    n = min(torch.cuda.device_count(), 4)
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", worker],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
