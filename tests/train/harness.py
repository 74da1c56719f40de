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
import time
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


def run_jobs_on_gpu(jobs_path: pathlib.Path, timeout: int = 900) -> str:
    """Run a jobs file in one process on this machine's GPU (the CUDA accelerator and the compiled
    Triton kernels, not the CPU test environment); the log of the run, which must succeed."""
    gpu_env = {k: v for k, v in env().items() if k != "DS_ACCELERATOR"}
    gpu_env["TRITON_INTERPRET"] = "0"
    proc = subprocess.run([sys.executable, str(DRIVER), str(jobs_path)], capture_output=True, text=True,
                          timeout=timeout, env=gpu_env, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return log


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


def launch_train(cfg_path: pathlib.Path, ds_config: str, log, extra=(), ranks: int = 2,
                 env_extra: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """Start ``deepspeed --module ds_infcl.train`` on ``ranks`` CPU ranks (own process group)."""
    cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module",
           "ds_infcl.train", "--deepspeed_config", ds_config, "--config", str(cfg_path), *extra]
    return subprocess.Popen(cmd, env={**env(), **(env_extra or {})}, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)


def metrics_rows(run_dir: pathlib.Path) -> List[dict]:
    """The rows of ``run_dir/metrics.csv`` so far (none before the file exists)."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def wait_for_steps(run_dir: pathlib.Path, n: int, proc: subprocess.Popen, event: str, timeout: int = 240) -> None:
    """Wait until ``n`` steps are logged; fail if ``proc`` ends first or ``timeout`` s pass
    (``event`` names what the test does next, for the failure message)."""
    t0 = time.time()
    while len(metrics_rows(run_dir)) < n:
        assert proc.poll() is None, f"the job ended before {event}"
        assert time.time() - t0 < timeout, f"the job did not reach the step of {event}"
        time.sleep(0.2)


def write_run_config(directory: pathlib.Path, num_steps: int, **sections: dict) -> pathlib.Path:
    """Write a run config of the synthetic task (global batch 16, a metrics row every step, no
    checkpoint unless ``sections`` says so, output in ``directory/run``) as the next
    ``directory/run<i>.json``; each of ``sections`` is merged into that section of the config."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {
        "task": {"name": "synthetic", "args": {"input_dim": 16, "embed_dim": 8, "num_samples": 512}},
        "batch": {"global_batch_size": 16},
        "train": {"num_steps": num_steps, "seed": 0},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "eval": {"at_end": False},
        "checkpoint": {"every_steps": 0, "at_end": False, "export_final": False},
        "output_dir": str(directory / "run"),
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = directory / f"run{len(list(directory.glob('run*.json')))}.json"
    path.write_text(json.dumps(cfg))
    return path


def one_run(run_config: dict, ds_config: dict, timeout: int = 300) -> dict:
    """``tests/train/one_run.py`` in a fresh process (a 1-rank world, no launcher):
    ``{"steps", "error", "message", "output"}``."""
    proc = subprocess.run([sys.executable, "-m", "tests.train.one_run", json.dumps(run_config), json.dumps(ds_config)],
                          capture_output=True, text=True, timeout=timeout, env=env(), cwd=str(REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ONE_RUN ")]
    assert lines, f"one_run printed no outcome (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {**json.loads(lines[-1][len("ONE_RUN "):]), "output": proc.stdout + proc.stderr}
