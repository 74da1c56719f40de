"""The learning-rate schedule as a run applies it (one CPU process, the shipped ZeRO-2 fp32 JSON
with its WarmupCosineLR, ``"auto"`` lengths): the first step trains (DeepSpeed's schedulers would
run the first two steps of a linear warm-up at lr 0); the CSV's ``lr`` is the one each step used;
a resume whose schedule would differ from the saved one (``train.num_steps`` changed under
``"auto"`` lengths) is refused with a config error (exit 2), not continued with a jump in lr.
Also the run's other start-up and mid-run errors: a bad ``--resume`` path, NaN features."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO2 = os.path.join(ROOT, "ds_configs", "zero2_fp32.json")
BASE_LR = 5e-4  # the shipped optimizer's lr


def _run(tmp_path, num_steps, *extra):
    cfg = {
        "task": {"name": "synthetic", "args": {"input_dim": 16, "embed_dim": 8}},
        "batch": {"global_batch_size": 16},
        "train": {"num_steps": num_steps, "seed": 0},
        "logging": {"every_steps": 1, "progress_bar": False},
        "eval": {"at_end": False},
        "checkpoint": {"every_steps": 4, "at_end": True, "export_final": False},
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO2, "--config", str(path),
                           *extra], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_first_step_trains_logged_lr_is_applied_and_resume_keeps_the_schedule(tmp_path):
    proc = _run(tmp_path, 40)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.csv") as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f)]
    warmup = 40 // 20  # "auto": num_steps / 20

    def expected(k):  # step k runs at WarmupCosineLR's iteration k
        if k < warmup:
            return BASE_LR * k / warmup
        progress = min(1.0, (k - warmup + 1) / (40 - warmup))
        return BASE_LR * (1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi * progress)) / 2)

    assert lrs[0] == pytest.approx(BASE_LR / warmup) and lrs[0] > 0
    assert lrs == pytest.approx([expected(k) for k in range(1, 41)])
    assert lrs[-1] == pytest.approx(BASE_LR * 1e-4)  # the schedule ends on its last step
    # Resuming the finished run with more steps would stretch the "auto" schedule: refused.
    proc = _run(tmp_path, 80, "--resume")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "resuming would make the lr jump" in proc.stderr


def test_bad_resume_path_and_nan_step_are_one_line_errors(tmp_path):
    """A bad ``--resume PATH`` is a config error (exit 2) before anything is built; NaN features
    name the step they appeared in."""
    proc = _run(tmp_path, 4, "--resume", str(tmp_path / "no_such_checkpoint"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: --resume" in proc.stderr and "no checkpoint there" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run(tmp_path, 4, "--set", "task.name=tests.train.nan_task:NanTask")
    assert proc.returncode != 0
    assert "step 2: query has 16 of 16 rows with NaN or Inf values" in proc.stderr, proc.stderr[-2000:]
