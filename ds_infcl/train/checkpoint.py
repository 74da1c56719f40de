"""Checkpoints: DeepSpeed's engine checkpoint plus what a resumed run needs to continue as if it
had never stopped.

Layout under the checkpoint directory (one tag per saved step)::

    latest                         # DeepSpeed's pointer to the newest tag
    step00000100/
        mp_rank_00_model_states.pt # DeepSpeed: module (towers + loss module with logit_scale),
        *optim_states.pt           #   optimizer and scheduler state (ZeRO shards per rank),
                                   #   and our client_state under "ds_infcl"
        rng_rank00000.pt           # ours: this rank's Python, NumPy, torch CPU and CUDA RNG states

``client_state["ds_infcl"]`` holds ``step`` (optimizer steps done: the data position of an
index-addressed task), ``samples`` (global samples consumed), the task's ``state_dict`` (data
position of a streaming task), ``world_size`` and the run config. RNG states are per rank because
each rank draws its own dropout masks; DeepSpeed writes ``client_state`` from rank 0 only.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["tag_for_step", "save_checkpoint", "load_checkpoint", "resolve_resume", "rng_state", "set_rng"]

_CLIENT_KEY = "ds_infcl"


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def rng_state(device: torch.device) -> Dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng(state: Dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    engine, ckpt_dir: str, step: int, run_state: Dict[str, Any], device: torch.device, keep_last: int = 0
) -> str:
    """Save the engine and ``run_state`` as tag ``step<step>``; all ranks call it. Returns the tag."""
    import deepspeed.comm as dist

    tag = tag_for_step(step)
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={_CLIENT_KEY: run_state})
    rank = dist.get_rank()
    path = os.path.join(ckpt_dir, tag, f"rng_rank{rank:05d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(rng_state(device), path)
    dist.barrier()
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
    def latest(d: str) -> Optional[str]:
        f = os.path.join(d, "latest")
        if os.path.isfile(f):
            with open(f) as fh:
                return fh.read().strip()
        return None

    if resume == "auto":
        tag = latest(default_dir)
        return (default_dir, tag) if tag else None
    path = os.path.normpath(resume)
    tag = latest(path)
    if tag:
        return path, tag
    if os.path.isdir(path) and os.path.isfile(os.path.join(os.path.dirname(path), "latest")):
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isdir(path) and any(f.endswith("model_states.pt") for f in os.listdir(path)):
        return os.path.dirname(path), os.path.basename(path)
    from ds_infcl.train.config import ConfigError

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
        set_rng(torch.load(rng_path, weights_only=False), device)
    elif rank == 0:
        print(
            f"[ds_infcl] resume: world size changed ({run_state.get('world_size')} -> "
            f"{dist.get_world_size()}) or RNG file missing; RNG states start fresh",
            flush=True,
        )
    return run_state
