"""The whole training step fed from real JPEG shards: CLIP ViT-B/16 + text tower, ZeRO-2, bf16,
GradCache, the ``infcl`` loss, the clip task's loader decoding on the CPU and/or the GPU.

    python -m ds_infcl.bench.jpeg_step --num-gpus 1 --decode cpu gpu --global-batch 16384 \\
        --chunk-size 512 --steps 4 --num-workers 16 --worker-batch-size 512 --num-samples 40000 \\
        --out runs/jpeg_step

In one command:

1. **shards**: ``--shards DIR`` (default ``data/jpeg<image-size>``) is written with
   ``ds_infcl.data.synth_jpeg_shards`` (img2dataset's layout, ``--num-samples`` samples) when it
   does not exist or is empty; a folder that already holds shards and their ``sizes.json`` is
   reused as it is (``--num-samples`` is then ignored, and said so); any other folder is an error
   naming it (nothing is overwritten);
2. **cases**: one ``deepspeed --module ds_infcl.train`` process per ``--decode`` value (``cpu``:
   loader workers decode with PIL; ``gpu``: they pass JPEG bytes and the rank decodes with nvjpeg),
   the run config of docs/data.md "Training from the shards" (``task.name: clip``,
   ``report_data_time: true``, ``resampled: true``, ``model.compile: "blocks"`` unless
   ``--no-compile``), written to ``<out>/<decode>/run.json``, output in ``<out>/<decode>/log.txt``;
3. **table**: per case the step-only samples/s per GPU (``summary.json``: the trainer excludes the
   first step and the waits for data), the end-to-end samples/s per GPU (``global batch / median
   cycle / ranks`` from the ``[clip data] batch k waited W s, cycle C s`` lines rank 0 prints; the
   cycle of batch k spans the wait for batch k-1 and its step, so the cycles of batches 3.. are
   the steps after the first: ``--steps`` must be >= 3), the median wait per batch (batches 2..:
   the first includes the loader's start), MFU (when the summary has it: CUDA only), peak memory,
   and the data counts the trainer reports (samples skipped by reason, summed over ranks: the
   summary's ``data``; ``0 skipped`` when it is empty). Printed, and written to
   ``<out>/results.md`` and ``<out>/results.csv``.

A case that fails prints the last lines of its log and its row says ``failed`` / ``oom`` /
``timeout``; the command exits 1 when a case did not run to the end. ``--decode gpu`` needs CUDA
and torchvision: without them it is an error before anything runs.

On CPU (the test): ``--arch tiny --image-size 40 --num-gpus 1`` runs one CPU rank under the
deepspeed launcher (DeepSpeed's CPU accelerator, gloo); ``--num-gpus 0`` runs the trainer as one
plain ``python -m ds_infcl.train`` process instead (the trainer makes a one-rank world itself), as
the trainer tests do. ``model.compile`` defaults to on where CUDA is available or a C++ compiler
is found (inductor's CPU backend needs one), else off.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

from ds_infcl.adapters.clip_configs import CLIP_ARCHITECTURES
from ds_infcl.bench.launching import _REPO, _gpu_info, _launch, launcher_command, trainer_args
from ds_infcl.data.shards import SIZES_FILE
from ds_infcl.train.config import apply_overrides

__all__ = ["main", "parse_data_lines", "data_rates", "prepare_shards", "format_data_counts"]

_DATA_LINE = re.compile(r"\[clip data\] batch (\d+) waited ([0-9.]+) s(?:, cycle ([0-9.]+) s)?")


def parse_data_lines(text: str) -> Dict[int, Tuple[float, Optional[float]]]:
    """``{k: (wait s, cycle s or None)}`` from the ``[clip data] batch k waited W s, cycle C s``
    lines of a log (the first batch has no cycle)."""
    out: Dict[int, Tuple[float, Optional[float]]] = {}
    for m in _DATA_LINE.finditer(text):
        out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)) if m.group(3) else None)
    return out


def data_rates(text: str, global_batch: int, ranks: int) -> Dict[str, object]:
    """The end-to-end numbers of a log: ``median_cycle_s`` over the batches k >= 3 (the cycle of
    batch k spans the wait for batch k-1 and step k-1, so these are the steps after the first),
    ``e2e_samples_per_s_per_gpu`` (``global_batch / median_cycle_s / ranks``), ``median_wait_s``
    over the batches k >= 2 (batch 1's wait includes the loader's start) and ``num_cycles``; empty
    strings where the log has too few lines."""
    lines = parse_data_lines(text)
    cycles = [c for k, (_, c) in sorted(lines.items()) if k >= 3 and c is not None]
    waits = [w for k, (w, _) in sorted(lines.items()) if k >= 2]
    out: Dict[str, object] = {"median_cycle_s": "", "e2e_samples_per_s_per_gpu": "", "median_wait_s": "",
                              "num_cycles": len(cycles)}
    if cycles:
        cycle = statistics.median(cycles)
        out["median_cycle_s"] = round(cycle, 4)
        out["e2e_samples_per_s_per_gpu"] = round(global_batch / cycle / ranks, 1) if cycle > 0 else ""
    if waits:
        out["median_wait_s"] = round(statistics.median(waits), 4)
    return out


def format_data_counts(counts: Dict[str, int]) -> str:
    """The trainer's data counts (``summary.json``'s ``data``) as one cell: ``0 skipped`` or
    ``bad_image=3, ...`` sorted by reason."""
    if not counts:
        return "0 skipped"
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def prepare_shards(folder: str, *, num_samples: int, samples_per_shard: int, image_size: int, seed: int,
                   processes: int) -> Dict[str, object]:
    """The shard folder of the run: written (``write_synth_jpeg_shards``) when ``folder`` does not
    exist or is empty, reused when it holds ``sizes.json`` and every shard it names. Returns
    ``{"written": bool, "num_samples", "num_shards"}``.

    Raises:
        SystemExit: ``folder`` exists with other content (no ``sizes.json``), is not a folder, or
            its ``sizes.json`` names shards that are missing or is unreadable.
    """
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise SystemExit(f"--shards {folder} is not a folder: give a folder of shards with {SIZES_FILE}, "
                         "or a path that does not exist yet (the shards are written there)")
    if os.path.isdir(folder) and os.listdir(folder):
        sizes_path = os.path.join(folder, SIZES_FILE)
        if not os.path.exists(sizes_path):
            raise SystemExit(f"--shards {folder} exists and holds no {SIZES_FILE} (it is not a folder of shards this "
                             "command wrote or img2dataset/OpenCLIP shards with their sizes): nothing is overwritten; "
                             "give an empty or new folder to write the shards in, or one with shards and "
                             f"{SIZES_FILE}")
        try:
            with open(sizes_path) as f:
                sizes = {str(k): int(v) for k, v in json.load(f).items()}
        except (OSError, ValueError, AttributeError) as e:
            raise SystemExit(f"--shards {folder}: {sizes_path} is not a JSON object of shard sizes ({e})") from None
        missing = sorted(name for name in sizes if not os.path.exists(os.path.join(folder, name)))
        if not sizes or missing:
            raise SystemExit(f"--shards {folder}: {SIZES_FILE} names {len(sizes)} shard(s), missing: "
                             f"{', '.join(missing[:5]) or '(it names none)'}; write the shards again into a new folder")
        return {"written": False, "num_samples": sum(sizes.values()), "num_shards": len(sizes)}
    from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards

    info = write_synth_jpeg_shards(folder, num_samples=num_samples, samples_per_shard=samples_per_shard,
                                   image_size=image_size, seed=seed, processes=processes)
    print(f"[jpeg_step] wrote {info['num_samples']} samples ({image_size} px) in {len(info['sizes'])} shards to "
          f"{folder} in {info['seconds']:.1f} s", flush=True)
    return {"written": True, "num_samples": info["num_samples"], "num_shards": len(info["sizes"])}


def _task_args(args, decode: str) -> Dict[str, object]:
    task = {"data_dir": os.path.abspath(args.shards), "arch": args.arch, "num_workers": args.num_workers,
            "worker_batch_size": args.worker_batch_size, "resampled": True, "decode": decode,
            "report_data_time": True}
    if args.arch.startswith("ViT-"):  # OpenCLIP's text side: a 49,408-token BPE, 77 tokens
        task.update(tokenizer_kind="bpe", vocab_size=49408, context_length=77)
    return task


def _ranks(args) -> int:
    return max(args.num_gpus, 1)


def run_config(args, decode: str, out: str) -> Dict[str, object]:
    """The run config of one case (docs/data.md, "Training from the shards"), ``--set`` applied."""
    run: Dict[str, object] = {
        "task": {"name": "clip", "args": _task_args(args, decode)},
        "loss": {"impl": "infcl"},
        "batch": {"global_batch_size": args.global_batch, "grad_cache": True,
                  "chunk_size": min(args.chunk_size, args.global_batch // _ranks(args))},
        "train": {"num_steps": args.steps, "seed": 0},
        "eval": {"every_steps": 0, "at_end": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "checkpoint": {"every_steps": 0, "at_end": False, "export_final": False},
        "output_dir": out,
    }
    if args.compile:
        run["model"] = {"compile": "blocks"}
    return apply_overrides(run, list(args.set))


def _command(args, run_path: str) -> List[str]:
    trainer = trainer_args(args.deepspeed_config, run_path, args.ds_set)
    if args.num_gpus == 0:  # one plain process: the trainer sets up a one-rank world itself
        return [sys.executable, "-m", "ds_infcl.train", *trainer]
    return launcher_command(args.num_gpus, trainer)


def run_case(args, decode: str) -> Dict[str, object]:
    """Launch one case and return its table row."""
    out = os.path.abspath(os.path.join(args.out, decode))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run = run_config(args, decode, out)
    run_path = os.path.join(out, "run.json")
    with open(run_path, "w") as f:
        json.dump(run, f, indent=2)
    log_path = os.path.join(out, "log.txt")
    cmd = _command(args, run_path)
    print(f"[jpeg_step] decode {decode}: {' '.join(cmd)} (log: {log_path})", flush=True)
    status, wall, text = _launch(cmd, log_path, args.case_timeout)
    ranks = _ranks(args)
    row: Dict[str, object] = {
        "decode": decode, "gpus": args.num_gpus, "global_batch": args.global_batch,
        "chunk": run["batch"]["chunk_size"], "steps": args.steps, "compile": bool(args.compile), "status": status,
        "step_samples_per_s_per_gpu": "", "e2e_samples_per_s_per_gpu": "", "median_wait_s": "", "median_cycle_s": "",
        "mfu": "", "peak_mem_gib": "", "data": "", "wall_s": round(wall, 1),
    }
    row.update({k: v for k, v in data_rates(text, args.global_batch, ranks).items() if k != "num_cycles"})
    summary_path = os.path.join(out, "summary.json")
    if status == "ok" and os.path.exists(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        row["step_samples_per_s_per_gpu"] = round(s["samples_per_s"] / ranks, 1)
        row["peak_mem_gib"] = round(s["peak_mem_mib"] / 1024, 2)
        if s.get("mfu") is not None:
            row["mfu"] = round(s["mfu"], 4)
        row["data"] = format_data_counts(s.get("data") or {})
    elif status == "ok":
        row["status"] = "failed"  # exited 0 without its summary: not a measurement
    if row["status"] == "ok" and row["e2e_samples_per_s_per_gpu"] == "":
        print(f"[jpeg_step] decode {decode}: no '[clip data] ... cycle' lines for batches >= 3 in {log_path}; "
              "no end-to-end rate", flush=True)
    if row["status"] != "ok":
        print(f"[jpeg_step] decode {decode} {row['status']}; last lines of {log_path}:\n"
              + "\n".join(text.splitlines()[-30:]), flush=True)
    return row


_FIELDS = ["decode", "gpus", "global_batch", "chunk", "steps", "compile", "status", "step_samples_per_s_per_gpu",
           "e2e_samples_per_s_per_gpu", "median_wait_s", "median_cycle_s", "mfu", "peak_mem_gib", "data", "wall_s"]


def write_results(args, gpu: Dict[str, object], shards: Dict[str, object], rows: List[Dict[str, object]]) -> List[str]:
    """Write ``results.csv`` and ``results.md`` under ``--out`` (after every case, so that a run cut
    short keeps its finished rows) and return the markdown lines."""
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    ranks = "1 plain process" if args.num_gpus == 0 else f"{args.num_gpus} rank(s)"
    lines = [
        f"# Training step from JPEG shards: {args.arch}, {os.path.basename(args.deepspeed_config)}, infcl, GradCache "
        f"chunk {args.chunk_size}/GPU, {ranks}",
        "",
        f"Device: {gpu['name']}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Shards: {args.shards} "
        f"({shards['num_samples']} samples in {shards['num_shards']} shards, "
        f"{'written by this run' if shards['written'] else 'reused'}); loader: {args.num_workers} workers per rank, "
        f"worker batches of {args.worker_batch_size}, resampled.",
        "",
        "Step-only: the trainer's samples/s (summary.json; first step and data waits excluded). End-to-end: global "
        "batch / median cycle of the `[clip data]` lines (steps after the first). Wait: median over batches 2.. .",
        "",
        "| decode | GPUs | global batch | chunk | compile | status | step-only samples/s per GPU | end-to-end samples/s "
        "per GPU | median wait (s) | median cycle (s) | MFU | peak memory / GPU (GiB) | data counts | wall (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") not in (None, "") else ""
        lines.append(f"| {r['decode']} | {r['gpus']} | {r['global_batch']} | {r['chunk']} | "
                     f"{'on' if r['compile'] else 'off'} | {r['status']} | {r['step_samples_per_s_per_gpu']} | "
                     f"{r['e2e_samples_per_s_per_gpu']} | {r['median_wait_s']} | {r['median_cycle_s']} | {mfu} | "
                     f"{r['peak_mem_gib']} | {r['data']} | {r['wall_s']} |")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()  # NVML query: no CUDA context in this process


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.jpeg_step", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--num-gpus", type=int, default=1,
                   help="ranks under the deepspeed launcher (on CPU: CPU ranks); 0: one plain python process")
    p.add_argument("--decode", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"],
                   help="one case per value: cpu (loader workers decode with PIL), gpu (nvjpeg on the rank's GPU)")
    p.add_argument("--arch", default="ViT-B-16", choices=sorted(CLIP_ARCHITECTURES),
                   help="the clip task's towers (task.args.arch); tiny: CPU test")
    p.add_argument("--global-batch", type=int, default=16384)
    p.add_argument("--chunk-size", type=int, default=512, help="GradCache chunk per GPU")
    p.add_argument("--steps", type=int, default=4, help="training steps (>= 3: the first is excluded)")
    p.add_argument("--num-workers", type=int, default=16, help="loader worker processes per rank")
    p.add_argument("--worker-batch-size", type=int, default=512, help="samples per loader-worker batch")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help='model.compile: "blocks" (default: on with CUDA or a C++ compiler, else off)')
    p.add_argument("--deepspeed-config", default=os.path.join(_REPO, "ds_configs", "zero2.json"))
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE", help="more DeepSpeed JSON overrides")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="run-config overrides of every case, e.g. task.args.prefetch_batches=2")
    p.add_argument("--shards", default=None,
                   help="shard folder: reused when it holds shards and sizes.json, written when new or empty "
                   "(default data/jpeg<image-size>)")
    p.add_argument("--num-samples", type=int, default=40000, help="samples to write (new shard folder only)")
    p.add_argument("--samples-per-shard", type=int, default=5000)
    p.add_argument("--image-size", type=int, default=256, help="size of the written JPEGs (the towers crop theirs)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="shards written at once")
    p.add_argument("--case-timeout", type=int, default=900, help="seconds per launched case")
    p.add_argument("--out", default="runs/jpeg_step")
    args = p.parse_args(argv)
    if args.num_gpus < 0:
        p.error("--num-gpus must be >= 0 (0: one plain python process)")
    if args.steps < 3:
        p.error(f"--steps must be >= 3 (the first step is excluded and the cycle of the last batch is not "
                f"printed), got {args.steps}")
    if args.global_batch % _ranks(args):
        p.error(f"--global-batch {args.global_batch} is not divisible by {_ranks(args)} rank(s)")
    args.decode = list(dict.fromkeys(args.decode))
    cuda = _cuda_available()
    if "gpu" in args.decode:
        from ds_infcl.data.device_decode import gpu_decode_problem

        problem = gpu_decode_problem()
        if problem is not None:
            p.error(f"--decode gpu needs CUDA and torchvision's decode_jpeg, but {problem}; "
                    "run --decode cpu here, or the gpu case on a CUDA machine")
    from ds_infcl.train.preflight import compile_toolchain_problem  # the trainer's own check at load

    cpu_problem = None if cuda else compile_toolchain_problem("cpu")
    if args.compile is None:
        args.compile = cuda or cpu_problem is None
    elif args.compile and cpu_problem is not None:
        p.error(f"--compile on CPU needs a C++ compiler: {cpu_problem}; or pass --no-compile")
    if args.shards is None:
        args.shards = os.path.join("data", f"jpeg{args.image_size}")
    shards = prepare_shards(args.shards, num_samples=args.num_samples, samples_per_shard=args.samples_per_shard,
                            image_size=args.image_size, seed=0, processes=args.processes)
    if not shards["written"]:
        print(f"[jpeg_step] reusing {shards['num_samples']} samples in {shards['num_shards']} shards of {args.shards} "
              "(--num-samples, --image-size and --samples-per-shard apply only to a new folder)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    gpu = _gpu_info() if cuda else {"name": "CPU (no CUDA)", "mem_gib": None}
    rows: List[Dict[str, object]] = []
    for decode in args.decode:
        rows.append(run_case(args, decode))
        write_results(args, gpu, shards, rows)
        r = rows[-1]
        print(f"[jpeg_step] decode {decode} {r['status']}: step-only {r['step_samples_per_s_per_gpu']} and "
              f"end-to-end {r['e2e_samples_per_s_per_gpu']} samples/s per GPU, wait {r['median_wait_s']} s, "
              f"data: {r['data']}, wall {r['wall_s']} s", flush=True)
    print("\n".join(write_results(args, gpu, shards, rows)))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
