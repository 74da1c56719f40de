"""Training metrics on rank 0: a CSV file, TensorBoard, DeepSpeed's monitors and a tqdm bar.

``<output_dir>/metrics.csv`` has one row per logged step with the columns of ``TRAIN_COLUMNS``;
evaluation results go to ``<output_dir>/eval.csv`` (``step`` plus the task's metric names). On
resume, rows after the resumed step (written by the interrupted run after its last checkpoint)
are dropped, so the file reads as one uninterrupted run. TensorBoard events go to
``<output_dir>/tensorboard`` through ``torch.utils.tensorboard`` (the ``tensorboard`` package, in
the ``train`` extra); on resume the writer purges the events after the resumed step, so TensorBoard
shows each step once. When the DeepSpeed JSON enables its own monitors (``tensorboard``, ``wandb``,
``csv_monitor``, ``comet``), the same scalars also go to them through ``engine.monitor`` as
``Train/<name>`` and ``Eval/<name>`` against the optimizer step (DeepSpeed's own ``Train/Samples/*``
events use the sample count).
"""

from __future__ import annotations

import csv
import math
import numbers
import os
import resource
import sys
from typing import Callable, Dict, List, Optional

import torch

__all__ = [
    "TRAIN_COLUMNS", "MetricsLogger", "format_metrics", "peak_memory_mib", "peak_tflops", "PEAK_TFLOPS",
    "model_flops_per_sample", "tflops_per_gpu", "hardware_flops_factor", "utilization", "sum_over_ranks",
]

TRAIN_COLUMNS = [
    "step", "loss", "logit_scale", "scale", "lr", "samples_per_s", "step_time_s", "peak_mem_mib", "samples",
    "model_tflops_per_gpu", "mfu", "hfu", "kept_chunks", "replayed_fraction",
]

# Dense bf16 / fp16 tensor-core peak per GPU in TFLOP/s (vendor data sheets, without sparsity).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "GH200": 989.4, "A100": 312.0, "A800": 312.0,
               "L40S": 362.1, "A10G": 125.0, "B200": 2250.0}


def peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """The device's dense 16-bit peak (``override`` if given; ``None`` on CPU or an unknown GPU)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "GH200" before "H200"
        if key in name:
            if key == "H100" and "PCIE" in name:
                return 756.5
            return PEAK_TFLOPS[key]
    return None


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this rank in MiB: allocated device memory on CUDA, process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def _truncate_csv(path: str, max_step: int) -> None:
    if not os.path.isfile(path):
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    header, body = rows[0], rows[1:]
    keep = [r for r in body if r and int(float(r[0])) <= max_step]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(keep)


class MetricsLogger:
    """Writes metrics on rank 0 (other ranks get a no-op logger).

    Args:
        output_dir: run directory.
        enabled: ``True`` on rank 0.
        csv_enabled / tensorboard / progress_bar: the ``logging`` section of the run config.
        total_steps / start_step: for the progress bar; ``start_step > 0`` also truncates the CSV
            files to rows ``<= start_step`` and purges later TensorBoard events (resume).
        monitor: DeepSpeed's ``engine.monitor`` when the JSON enables one (``write_events``).
    """

    def __init__(
        self,
        output_dir: str,
        *,
        enabled: bool,
        csv_enabled: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
        total_steps: int = 0,
        start_step: int = 0,
        monitor=None,
    ):
        self.enabled = enabled
        self._monitor = monitor if enabled and getattr(monitor, "enabled", False) else None
        self.output_dir = output_dir
        self._csv_enabled = csv_enabled and enabled
        self._tb = None
        self._bar = None
        self.train_path = os.path.join(output_dir, "metrics.csv")
        self.eval_path = os.path.join(output_dir, "eval.csv")
        self._eval_header: Optional[List[str]] = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if self._csv_enabled:
            if start_step > 0:
                _truncate_csv(self.train_path, start_step)
                _truncate_csv(self.eval_path, start_step)
            else:
                for p in (self.train_path, self.eval_path):
                    if os.path.exists(p):
                        os.remove(p)
            if not os.path.exists(self.train_path):
                with open(self.train_path, "w", newline="") as f:
                    csv.writer(f).writerow(TRAIN_COLUMNS)
            if os.path.exists(self.eval_path):
                with open(self.eval_path, newline="") as f:
                    self._eval_header = next(csv.reader(f), None)
        if tensorboard:
            tb_dir = os.path.join(output_dir, "tensorboard")
            from torch.utils.tensorboard import SummaryWriter  # checked at config load

            self._tb = SummaryWriter(tb_dir, purge_step=start_step + 1 if start_step else None)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr)

    def log_train(self, row: Dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._csv_enabled:
            with open(self.train_path, "a", newline="") as f:
                csv.writer(f).writerow(["" if row.get(c) is None else row[c] for c in TRAIN_COLUMNS])
        if self._tb is not None:
            for k in TRAIN_COLUMNS[1:]:
                if row.get(k) is not None:
                    self._tb.add_scalar(f"train/{k}", row[k], int(row["step"]))
        if self._monitor is not None:
            step = int(row["step"])
            self._monitor.write_events([(f"Train/{k}", float(row[k]), step) for k in TRAIN_COLUMNS[1:]
                                        if row.get(k) is not None])
        if self._bar is not None:
            post = dict(loss=f"{row['loss']:.4f}", scale=f"{row.get('scale', float('nan')):.2f}",
                        sps=f"{row.get('samples_per_s', 0):.0f}")
            if row.get("mfu") is not None:
                post["mfu"] = f"{100 * row['mfu']:.1f}%"
            if row.get("hfu") is not None:
                post["hfu"] = f"{100 * row['hfu']:.1f}%"
            self._bar.set_postfix(refresh=False, **post)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log_eval(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled or not metrics:
            return
        if self._csv_enabled:
            if self._eval_header is None:
                self._eval_header = ["step"] + sorted(metrics)
                with open(self.eval_path, "w", newline="") as f:
                    csv.writer(f).writerow(self._eval_header)
            with open(self.eval_path, "a", newline="") as f:
                csv.writer(f).writerow([step] + [metrics.get(k, "") for k in self._eval_header[1:]])
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"eval/{k}", v, step)
        if self._monitor is not None:
            self._monitor.write_events([(f"Eval/{k}", float(v), step) for k, v in sorted(metrics.items())])
        if self._bar is not None:
            self._bar.write(f"[eval step {step}] " + format_metrics(metrics))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def format_metrics(metrics: dict) -> str:
    """``k=v, ...`` sorted by name; counts (integer values, and ``num_*`` / ``*_samples`` with an
    integral value) as integers, the rest with four decimals."""
    def fmt(key, value):
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return f"{key}={int(value)}"
        if (key.startswith("num_") or key.endswith("_samples")) and float(value).is_integer():
            return f"{key}={int(value)}"
        return f"{key}={value:.4f}"

    return ", ".join(fmt(k, v) for k, v in sorted(metrics.items()))


def model_flops_per_sample(engine, batch, device: torch.device, log: Callable[[str], None]) -> Optional[float]:
    """Training FLOPs of one example (its query and its keys through the towers): 3 x the forward
    FLOPs that ``torch.utils.flop_counter`` counts on a one-example slice of the first batch (the
    usual model-FLOPs definition: forward and a backward of twice its cost; GradCache's extra
    forward and recomputation are not model FLOPs). Every rank calls it (ZeRO-3 forwards are
    collective); the RNG state is restored, so the run is the same as without it."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_infcl.train.model import eager_blocks
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
        log(f"model FLOPs not counted ({type(e).__name__}: {e}); no MFU in the logs")
        return None
    finally:
        set_rng_state(state, device)


def tflops_per_gpu(flops_per_sample: Optional[float], samples_per_s: float, world: int) -> Optional[float]:
    if not flops_per_sample or not math.isfinite(samples_per_s):
        return None
    return flops_per_sample * samples_per_s / world / 1e12


def hardware_flops_factor(replayed_fraction: float, recompute_fraction: float = 0.0) -> float:
    """Hardware FLOPs over model FLOPs of a training step: ``(3 + r + c) / 3``.

    Model FLOPs count a forward (1) and a backward of twice its cost (2) per example. The GPU
    also runs GradCache's first forward of every replayed chunk, ``r`` = the replayed share of the
    local batch (1 for ``grad_cache: true``, 0 for the plain step, ``(n - K) / n`` for the hybrid
    of ``grad_cache: "auto"``), and activation checkpointing's recompute in the backward, ``c`` =
    the recomputed share of a forward (``Task.recomputed_forward_fraction``). HFU = MFU x this
    factor: the share of the peak the GPU spent on arithmetic, replays included; MFU counts only
    the work the model needs, so it is the one to compare between methods."""
    return (3.0 + replayed_fraction + recompute_fraction) / 3.0


def utilization(flops_per_sample: Optional[float], samples_per_s: float, world: int, peak: Optional[float],
                replayed_fraction: float, recompute_fraction: float = 0.0) -> Dict[str, Optional[float]]:
    """``model_tflops_per_gpu``, ``mfu`` (over the GPU's ``peak`` TFLOP/s) and ``hfu`` (MFU x
    ``hardware_flops_factor``) at ``samples_per_s`` over ``world`` GPUs; ``None`` where the FLOPs
    or the peak are not known."""
    tflops = tflops_per_gpu(flops_per_sample, samples_per_s, world)
    mfu = None if tflops is None or not peak else tflops / peak
    hfu = None if mfu is None else mfu * hardware_flops_factor(replayed_fraction, recompute_fraction)
    return {"model_tflops_per_gpu": tflops, "mfu": mfu, "hfu": hfu}


def sum_over_ranks(mine: Dict[str, int]) -> Dict[str, int]:
    """Counts of this rank (the task's ``data_report()``: samples skipped, examples unused, ...)
    summed over the ranks; every rank gets the same dict (a collective: all ranks call it)."""
    import deepspeed.comm as dist

    mine = {k: int(v) for k, v in mine.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    total: Dict[str, int] = {}
    for counts in gathered:
        for k, v in (counts or {}).items():
            total[k] = total.get(k, 0) + v
    return total
