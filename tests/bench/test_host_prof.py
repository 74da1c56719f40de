"""``python -m ds_infcl.bench.host_prof`` on 2 gloo ranks: the operator table, and with ``--phases``
each rank's host time per step of the distributed call; ``--phases`` outside torchrun is a usage
error. And ``ds_infcl.bench.comm_probe``'s collectives on the same 2 gloo ranks."""

import os
import re
import subprocess
import sys

from ds_infcl.train.dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_phases_on_two_ranks():
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "ds_infcl.bench.host_prof", "--batch", "12", "--dim", "8", "--calls", "3", "--profiled-calls", "1",
           "--algorithms", "gather", "ring", "--phases"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for alg, fn in (("gather", "GatherInfoNCEFunction"), ("ring", "RingInfoNCEFunction")):
        for rank in (0, 1):
            block = re.search(rf"== {alg} b=12 rank {rank}: host ms per call median [0-9.]+, max [0-9.]+ "
                              rf"\(call \d of 3\)\n((?:   .*\n)+)", out.stdout)
            assert block, out.stdout
            steps = dict(re.findall(r"^   (\S+)\s+([0-9.]+) ms/call", block.group(1), re.M))
            assert {f"{fn}.forward", f"{fn}.backward", "exchange_layout"} <= set(steps), steps
            # inclusive: the Function's forward holds its collectives
            assert float(steps[f"{fn}.forward"]) > 0
    assert "| gather | 12 |" in out.stdout and "| ring | 12 |" in out.stdout


def test_phases_needs_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-m", "ds_infcl.bench.host_prof", "--phases"], env=dict(env, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "--phases times the steps of the distributed call: run under torchrun" in out.stderr


def test_comm_probe_on_two_gloo_ranks():
    """``ds_infcl.bench.comm_probe`` on CPU: the collectives' rows (the GPU rows need CUDA)."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "ds_infcl.bench.comm_probe", "--batch", "32", "--dim", "8", "--reps", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"^\| (.+) \| ([0-9.]+) \|$", out.stdout, re.M)
    assert [name for name, _ in rows] == ["all-gather of the keys [32, 8] float32",
                                         "reduce-scatter of their gradient [64, 8] float32",
                                         "all-gather of column statistics [64] float32"], out.stdout
    assert all(float(ms) > 0 for _, ms in rows)
    assert "deprecated" not in out.stderr
