"""``bench/ring_trace.py`` on 2 gloo ranks: each rank prints its per-call times and writes its
trace and timeline; without torchrun it says how to launch it."""

import os
import re
import subprocess
import sys

from ds_infcl.train.dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "ds_infcl", "bench", "ring_trace.py")


def test_two_ranks_write_their_traces(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT,
           "--batch", "64", "--dim", "16", "--reps", "2", "--algorithm", "ring", "--tag", "t", "--out", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        m = re.search(rf"\[t\] rank {rank} b 64 ms per call: \[([0-9., ]+)\]", out.stdout)
        assert m and len(m.group(1).split(",")) == 2, out.stdout
        assert (tmp_path / f"ring_t_b64_rank{rank}.json").stat().st_size > 0
        assert (tmp_path / f"ring_t_b64_rank{rank}_kernels.txt").exists()


def test_without_torchrun_says_how():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, SCRIPT], env=dict(env, PYTHONPATH=REPO), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "run under torchrun" in out.stderr
