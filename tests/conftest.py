"""Test-wide environment, set before any kernel module is imported.

TRITON_INTERPRET=1 lets the Triton kernels run on CPU (it must be set before ``@triton.jit``
decorates them). DS_ACCELERATOR=cpu makes DeepSpeed pick the CPU accelerator without a warning.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
