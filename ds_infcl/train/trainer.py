"""The training run as a class: ``Trainer(cfg, ds_config)`` builds, ``fit()`` runs the steps,
``close()`` releases everything however the run ends.

    with Trainer(cfg, ds_config) as trainer:
        summary = trainer.fit()

- ``__init__``: the process group, the checks of ``train/preflight.py``, the DeepSpeed config and
  optimizer, the task, the model, the engine, a resume, the metrics logger, the data stream.
- ``train_step()``: launch one optimizer step (``forward_backward_step`` runs the step of
  ``train/steps.py``: uncached or GradCache), then read the step before it (on CUDA; on the CPU
  the step itself): timed, checked for a finite loss and gradient norm, logged
  (``train/inflight.py``: the host never waits for the GPU to drain between steps).
- ``maybe_eval()`` / ``maybe_checkpoint(force=False)``: on their schedules, after every step in flight was read.
- A stop vote at every step boundary (``StopOnSignal.vote``): when any rank got
  SIGTERM/SIGINT/SIGHUP or lost its launcher, all save after the step in flight
  (``checkpoint.on_signal``) and ``fit`` raises ``StopRun`` (exit 128 + the signal).
- ``close()``: watchdog, data stream, metrics logger and engine closed. ``__exit__`` runs it, so
  a step that raises leaves no thread behind in a caller that catches the error (tests, notebooks).

Checkpoints (``train/checkpoint.py``), metrics (``train/metrics.py``) and the final export
(``train/export.py``) are components in their own files; the task is used only through the
``ds_infcl.tasks.base.Task`` interface, whose methods are all there to call.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from ds_infcl.ops.validation import deferred_value_checks
from ds_infcl.tasks.base import Batch, as_batch, get_task
from ds_infcl.train import ds_sync_free, zero3_gather
from ds_infcl.train.checkpoint import load_checkpoint, run_id_after, save_checkpoint
from ds_infcl.train.config import RunConfig
from ds_infcl.train.dist import ProgressWatchdog, accelerator_name, init_distributed, local_device
from ds_infcl.train.ds_config import resolve_deepspeed_config
from ds_infcl.train.export import export_model, save_params, write_run_files
from ds_infcl.train.metrics import (
    MetricsLogger, model_flops_per_sample, peak_memory_mib, peak_tflops, sum_over_ranks, utilization,
)
from ds_infcl.train.inflight import InFlight, Launched, check_finite_values
from ds_infcl.train.keep_chunks import KeepChunks
from ds_infcl.train.model import ContrastiveModel, Encoder, compile_towers
from ds_infcl.train.optim import prepare_optimizer
from ds_infcl.train.profiling import profiled_call
from ds_infcl.train.preflight import check_at_load, check_param_shapes, check_same_schedule, stage_hints
from ds_infcl.train.signals import StopOnSignal, StopRun
from ds_infcl.train.steps import StepResult, grad_cache_step, place_batch, seed_all, uncached_step

__all__ = ["Trainer", "TrainSummary", "Encoder"]


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
    hfu: Optional[float] = None  # hardware FLOPs utilization: replays and recompute counted too (metrics.py)
    kept_chunks: Optional[int] = None  # chunks per step that kept their graph (the last step's)
    replayed_fraction: float = 0.0  # share of the local batch encoded twice (the last step's)


_GRAD_CACHE_NAMES = {True: "on", False: "off", "auto": "auto (the first chunks keep their graph, the rest are replayed)"}


def _log(msg: str, rank: int) -> None:
    if rank == 0:
        print(f"[ds_infcl] {msg}", flush=True)


class Trainer:
    """Train ``cfg.task`` with DeepSpeed on every rank of the launched world.

    Args:
        cfg: validated run config.
        ds_config: the DeepSpeed config as a dict (batch fields may be missing or ``"auto"``).
        resume: ``None`` (start fresh), ``"auto"`` (newest checkpoint in the checkpoint dir, if
            any) or a checkpoint path (see ``checkpoint.resolve_resume``).
        ds_config_source: name of the DeepSpeed config in error messages.
        save_params: write the final (gathered) parameters as float32 to this ``.pt`` file on
            rank 0 (tests compare runs with it).

    Everything ``__init__`` opened is released by ``close()`` (also when ``__init__`` itself fails).
    """

    def __init__(self, cfg: RunConfig, ds_config: Dict[str, Any], *, resume: Optional[str] = None,
                 ds_config_source: str = "DeepSpeed config", save_params: Optional[str] = None):
        import deepspeed.comm as dist

        self.t_start = time.time()
        self.save_params_path = save_params
        self.watchdog: Optional[ProgressWatchdog] = None
        self.logger: Optional[MetricsLogger] = None
        self.engine = self.data = None
        self._closed = False
        init_distributed(cfg.dist.timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # A signal or the launcher's death stops the run at a step boundary (train/signals.py).
        self.stop = StopOnSignal(self.rank).install()
        self.device = local_device()
        try:
            found = self._configure(cfg, ds_config, resume, ds_config_source)
            self._build_engine(found)
            self.start_step, self.samples = self._resume(resume, found)
            # Whose checkpoints this run may replace or prune: a resume of the newest tag continues
            # that run, any other start is a new run (train/checkpoint.py).
            self.run_id = run_id_after(found if self.resumed else None)
            self._announce()
            self._open_run()
        except BaseException:
            self.close()
            raise

    # -- set-up ----------------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        """A line on rank 0's stdout."""
        _log(msg, self.rank)

    def _configure(self, cfg: RunConfig, ds_config: Dict[str, Any], resume, source: str):
        """Configs: batch layout and optimizer; both fail before any model is built. So do the
        checks of what would otherwise fail at step 1 or at the first checkpoint
        (train/preflight.py: the compile toolchain, writable output and checkpoint folders, a
        resume's record against this run). Returns the resume's ``(dir, tag)`` or ``None``."""
        found = check_at_load(cfg, ds_config, self.world, device_type=self.device.type, rank=self.rank,
                              resume=resume, source=source)
        if cfg.batch.chunk_size == "auto":  # measure the towers for the chunk (train/chunk_auto.py)
            from ds_infcl.train.chunk_auto import resolve_auto_chunk

            cfg = resolve_auto_chunk(cfg, ds_config, self.world, self.rank, self.device, self.log)
        ds_cfg, self.layout = resolve_deepspeed_config(cfg, ds_config, self.world, source=source)
        self.ds_cfg, self.client_optimizer, self.notes = prepare_optimizer(ds_cfg, accelerator_name())
        for n in self.notes:
            self.log(n)
        if cfg.batch.grad_cache is True and self.layout.num_chunks == 1:
            self.log("batch.grad_cache is on with one chunk per rank: GradCache adds a pass for nothing")
        self.cfg = cfg
        self.task = get_task(cfg.task.name, cfg.task.args, cfg.task.module)
        return found

    def _build_engine(self, found) -> None:
        """The model, identically initialized on all ranks (DeepSpeed also broadcasts rank 0's),
        and the DeepSpeed engine; per-rank RNG streams from here on (dropout differs between ranks,
        as in any DP run)."""
        import deepspeed

        ds_sync_free.install(self.log)  # DeepSpeed's norm mask and clip without host waits (train/ds_sync_free.py)
        cfg = self.cfg
        seed_all(cfg.train.seed)
        stage = int(self.ds_cfg.get("zero_optimization", {}).get("stage", 0))
        towers = compile_towers(self.task.build_towers(), cfg.model, stage, self.log, self.layout.micro_batch_size)
        model = ContrastiveModel(towers, self.task.build_loss(cfg.loss))
        if found is not None:  # another model than the checkpoint's: said before the engine is built
            check_param_shapes(found, model)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=self.client_optimizer,
            config=self.ds_cfg,
        )
        self.engine.module.loss.group = self.engine.data_parallel_group
        seed_all(cfg.train.seed + 1 + 7919 * self.rank)

    def _resume(self, resume: Optional[str], found):
        """``(start_step, samples)``: from the checkpoint ``found`` (resolved, and its world size
        and batch checked, by ``check_at_load``), else 0."""
        self.resumed = resumed = False
        start_step, samples = 0, 0
        if resume and found is not None:
            state = load_checkpoint(self.engine, found[0], found[1], self.device)
            # Against the client state too: records of older versions keep no schedule.
            check_same_schedule(state, self.ds_cfg, f"{found[0]}/{found[1]}")
            self.resumed = resumed = True
            start_step, samples = int(state["step"]), int(state["samples"])
            self.task.load_state_dict(state.get("task_state", {}))
            self.log(f"resumed from {found[0]}/{found[1]} at step {start_step}")
        elif resume:
            self.log(f"--resume {resume}: no checkpoint in {self.cfg.checkpoint_dir}; starting fresh")
        if self.scheduler is not None and not resumed:
            # DeepSpeed's schedulers start at iteration -1 (lr 0) and step after each optimizer step,
            # so with a linear warm-up the first two steps would run at lr 0. Start at iteration 1:
            # optimizer step k runs at iteration k (the warm-up's first step at 1/warmup of the lr).
            self.scheduler.step(1)
        return start_step, samples

    def _announce(self) -> None:
        cfg, layout, engine = self.cfg, self.layout, self.engine
        self.log(
            f"world {self.world} ({accelerator_name()}), global batch {layout.global_batch_size} = micro "
            f"{layout.micro_batch_size} x accumulation {layout.num_chunks} x {self.world} ranks, "
            f"ZeRO stage {engine.zero_optimization_stage()}, loss {cfg.loss.impl}, "
            f"GradCache {_GRAD_CACHE_NAMES[cfg.batch.grad_cache]}, steps {self.start_step}->{cfg.train.num_steps}"
        )
        for hint in stage_hints(self.ds_cfg, self.world, self.device.type):
            self.log(hint)
        # grad_cache "auto": how many chunks keep their graph (train/keep_chunks.py), logged there
        self.keep = KeepChunks(cfg.batch, self.layout.num_chunks, self.device, self.log) if cfg.batch.grad_cache else None
        self.gather, why = zero3_gather.decide(cfg.batch.gather_params, engine, self.device, cfg.batch.grad_cache)
        if cfg.batch.grad_cache and int(engine.zero_optimization_stage()) >= 3:
            how = "gathered once per step" if self.gather else "gathered per chunk by ZeRO-3"
            self.log(f"ZeRO-3 GradCache: parameters {how} ({why})")

    def _open_run(self) -> None:
        """The metrics logger, the run's config files (rank 0), the data stream, the watchdog."""
        cfg, rank = self.cfg, self.rank
        self.logger = MetricsLogger(
            cfg.output_dir, enabled=rank == 0, csv_enabled=cfg.logging.csv,
            tensorboard=cfg.logging.tensorboard, progress_bar=cfg.logging.progress_bar,
            total_steps=cfg.train.num_steps, start_step=self.start_step,
            monitor=getattr(self.engine, "monitor", None),
        )
        if rank == 0:
            write_run_files(cfg.output_dir, cfg.to_dict(), self.ds_cfg)
        self.data = self.task.batches(
            rank=rank, world_size=self.world, local_batch_size=self.layout.local_batch_size,
            start_step=self.start_step, seed=cfg.train.seed,
        )
        self.encoder = Encoder(self.engine, self.device)
        self.losses, self.eval_metrics = [], {}
        self.train_time, self.timed_samples = 0.0, 0
        self.step = self.start_step
        self.flops_per_sample: Optional[float] = None
        # Activation checkpointing's recomputed share of the forward (the task says), for the HFU.
        self.recompute_fraction = float(self.task.recomputed_forward_fraction())
        self.last_result: Optional[StepResult] = None
        self.inflight = InFlight(self.device, self._settled)
        self.peak = peak_tflops(self.device, cfg.logging.peak_tflops)
        self.engine.train()
        self.watchdog = ProgressWatchdog(cfg.dist.timeout_s, rank) if self.world > 1 else None

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> TrainSummary:
        """Steps up to ``train.num_steps``, each followed by its evaluation and checkpoint when
        due; then the summary (the final export and ``summary.json`` included). The stop vote of a
        boundary is queued before the next step is launched and read after it (``agreed``), so
        neither waits for the GPU; a stop then saves after that step."""
        while self.step < self.cfg.train.num_steps:
            vote = self.stop.vote(device=self.device)
            self.train_step()
            if vote.agreed():
                self.inflight.settle()
                tag = self.maybe_checkpoint(force=self.cfg.checkpoint.on_signal)
                self._close_logger()
                raise StopRun(self.stop.signum, self.step, tag)
            self.maybe_eval()
            self.maybe_checkpoint()
        self.inflight.settle()
        return self.finish()

    def beat(self) -> None:
        """Progress made: the watchdog's clock restarts."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def train_step(self) -> Launched:
        """Launch one optimizer step on the next batch, then read the one before it (CUDA) or
        this one (CPU) (``_settled``: timed, checked for finite values, logged). Returns the
        launched step."""
        cfg, device = self.cfg, self.device
        lrs = self.engine.get_lr()
        lr_applied = float(lrs[0]) if lrs else float("nan")  # the lr this step's update uses
        batch = place_batch(as_batch(next(self.data)), device, cfg.data.offload, cfg.data.pin_memory)
        if self.flops_per_sample is None and self.step == self.start_step:
            known = self.task.model_flops_per_sample()  # a task that knows its FLOPs says so
            self.flops_per_sample = float(known) if known is not None else \
                model_flops_per_sample(self.engine, batch, device, self.log)
        self.inflight.start_clock()
        try:
            if self.step + 1 == cfg.logging.profile_step:  # under torch.profiler, to <output_dir>/profile
                result = profiled_call(self.forward_backward_step, batch, label=f"step {self.step + 1}",
                                       out_dir=os.path.join(cfg.output_dir, "profile"), device=device, rank=self.rank,
                                       log=self.log)
            else:
                result = self.forward_backward_step(batch)
        except Exception:
            self.inflight.settle()  # a step in flight that went wrong (a NaN update) is the cause: its error first
            raise
        self.step += 1
        self.samples += self.layout.global_batch_size
        engine = self.engine
        values = {"loss": result.loss,
                  "grad_norm": engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None,
                  "bad_inputs": result.input_checks.failed() if result.input_checks else None}
        if self._logs(self.step):
            values["logit_scale"] = self._logit_scale_tensor()
        applied = bool(engine.was_step_applied()) if hasattr(engine, "was_step_applied") else False
        launched = self.inflight.stage(self.step, result, values, lr=lr_applied, applied=applied, samples=self.samples)
        self.inflight.settle_behind()  # on CUDA the step before it; on CPU this one
        return launched

    def _logs(self, step: int) -> bool:
        return step % self.cfg.logging.every_steps == 0 or step == self.cfg.train.num_steps

    def _settled(self, launched: Launched, values: Dict[str, Optional[float]], seconds: float) -> None:
        """A step read back (``InFlight``): its time counted (not the first step's, which includes
        the warm-up, unless it is the only one), its values checked and logged."""
        step, batch_size = launched.step, self.layout.global_batch_size
        if step > self.start_step + 1 or step == self.cfg.train.num_steps:
            self.train_time += seconds
            self.timed_samples += batch_size
        self.beat()
        self.losses.append(values["loss"])
        check_finite_values(step, values["loss"], values["grad_norm"], launched.extra["applied"],
                            launched.result.input_checks if values["bad_inputs"] else None)
        if self._logs(step):
            ls, sps = values["logit_scale"], batch_size / seconds if seconds > 0 else float("nan")
            self.logger.log_train({
                "step": step, "loss": values["loss"], "logit_scale": ls, "scale": self._scale_of(ls),
                "lr": launched.extra["lr"], "samples_per_s": sps, "step_time_s": seconds, "samples": launched.extra["samples"],
                "peak_mem_mib": peak_memory_mib(self.device), **self._utilization(sps, launched.result)})
        self.logger.advance()

    def forward_backward_step(self, batch: Batch) -> StepResult:
        """Forward, backward and optimizer step of ``batch`` (GradCache's chunked protocol or one
        pass); the loss's input errors (NaN/Inf features, ...) name the step."""
        cfg = self.cfg
        try:
            with deferred_value_checks(labels_checked=batch.labels_known_in_range) as checks:
                if cfg.batch.grad_cache:
                    result = grad_cache_step(self.engine, batch, cfg.batch.chunk_size, self.device,
                                             verify_replay=cfg.batch.verify_replay, gather_params=self.gather,
                                             copy_stream=cfg.data.copy_stream, num_kept=self.keep.num_kept())
                    self.keep.observe(result)  # grad_cache "auto": the measuring step decides what later steps keep
                else:
                    result = uncached_step(self.engine, batch, self.device)
        except ValueError as e:
            raise ValueError(f"step {self.step + 1}: {e}") from e
        result.input_checks = checks
        self.last_result = result
        return result

    def _logit_scale_tensor(self) -> torch.Tensor:
        with torch.no_grad():
            return self.engine("logit_scale").float()

    def _scale_of(self, logit_scale: float) -> float:
        """The scale the loss applies: ``exp(logit_scale)`` clamped as the loss module clamps it."""
        return math.exp(min(logit_scale, getattr(self.engine.module.loss, "max_logit_scale", math.inf)))

    def _utilization(self, samples_per_s: float, result: StepResult) -> Dict[str, Any]:
        """Model TFLOP/s per GPU, MFU, HFU (``metrics.utilization``) at ``samples_per_s`` of steps
        like ``result``'s, and its kept chunks and replayed share."""
        return {**utilization(self.flops_per_sample, samples_per_s, self.world, self.peak, result.replayed_fraction,
                              self.recompute_fraction),
                "kept_chunks": result.num_kept, "replayed_fraction": result.replayed_fraction}

    def maybe_eval(self) -> Optional[Dict[str, float]]:
        """The task's evaluation (on every rank) when ``eval.every_steps`` divides the step, or
        after the last step with ``eval.at_end``; its metrics, or ``None`` when not due."""
        cfg, step = self.cfg, self.step
        is_last = step == cfg.train.num_steps
        if not ((cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or (is_last and cfg.eval.at_end)):
            return None
        self.inflight.settle()
        self.engine.eval()
        self.eval_metrics = self.task.evaluate(self.encoder, step)
        self.engine.train()
        self.beat()
        self.logger.log_eval(step, self.eval_metrics)
        return self.eval_metrics

    def maybe_checkpoint(self, force: bool = False) -> Optional[str]:
        """Save a checkpoint when ``checkpoint.every_steps`` divides the step, after the last step
        with ``checkpoint.at_end``, or now with ``force`` (the place for a stop at the step boundary:
        a signal handler's flag checked after the step saves here, then leaves the loop). Every
        rank calls it; returns the tag saved, or ``None``."""
        cfg, step = self.cfg, self.step
        is_last = step == cfg.train.num_steps
        due = (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or (is_last and cfg.checkpoint.at_end)
        if not (due or force):
            return None
        self.inflight.settle()  # every step before it checked: no checkpoint holds a non-finite update
        run_state = {
            "step": step, "samples": self.samples, "task_state": self.task.state_dict(),
            "world_size": self.world, "global_batch_size": self.layout.global_batch_size,
            "run_config": cfg.to_dict(), "scheduler": self.ds_cfg.get("scheduler"),
        }
        tag = save_checkpoint(self.engine, cfg.checkpoint_dir, step, run_state, self.device, cfg.checkpoint.keep_last,
                              run_id=self.run_id, overwrite=cfg.checkpoint.overwrite)
        self.beat()
        if not cfg.logging.progress_bar or force:
            self.log(f"saved checkpoint {cfg.checkpoint_dir}/{tag}")
        return tag

    # -- the end ---------------------------------------------------------------------------------

    def finish(self) -> TrainSummary:
        """After the last step: the data counts, the final scale, the saved parameters and the
        export (collectives: every rank calls it), and the summary (``summary.json`` on rank 0)."""
        cfg, engine, rank = self.cfg, self.engine, self.rank
        self._close_logger()
        data_counts = sum_over_ranks(self.task.data_report())
        if data_counts:
            self.log("data: " + ", ".join(f"{k}={v}" for k, v in sorted(data_counts.items())))
        final_scale = float(self._logit_scale_tensor())
        self.beat()
        if self.save_params_path:
            save_params(engine, self.save_params_path, rank)
        if cfg.checkpoint.export_final and self.task.can_export():
            export_model(engine, self.task, os.path.join(cfg.output_dir, "final_model"), rank,
                         getattr(torch, cfg.checkpoint.export_dtype))
        summary = self._summary(final_scale, data_counts)
        if rank == 0:
            with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
                json.dump(summary.__dict__, f, indent=2)
        return summary

    def _summary(self, final_scale: float, data_counts: Dict[str, int]) -> TrainSummary:
        losses = self.losses
        summary = TrainSummary(
            steps=self.step, start_step=self.start_step, world_size=self.world,
            global_batch_size=self.layout.global_batch_size, num_chunks=self.layout.num_chunks,
            final_loss=losses[-1] if losses else float("nan"), final_logit_scale=final_scale,
            final_scale=self._scale_of(final_scale), losses=losses,
            samples_per_s=(self.timed_samples / self.train_time) if self.train_time > 0 else float("nan"),
            peak_mem_mib=peak_memory_mib(self.device), wall_s=time.time() - self.t_start,
            eval=self.eval_metrics, notes=self.notes, data=data_counts,
        )
        summary.model_flops_per_sample = self.flops_per_sample
        if self.last_result is not None:  # the steady state: the last step's kept and replayed chunks
            for key, value in self._utilization(summary.samples_per_s, self.last_result).items():
                setattr(summary, key, value)
        return summary

    def close(self) -> None:
        """Release what the run holds, however it ends (idempotent): stop the watchdog, close the
        data stream (a loader's worker processes, a prefetch or device-decode thread stop now, not
        when a caught error's traceback is released), close the metrics logger, destroy the
        engine. Every part is attempted; the first failure is raised after the rest ran."""
        if self._closed:
            return
        self._closed = True
        first: Optional[BaseException] = None
        for release in (self.stop.restore, self._stop_watchdog, self._close_data, self._close_logger,
                        self._destroy_engine):
            try:
                release()
            except BaseException as e:  # noqa: BLE001 -- the others still run; raised below
                first = first or e
        if first is not None:
            raise first

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def _close_data(self) -> None:
        close = getattr(self.data, "close", None)  # a generator, or a loader object with close()
        self.data = None
        if callable(close):
            close()

    def _close_logger(self) -> None:
        if self.logger is not None:
            self.logger.close()
            self.logger = None

    def _destroy_engine(self) -> None:
        if self.engine is not None:
            self.engine.destroy()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- with an error in flight, that error is the one to see
            if exc_type is None:
                raise
            print("[ds_infcl] clean-up after the error below failed too:", file=sys.stderr)
            traceback.print_exc()
        return False
