"""``bench/ring_trace.py`` on 2 gloo ranks: each rank prints its per-call times and writes its
trace and timeline; without torchrun it says how to launch it."""

import os
import re
import subprocess
import sys

import pytest

from ds_infcl.train.dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "ds_infcl", "bench", "ring_trace.py")


@pytest.mark.parametrize("loss", [["--algorithm", "ring"], ["--loss", "siglip", "--check", "default"]], ids=["infonce", "siglip"])
def test_two_ranks_write_their_traces(tmp_path, loss):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT,
           "--batch", "64", "--dim", "16", "--reps", "2", "--tag", "t", "--out", str(tmp_path)] + loss
    stem = "siglip" if "siglip" in loss else "infonce"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        m = re.search(rf"\[t\] rank {rank} b 64 ms per call: \[([0-9., ]+)\]", out.stdout)
        assert m and len(m.group(1).split(",")) == 2, out.stdout
        assert (tmp_path / f"{stem}_t_b64_rank{rank}.json").stat().st_size > 0
        assert (tmp_path / f"{stem}_t_b64_rank{rank}_kernels.txt").exists()


def test_without_torchrun_says_how():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, SCRIPT], env=dict(env, PYTHONPATH=REPO), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "run under torchrun" in out.stderr


def test_idle_gaps_of_a_synthetic_trace():
    """Union over streams, the call's window by launch time, the launch lag and the frames."""
    from ds_infcl.bench.ring_trace import format_gaps, idle_gaps

    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "tid": 7,
                "args": {"correlation": corr}}

    def kernel(corr, name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
                "args": {"correlation": corr}}

    events = [
        launch(1, 10), launch(2, 20), launch(3, 500), launch(4, 1500),
        kernel(1, "k1", 50, 100, 1), kernel(2, "k2", 100, 200, 2), kernel(3, "k3", 600, 100, 1),
        kernel(4, "k4", 1600, 100, 1),  # launched after the window: another call's
        {"ph": "X", "cat": "python_function", "name": "ds_infcl/loss/api.py(10): contrastive_loss", "ts": 0,
         "dur": 1000, "tid": 7},
        {"ph": "X", "cat": "python_function", "name": "ds_infcl/loss/ring_fused.py(150): backward", "ts": 400,
         "dur": 200, "tid": 7},
        {"ph": "X", "cat": "python_function", "name": "torch/autograd/graph.py(800): run", "ts": 450,
         "dur": 100, "tid": 7},
        {"ph": "X", "cat": "python_function", "name": "ds_infcl/other.py(1): elsewhere", "ts": 450,
         "dur": 100, "tid": 8},
    ]
    g = idle_gaps(events, (0, 1000))
    assert (g["host_us"], g["span_us"], g["busy_us"], g["idle_us"], g["lead_us"]) == (1000, 650, 350, 300, 50)
    assert g["gaps"] == [(300, "k2", "k3", 200, "loss/ring_fused.py(150): backward < loss/api.py(10): contrastive_loss")]
    lines = format_gaps("[t]", 0, g)
    assert "idle 0.30 ms" in lines[0] and "k2" in lines[1] and "+200.0 us into it" in lines[1]
    assert idle_gaps(events, (2000, 3000))["gaps"] == []
