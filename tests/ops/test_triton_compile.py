"""The Triton LSE kernels and the Gluon forward and backward compile for Hopper (sm_90) with CI's
Triton, on the CPU machine (the Gluon kernels cannot run in the interpreter at all: this is their
CPU check).

The CPU tests run the kernels under TRITON_INTERPRET=1, which executes Python semantics: it
accepts code that the compiler rejects (a name bound in one branch of a constexpr ``if`` only, a
value whose type differs between the branches of an ``if``). Such code would first fail on the
GPU. Here every flag combination the launchers use is compiled ahead of time for sm_90
(``ds_infcl.bench.triton_sass --all-variants``, in a subprocess without the interpreter) and must
produce a kernel.
"""

import os
import subprocess
import sys

import pytest
import triton
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(TOOLS, "ptxas")), reason="Triton's NVIDIA tools are not installed")
def test_every_kernel_variant_compiles_for_hopper():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "ds_infcl.bench.triton_sass", "--all-variants"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # fwd: 1 + 3 variants, fwd_rows: 1 + 2, fwd_redo: 1 + 1, bwd: 1 + 6, the Gluon (Hopper)
    # bwd_gluon: 1 + 5 and fwd_gluon: 1 + 3
    assert len(lines) == 26, proc.stdout
    for ln in lines:
        assert "failed" not in ln and "regs " in ln, ln
