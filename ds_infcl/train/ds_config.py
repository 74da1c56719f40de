"""The DeepSpeed JSON against the run config: batch fields filled and cross-checked, unknown keys
named, ``zero_optimization`` validated with DeepSpeed's own config model.

``resolve_deepspeed_config`` fills the DeepSpeed batch fields so that

    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size

holds with ``train_batch_size = batch.global_batch_size``; without GradCache the micro batch is the
whole local batch (one micro-step per step); with GradCache the micro batch is one chunk and
``gradient_accumulation_steps`` is the number of chunks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List

from ds_infcl.errors import ConfigError
from ds_infcl.train.config import RunConfig

__all__ = [
    "BatchLayout",
    "check_deepspeed_blocks",
    "deepspeed_top_level_keys",
    "resolve_deepspeed_config",
    "unknown_deepspeed_keys",
]




@dataclass
class BatchLayout:
    """How one step's global batch is laid out on the ranks and micro-steps."""

    global_batch_size: int
    world_size: int
    local_batch_size: int
    micro_batch_size: int
    num_chunks: int  # = gradient_accumulation_steps


_DS_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


# Top-level blocks of a DeepSpeed config besides the plain keys of deepspeed.runtime.constants.
_DS_BLOCKS = (
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "checkpoint", "comet", "comms_logger",
    "compile", "compression_training", "csv_monitor", "curriculum_learning", "data_efficiency", "elasticity",
    "flops_profiler", "fp16", "gradient_accumulation_dtype", "hybrid_engine", "nebula", "optimizer", "pipeline",
    "scheduler", "sparse_attention", "sparse_gradients", "tensorboard", "timers", "torch_autocast", "wandb",
    "weight_quantization", "zero_optimization",
)


def deepspeed_top_level_keys() -> set:
    """The top-level keys DeepSpeed reads (from ``deepspeed.runtime.constants`` and its blocks)."""
    import re

    import deepspeed.runtime.constants as constants

    names = {v for k, v in vars(constants).items()
             if k.isupper() and isinstance(v, str) and re.fullmatch(r"[a-z][a-z0-9_]*", v)}
    return names | set(_DS_BLOCKS)


def unknown_deepspeed_keys(ds_config: Dict[str, Any]) -> List[str]:
    """One line per top-level key of ``ds_config`` that DeepSpeed would ignore, with the closest
    known key. (Unknown keys inside ``zero_optimization`` DeepSpeed refuses itself:
    ``check_deepspeed_blocks``.)"""
    import difflib

    known = deepspeed_top_level_keys()
    out = []
    for key in ds_config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"{key}: not a DeepSpeed key, DeepSpeed ignores it{hint}")
    return out


def check_deepspeed_blocks(ds_config: Dict[str, Any], source: str) -> None:
    """Validate the blocks DeepSpeed validates itself at ``initialize`` (``zero_optimization``)
    with DeepSpeed's own config model, so that ``--check`` refuses what the run would."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = ds_config.get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, dict):
        raise ConfigError(f"{source}: zero_optimization must be an object, got {zero!r}")
    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, or DeepSpeed's own checks
        first = " ".join(str(e).split("\n")[1:3]).strip() or str(e)
        raise ConfigError(f"{source}: zero_optimization is not valid for DeepSpeed: {first}") from None


def resolve_deepspeed_config(
    cfg: RunConfig, ds_config: Dict[str, Any], world_size: int, *, source: str = "DeepSpeed config"
):
    """Cross-check the DeepSpeed config with the run config and fill its batch fields.

    Each of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` may be absent or ``"auto"`` (filled here) or a number (then it
    must equal the value the run config implies).

    Returns:
        ``(ds_config, layout)``: a new dict and the ``BatchLayout``.

    Raises:
        ConfigError: a batch that does not divide over ranks or chunks, or a contradiction, naming
            the keys of both files.
    """
    if not isinstance(ds_config, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    check_deepspeed_blocks(ds_config, source)
    fp16 = bool((ds_config.get("fp16") or {}).get("enabled", False))
    if cfg.batch.gather_params is True and fp16:  # also refused by the engine; --check says it first
        raise ConfigError(
            f"batch.gather_params: true is not supported with fp16 ({source} has fp16.enabled); use bf16, "
            "or set batch.gather_params to \"auto\" or false"
        )
    B = cfg.batch.global_batch_size
    if B % world_size:
        raise ConfigError(
            f"batch.global_batch_size: {B} does not divide over {world_size} data-parallel ranks; "
            f"use a multiple of {world_size}"
        )
    local = B // world_size
    if cfg.batch.grad_cache:
        chunk = cfg.batch.chunk_size
        if chunk == "auto":  # not measured yet (--check): the largest chunk "auto" could pick (train/chunk_auto.py)
            from ds_infcl.train.chunk_auto import candidate_chunks

            chunk = candidate_chunks(local)[-1]
        if local % chunk:
            raise ConfigError(
                f"batch.chunk_size: {chunk} does not divide the local batch of {local} "
                f"(batch.global_batch_size {B} / {world_size} ranks)"
            )
        micro, gas = chunk, local // chunk
        keep = cfg.batch.keep_chunks
        if keep is not None and keep > gas and cfg.batch.chunk_size != "auto":
            raise ConfigError(
                f"batch.keep_chunks: {keep} exceeds the {gas} chunks of a step (local batch {local} / "
                f"batch.chunk_size {chunk}); give at most {gas} ({gas} keeps every chunk: no replay)"
            )
    else:
        micro, gas = local, 1
    want = {
        "train_batch_size": B,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
    }
    out = copy.deepcopy(ds_config)
    for key in _DS_BATCH_KEYS:
        have = out.get(key, "auto")
        if have == "auto":
            out[key] = want[key]
            continue
        if isinstance(have, bool) or not isinstance(have, int):
            raise ConfigError(f"{source}: {key} must be an integer or \"auto\", got {have!r}")
        if have != want[key]:
            why = _why_batch_key(key, cfg, world_size, local, micro, gas)
            raise ConfigError(
                f"{source}: {key} = {have} contradicts the run config ({why}); set it to "
                f"{want[key]} or \"auto\""
            )
    _fill_schedule(out, cfg, source)
    layout = BatchLayout(B, world_size, local, micro, gas)
    return out, layout


def _why_batch_key(key: str, cfg: RunConfig, world_size: int, local: int, micro: int, gas: int) -> str:
    """Why the run config implies its value of the DeepSpeed batch field ``key``."""
    B = cfg.batch.global_batch_size
    return {
        "train_batch_size": f"batch.global_batch_size is {B}",
        "train_micro_batch_size_per_gpu": (
            f"with GradCache the micro batch is batch.chunk_size = {micro}"
            if cfg.batch.grad_cache
            else f"without GradCache the micro batch is the local batch "
            f"{B} / {world_size} ranks = {micro}"
        ),
        "gradient_accumulation_steps": (
            f"with GradCache it is the number of chunks, {local} / {cfg.batch.chunk_size} = {gas}"
            if cfg.batch.grad_cache
            else "without GradCache it must be 1: the contrastive loss of separate "
            "micro-batches is not the loss of the global batch (set batch.grad_cache)"
        ),
    }[key]


def _fill_schedule(out: Dict[str, Any], cfg: RunConfig, source: str) -> None:
    """``"auto"`` schedule lengths follow ``train.num_steps`` (warm-up: 5% of the steps)."""
    sched = out.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        params = sched["params"]
        for key, value in (
            ("total_num_steps", cfg.train.num_steps),
            ("warmup_num_steps", max(1, cfg.train.num_steps // 20)),
        ):
            if params.get(key) == "auto":
                params[key] = value
        bad = sorted(k for k, v in params.items() if v == "auto")
        if bad:
            raise ConfigError(f"{source}: scheduler.params.{bad[0]} = \"auto\" is not supported; give a number")
