"""How the benchmarks launch a case: the ``deepspeed`` launcher or a plain process on chosen GPUs,
in its own process group with a timeout, its status read from its exit and log; the GPUs of the
machine from ``nvidia-smi`` (the launching process creates no CUDA context). Used by
``ds_infcl.bench.engine`` and ``ds_infcl.bench.jpeg_step``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from ds_infcl.train.dist import free_port

__all__ = ["launcher_command", "trainer_args"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(cmd, log_path: str, timeout: float, exit_codes=None, env_extra=None):
    """Run one case's command (the repository on its ``PYTHONPATH``, output to ``log_path``, its own
    process group, killed after ``timeout`` seconds); returns ``(status, wall seconds, log text)``,
    status ``ok``, ``failed``, ``oom``, ``timeout`` or ``exit_codes[rc]``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    if "--include" in cmd:  # _gpu_selection: the launcher sees every GPU and picks the named ones
        env.pop("CUDA_VISIBLE_DEVICES", None)
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else (exit_codes or {}).get(rc, "failed")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = "timeout"
    wall = time.time() - t0
    text = open(log_path, errors="replace").read()
    if status == "failed" and ("OutOfMemoryError" in text or "CUDA out of memory" in text):
        status = "oom"
    return status, wall, text


def _gpu_selection(num_gpus: int, ids: Optional[List[str]] = None) -> List[str]:
    """The launcher's GPU arguments. The ``deepspeed`` launcher ignores ``CUDA_VISIBLE_DEVICES``
    once ``--num_gpus`` is given (it would run on GPUs 0..N-1), so a set ``CUDA_VISIBLE_DEVICES``
    (or ``ids``, the GPUs of one side of ``--side-by-side``) becomes ``--include localhost:<ids>``
    (and is taken out of the launcher's environment by ``_launch``): two benchmarks can run side by
    side on GPUs 0 and 1 of one host."""
    if ids:
        return ["--include", "localhost:" + ",".join(ids)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return ["--num_gpus", str(num_gpus)]
    ids = [i.strip() for i in visible.split(",") if i.strip()]
    if len(ids) != num_gpus or not all(i.isdigit() for i in ids):
        raise SystemExit(f"CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)} GPU(s) but --num-gpus is {num_gpus}: "
                         "name exactly --num-gpus GPU indices (digits), or unset CUDA_VISIBLE_DEVICES")
    return ["--include", "localhost:" + ",".join(ids)]


def trainer_args(deepspeed_config: str, run_path: str, ds_set=()) -> List[str]:
    """``ds_infcl.train``'s arguments for a benchmark case: no lr schedule, clipping at 1.0, torch's
    AdamW, then ``ds_set``'s overrides."""
    out = ["--deepspeed_config", deepspeed_config, "--config", run_path,
           "--ds-set", "scheduler=null", "--ds-set", "gradient_clipping=1.0",
           # torch.optim.AdamW (fused on CUDA): no JIT build of FusedAdam in every fresh machine
           "--ds-set", "optimizer.params.torch_adam=true"]
    for extra in ds_set:
        out += ["--ds-set", extra]
    return out


def launcher_command(num_gpus: int, trainer: List[str], ids: Optional[List[str]] = None) -> List[str]:
    """The ``deepspeed`` launcher running ``ds_infcl.train`` with ``trainer`` on ``num_gpus`` GPUs
    (``_gpu_selection``), on a free port."""
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [launcher, *_gpu_selection(num_gpus, ids), "--master_port", str(free_port()), "--module", "ds_infcl.train",
            *trainer]


def _case_row(status: str, wall: float, **case) -> Dict:
    """A table row: the ``case``'s columns, then ``status``, the measured columns left empty (a case
    that ran fills them from its summary) and the wall time."""
    return {**case, "status": status, "samples_per_s": "", "samples_per_s_per_gpu": "", "step_time_s": "",
            "peak_mem_gib": "", "kept": "", "wall_s": round(wall, 1)}


def _summary(out: str) -> Dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _visible_gpu_ids() -> List[str]:
    """The GPU indices this process may use: ``CUDA_VISIBLE_DEVICES``, else every GPU nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return [i.strip() for i in visible.split(",") if i.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def _gpu_info() -> Dict[str, object]:
    """Name and memory of the GPUs from nvidia-smi: this process must not create a CUDA context
    (it would hold device memory while the measured cases run)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"name": "no GPU (nvidia-smi not found)", "mem_gib": None}
    name, mem = [x.strip() for x in out[0].split(",")]
    return {"name": f"{len(out)} x {name}", "mem_gib": float(mem) / 1024}
