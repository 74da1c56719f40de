"""``python -m ds_infcl.demos.trainer`` (``make demo``): train a contrastive model on 2 ranks through
the deepspeed launcher (CPU and gloo on a machine without GPUs), evaluate it and print a summary.

The default task, ``--task digits``, is the built-in CLIP job: the 1,797 handwritten digits that
ship with scikit-learn are written to webdataset shards (train / held-out split, varied captions
such as "a handwritten 7" or "the digit seven") under ``--data-dir``; a small CLIP
(``digits-tiny``: ViT and text transformer, 217k parameters) is trained from scratch with the
``infcl`` loss over the global batch; held-out zero-shot accuracy and recall are printed. It runs::

    deepspeed --num_gpus 2 --master_port <free> --module ds_infcl.train \\
        --deepspeed_config ds_configs/zero2_fp32.json --ds-set optimizer.params.lr=0.002 \\
        --config <output_dir>/demo_run.json

``--task synthetic`` trains the dependency-free synthetic pairs task instead (ZeRO-2, bf16,
GradCache in 4 chunks per rank, recall@1 on held-out pairs).

Both use ``DS_ACCELERATOR=cpu`` when no GPU is visible and ``OMP_NUM_THREADS=1``, write
``metrics.csv``, ``eval.csv``, TensorBoard scalars, a checkpoint and ``summary.json`` under
``--output-dir``. ``--resume`` continues an interrupted demo from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from ds_infcl.train.dist import free_port

__all__ = ["demo_run_config", "main"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Per task: the DeepSpeed JSON, its overrides, and the defaults of the command-line flags.
TASKS = {
    "digits": {
        "ds_config": "zero2_fp32.json", "ds_set": ["optimizer.params.lr=0.002"],
        "steps": 150, "global_batch_size": 256, "chunk_size": None, "eval_every": 50,
    },
    "synthetic": {
        "ds_config": "zero2.json", "ds_set": [],
        "steps": 150, "global_batch_size": 256, "chunk_size": 32, "eval_every": 50,
    },
}


def demo_run_config(
    output_dir: str,
    num_steps: int,
    global_batch_size: int,
    chunk_size,
    impl: str,
    task: str = "synthetic",
    data_dir: str = "data/digits",
    eval_every: int = 50,
) -> dict:
    """The run config of the demo (``task`` is ``digits`` or ``synthetic``)."""
    if task == "digits":
        task_cfg = {"name": "clip", "args": {"data_dir": data_dir, "arch": "digits-tiny", "init_temperature": 0.2}}
    elif task == "synthetic":
        task_cfg = {"name": "synthetic", "args": {"input_dim": 32, "latent_dim": 8, "hidden_dim": 64,
                                                  "embed_dim": 16, "noise": 0.3, "dropout": 0.1}}
    else:
        raise ValueError(f"unknown demo task {task!r}; choose one of {sorted(TASKS)}")
    batch = {"global_batch_size": global_batch_size, "grad_cache": chunk_size is not None}
    if chunk_size is not None:
        batch["chunk_size"] = chunk_size
    return {
        "task": task_cfg,
        "loss": {"impl": impl},
        "batch": batch,
        "train": {"num_steps": num_steps, "seed": 0},
        "eval": {"every_steps": eval_every, "at_end": True},
        "logging": {"every_steps": 1, "progress_bar": True},
        "checkpoint": {"every_steps": 50, "at_end": True, "keep_last": 1},
        "output_dir": output_dir,
    }


_LOSS_NAMES = {"infcl": "Inf-CL loss", "siglip": "SigLIP loss"}


def _print_digits(s: dict, impl: str = "infcl") -> None:
    ev = s.get("eval", {})
    n = int(ev.get("num_images", 0))
    print(f"\n=== ds_infcl demo: CLIP on the scikit-learn digits, {_LOSS_NAMES.get(impl, impl + ' loss')}, "
          "DeepSpeed ZeRO-2 ===")
    loss = f", loss {s['losses'][0]:.4f} -> {s['losses'][-1]:.4f}" if s["losses"] else ""
    print(f"ranks {s['world_size']}, global batch {s['global_batch_size']}, steps {s['steps']}{loss}")
    if "zero_shot_top1" in ev:
        print(f"held-out zero-shot accuracy: top-1 {100 * ev['zero_shot_top1']:.1f}%, "
              f"top-5 {100 * ev['zero_shot_top5']:.1f}% ({n} digits, 10 classes, chance 10%)")
    for direction in ("image_to_text", "text_to_image"):
        key = f"label_{direction}_R@1"
        if key in ev:
            print(f"held-out recall@1 {direction.replace('_', ' ')}: {100 * ev[key]:.1f}% "
                  f"(a caption of the same digit counts), R@5 {100 * ev[f'label_{direction}_R@5']:.1f}%")
    if "image_to_text_R@1" in ev:
        print(f"held-out instance recall@10 (its own caption among {n}): image->text "
              f"{100 * ev['image_to_text_R@10']:.1f}%, text->image {100 * ev['text_to_image_R@10']:.1f}%")


def _print_synthetic(s: dict) -> None:
    losses = s["losses"]
    print("\n=== ds_infcl demo: synthetic pairs, Inf-CL loss, DeepSpeed ZeRO-2, GradCache ===")
    print(f"ranks {s['world_size']}, global batch {s['global_batch_size']} ({s['num_chunks']} chunks per rank), steps {s['steps']}")
    if losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; scale {s['final_scale']:.3f}")
    for k, v in sorted(s.get("eval", {}).items()):
        print(f"{k} {v:.4f} (held-out pairs, chance {1 / 256:.4f})")


def _last_eval(path: str) -> dict:
    """The last row of an ``eval.csv`` as floats ({} if there is none)."""
    import csv

    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for k, v in rows[-1].items() if k != "step" and v not in ("", None)} if rows else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.demos.trainer", description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="digits")
    p.add_argument("--num-ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="default: 150 (450 with --impl siglip)")
    p.add_argument("--global-batch-size", type=int, default=None, help="default: 256")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="GradCache chunk per rank (default: 32 for synthetic, off for digits)")
    p.add_argument("--impl", default="infcl", help="loss implementation (infcl, a baseline, or siglip)")
    p.add_argument("--deepspeed-config", default=None, help="default: ds_configs/zero2_fp32.json (digits), zero2.json (synthetic)")
    p.add_argument("--data-dir", default="data/digits", help="digits shards (written on first use)")
    p.add_argument("--output-dir", default=None, help="default: runs/demo_<task>")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir "
                   "(without it each demo starts a new run there, over the previous demo's checkpoints)")
    args = p.parse_args(argv)
    d = TASKS[args.task]
    # SigLIP's sigmoid loss needs a longer schedule on the digits (450 steps: 95% held-out top-1,
    # docs/siglip.md).
    steps = args.steps if args.steps is not None else d["steps"] * (3 if args.impl == "siglip" else 1)
    gbs = args.global_batch_size if args.global_batch_size is not None else d["global_batch_size"]
    chunk = args.chunk_size if args.chunk_size is not None else d["chunk_size"]
    ds_config = args.deepspeed_config or os.path.join(_REPO, "ds_configs", d["ds_config"])
    out = args.output_dir or f"runs/demo_{args.task}"
    if args.num_ranks < 1 or steps < 1 or gbs < args.num_ranks:
        p.error("need --num-ranks >= 1, --steps >= 1 and --global-batch-size >= --num-ranks")

    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(launcher):
        print("the 'deepspeed' launcher is not on PATH (pip install deepspeed)", file=sys.stderr)
        return 1
    if args.task == "digits":
        from ds_infcl.tasks.clip import ensure_digits_shards

        t0 = time.time()
        info = ensure_digits_shards(args.data_dir)
        print(f"[demo] digits shards in {args.data_dir}: {info['train']['num_samples']} train, "
              f"{info['heldout']['num_samples']} held-out ({time.time() - t0:.1f} s)", flush=True)
    os.makedirs(out, exist_ok=True)
    run_path = os.path.join(out, "demo_run.json")
    with open(run_path, "w") as f:
        json.dump(demo_run_config(out, steps, gbs, chunk, args.impl, args.task, args.data_dir,
                                  min(d["eval_every"], steps)), f, indent=2)

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
    except ImportError:  # pragma: no cover
        pass
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        launcher, "--num_gpus", str(args.num_ranks), "--master_port", str(free_port()),
        "--module", "ds_infcl.train", "--deepspeed_config", ds_config,
    ]
    for kv in d["ds_set"] if args.deepspeed_config is None else []:
        cmd += ["--ds-set", kv]
    # A new demo run each time (--fresh): the previous demo's checkpoints in the same folder would
    # otherwise make the trainer refuse a fresh start (docs/training.md, "Resume").
    cmd += ["--config", run_path] + (["--resume"] if args.resume else ["--fresh"])
    print("[demo] " + " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, env=env)
    wall = time.time() - t0
    if rc != 0:
        print(f"[demo] training failed (exit code {rc})", file=sys.stderr)
        return rc
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    trained = bool(s["losses"])
    if not trained:  # --resume of a finished run: show its last evaluation
        print(f"[demo] nothing to train: the run in {out} had reached step {s['steps']}; its last evaluation:")
        s["eval"] = _last_eval(os.path.join(out, "eval.csv")) or s.get("eval", {})
    if args.task == "digits":
        _print_digits(s, args.impl)
    else:
        _print_synthetic(s)
    if trained:
        print(f"{s['samples_per_s']:.0f} samples/s, peak memory {s['peak_mem_mib']:.0f} MiB per rank, wall {wall:.1f} s")
    print(f"metrics: {out}/metrics.csv, eval: {out}/eval.csv, checkpoint: {out}/checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
