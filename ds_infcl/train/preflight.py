"""Checks at load: faults that would otherwise surface at step 1 or at the first checkpoint,
after the task's data and model have been loaded (minutes for a large model), found before any of
that is built.

``check_at_load`` runs in ``train`` right after the batch layout is resolved (before the task is
built) and in ``--check`` (``dry``: nothing is created or written). It checks:

- ``model.compile``: not with ZeRO stage 3, and the toolchain ``torch.compile`` needs on this
  machine is there: a C++ compiler on CPU (inductor builds C++ kernels), triton and a C compiler
  on CUDA (triton builds its launcher with one). Without them the first forward would fail inside
  inductor.
- ``model.fp8`` (``fp8.check_fp8``): not with ZeRO stage 3; torchao installed; a CUDA GPU of compute
  capability 8.9 or newer.
- ``output_dir`` and the checkpoint directory are writable (a probe file is written, fsynced and
  removed; a full disk is named as such), so that a run does not train for hours and then fail to
  save.
- ``--resume``: the newest intact checkpoint (``checkpoint.resolve_resume``: its files' sizes and
  SHA-256 against its record, checked by rank 0 and its answer broadcast); without a checkpoint to
  resume, a ``checkpoint.dir`` holding complete checkpoints is refused unless
  ``checkpoint.overwrite`` (``--fresh``).
- ``--resume``: the checkpoint's completion record against this run (global batch, number of
  ranks under ZeRO 1-3, the learning-rate schedule when the record has it); once the towers are
  built, before ``deepspeed.initialize``, their parameter shapes (``check_param_shapes``).
- the DeepSpeed JSON's objects that ``deepspeed.initialize`` builds: fp16 and bf16 both on, an
  unknown scheduler type, a scheduler or optimizer parameter its class does not take.
- ``batch.chunk_size: "auto"`` with a number for the micro batch or the accumulation steps in the
  DeepSpeed JSON (they are the chunk and the number of chunks: only ``"auto"`` can agree).
"""

from __future__ import annotations

import errno
import importlib.util
import inspect
import json
import os
import shutil
import socket
from typing import Any, Dict, List, Optional

from ds_infcl.errors import ConfigError
from ds_infcl.train.fp8 import check_fp8

__all__ = ["stage_hints", "check_at_load", "check_compile", "compile_toolchain_problem", "check_deepspeed_objects", "check_writable",
           "check_resume", "check_same_schedule", "check_param_shapes"]


def stage_hints(ds_config: Dict[str, Any], world_size: int, device_type: str) -> List[str]:
    """Advice on the ZeRO stage for this world, logged at start (nothing is changed): on one CUDA
    device ZeRO-2 partitions nothing and runs its per-parameter gradient hooks in every backward
    (every GradCache chunk), which the device waits for."""
    zero = ds_config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or zero.get("offload_param")
    if world_size == 1 and device_type == "cuda" and int(zero.get("stage", 0)) == 2 and not offload:
        return ["ZeRO-2 on one GPU partitions nothing and adds per-parameter gradient hooks to every backward: "
                "ds_configs/zero1.json ran the ViT-B/16 step 10% faster on an H100 (docs/training.md, "
                "\"Which ZeRO stage\")"]
    return []


def compile_toolchain_problem(device_type: str) -> Optional[str]:
    """What ``torch.compile`` (inductor) lacks on this machine for ``device_type``, or ``None``.

    CPU: a C++ compiler, searched as inductor searches it (``torch._inductor.config.cpp.cxx``,
    ``$CXX``). CUDA: the triton package, and a C compiler as triton looks for one (``$CC``, else
    ``gcc`` or ``clang``) to build its kernel launcher.
    """
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 -- InvalidCxxCompiler, or anything else inductor raises
            return (f"inductor finds no working C++ compiler ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    "install g++ (apt-get install g++) or point $CXX at one")
        return None
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed (inductor generates triton kernels on CUDA); pip install triton"
        cc = os.environ.get("CC")
        if cc is not None:
            if shutil.which(cc) is None:
                return f"$CC={cc!r} is not an executable (triton builds its kernel launcher with it)"
        elif shutil.which("gcc") is None and shutil.which("clang") is None:
            return "no C compiler (gcc or clang, or $CC): triton builds its kernel launcher with one; install gcc"
    return None


def check_compile(model_config, zero_stage: int, device_type: str, task_args: Optional[Dict[str, Any]] = None) -> None:
    """``model.compile`` against the DeepSpeed stage, the task's ``liger`` and this machine's toolchain.

    Raises:
        ConfigError: compile with ZeRO stage 3 or with Liger-Kernel, or a missing compiler (named,
            with how to fix it).
    """
    if model_config.compile is False:
        return
    if (task_args or {}).get("liger"):
        from ds_infcl.adapters.decoder_step import LIGER_WITH_COMPILE

        raise ConfigError(LIGER_WITH_COMPILE)
    from ds_infcl.train.model import check_compile_stage

    check_compile_stage(zero_stage)
    problem = compile_toolchain_problem(device_type)
    if problem is not None:
        raise ConfigError(f"model.compile: torch.compile cannot build kernels on this machine ({device_type}): "
                          f"{problem}; or set model.compile false")


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def check_writable(path: str, key: str, *, dry: bool) -> None:
    """``path`` (a directory the run writes into) can be created and written.

    ``dry`` (``--check``, which writes nothing): the nearest existing folder on the way must be a
    writable directory on a disk that is not full. Otherwise the directory is created and a small
    probe file is written, fsynced and removed: a read-only or full file system fails here.

    Raises:
        ConfigError: naming ``key``, the path, the reason, and how to go on.
    """
    fix = f"give a writable folder (--set {key}=...)"
    if dry:
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ConfigError(f"{key}: {path!r} cannot be a folder: {existing!r} is a file; {fix}")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: {path!r} is not writable (no write permission on {existing!r}); {fix}")
        if _free_bytes(existing) == 0:
            raise ConfigError(f"{key}: the disk of {path!r} is full (0 bytes free); free space there or {fix}")
        return
    probe = os.path.join(path, f".ds_infcl_write_probe.{socket.gethostname()}.{os.getpid()}")  # one per rank
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ds_infcl write probe\n" * 64)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ConfigError(f"{key}: the disk of {path!r} is full ({_free_bytes(path) or 0} bytes free); "
                              f"free space there or {fix}") from None
        raise ConfigError(f"{key}: cannot write into {path!r} ({e.strerror or e}); {fix}") from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def check_resume(found, world_size: int, zero_stage: int, global_batch_size: int, ds_config: Dict[str, Any]) -> None:
    """A resume from ``found`` (``(checkpoint_dir, tag)`` from ``resolve_resume``) against this run,
    from the tag's completion record alone (nothing is loaded): global batch and number of ranks
    (``checkpoint.check_world_size``), and the learning-rate schedule where the record keeps it.

    Raises:
        ConfigError: what differs and how to go on.
    """
    from ds_infcl.train.checkpoint import check_world_size, read_record

    ckpt_dir, tag = found
    check_world_size(ckpt_dir, tag, world_size, zero_stage, global_batch_size)
    record = read_record(ckpt_dir, tag)
    if record is not None:
        check_same_schedule(record, ds_config, f"{ckpt_dir}/{tag}")


def check_same_schedule(state: Dict[str, Any], ds_cfg: Dict[str, Any], where: str) -> None:
    """A resumed run continues the learning-rate schedule it was saved with: a different one
    (for example ``"auto"`` lengths after a change of ``train.num_steps``) would make the lr jump."""
    if "scheduler" not in state:  # a checkpoint of an older version: nothing to compare
        return
    saved, now = state["scheduler"], ds_cfg.get("scheduler")
    if saved != now:
        raise ConfigError(
            f"--resume: the checkpoint {where} was trained with the learning-rate schedule {json.dumps(saved)}, "
            f"this run resolves to {json.dumps(now)} (\"auto\" lengths follow train.num_steps); resuming would "
            "make the lr jump. Resume with the same train.num_steps, or give the saved values explicitly "
            "(--ds-set scheduler.params.total_num_steps=... and warmup_num_steps=...)"
        )


def check_param_shapes(found, model) -> None:
    """The parameters of ``model`` (built, not yet handed to DeepSpeed) against the shapes the
    checkpoint ``found`` recorded (checkpoints of older versions record none: nothing to compare).
    DeepSpeed would find a difference only after ``deepspeed.initialize``, as a ``RuntimeError``
    from ``load_state_dict``.

    Raises:
        ConfigError: naming the first parameters that differ or are missing on either side.
    """
    from ds_infcl.train.checkpoint import read_record

    record = read_record(*found) or {}
    saved = record.get("param_shapes")
    if saved is None:
        return
    now = {name: list(p.shape) for name, p in model.named_parameters()}
    diffs = [f"{n}: {saved[n]} in the checkpoint, {now[n]} now" for n in now if n in saved and saved[n] != now[n]]
    diffs += [f"{n}: only in this run's model" for n in now if n not in saved]
    diffs += [f"{n}: only in the checkpoint" for n in saved if n not in now]
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise ConfigError(
            f"--resume: the checkpoint {found[0]}/{found[1]} holds another model than this run builds: "
            f"{'; '.join(diffs[:3])}{more}. Resume with the task and model settings it was trained with "
            "(task.args, loss; its run config is in its client state and the run's run_config.json)"
        )


def _unknown_params(cls, params: Dict[str, Any], skip=()) -> List[str]:
    """Keys of ``params`` that ``cls(first, **params)`` would reject (``skip``: keys DeepSpeed
    consumes itself)."""
    sig = inspect.signature(cls)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    names = list(sig.parameters)[1:]  # the first is the parameters / the optimizer
    return sorted(k for k in params if k not in names and k not in skip)


def _optimizer_class(opt: Dict[str, Any], ds_config: Dict[str, Any]):
    """The class DeepSpeed builds for the ``optimizer`` block (after ``prepare_optimizer``) and the
    keys it consumes itself, or ``(None, ())`` where this check does not know it (Lamb, Lion,
    Adagrad, ...: DeepSpeed's own ops)."""
    import torch

    name = str(opt.get("type", ""))
    params = opt.get("params") or {}
    if name.lower() in ("adam", "adamw"):
        consumed = ("torch_adam", "adam_w_mode", "fp32_optimizer_states")
        if params.get("torch_adam"):
            w_mode = name.lower() == "adamw" or params.get("adam_w_mode", True)
            return (torch.optim.AdamW if w_mode else torch.optim.Adam), consumed + ("foreach",)
        offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        except ImportError:  # pragma: no cover - DeepSpeed without its op classes
            return None, ()
        return (DeepSpeedCPUAdam if offload in ("cpu", "nvme") else FusedAdam), consumed
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and name.lower() not in ("adagrad",):
        return cls, ()
    return None, ()


def check_deepspeed_objects(ds_config: Dict[str, Any], source: str = "DeepSpeed config") -> None:
    """What ``deepspeed.initialize`` would reject only after the model is built, checked on the
    JSON (after ``prepare_optimizer``): both fp16 and bf16 on, an unknown scheduler type, a
    scheduler or optimizer parameter its class does not take (or a required one missing).

    Raises:
        ConfigError: naming the key, what is wrong and what is allowed.
    """
    import torch
    from deepspeed.runtime import lr_schedules

    if all(bool((ds_config.get(k) or {}).get("enabled", False)) for k in ("fp16", "bf16")):
        raise ConfigError(f"{source}: fp16.enabled and bf16.enabled are both true; enable one of them")
    sched = ds_config.get("scheduler")
    if isinstance(sched, dict) and sched.get("type") is not None:
        name = str(sched["type"])
        cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
        if not isinstance(cls, type):
            raise ConfigError(f"{source}: scheduler.type {name!r} is unknown; use one of "
                              f"{list(lr_schedules.VALID_LR_SCHEDULES)} or a torch.optim.lr_scheduler class")
        params = sched.get("params") or {}
        bad = _unknown_params(cls, params)
        if bad:
            raise ConfigError(f"{source}: scheduler.params.{bad[0]}: not a parameter of {name}; its parameters are "
                              f"{list(inspect.signature(cls).parameters)[1:]}")
        try:
            inspect.signature(cls).bind(None, **params)
        except TypeError as e:
            raise ConfigError(f"{source}: scheduler.params: {name} {e}") from None
    opt = ds_config.get("optimizer")
    if isinstance(opt, dict):
        cls, consumed = _optimizer_class(opt, ds_config)
        if cls is not None:
            bad = _unknown_params(cls, opt.get("params") or {}, consumed)
            if bad:
                raise ConfigError(
                    f"{source}: optimizer.params.{bad[0]}: not a parameter of {cls.__name__} (what optimizer.type "
                    f"{opt.get('type')!r} builds here); its parameters are "
                    f"{list(inspect.signature(cls).parameters)[1:]}"
                    + (f", and DeepSpeed's own {[k for k in consumed if k not in inspect.signature(cls).parameters]}"
                       if consumed else "")
                )


def _resolve_once(resume: str, ckpt_dir: str, rank: int):
    """``resolve_resume`` with its file checks (every file's SHA-256) done once: by rank 0, its
    answer (or its error) broadcast, so that every rank takes the same tag. Without a process
    group (``--check``), here."""
    import torch.distributed as tdist

    from ds_infcl.train.checkpoint import resolve_resume

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return resolve_resume(resume, ckpt_dir)
    answer = [None, None]
    if rank == 0:
        try:
            answer[0] = resolve_resume(resume, ckpt_dir)
        except ConfigError as e:
            answer[1] = str(e)
    tdist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise ConfigError(answer[1])
    return tuple(answer[0]) if answer[0] is not None else None


def check_at_load(cfg, ds_config: Dict[str, Any], world_size: int, *, device_type: str, rank: int = 0,
                  resume: Optional[str] = None, dry: bool = False, source: str = "DeepSpeed config"):
    """All the checks above for a run; ``ds_config`` is the DeepSpeed JSON as given (after
    ``--ds-set``). Returns the checkpoint ``resolve_resume`` found for ``resume`` (``None``: a
    fresh start). Nothing is built; ``dry`` (``--check``): nothing is created or written either.

    ``output_dir`` is probed by rank 0 (the only one that writes there); the checkpoint directory,
    when the run saves checkpoints, by every rank (each writes its own shard and RNG files).
    """
    from ds_infcl.train.ds_config import resolve_deepspeed_config

    if cfg.batch.chunk_size == "auto":  # a number would be checked only after the towers are timed
        fixed = [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                 if ds_config.get(k, "auto") != "auto"]
        if fixed:
            raise ConfigError(
                f"{source}: {fixed[0]} = {ds_config[fixed[0]]!r} with batch.chunk_size \"auto\", which picks the "
                f"micro batch (the chunk) and the accumulation steps; set {' and '.join(fixed)} to \"auto\" "
                "or give batch.chunk_size a number"
            )
    resolved, layout = resolve_deepspeed_config(cfg, ds_config, world_size, source=source)
    from ds_infcl.train.optim import prepare_optimizer

    check_deepspeed_objects(prepare_optimizer(resolved, device_type)[0], source)
    zero_stage = int((resolved.get("zero_optimization") or {}).get("stage", 0))
    check_compile(cfg.model, zero_stage, device_type, cfg.task.args)
    check_fp8(cfg.model, zero_stage, device_type)
    found = None
    if resume:
        found = _resolve_once(resume, cfg.checkpoint_dir, rank)
        if found is not None:
            check_resume(found, world_size, zero_stage, layout.global_batch_size, resolved)
    if found is None and (cfg.checkpoint.every_steps or cfg.checkpoint.at_end or cfg.checkpoint.on_signal):
        from ds_infcl.train.checkpoint import check_fresh_start

        check_fresh_start(cfg.checkpoint_dir, cfg.checkpoint.overwrite)
    if rank == 0:
        check_writable(cfg.output_dir, "output_dir", dry=dry)
    if cfg.checkpoint.every_steps or cfg.checkpoint.at_end:
        check_writable(cfg.checkpoint_dir, "checkpoint.dir", dry=dry)
    return found
