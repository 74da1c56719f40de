"""Helpers of the trainer tests: run ``tests/train/driver.py`` under the deepspeed launcher (or
alone) in a subprocess, with the CPU environment, and read what the jobs left behind."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Optional

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "train" / "driver.py"
DEEPSPEED = pathlib.Path(sys.executable).parent / "deepspeed"

# 3 SGD steps with momentum and a constant learning rate: the update is proportional to the
# gradient (Adam would hide a gradient counted twice), so parameter equality tests the gradients.
SGD = [
    'optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}',
    "scheduler=null",
    "zero_allow_untested_optimizer=true",
    "gradient_clipping=0",
    # ZeRO-3: partition even the tiny parameters, so gathering is exercised.
    "zero_optimization.stage3_param_persistence_threshold=0",
]
COMMON = [
    "batch.global_batch_size=24",
    "train.num_steps=3",
    "logging.progress_bar=false",
    "checkpoint.at_end=false",
    "eval.at_end=false",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> Dict[str, str]:
    e = dict(os.environ)
    e.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def job(name: str, ds_config: str, ds_set=(), set_=(), resume: Optional[str] = None) -> dict:
    return {"name": name, "ds_config": str(REPO / "ds_configs" / ds_config), "ds_set": list(ds_set),
            "set": list(set_), "resume": resume}


def write_jobs(directory: pathlib.Path, jobs: List[dict], name: str = "jobs.json") -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(jobs, indent=1))
    return path


def run_jobs(jobs_path: pathlib.Path, num_ranks: int, timeout: int = 900) -> None:
    """Run a jobs file with ``num_ranks`` ranks: the deepspeed launcher, or plain python for 1."""
    if num_ranks == 1:
        cmd = [sys.executable, str(DRIVER), str(jobs_path)]
    else:
        cmd = [str(DEEPSPEED), "--num_gpus", str(num_ranks), "--master_port", str(free_port()),
               str(DRIVER), str(jobs_path)]
    log = jobs_path.with_suffix(".log")
    with open(log, "w") as f:
        proc = start(cmd, f)
        rc = wait(proc, timeout)
    if rc != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({rc}):\n" + log.read_text()[-6000:])


def start(cmd: List[str], log) -> subprocess.Popen:
    """Start a launcher in its own process group (so that a timeout can end its ranks too)."""
    return subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def wait(proc: subprocess.Popen, timeout: int) -> int:
    """Exit code of ``proc``; on timeout kill its whole process group and return -9."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def params(run_dir: pathlib.Path) -> Dict[str, torch.Tensor]:
    return torch.load(run_dir / "params.pt")


def summary(run_dir: pathlib.Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def csv_losses(run_dir: pathlib.Path) -> Dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def max_abs_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)

