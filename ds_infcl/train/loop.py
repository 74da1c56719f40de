"""The training run: set-up, the step loop, evaluation, logging, checkpoints.

``train(run_config, ds_config)`` is what ``python -m ds_infcl.train`` calls on every rank; it may
be called several times in one process (the tests do).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from ds_infcl.train.checkpoint import load_checkpoint, run_id_after, save_checkpoint
from ds_infcl.train.config import RunConfig
from ds_infcl.train.ds_config import resolve_deepspeed_config
from ds_infcl.train.dist import ProgressWatchdog, accelerator_name, init_distributed, local_device
from ds_infcl.train.metrics import MetricsLogger, peak_memory_mib, peak_tflops
from ds_infcl.train.model import ContrastiveModel, compile_towers, eager_blocks
from ds_infcl.train.optim import prepare_optimizer
from ds_infcl.train.preflight import check_at_load, check_param_shapes, check_same_schedule
from ds_infcl.train.signals import StopOnSignal, StopRun
from ds_infcl.train import zero3_gather
from ds_infcl.train.steps import grad_cache_step, uncached_step
from ds_infcl.tasks.base import Batch, as_batch, build_loss, get_task

__all__ = ["train", "TrainSummary", "Encoder"]


@dataclass
class TrainSummary:
    """What ``train`` returns (on every rank) and writes to ``<output_dir>/summary.json`` (rank 0)."""

    steps: int
    start_step: int
    world_size: int
    global_batch_size: int
    num_chunks: int
    final_loss: float
    final_logit_scale: float
    losses: list
    samples_per_s: float
    peak_mem_mib: float
    wall_s: float
    eval: Dict[str, float] = field(default_factory=dict)
    notes: list = field(default_factory=list)
    final_scale: float = float("nan")  # exp(final_logit_scale), clamped: the "scale" of the logs
    data: Dict[str, int] = field(default_factory=dict)  # the task's data counts, summed over ranks
    model_flops_per_sample: Optional[float] = None  # 3 x the towers' forward FLOPs of one example
    model_tflops_per_gpu: Optional[float] = None  # at the run's samples/s
    mfu: Optional[float] = None  # model FLOPs utilization: model_tflops_per_gpu / the GPU's peak


class Encoder:
    """What ``Task.evaluate`` gets: the trained towers without gradients (all ranks call it)."""

    def __init__(self, engine, device: torch.device):
        self._engine = engine
        self.device = device

    def _run(self, mode: str, inputs):
        from ds_infcl.tasks.base import tree_map

        inputs = tree_map(lambda t: t.to(self.device), inputs)
        with torch.no_grad():
            if mode == "encode_query":
                return self._engine("encode_query", inputs)
            return self._engine("encode_key", None, inputs)

    def encode_query(self, inputs) -> torch.Tensor:
        return self._run("encode_query", inputs)

    def encode_key(self, inputs) -> torch.Tensor:
        return self._run("encode_key", inputs)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _place(batch: Batch, cfg: RunConfig, device: torch.device) -> Batch:
    """Data offload: keep the local batch on the host (pinned on CUDA) for chunk-by-chunk copies,
    or (``data.offload: false``) move all of it to the device now."""
    if device.type != "cuda":
        return batch
    if not cfg.data.offload:
        return batch.map(lambda t: t.to(device, non_blocking=True))
    if cfg.data.pin_memory in ("auto", True):  # (a task that decodes on the device hands over device tensors)
        batch = batch.map(lambda t: t.pin_memory() if t.device.type == "cpu" else t)
    return batch


def _logit_scale(engine) -> float:
    with torch.no_grad():
        return float(engine("logit_scale").float())


def _scale_of(engine, logit_scale: float) -> float:
    """The scale the loss applies: ``exp(logit_scale)`` clamped as the loss module clamps it."""
    return math.exp(min(logit_scale, getattr(engine.module.loss, "max_logit_scale", math.inf)))


def _log(msg: str, rank: int) -> None:
    if rank == 0:
        print(f"[ds_infcl] {msg}", flush=True)


def train(
    cfg: RunConfig,
    ds_config: Dict[str, Any],
    *,
    resume: Optional[str] = None,
    ds_config_source: str = "DeepSpeed config",
    save_params: Optional[str] = None,
) -> TrainSummary:
    """Train ``cfg.task`` with DeepSpeed on every rank of the launched world.

    Args:
        cfg: validated run config.
        ds_config: the DeepSpeed config as a dict (batch fields may be missing or ``"auto"``).
        resume: ``None`` (start fresh), ``"auto"`` (newest checkpoint in the checkpoint dir, if
            any) or a checkpoint path (see ``checkpoint.resolve_resume``).
        ds_config_source: name of the DeepSpeed config in error messages.
        save_params: write the final (gathered) parameters as float32 to this ``.pt`` file on
            rank 0 (tests compare runs with it).
    """
    import deepspeed
    import deepspeed.comm as dist

    t_start = time.time()
    init_distributed(cfg.dist.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    # SIGTERM/SIGINT/SIGHUP, or the launcher's death: stop at a step boundary (train/signals.py)
    stop = StopOnSignal(rank).install()
    device = local_device()
    accel = accelerator_name()

    # Configs: batch layout and optimizer; both fail before any model is built. So do the checks of
    # what would otherwise fail at step 1 or at the first checkpoint (train/preflight.py: the compile
    # toolchain, writable output and checkpoint folders, a resume's record against this run).
    found = check_at_load(cfg, ds_config, world, device_type=device.type, rank=rank, resume=resume,
                          source=ds_config_source)
    if cfg.batch.chunk_size == "auto":  # measure the towers for the chunk (train/chunk_auto.py)
        from ds_infcl.train.chunk_auto import resolve_auto_chunk

        cfg = resolve_auto_chunk(cfg, ds_config, world, rank, device, lambda m: _log(m, rank))
    ds_cfg, layout = resolve_deepspeed_config(cfg, ds_config, world, source=ds_config_source)
    ds_cfg, client_optimizer, notes = prepare_optimizer(ds_cfg, accel)
    for n in notes:
        _log(n, rank)
    if cfg.batch.grad_cache and layout.num_chunks == 1:
        _log("batch.grad_cache is on with one chunk per rank: GradCache adds a pass for nothing", rank)
    task = get_task(cfg.task.name, cfg.task.args, cfg.task.module)

    # Model: identical initialization on all ranks (DeepSpeed also broadcasts rank 0's).
    _seed_all(cfg.train.seed)
    towers = compile_towers(task.build_towers(), cfg.model, int(ds_cfg.get("zero_optimization", {}).get("stage", 0)),
                            lambda m: _log(m, rank))
    model = ContrastiveModel(towers, build_loss(task, cfg.loss))
    if found is not None:  # another model than the checkpoint's: said before the engine is built
        check_param_shapes(found, model)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=client_optimizer,
        config=ds_cfg,
    )
    engine.module.loss.group = engine.data_parallel_group
    # Per-rank RNG streams from here on (dropout differs between ranks, as in any DP run).
    _seed_all(cfg.train.seed + 1 + 7919 * rank)

    start_step, samples = 0, 0
    resumed = False
    if resume:
        if found is not None:  # resolved, and its world size and batch checked, by check_at_load
            state = load_checkpoint(engine, found[0], found[1], device)
            # Against the client state too: records of older versions keep no schedule.
            check_same_schedule(state, ds_cfg, f"{found[0]}/{found[1]}")
            resumed = True
            start_step, samples = int(state["step"]), int(state["samples"])
            if hasattr(task, "load_state_dict"):
                task.load_state_dict(state.get("task_state", {}))
            _log(f"resumed from {found[0]}/{found[1]} at step {start_step}", rank)
        else:
            _log(f"--resume {resume}: no checkpoint in {cfg.checkpoint_dir}; starting fresh", rank)

    if scheduler is not None and not resumed:
        # DeepSpeed's schedulers start at iteration -1 (lr 0) and step after each optimizer step,
        # so with a linear warm-up the first two steps would run at lr 0. Start at iteration 1:
        # optimizer step k runs at iteration k (the warm-up's first step at 1/warmup of the lr).
        scheduler.step(1)
    _log(
        f"world {world} ({accel}), global batch {layout.global_batch_size} = micro "
        f"{layout.micro_batch_size} x accumulation {layout.num_chunks} x {world} ranks, "
        f"ZeRO stage {engine.zero_optimization_stage()}, loss {cfg.loss.impl}, "
        f"GradCache {'on' if cfg.batch.grad_cache else 'off'}, steps {start_step}->{cfg.train.num_steps}",
        rank,
    )
    gather, why = zero3_gather.decide(cfg.batch.gather_params, engine, device, cfg.batch.grad_cache)
    if cfg.batch.grad_cache and int(engine.zero_optimization_stage()) >= 3:
        _log(f"ZeRO-3 GradCache: parameters {'gathered once per step' if gather else 'gathered per chunk by ZeRO-3'} ({why})", rank)
    logger = MetricsLogger(
        cfg.output_dir, enabled=rank == 0, csv_enabled=cfg.logging.csv,
        tensorboard=cfg.logging.tensorboard, progress_bar=cfg.logging.progress_bar,
        total_steps=cfg.train.num_steps, start_step=start_step, monitor=getattr(engine, "monitor", None),
    )
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "run_config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        with open(os.path.join(cfg.output_dir, "ds_config.resolved.json"), "w") as f:
            json.dump(ds_cfg, f, indent=2)

    data = task.batches(
        rank=rank, world_size=world, local_batch_size=layout.local_batch_size,
        start_step=start_step, seed=cfg.train.seed,
    )
    encoder = Encoder(engine, device)
    losses, eval_metrics = [], {}
    train_time, timed_samples = 0.0, 0
    step = start_step
    engine.train()
    watchdog = ProgressWatchdog(cfg.dist.timeout_s, rank) if world > 1 else None
    flops_per_sample: Optional[float] = None
    peak = peak_tflops(device, cfg.logging.peak_tflops)
    beat = watchdog.beat if watchdog is not None else (lambda: None)
    run_id = run_id_after(found if resumed else None)  # whose checkpoints this run may replace or prune
    try:
        while step < cfg.train.num_steps:
            lrs = engine.get_lr()
            lr_applied = float(lrs[0]) if lrs else float("nan")  # the lr this step's update uses
            batch = _place(as_batch(next(data)), cfg, device)
            if flops_per_sample is None and step == start_step:
                known = getattr(task, "model_flops_per_sample", None)  # a task that knows its FLOPs says so
                flops_per_sample = float(known()) if callable(known) else _model_flops_per_sample(engine, batch, device, rank)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.time()
            try:
                if cfg.batch.grad_cache:
                    result = grad_cache_step(engine, batch, cfg.batch.chunk_size, device,
                                             verify_replay=cfg.batch.verify_replay, gather_params=gather,
                                             copy_stream=cfg.data.copy_stream)
                else:
                    result = uncached_step(engine, batch, device)
            except ValueError as e:  # the loss's input checks (NaN/Inf features, ...): say which step
                raise ValueError(f"step {step + 1}: {e}") from e
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.time() - t0
            step += 1
            samples += layout.global_batch_size
            if step > start_step + 1 or step == cfg.train.num_steps:  # the first step includes warm-up
                train_time += dt
                timed_samples += layout.global_batch_size
            beat()
            losses.append(result.loss)
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"step {step}: loss is {result.loss}; stopping (lower the learning rate, check fp16 scaling)")

            if step % cfg.logging.every_steps == 0 or step == cfg.train.num_steps:
                ls = _logit_scale(engine)
                tflops = _tflops_per_gpu(flops_per_sample, layout.global_batch_size / dt, world)
                logger.log_train({
                    "step": step, "loss": result.loss, "logit_scale": ls,
                    "scale": _scale_of(engine, ls),
                    "lr": lr_applied,
                    "samples_per_s": layout.global_batch_size / dt, "step_time_s": dt,
                    "peak_mem_mib": peak_memory_mib(device), "samples": samples,
                    "model_tflops_per_gpu": tflops, "mfu": None if tflops is None or not peak else tflops / peak,
                })
            logger.advance()

            is_last = step == cfg.train.num_steps
            if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or (is_last and cfg.eval.at_end):
                engine.eval()
                eval_metrics = task.evaluate(encoder, step) if hasattr(task, "evaluate") else {}
                engine.train()
                beat()
                logger.log_eval(step, eval_metrics)

            stopping = stop.agree(device=device)  # a signal on any rank: all save here, then stop
            if ((cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or (is_last and cfg.checkpoint.at_end)
                    or (stopping and cfg.checkpoint.on_signal)):
                run_state = {
                    "step": step, "samples": samples,
                    "task_state": task.state_dict() if hasattr(task, "state_dict") else {},
                    "world_size": world, "global_batch_size": layout.global_batch_size, "run_config": cfg.to_dict(),
                    "scheduler": ds_cfg.get("scheduler"),
                }
                tag = save_checkpoint(engine, cfg.checkpoint_dir, step, run_state, device, cfg.checkpoint.keep_last,
                                      run_id=run_id, overwrite=cfg.checkpoint.overwrite)
                beat()
                if not cfg.logging.progress_bar or stopping:
                    _log(f"saved checkpoint {cfg.checkpoint_dir}/{tag}", rank)
            if stopping:
                logger.close()
                raise StopRun(stop.signum, step, tag if cfg.checkpoint.on_signal else None)
    except BaseException:
        stop.restore()
        # Stop the task's loader (worker processes, a prefetch or device-decode thread) now, not
        # when the traceback is released: a caller that catches the error keeps it alive.
        close = getattr(data, "close", None)
        if callable(close):
            close()
        raise

    stop.restore()
    logger.close()
    data_counts = _data_report(task)
    if data_counts:
        _log("data: " + ", ".join(f"{k}={v}" for k, v in sorted(data_counts.items())), rank)
    final_scale = _logit_scale(engine)
    beat()
    if save_params:
        _save_params(engine, save_params, rank)
    if cfg.checkpoint.export_final and callable(getattr(task, "save_pretrained", None)):
        _export(engine, task, os.path.join(cfg.output_dir, "final_model"), rank,
                getattr(torch, cfg.checkpoint.export_dtype))
    summary = TrainSummary(
        steps=step, start_step=start_step, world_size=world,
        global_batch_size=layout.global_batch_size, num_chunks=layout.num_chunks,
        final_loss=losses[-1] if losses else float("nan"), final_logit_scale=final_scale,
        final_scale=_scale_of(engine, final_scale), losses=losses,
        samples_per_s=(timed_samples / train_time) if train_time > 0 else float("nan"),
        peak_mem_mib=peak_memory_mib(device), wall_s=time.time() - t_start,
        eval=eval_metrics, notes=notes, data=data_counts,
    )
    summary.model_flops_per_sample = flops_per_sample
    summary.model_tflops_per_gpu = _tflops_per_gpu(flops_per_sample, summary.samples_per_s, world)
    if summary.model_tflops_per_gpu is not None and peak:
        summary.mfu = summary.model_tflops_per_gpu / peak
    if rank == 0:
        with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary.__dict__, f, indent=2)
    if watchdog is not None:
        watchdog.stop()
    if hasattr(engine, "destroy"):
        engine.destroy()
    return summary


def _model_flops_per_sample(engine, batch: Batch, device: torch.device, rank: int) -> Optional[float]:
    """Training FLOPs of one example (its query and its keys through the towers): 3 x the forward
    FLOPs that ``torch.utils.flop_counter`` counts on a one-example slice of the first batch (the
    usual model-FLOPs definition: forward and a backward of twice its cost; GradCache's extra
    forward and recomputation are not model FLOPs). Every rank calls it (ZeRO-3 forwards are
    collective); the RNG state is restored, so the run is the same as without it."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_infcl.train.steps import get_rng_state, move_batch, set_rng_state

    if len(batch) == 0:
        return None
    state = get_rng_state(device)
    try:
        one = move_batch(batch.slice(0, 1), device)
        # eager_blocks: under the counter's dispatch mode dynamo would mark compiled blocks skipped
        with torch.no_grad(), eager_blocks(), FlopCounterMode(display=False) as counter:
            engine("encode", one.query_inputs, one.key_inputs)
        return 3.0 * counter.get_total_flops() or None
    except Exception as e:  # noqa: BLE001 -- a tower the counter cannot trace costs only the MFU column
        _log(f"model FLOPs not counted ({type(e).__name__}: {e}); no MFU in the logs", rank)
        return None
    finally:
        set_rng_state(state, device)


def _tflops_per_gpu(flops_per_sample: Optional[float], samples_per_s: float, world: int) -> Optional[float]:
    if not flops_per_sample or not math.isfinite(samples_per_s):
        return None
    return flops_per_sample * samples_per_s / world / 1e12


def _data_report(task) -> Dict[str, int]:
    """The task's ``data_report()`` (this rank's counts: samples skipped, examples unused, ...)
    summed over the ranks; every rank gets the same dict (a collective: all ranks call it)."""
    import deepspeed.comm as dist

    report = getattr(task, "data_report", None)
    mine = {k: int(v) for k, v in (report() if callable(report) else {}).items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    total: Dict[str, int] = {}
    for counts in gathered:
        for k, v in (counts or {}).items():
            total[k] = total.get(k, 0) + v
    return total


def _save_params(engine, path: str, rank: int) -> None:
    """Gather every parameter (ZeRO-3 included) and save float32 copies on rank 0."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    engine.empty_partition_cache()  # ZeRO-3: no parameter may still be in flight from a prefetch
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        state = {k: v.detach().float().cpu().clone() for k, v in params.items()}
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, path)


def _master_params(engine, rank: int) -> Dict[str, torch.Tensor]:
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


def _export(engine, task, folder: str, rank: int, dtype: torch.dtype = torch.float32) -> None:
    """Gather the parameters (ZeRO-3 included) and let the task write its model folder on rank 0,
    from the optimizer's float32 master weights (a bf16 module copy would lose every update below
    bf16's resolution, 2**-8 of the value), rounded once to ``dtype`` (``checkpoint.export_dtype``)."""
    import deepspeed
    import deepspeed.comm as dist

    engine.empty_partition_cache()
    masters = _master_params(engine, rank)
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
