"""The end of a run's model: the final parameters saved for comparison (``--save_params``) and the
task's export folder (``checkpoint.export_final``), both gathered under ZeRO-3."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import torch

__all__ = ["save_params", "master_params", "export_model", "write_run_files"]


def save_params(engine, path: str, rank: int) -> None:
    """Gather every parameter (ZeRO-3 included) and save float32 copies on rank 0."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    engine.empty_partition_cache()  # ZeRO-3: no parameter may still be in flight from a prefetch
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        state = {k: v.detach().float().cpu().clone() for k, v in params.items()}
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, path)


def master_params(engine, rank: int) -> Dict[str, torch.Tensor]:
    """On rank 0, the optimizer's float32 master copy of every trainable parameter (ZeRO 1-3 and
    the bf16 optimizer keep one; a collective where it is partitioned, so every rank calls this);
    ``{}`` elsewhere and for parameters without one."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        if master is not None and rank == 0:
            out[name] = master.detach().float().cpu()
    return out


def export_model(engine, task, folder: str, rank: int, dtype: torch.dtype = torch.float32) -> None:
    """Gather the parameters (ZeRO-3 included) and let the task write its model folder on rank 0,
    from the optimizer's float32 master weights (a bf16 module copy would lose every update below
    bf16's resolution, 2**-8 of the value), rounded once to ``dtype`` (``checkpoint.export_dtype``)."""
    import deepspeed
    import deepspeed.comm as dist

    engine.empty_partition_cache()
    masters = master_params(engine, rank)
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        if rank == 0:
            # The module's parameters hold their float32 masters (or a float32 copy) while the task
            # writes its folder, then get their own tensors back.
            originals = {name: p.data for name, p in params.items()}
            try:
                for name, p in params.items():
                    p.data = (masters[name] if name in masters else p.data.float()).to(device=p.device, dtype=dtype)
                loss = engine.module.loss
                logit_scale = loss.logit_scale.detach().float().reshape(()).cpu().clone()
                extra = {}
                if isinstance(getattr(loss, "logit_bias", None), torch.Tensor):  # SigLIP
                    extra["logit_bias"] = loss.logit_bias.detach().float().reshape(()).cpu().clone()
                task.save_pretrained(folder, engine.module.towers, logit_scale, **extra)
            finally:
                for name, p in params.items():
                    p.data = originals[name]
    dist.barrier()
    if rank == 0:
        print(f"[ds_infcl] exported the final model to {folder}", flush=True)


def write_run_files(output_dir: str, run_config: Dict[str, Any], ds_config: Dict[str, Any]) -> None:
    """``run_config.json`` and ``ds_config.resolved.json`` in ``output_dir`` (rank 0, at the start):
    what the run was asked to do, with every default filled in."""
    os.makedirs(output_dir, exist_ok=True)
    for name, obj in (("run_config.json", run_config), ("ds_config.resolved.json", ds_config)):
        with open(os.path.join(output_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
