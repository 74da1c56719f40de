"""Command line of the trainer: ``python -m ds_infcl.train`` (under any launcher, or alone).

    deepspeed --num_gpus 2 -m ds_infcl.train \\
        --deepspeed_config ds_configs/zero2.json --config run.json \\
        [--set batch.global_batch_size=512 ...] [--ds-set zero_optimization.stage=3 ...] \\
        [--resume auto|CHECKPOINT_PATH]

Without a launcher it runs as a single rank. ``--check`` validates both configs (for a given
``--world-size``) and exits without training. See docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import List, Optional

from ds_infcl.train.config import ConfigError, apply_overrides, load_run_config, read_json_file
from ds_infcl.train.ds_config import resolve_deepspeed_config

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ds_infcl.train",
        description="Train a contrastive model with an exact global-batch loss (Inf-CL) on DeepSpeed.",
    )
    p.add_argument("--config", "-c", help="run config JSON (task, loss, batch, data, eval, logging, checkpoint)")
    p.add_argument("--deepspeed_config", "--ds-config", dest="deepspeed_config", required=True,
                   help="DeepSpeed config JSON (ZeRO stage, precision, optimizer, scheduler), e.g. ds_configs/zero2.json")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run config key (JSON value), e.g. --set batch.chunk_size=32; repeatable")
    p.add_argument("--ds-set", dest="ds_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DeepSpeed config key, e.g. --ds-set zero_optimization.stage=3 "
                   "(a null value removes the key: --ds-set scheduler=null); repeatable")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="resume: 'auto' (default when the flag has no value: the newest complete checkpoint in "
                   "checkpoint.dir, or a fresh start if none), a checkpoint directory, or a tag directory")
    p.add_argument("--fresh", action="store_true",
                   help="start a new run even where checkpoint.dir holds complete checkpoints (same as "
                   "--set checkpoint.overwrite=true); without it such a start is refused")
    p.add_argument("--output_dir", "--output-dir", dest="output_dir", help="shortcut for --set output_dir=...")
    p.add_argument("--save-params", dest="save_params", help="write the final float32 parameters to this .pt file (rank 0)")
    p.add_argument("--check", action="store_true", help="validate the configs and exit")
    p.add_argument("--world-size", type=int, default=None, help="world size assumed by --check (default: $WORLD_SIZE or 1)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def _load_ds_config(path: str, overrides: List[str]) -> dict:
    """The DeepSpeed JSON with the ``--ds-set`` overrides; a key DeepSpeed would ignore (a typo such
    as ``zero_optimisation``) is warned about, with the closest known key, on rank 0."""
    from ds_infcl.train.ds_config import unknown_deepspeed_keys

    ds = apply_overrides(read_json_file(path, "--deepspeed_config"), overrides, what="--ds-set", delete_on_null=True)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in unknown_deepspeed_keys(ds):
            print(f"[ds_infcl] warning: {path}: {line}", file=sys.stderr, flush=True)
    return ds


def _check(cfg, ds_config, args) -> int:
    """``--check``: every check a run makes before step 1, with nothing written and no process group."""
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    from ds_infcl.train.optim import prepare_optimizer
    from ds_infcl.tasks.base import check_only, get_task
    from ds_infcl.train.dist import accelerator_name
    from ds_infcl.train.preflight import check_at_load

    resolved, layout = resolve_deepspeed_config(cfg, ds_config, world, source=args.deepspeed_config)
    prepare_optimizer(resolved, "cuda")
    check_at_load(cfg, ds_config, world, device_type=accelerator_name(), resume=args.resume, dry=True,
                  source=args.deepspeed_config)
    with check_only():  # validates what the run would read; writes nothing
        task = get_task(cfg.task.name, cfg.task.args, cfg.task.module)
        task.check_loss(cfg.loss)  # what building the loss would refuse (FastCLIP's num_samples)
    print(f"ok: world {world}, global batch {layout.global_batch_size} = micro {layout.micro_batch_size}"
          f" x accumulation {layout.num_chunks} x {world}")
    return 0


def _print_done(summary) -> None:
    """Rank 0's last line: steps, loss, scale, speed (and model TFLOP/s, MFU, HFU), memory, time, eval."""
    from ds_infcl.train.metrics import format_metrics

    ev = format_metrics(summary.eval)
    print(
        f"[ds_infcl] done: {summary.steps} steps, final loss {summary.final_loss:.4f}, scale "
        f"{summary.final_scale:.2f} (logit_scale {summary.final_logit_scale:.3f}), "
        f"{summary.samples_per_s:.1f} samples/s"
        + (f" ({summary.model_tflops_per_gpu:.1f} model TFLOP/s per GPU"
           + (f", MFU {100 * summary.mfu:.1f}%" if summary.mfu is not None else "")
           + (f", HFU {100 * summary.hfu:.1f}%" if summary.hfu is not None else "") + ")"
           if summary.model_tflops_per_gpu is not None else "")
        + ", peak mem "
        f"{summary.peak_mem_mib:.0f} MiB, {summary.wall_s:.1f} s" + (f", {ev}" if ev else ""),
        flush=True,
    )


def main(argv: Optional[List[str]] = None) -> int:
    # torch's own deprecation notice for the collective DeepSpeed calls, printed by every rank.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated", category=FutureWarning)
    args = build_parser().parse_args(argv)
    try:
        overrides = list(args.overrides)
        if args.output_dir:
            overrides.append(f"output_dir={args.output_dir}")
        if args.fresh and args.resume is not None:
            raise ConfigError("--fresh starts a new run and --resume continues one: pass only one of them")
        if args.fresh:
            overrides.append("checkpoint.overwrite=true")
        cfg = load_run_config(args.config, overrides)
        ds_config = _load_ds_config(args.deepspeed_config, args.ds_overrides)
        if args.resume not in (None, "auto"):  # a bad path stops the run here, not after set-up
            from ds_infcl.train.checkpoint import resolve_resume

            resolve_resume(args.resume, cfg.checkpoint_dir, verify=False)  # rank 0 verifies it at load
        if args.check:
            return _check(cfg, ds_config, args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    from ds_infcl.train.dist import shutdown
    from ds_infcl.train.loop import train
    from ds_infcl.train.signals import StopRun

    try:
        summary = train(cfg, ds_config, resume=args.resume, ds_config_source=args.deepspeed_config,
                        save_params=args.save_params)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except StopRun as e:  # a signal: every rank stopped at the same step (and saved there)
        shutdown()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[ds_infcl] {e}; exit status {e.exit_code}", flush=True)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 -- only communication failures are reworded
        from ds_infcl.train.dist import is_comm_failure

        if not is_comm_failure(e):
            raise
        rank = os.environ.get("RANK", "?")
        print(f"[ds_infcl] rank {rank}: lost contact with the other ranks (a peer process died, hung longer "
              f"than dist.timeout_s={cfg.dist.timeout_s} s, or the network failed); ending this rank. "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr, flush=True)
        return 1
    shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        _print_done(summary)
    return 0


def run() -> None:
    """Process entry point (``python -m ds_infcl.train``, the ``ds-infcl-train`` script): ``main``,
    then leave without interpreter finalization (see ``ds_infcl.train.dist.exit_process``)."""
    from ds_infcl.train.dist import exit_process

    exit_process(main())
