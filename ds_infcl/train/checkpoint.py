"""Checkpoints: DeepSpeed's engine checkpoint plus what a resumed run needs to continue as if it
had never stopped.

Layout under the checkpoint directory (one tag per saved step)::

    latest                         # the newest *complete* tag (DeepSpeed's format, written by us)
    step00000100/
        mp_rank_00_model_states.pt # DeepSpeed: module (towers + loss module with logit_scale),
        *optim_states.pt           #   optimizer and scheduler state (ZeRO shards per rank),
                                   #   and our client_state under "ds_infcl"
        rng_rank00000.pt           # ours: this rank's Python, NumPy, torch CPU and CUDA RNG states
                                   #   (tensors and plain values: loads with weights_only=True)
        ds_infcl_checkpoint.json   # ours, written last: step, world size, ZeRO stage, batch, lr schedule

Writing is ordered so that a process killed at any moment never leaves a checkpoint that
``--resume`` would pick up half-written: every rank writes its files, all ranks meet at a barrier,
rank 0 writes ``ds_infcl_checkpoint.json`` (the tag's completion record), and only then points
``latest`` at the tag by an atomic rename. ``--resume auto`` follows ``latest``; a tag without
its completion record is refused (an explicit path) or skipped for the newest complete one.
A resume on another number of ranks is checked against the record before anything is loaded
(``check_world_size``).

``client_state["ds_infcl"]`` holds ``step`` (optimizer steps done: the data position of an
index-addressed task), ``samples`` (global samples consumed), the task's ``state_dict`` (data
position of a streaming task), ``world_size`` and the run config. RNG states are per rank because
each rank draws its own dropout masks; DeepSpeed writes ``client_state`` from rank 0 only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Dict, Optional, Tuple

import torch

from ds_infcl import settings

__all__ = [
    "tag_for_step", "save_checkpoint", "load_checkpoint", "resolve_resume", "rng_state", "set_rng",
    "read_record", "check_world_size", "RECORD",
]

_CLIENT_KEY = "ds_infcl"
RECORD = "ds_infcl_checkpoint.json"
# Fault injection for the tests (tests/train/test_faults.py): the step whose checkpoint write is
# cut short by killing rank 0 after the DeepSpeed files and before the completion record.
_KILL_IN_CHECKPOINT = "DS_INFCL_TEST_KILL_IN_CHECKPOINT"


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def rng_state(device: torch.device) -> Dict[str, Any]:
    """This process's RNG states as tensors and plain values (``torch.load(weights_only=True)``)."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng(state: Dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_record(ckpt_dir: str, tag: str) -> Optional[Dict[str, Any]]:
    """The completion record of ``ckpt_dir/tag`` (``None``: the tag was never completed)."""
    path = os.path.join(ckpt_dir, tag, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_checkpoint(
    engine, ckpt_dir: str, step: int, run_state: Dict[str, Any], device: torch.device, keep_last: int = 0
) -> str:
    """Save the engine and ``run_state`` as tag ``step<step>``; all ranks call it. Returns the tag."""
    import deepspeed.comm as dist

    tag = tag_for_step(step)
    rank = dist.get_rank()
    if rank == 0 and os.path.isfile(os.path.join(ckpt_dir, tag, RECORD)):
        os.remove(os.path.join(ckpt_dir, tag, RECORD))  # a tag rewritten (after a resume) is incomplete until done
    dist.barrier()
    # DeepSpeed's own "latest" would point at the tag as soon as rank 0's files are written.
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={_CLIENT_KEY: run_state}, save_latest=False)
    path = os.path.join(ckpt_dir, tag, f"rng_rank{rank:05d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(rng_state(device), path)
    if rank == 0 and settings.get(_KILL_IN_CHECKPOINT) == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # every rank's files are complete
    if rank == 0:
        record = {
            "tag": tag, "step": step, "samples": run_state.get("samples"), "world_size": dist.get_world_size(),
            "zero_stage": int(engine.zero_optimization_stage()), "global_batch_size": run_state.get("global_batch_size"),
        }
        if "scheduler" in run_state:  # a resume checks its schedule before anything is loaded (train/preflight.py)
            record["scheduler"] = run_state["scheduler"]
        # and its parameters' shapes before the engine is built (ZeRO-3 keeps a partition's: ds_shape)
        record["param_shapes"] = {name: list(getattr(p, "ds_shape", p.shape))
                                  for name, p in engine.module.named_parameters()}
        _write_atomic(os.path.join(ckpt_dir, tag, RECORD), json.dumps(record, indent=1))
        _write_atomic(os.path.join(ckpt_dir, "latest"), tag)
    if keep_last and rank == 0:
        tags = sorted(t for t in os.listdir(ckpt_dir) if t.startswith("step") and t[4:].isdigit())
        for old in tags[:-keep_last]:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    dist.barrier()
    return tag


def resolve_resume(resume: str, default_dir: str) -> Optional[Tuple[str, str]]:
    """``--resume`` value -> ``(checkpoint_dir, tag)`` or ``None`` (nothing to resume).

    ``auto``: the newest tag in ``default_dir`` if there is one, else ``None``. A directory with a
    ``latest`` file: its newest tag. A tag directory (``.../step00000100``): that tag.
    """
    from ds_infcl.errors import ConfigError

    def tags(d: str):
        return sorted((t for t in os.listdir(d) if t.startswith("step") and t[4:].isdigit()), reverse=True)

    def records_kept(d: str) -> bool:  # False: written by a version without completion records
        return any(read_record(d, t) is not None for t in tags(d))

    def latest(d: str) -> Optional[str]:
        f = os.path.join(d, "latest")
        if not os.path.isfile(f):
            return None
        with open(f) as fh:
            tag = fh.read().strip()
        if read_record(d, tag) is not None or not records_kept(d):
            return tag
        good = next((t for t in tags(d) if read_record(d, t) is not None), None)
        print(f"[ds_infcl] resume: checkpoint {d}/{tag} was not completed (no {RECORD}); "
              f"{'using ' + good if good else 'no complete checkpoint before it'}", flush=True)
        return good

    def complete(d: str, tag: str) -> Tuple[str, str]:
        if read_record(d, tag) is None and records_kept(d):
            raise ConfigError(
                f"--resume {resume}: the checkpoint {d}/{tag} was not completed (its write was cut short: "
                f"no {RECORD}); resume from an earlier tag or with --resume auto"
            )
        return d, tag

    if resume == "auto":
        if not os.path.isdir(default_dir):
            return None
        tag = latest(default_dir)
        return (default_dir, tag) if tag else None
    path = os.path.normpath(resume)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "latest")):
        tag = latest(path)
        if tag:
            return path, tag
    if os.path.isdir(path) and os.path.isfile(os.path.join(os.path.dirname(path), "latest")):
        return complete(os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path) and any(f.endswith("model_states.pt") for f in os.listdir(path)):
        return complete(os.path.dirname(path), os.path.basename(path))
    raise ConfigError(
        f"--resume {resume}: no checkpoint there (expected a checkpoint directory with a 'latest' "
        "file, a tag directory such as .../step00000100, or 'auto')"
    )


def load_checkpoint(engine, ckpt_dir: str, tag: str, device: torch.device) -> Dict[str, Any]:
    """Load engine, optimizer and scheduler state and this rank's RNG; return the run state."""
    import deepspeed.comm as dist

    load_path, client_state = engine.load_checkpoint(ckpt_dir, tag=tag)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {tag!r} from {ckpt_dir}")
    run_state = (client_state or {}).get(_CLIENT_KEY)
    if run_state is None:
        raise ValueError(f"checkpoint {ckpt_dir}/{tag} has no ds_infcl run state (not written by ds_infcl.train)")
    rank = dist.get_rank()
    rng_path = os.path.join(ckpt_dir, tag, f"rng_rank{rank:05d}.pt")
    if os.path.isfile(rng_path) and run_state.get("world_size") == dist.get_world_size():
        set_rng(torch.load(rng_path, weights_only=True), device)
    elif rank == 0:
        print(
            f"[ds_infcl] resume: world size changed ({run_state.get('world_size')} -> "
            f"{dist.get_world_size()}) or RNG file missing; RNG states start fresh",
            flush=True,
        )
    return run_state


def check_world_size(ckpt_dir: str, tag: str, world_size: int, zero_stage: int, global_batch_size: int) -> None:
    """Refuse, before anything is loaded, a resume that cannot continue the saved run: another
    global batch, or another number of ranks where ZeRO (stage >= 1) shards the optimizer state
    per rank (DeepSpeed's plain loader needs the same partitioning).

    Raises:
        ConfigError: naming what differs and how to go on.
    """
    from ds_infcl.errors import ConfigError

    record = read_record(ckpt_dir, tag)
    if record is None:  # a checkpoint of an older version: nothing to compare
        return
    saved_gbs = record.get("global_batch_size")
    if saved_gbs is not None and saved_gbs != global_batch_size:
        raise ConfigError(
            f"--resume: the checkpoint {ckpt_dir}/{tag} was trained with a global batch of {saved_gbs}, this run "
            f"has {global_batch_size}; the data position and the schedule assume the saved one: set "
            f"batch.global_batch_size={saved_gbs}"
        )
    saved_world = record.get("world_size")
    if saved_world != world_size and max(zero_stage, int(record.get("zero_stage", 0))) >= 1:
        raise ConfigError(
            f"--resume: the checkpoint {ckpt_dir}/{tag} was written by {saved_world} ranks under ZeRO stage "
            f"{record.get('zero_stage')}, which shards the optimizer state per rank; this run has {world_size} "
            f"ranks. Resume on {saved_world} ranks (the global batch stays {saved_gbs}), or convert the "
            "checkpoint with DeepSpeed's universal checkpoint tools first (deepspeed.checkpoint.ds_to_universal)"
        )
