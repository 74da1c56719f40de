"""Process set-up around DeepSpeed: environment defaults, the CPU shared-memory-op patch, devices.

CPU facts (../shared/notes and DESIGN.md section 5): on a machine without a GPU DeepSpeed picks
its CPU accelerator and gloo; ``init_distributed`` would JIT-compile a shared-memory op (about a
minute) that training never uses, so ``skip_cpu_shm_op_build`` replaces its builder first.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from typing import Optional

import torch

from ds_infcl.exits import run_exit_calls

__all__ = [
    "accelerator_name",
    "skip_cpu_shm_op_build",
    "ensure_single_process_env",
    "init_distributed",
    "is_comm_failure",
    "ProgressWatchdog",
    "local_device",
    "free_port",
    "shutdown",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerator_name() -> str:
    """DeepSpeed's accelerator name (``"cuda"``, ``"cpu"``, ...)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"  # explicit: silences DeepSpeed's detection warning
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def skip_cpu_shm_op_build() -> None:
    """On the CPU accelerator, stop ``init_distributed`` from JIT-building the shm comm op.

    ``deepspeed.comm`` re-exports ``torch``, so ``import deepspeed.comm.torch`` gives the wrong
    module: the patch must go through ``sys.modules``.
    """
    if accelerator_name() != "cpu":
        return
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def ensure_single_process_env() -> bool:
    """Without a launcher (no ``RANK``/``WORLD_SIZE``), set the variables of a 1-rank world.

    Returns ``True`` if it set them.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return True


def init_distributed(timeout_s: Optional[float] = None) -> None:
    """Initialize ``deepspeed.comm`` once per process (gloo on CPU, NCCL on CUDA); ``timeout_s``
    bounds every collective's wait for a peer (``dist.timeout_s`` of the run config)."""
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    skip_cpu_shm_op_build()
    ensure_single_process_env()
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    # NCCL: let a timed-out collective raise in the process instead of hanging it.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=False, **kwargs)
    elif getattr(deepspeed.comm, "cdb", None) is None:
        deepspeed.init_distributed(verbose=False, **kwargs)


def is_comm_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer died, hung past the timeout or the
    network failed (gloo, NCCL, the TCP store)."""
    import torch.distributed as dist

    error_types = tuple(t for t in (getattr(dist, "DistError", None),) if t is not None)
    if error_types and isinstance(exc, error_types):
        return True
    text = str(exc)
    markers = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
               "timed out", "NCCL error", "ncclRemoteError", "ProcessGroupGloo", "ProcessGroupNCCL",
               "Socket Timeout", "connection refused")
    return isinstance(exc, RuntimeError) and any(m in text for m in markers)


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) or ``cpu``."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    acc.set_device(local_rank)
    return torch.device(acc.device_name(local_rank))


def exit_process(code: int) -> None:
    """Leave the process now with ``code``, after flushing logging and stdio, without interpreter
    finalization.

    For process entry points only (``python -m ds_infcl.train``, ``ds-infcl-train``, the
    distributed benchmarks, spawned workers), after :func:`shutdown`. Our exit cleanups
    (``ds_infcl.exits.at_exit``: a layout file in ``/dev/shm`` whose name is still there, an
    extracted tree) run first, since ``os._exit`` skips ``atexit``. On 2-rank CPU runs a rank has
    still aborted now and then at interpreter exit ("terminate called without an active
    exception", exit code -6, after its last checkpoint was written), so a finished run reported
    failure: gloo's worker threads can still own communication work objects (ZeRO-3 keeps async
    handles in its parameters) when Python's finalization destroys them. Everything a run writes
    is closed before this point.
    """
    import logging

    run_exit_calls()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def shutdown() -> None:
    """Barrier, then destroy the process group: leaving it to interpreter exit has aborted a rank
    now and then ("terminate called without an active exception" from a live gloo thread)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


class ProgressWatchdog:
    """Ends this process when the run makes no progress for ``timeout_s`` seconds.

    A collective waiting for a peer that hung (stopped, deadlocked, partitioned) may wait far
    longer than the process group's timeout (groups DeepSpeed creates keep torch's default, and
    NCCL only notices through its watchdog). The loop calls ``beat()`` after every step, evaluation
    and checkpoint; a daemon thread prints one line naming this rank and the timeout, then leaves
    with status 1 (``os._exit``: no interpreter shutdown that could wait on the hung collective),
    and the launcher ends the other local ranks.
    """

    def __init__(self, timeout_s: float, rank: int, what: str = "dist.timeout_s"):
        import threading
        import time

        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.what = what
        self._time = time.monotonic
        self._last = self._time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_infcl-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = self._time()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = max(0.2, min(5.0, self.timeout_s / 8))
        while not self._stop.wait(period):
            idle = self._time() - self._last
            if idle > self.timeout_s:
                print(f"[ds_infcl] rank {self.rank}: lost contact with the other ranks: no step finished for "
                      f"{idle:.0f} s ({self.what}={self.timeout_s:g} s); a peer process died or hung, or the "
                      "network failed; ending this rank", file=sys.stderr, flush=True)
                os._exit(1)
