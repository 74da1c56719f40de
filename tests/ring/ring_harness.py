"""Spawn a gloo process group on CPU, run many cases per spawn, bring the results back.

Spawning costs seconds, so each test spawns once per world size and runs a list of cases in the
workers; the assertions run in the pytest process against the fp64 reference on the gathered
batch. Workers write ``rank{r}.pt`` into a temporary folder; a hang becomes a timeout error.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Callable, List

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, fn, payload, pg_timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    result = None
    try:
        if world > 0:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
            )
        result = fn(rank, world, payload)
    except BaseException:  # reported to the parent, which fails the test with the traceback
        result = {"__error__": traceback.format_exc()}
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if world > 0 and dist.is_initialized():
            dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker threads can still own work objects
    # (autograd collectives such as OpenCLIP's keep some alive) when Python tears them down, and
    # the worker then aborts ("terminate called without an active exception") after its result is
    # written, which failed a whole test now and then. The trainer's entry points do the same
    # (ds_infcl.train.dist.exit_process, which also removes a layout file's name left by a group
    # that made one exchange only).
    from ds_infcl.train.dist import exit_process

    exit_process(0)


def spawn(fn: Callable, world: int, payload=None, timeout: float = 120.0, pg_timeout: float = 60.0) -> List:
    """Run ``fn(rank, world, payload)`` on ``world`` gloo ranks; list of per-rank results.

    ``fn`` must be importable (a module-level function). ``pg_timeout`` is the gloo group's
    collective timeout. Raises ``TimeoutError`` if the group does not finish within ``timeout``
    seconds, ``RuntimeError`` with a worker's traceback if one
    failed.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world, free_port(), out_dir, fn, payload, pg_timeout), nprocs=world, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world}-rank group did not finish within {timeout} s")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if isinstance(res, dict) and "__error__" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['__error__']}")
    return results


def record_calls(owner, name: str, note: Callable = lambda result: 1) -> list:
    """Replace ``owner.<name>`` (a module or object of the calling worker process) by a wrapper
    that appends ``note(result)`` to the returned list on every call, then returns the result."""
    plain = getattr(owner, name)
    calls: list = []

    def recording(*args, **kwargs):
        result = plain(*args, **kwargs)
        calls.append(note(result))
        return result

    setattr(owner, name, recording)
    return calls
