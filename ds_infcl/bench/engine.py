"""GPU benchmark of the whole training step: CLIP ViT-B/16 + text tower, ZeRO-2, bf16, GradCache,
the ``infcl`` loss against the ``local`` baseline (OpenCLIP's local loss + gather_with_grad).

    python -m ds_infcl.bench.engine --num-gpus 1 --out runs/bench_gpu

For each loss implementation it runs, each as its own ``deepspeed --num_gpus N --module
ds_infcl.train`` process (an out-of-memory rank cannot hang the next case):

1. **throughput**: at ``--throughput-batch`` (a global batch the baseline fits), ``--steps``
   steps (the first is warm-up), reporting samples/s and peak device memory per GPU;
2. **largest batch**: one step at global batches doubling from ``--search-start`` until the
   case runs out of memory, fails, exceeds ``--case-timeout`` seconds, or reaches
   ``--search-max``; the largest that ran is reported (with ``>=`` when the search stopped for
   time or the cap rather than memory).

Results: a printed table, ``<out>/results.csv`` and ``<out>/results.md`` (device name, settings).
With GradCache the towers hold one chunk of activations at a time, so the batch limit is set by
the features, their cached gradients and the loss; the baseline's ``[b, B]`` logits grow
quadratically. ``--arch tiny`` runs the same pipeline in seconds (CPU smoke test).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from ds_infcl.train.dist import free_port

__all__ = ["main"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _task_args(args) -> Dict:
    extra = json.loads(args.task_args) if args.task_args else {}
    return {"arch": args.arch, **extra} if args.task == "bench_clip" else extra


def _tokens_per_sample(args) -> Optional[int]:
    if args.task != "bench_decoder":
        return None
    extra = json.loads(args.task_args) if args.task_args else {}
    return int(extra.get("seq_len", 256)) * (2 + int(extra.get("num_negatives", 1)))


def _run_case(args, impl: str, global_batch: int, steps: int, tag: str) -> Dict:
    out = os.path.join(args.out, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    chunk = min(args.chunk_size, global_batch // args.num_gpus)
    run = {
        "task": {"name": args.task, "args": _task_args(args)},
        "loss": {"impl": impl},
        "batch": {"global_batch_size": global_batch, "grad_cache": True, "chunk_size": chunk},
        "data": {"offload": True},
        "train": {"num_steps": steps, "seed": 0},
        "eval": {"every_steps": 0, "at_end": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "checkpoint": {"every_steps": 0, "at_end": False, "export_final": False},
        "output_dir": out,
    }
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(run, f, indent=2)
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", str(args.num_gpus), "--master_port", str(free_port()), "--module", "ds_infcl.train",
           "--deepspeed_config", args.deepspeed_config, "--config", os.path.join(out, "run.json"),
           "--ds-set", "scheduler=null", "--ds-set", "gradient_clipping=1.0",
           # torch.optim.AdamW (foreach): no JIT build of FusedAdam in every fresh machine
           "--ds-set", "optimizer.params.torch_adam=true"]
    for extra in args.ds_set:
        cmd += ["--ds-set", extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    log_path = os.path.join(out, "log.txt")
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.case_timeout)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = "timeout"
    wall = time.time() - t0
    text = open(log_path, errors="replace").read()
    if status == "failed" and ("OutOfMemoryError" in text or "CUDA out of memory" in text):
        status = "oom"
    if status == "failed":
        print(f"[bench] {tag} failed; last lines of {log_path}:\n" + "\n".join(text.splitlines()[-30:]), flush=True)
    row = {"impl": impl, "global_batch": global_batch, "gpus": args.num_gpus, "chunk": chunk, "steps": steps,
           "status": status, "samples_per_s": "", "step_time_s": "", "peak_mem_gib": "", "wall_s": round(wall, 1)}
    if status == "ok":
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        row["samples_per_s"] = round(s["samples_per_s"], 1)
        row["step_time_s"] = round(global_batch / s["samples_per_s"], 3) if s["samples_per_s"] else ""
        row["peak_mem_gib"] = round(s["peak_mem_mib"] / 1024, 2)
        if s.get("mfu") is not None:
            row["mfu"] = round(s["mfu"], 4)
        tokens = _tokens_per_sample(args)
        if tokens and s["samples_per_s"]:
            row["tokens_per_s"] = round(s["samples_per_s"] * tokens)
    print(f"[bench] {impl:8s} B={global_batch:>8d} {status:8s} sps={row['samples_per_s']} "
          f"tokens/s={row.get('tokens_per_s', '-')} mfu={row.get('mfu', '-')} "
          f"peak={row['peak_mem_gib']} GiB wall={row['wall_s']} s", flush=True)
    return row


def _gpu_info() -> Dict[str, object]:
    """Name and memory of the GPUs from nvidia-smi: this process must not create a CUDA context
    (it would hold device memory while the measured cases run)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"name": "no GPU (nvidia-smi not found)", "mem_gib": None}
    name, mem = [x.strip() for x in out[0].split(",")]
    return {"name": f"{len(out)} x {name}", "mem_gib": float(mem) / 1024}


def _linear_limit(rows: List[Dict], impl: str, mem_gib: Optional[float]) -> str:
    """Global batch at which the last two searched sizes' peak memory, extended linearly, reaches
    the device memory (the Inf-CL path grows linearly with the batch under GradCache)."""
    ok = [r for r in rows if r["phase"] == "search" and r["impl"] == impl and r["status"] == "ok"]
    if mem_gib is None or len(ok) < 2:
        return ""
    (b1, m1), (b2, m2) = [(r["global_batch"], r["peak_mem_gib"]) for r in ok[-2:]]
    slope = (m2 - m1) / (b2 - b1)
    if slope <= 0:
        return ""
    return f"~{int(b2 + (mem_gib - m2) / slope):,} (linear extrapolation of peak memory, {slope * 2**20:.2f} GiB per 1M samples)"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--impls", nargs="+", default=["local", "infcl"])
    p.add_argument("--arch", default="vit-b-16", help="bench_clip: vit-b-16 or tiny (CPU smoke test)")
    p.add_argument("--task", default="bench_clip", choices=["bench_clip", "bench_decoder"],
                   help="bench_clip (CLIP towers) or bench_decoder (an LLM embedder, e.g. Qwen2-1.5B's shape)")
    p.add_argument("--task-args", default=None, metavar="JSON",
                   help='task arguments, e.g. \'{"arch": "qwen2-1.5b", "seq_len": 256, "lora": {"r": 16}}\'')
    p.add_argument("--chunk-size", type=int, default=256, help="GradCache chunk per GPU")
    p.add_argument("--throughput-batch", type=int, default=16384, help="0 skips the throughput phase")
    p.add_argument("--steps", type=int, default=4, help="throughput steps (the first is warm-up)")
    p.add_argument("--search-start", type=int, default=32768)
    p.add_argument("--search-max", type=int, default=1 << 20)
    p.add_argument("--case-timeout", type=int, default=420, help="seconds per launched case")
    p.add_argument("--no-search", action="store_true")
    p.add_argument("--deepspeed-config", default=os.path.join(_REPO, "ds_configs", "zero2.json"))
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                   help="more DeepSpeed JSON overrides for every case (repeatable), e.g. "
                   "zero_optimization.stage3_param_persistence_threshold=1e12")
    p.add_argument("--label", default=None, help="title of the results table (default: the DeepSpeed config's name)")
    p.add_argument("--out", default="runs/bench_gpu")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    gpu = _gpu_info()

    rows = []
    for impl in args.impls if args.throughput_batch > 0 else ():
        rows.append(dict(_run_case(args, impl, args.throughput_batch, args.steps, f"{impl}_tp_{args.throughput_batch}"), phase="throughput"))
    largest: Dict[str, str] = {}
    if not args.no_search:
        for impl in args.impls:
            B, best, why = args.search_start, None, "cap"
            while B <= args.search_max:
                row = dict(_run_case(args, impl, B, 1, f"{impl}_max_{B}"), phase="search")
                rows.append(row)
                if row["status"] != "ok":
                    why = row["status"]
                    break
                best = B
                B *= 2
            largest[impl] = "none" if best is None else (f"{best}" if why == "oom" else f">= {best} ({why})")

    fields = ["phase", "impl", "gpus", "global_batch", "chunk", "steps", "status", "samples_per_s", "tokens_per_s",
              "mfu", "step_time_s", "peak_mem_gib", "wall_s"]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"# Training-step benchmark: {args.arch}, {args.label or os.path.basename(args.deepspeed_config)}"
        f"{' ' + ' '.join(args.ds_set) if args.ds_set else ''}, GradCache chunk {args.chunk_size}/GPU",
        "", f"Device: {gpu['name']} ({gpu['mem_gib'] or 0:.0f} GiB each); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        "| impl | global batch | status | samples/s | step time (s) | peak memory / GPU (GiB) |", "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["phase"] == "throughput":
            lines.append(f"| {r['impl']} | {r['global_batch']} | {r['status']} | {r['samples_per_s']} | {r['step_time_s']} | {r['peak_mem_gib']} |")
    if largest:
        lines += ["", "| impl | largest global batch that ran (one step) | memory-limited estimate |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v} | {_linear_limit(rows, k, gpu['mem_gib']) if k == 'infcl' else ''} |" for k, v in largest.items()]
        lines += ["", "Search rows (batch, status, peak GiB): " + "; ".join(
            f"{r['impl']} {r['global_batch']} {r['status']} {r['peak_mem_gib']}" for r in rows if r["phase"] == "search")]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
