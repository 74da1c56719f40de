"""``python -m ds_infcl.train.demo``: train the synthetic task on 2 ranks through the deepspeed
launcher (CPU and gloo on a machine without GPUs) and print a summary.

It writes a run config to ``<output_dir>/demo_run.json`` and runs::

    deepspeed --num_gpus 2 --master_port <free> --module ds_infcl.train \\
        --deepspeed_config ds_configs/zero2.json --config <output_dir>/demo_run.json

with ``DS_ACCELERATOR=cpu`` (when no GPU is visible) and ``OMP_NUM_THREADS=1``: ZeRO-2, bf16,
AdamW, GradCache (4 chunks per rank), the Inf-CL loss over the global batch, a checkpoint at the
end, evaluation (recall@1 on held-out pairs) before and after.
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


def demo_run_config(output_dir: str, num_steps: int, global_batch_size: int, chunk_size: int, impl: str) -> dict:
    return {
        "task": {"name": "synthetic", "args": {"input_dim": 32, "latent_dim": 8, "hidden_dim": 64,
                                               "embed_dim": 16, "noise": 0.3, "dropout": 0.1}},
        "loss": {"impl": impl},
        "batch": {"global_batch_size": global_batch_size, "grad_cache": True, "chunk_size": chunk_size},
        "train": {"num_steps": num_steps, "seed": 0},
        "eval": {"every_steps": max(1, num_steps // 3), "at_end": True},
        "logging": {"every_steps": 1, "progress_bar": True},
        "checkpoint": {"every_steps": 0, "at_end": True, "keep_last": 1},
        "output_dir": output_dir,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.train.demo", description=__doc__.split("\n")[0])
    p.add_argument("--num-ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--impl", default="infcl", help="loss implementation (infcl, or a baseline)")
    p.add_argument("--deepspeed-config", default=os.path.join(_REPO, "ds_configs", "zero2.json"))
    p.add_argument("--output-dir", default="runs/demo")
    args = p.parse_args(argv)

    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(launcher):
        print("the 'deepspeed' launcher is not on PATH (pip install deepspeed)", file=sys.stderr)
        return 1
    os.makedirs(args.output_dir, exist_ok=True)
    run_path = os.path.join(args.output_dir, "demo_run.json")
    with open(run_path, "w") as f:
        json.dump(demo_run_config(args.output_dir, args.steps, args.global_batch_size, args.chunk_size, args.impl), f, indent=2)

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
        "--module", "ds_infcl.train",
        "--deepspeed_config", args.deepspeed_config, "--config", run_path,
    ]
    print("[demo] " + " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, env=env)
    wall = time.time() - t0
    if rc != 0:
        print(f"[demo] training failed (exit code {rc})", file=sys.stderr)
        return rc
    with open(os.path.join(args.output_dir, "summary.json")) as f:
        s = json.load(f)
    losses = s["losses"]
    print("\n=== ds_infcl demo: synthetic pairs, Inf-CL loss, DeepSpeed ZeRO-2, GradCache ===")
    print(f"ranks {s['world_size']}, global batch {s['global_batch_size']} ({s['num_chunks']} chunks per rank), steps {s['steps']}")
    if losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; logit scale {s['final_logit_scale']:.3f}")
    for k, v in sorted(s.get("eval", {}).items()):
        print(f"{k} {v:.4f} (held-out pairs, chance {1 / 256:.4f})")
    print(f"{s['samples_per_s']:.0f} samples/s, peak memory {s['peak_mem_mib']:.0f} MiB per rank, wall {wall:.1f} s")
    print(f"metrics: {args.output_dir}/metrics.csv, eval: {args.output_dir}/eval.csv, checkpoint: {args.output_dir}/checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
