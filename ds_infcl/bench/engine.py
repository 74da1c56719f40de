"""GPU benchmark of the whole training step: CLIP ViT-B/16 + text tower, ZeRO-2, bf16, GradCache,
the ``infcl`` loss against the ``local`` baseline (OpenCLIP's local loss + gather_with_grad).

    python -m ds_infcl.bench.engine --num-gpus 1 --out runs/bench_gpu

For each loss implementation it runs, each as its own ``deepspeed --num_gpus N --module
ds_infcl.train`` process (an out-of-memory rank cannot hang the next case):

1. **throughput**: at ``--throughput-batch`` (a global batch the baseline fits), ``--steps``
   steps, reporting samples/s (over the steps after the ``--warmup`` first, from each step's
   device time in the case's ``metrics.csv``; OpenCLIP's step also runs 2 untimed steps first)
   and peak device memory per GPU;
2. **largest batch**: one step at global batches doubling from ``--search-start`` until the
   case runs out of memory, fails, exceeds ``--case-timeout`` seconds, or reaches
   ``--search-max``; the largest that ran is reported (with ``>=`` when the search stopped for
   time or the cap rather than memory).

Results: a printed table, ``<out>/results.csv`` and ``<out>/results.md`` (device name, settings).
With GradCache the towers hold one chunk of activations at a time, so the batch limit is set by
the features, their cached gradients and the loss; the baseline's ``[b, B]`` logits grow
quadratically. ``--arch tiny`` runs the same pipeline in seconds (CPU smoke test).

An impl may carry options of the towers: ``infcl+compile`` (``model.compile: "blocks"``),
``infcl+auto`` (``batch.chunk_size: "auto"``; the row shows the chunk it chose), both
(``infcl+compile+auto``), ``infcl+gcauto`` (``batch.grad_cache: "auto"``: the chunks whose
activations fit keep their graph, the rest are replayed; the row's ``kept`` column shows how many
of the step's chunks were kept, GradCache keeps none), ``+fp8`` (``model.fp8``: the blocks' linear
layers in float8, tensorwise scaling; ``+fp8row`` rowwise, ``+fp8auto`` only the layers of
torchao's size thresholds; needs ``+compile`` and torchao); for ``--task bench_decoder`` also ``+liger``,
``+packing``, ``+nockpt`` (no layer checkpointing), ``+ckptauto`` (layer checkpointing only where a
forward would not fit), ``+lora`` (LoRA r 16, alpha 32) and ``+chunkN`` (that case's GradCache chunk),
so one command gives the "what each change gave" table of the decoder step (docs/retrieval.md); ``--set KEY=VALUE`` overrides any
run-config key of every case (``--set batch.grad_cache=auto`` labels the rows ``+gcauto`` too). Each
row gives MFU (model FLOPs: 3 x the towers' forward) and HFU (hardware FLOPs: GradCache's replayed
forwards and activation checkpointing's recompute counted too,
``ds_infcl.train.metrics.hardware_flops_factor``).
``openclip_step`` is OpenCLIP's own training step (``ds_infcl.bench.openclip_step``: ``amp_bf16``,
TF32 allowed, AdamW fused, DDP and ``ClipLoss`` with ``local_loss`` + ``gather_with_grad``) in each
of ``--openclip-modes``: ``eager``, ``compile`` (its ``--torchcompile``), each optionally ``+gc``
(its ``--grad-checkpointing``). Per mode: the plain step at each size of ``--openclip-batches``
until one runs out of memory, then its ``accum_freq`` path at each per-GPU batch of
``--openclip-accum-batches`` in micro-batches of ``--openclip-accum-micro``. Its rows stand beside
ours in the same table (samples/s per GPU and MFU counted the same way: 3 x the towers' forward
FLOPs of one pair, against the GPU's dense bf16 peak), and a second table sets each of our
throughput rows beside the fastest OpenCLIP configuration that ran at the same global batch,
naming it. With ``--side-by-side`` OpenCLIP's cases run on the next ``--num-gpus`` GPUs at the
same time as ours (2 x ``--num-gpus`` GPUs visible), so both sides share the host alike and the
table takes half the wall time; the table's header names the split.
``st_cached`` (``--task bench_decoder`` only) is sentence-transformers' ``CachedMultipleNegativesRankingLoss``
with peft LoRA on the same decoder shape (``ds_infcl.bench.st_cached``), one GPU (the first visible),
no DeepSpeed, at ``--st-batch`` pairs in mini-batches of ``--st-mini-batch``: its row gives samples
and tokens/s per GPU beside ours. The impls run in the order given (OpenCLIP's rows last).

    python -m ds_infcl.bench.engine --num-gpus 1 --no-search --chunk-size 512 --throughput-batch 2048 \
        --impls infcl+compile openclip_step --openclip-modes eager compile \
        --openclip-accum-batches 2048 --openclip-accum-micro 512 --out runs/towers
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

from ds_infcl.bench.openclip_step import ARCHS as OPENCLIP_ARCHS
from ds_infcl.bench.openclip_step import MISSING_EXIT_CODE, mode_name
from ds_infcl.bench.engine_impls import impl_label, parse_impl
from ds_infcl.bench.launching import (
    _REPO, _case_row, _gpu_info, _launch, _summary, _visible_gpu_ids, launcher_command, trainer_args,
)
from ds_infcl.train.config import apply_overrides
from ds_infcl.train.dist import free_port
from ds_infcl.train.metrics import hardware_flops_factor

__all__ = ["main"]



def _task_args(args) -> Dict:
    extra = json.loads(args.task_args) if args.task_args else {}
    return {"arch": args.arch, **extra} if args.task == "bench_clip" else extra


def _model_label(args) -> str:
    """What the table's title names: the CLIP arch, or the decoder task with its arguments."""
    if args.task == "bench_clip":
        return args.arch
    return f"{args.task} {args.task_args}" if args.task_args else args.task


def _tokens_per_sample(args) -> Optional[float]:
    """Real tokens of one example of ``bench_decoder`` (its expected value with ``min_seq_len``)."""
    if args.task != "bench_decoder":
        return None
    from ds_infcl.tasks.base import get_task

    return get_task("bench_decoder", json.loads(args.task_args) if args.task_args else {}).tokens_per_sample()


def timed_rate(out: str, global_batch: int, warmup: int) -> float:
    """Samples/s (all GPUs) of a finished case over its steps after the first ``warmup``: the
    global batch over the mean of those steps' times in ``<out>/metrics.csv`` (the trainer's
    device-clock step times, ``train/inflight.py``)."""
    path = os.path.join(out, "metrics.csv")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: the case ran without logging.csv, so its step times are unknown")
    with open(path, newline="") as f:
        times = [float(r["step_time_s"]) for r in csv.DictReader(f) if int(r["step"]) > warmup]
    if not times:
        raise SystemExit(f"{path} has no step after the {warmup} warm-up step(s): give --steps more than --warmup")
    return global_batch * len(times) / sum(times)


def _run_case(args, impl: str, global_batch: int, steps: int, tag: str, warmup: int = 0) -> Dict:
    """One case of ours; its rate over the steps after the first ``warmup`` (``timed_rate``)."""
    out = os.path.join(args.out, tag.replace("+", "_"))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    chunk = min(args.chunk_size, global_batch // args.num_gpus)
    loss_impl, impl_sets = parse_impl(impl)
    impl_sets = [o if not o.startswith("batch.chunk_size=") or o.endswith("auto")
                 else f"batch.chunk_size={min(int(o.split('=')[1]), global_batch // args.num_gpus)}" for o in impl_sets]
    run = {
        "task": {"name": args.task, "args": _task_args(args)},
        "loss": {"impl": loss_impl},
        "batch": {"global_batch_size": global_batch, "grad_cache": True, "chunk_size": chunk},
        "data": {"offload": True},
        "train": {"num_steps": steps, "seed": 0},
        "eval": {"every_steps": 0, "at_end": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "checkpoint": {"every_steps": 0, "at_end": False, "export_final": False},
        "output_dir": out,
    }
    run = apply_overrides(run, impl_sets + list(args.set))
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(run, f, indent=2)
    cmd = launcher_command(args.num_gpus, trainer_args(args.deepspeed_config, os.path.join(out, "run.json"), args.ds_set),
                           getattr(args, "gpu_ids", None))
    log_path = os.path.join(out, "log.txt")
    status, wall, text = _launch(cmd, log_path, args.case_timeout)
    if status == "failed":
        print(f"[bench] {tag} failed; last lines of {log_path}:\n" + "\n".join(text.splitlines()[-30:]), flush=True)
    row = _case_row(status, wall, impl=impl_label(impl, run), global_batch=global_batch, gpus=args.num_gpus,
                    chunk=run["batch"]["chunk_size"], steps=steps)
    if status == "ok":
        s = _summary(out)
        sps = timed_rate(out, global_batch, warmup)
        row["samples_per_s"] = round(sps, 1)
        row["samples_per_s_per_gpu"] = round(sps / args.num_gpus, 1)
        with open(os.path.join(out, "run_config.json")) as f:
            row["chunk"] = json.load(f)["batch"]["chunk_size"]  # what "auto" chose
        row["step_time_s"] = round(global_batch / sps, 3) if sps else ""
        row["peak_mem_gib"] = round(s["peak_mem_mib"] / 1024, 2)
        for key in ("mfu", "hfu"):  # the run's figures are at its own rate (every step but the first)
            if s.get(key) is not None and s["samples_per_s"]:
                row[key] = round(s[key] * sps / s["samples_per_s"], 4)
        if s.get("kept_chunks") is not None:  # of the step's chunks (per GPU), the last step's
            row["kept"] = f"{s['kept_chunks']}/{s['num_chunks']}"
        tokens = _tokens_per_sample(args)
        if tokens and sps:
            row["tokens_per_s"] = round(sps * tokens)
            row["tokens_per_s_per_gpu"] = round(sps * tokens / args.num_gpus)
    print(f"[bench] {row['impl']:8s} B={global_batch:>8d} {status:8s} sps={row['samples_per_s']} "
          f"tokens/s={row.get('tokens_per_s', '-')} mfu={row.get('mfu', '-')} hfu={row.get('hfu', '-')} "
          f"kept={row['kept'] or '-'} "
          f"peak={row['peak_mem_gib']} GiB wall={row['wall_s']} s", flush=True)
    return row


OPENCLIP_MODES = ("eager", "compile", "eager+gc", "compile+gc")


def _run_openclip_case(args, batch_per_gpu: int, accum_freq: int, mode: str = "eager") -> Dict:
    """One ``ds_infcl.bench.openclip_step`` process (``torchrun`` on several GPUs) in ``mode`` (one of
    ``OPENCLIP_MODES``): a row of the table; status ``no open_clip`` when it cannot be imported."""
    compiled, gc = mode.startswith("compile"), mode.endswith("+gc")
    loss = args.openclip_loss
    tag = (f"openclip_step_{'siglip_' if loss == 'siglip' else ''}{mode.replace('+', '_')}_{batch_per_gpu}"
           + (f"_accum{accum_freq}" if accum_freq > 1 else ""))
    out = os.path.join(args.out, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    module_args = ["-m", "ds_infcl.bench.openclip_step", "--arch", args.arch, "--batch-per-gpu", str(batch_per_gpu),
                   "--accum-freq", str(accum_freq), "--steps", str(args.openclip_steps), "--warmup", str(args.warmup),
                   "--loss", loss, "--out", out]
    module_args += (["--compile"] if compiled else []) + (["--grad-checkpointing"] if gc else [])
    if args.num_gpus > 1:
        torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--nproc_per_node", str(args.num_gpus), "--master_port", str(free_port())] + module_args
    else:
        cmd = [sys.executable] + module_args
    log_path = os.path.join(out, "log.txt")
    ids = getattr(args, "gpu_ids", None)
    status, wall, text = _launch(cmd, log_path, args.case_timeout, {MISSING_EXIT_CODE: "no open_clip"},
                                 {"CUDA_VISIBLE_DEVICES": ",".join(ids)} if ids else None)
    if status in ("failed", "no open_clip"):
        print(f"[bench] {tag} {status}; last lines of {log_path}:\n" + "\n".join(text.splitlines()[-20:]), flush=True)
    row = _case_row(status, wall, impl=mode_name(compiled, accum_freq, gc, loss), phase="openclip",
                    global_batch=batch_per_gpu * args.num_gpus, gpus=args.num_gpus,
                    chunk=batch_per_gpu // accum_freq if accum_freq > 1 else "", steps=args.openclip_steps)
    if status == "ok":
        s = _summary(out)
        row["samples_per_s_per_gpu"] = round(s["samples_per_s_per_gpu"], 1)
        row["samples_per_s"] = round(s["samples_per_s_per_gpu"] * args.num_gpus, 1)
        row["step_time_s"] = round(s["step_time_s"], 3)
        row["peak_mem_gib"] = round(s["peak_mem_gib"], 2)
        if s.get("mfu") is not None:
            row["mfu"] = round(s["mfu"], 4)
            # its accum_freq path encodes every micro-batch twice (no grad, then with grad), its
            # grad checkpointing recomputes each block's forward
            row["hfu"] = round(s["mfu"] * hardware_flops_factor(1.0 if accum_freq > 1 else 0.0, 1.0 if gc else 0.0), 4)
    print(f"[bench] {row['impl']} batch/GPU={batch_per_gpu} {status} sps/GPU={row['samples_per_s_per_gpu']} "
          f"mfu={row.get('mfu', '-')} peak={row['peak_mem_gib']} GiB wall={row['wall_s']} s", flush=True)
    return row


def _our_rows(args, gpu, rows: List[Dict]) -> List[Dict]:
    """The throughput cases of every impl of ours (and ``st_cached``) in the order given, appended
    to ``rows`` (the results files rewritten after each impl unless ``gpu`` is ``None``)."""
    for impl in [i for i in args.impls if i != "openclip_step"]:
        if impl == "st_cached":
            from ds_infcl.bench.st_cached import engine_row

            rows.append(engine_row(args, _launch, _case_row, _summary))
        for batch in [b for b in args.throughput_batch if b > 0 and impl != "st_cached"]:
            rows.append(dict(_run_case(args, impl, batch, args.steps, f"{impl}_tp_{batch}", args.warmup),
                             phase="throughput"))
        if gpu is not None:
            _write_results(args, gpu, rows, {})
    return rows


def _side_by_side(args, gpu) -> List[Dict]:
    """``--side-by-side``: our cases on the first ``--num-gpus`` GPUs and OpenCLIP's on the next
    ``--num-gpus`` at the same time, so that both share the host and the machine alike; our rows,
    then OpenCLIP's."""
    import copy
    import threading

    ids = _visible_gpu_ids()
    n = args.num_gpus
    if len(ids) < 2 * n or not all(i.isdigit() for i in ids):
        raise SystemExit(f"--side-by-side needs 2 x --num-gpus = {2 * n} GPUs (digits in CUDA_VISIBLE_DEVICES), "
                         f"found {ids or 'none'}")
    args.sides = (ids[:n], ids[n:2 * n])
    ours_args, oc_args = copy.copy(args), copy.copy(args)
    ours_args.gpu_ids, oc_args.gpu_ids = args.sides
    print(f"[bench] side by side: ours on GPU(s) {','.join(args.sides[0])}, OpenCLIP on {','.join(args.sides[1])}", flush=True)
    ours: List[Dict] = []
    failed: List[BaseException] = []

    def run_ours():
        try:
            _our_rows(ours_args, None, ours)
        except BaseException as e:  # noqa: BLE001 -- raised in the main thread below
            failed.append(e)

    thread = threading.Thread(target=run_ours, name="ours")
    thread.start()
    theirs = _openclip_rows(oc_args)
    thread.join()
    if failed:
        raise failed[0]
    rows = ours + theirs
    _write_results(args, gpu, rows, {})
    return rows


def _openclip_rows(args) -> List[Dict]:
    """For each of ``--openclip-modes``: OpenCLIP's plain step at each of ``--openclip-batches``
    (ascending) until one does not run, then its ``accum_freq`` path at each of
    ``--openclip-accum-batches``."""
    rows: List[Dict] = []
    if args.arch not in OPENCLIP_ARCHS:
        print(f"[bench] openclip_step: no OpenCLIP model for --arch {args.arch} (only {sorted(OPENCLIP_ARCHS)}); skipped",
              flush=True)
        return rows
    for mode in args.openclip_modes:
        for b in sorted(args.openclip_batches):
            rows.append(_run_openclip_case(args, b, 1, mode))
            if rows[-1]["status"] != "ok":
                break
        if rows and rows[-1]["status"] == "no open_clip":
            return rows
        for b in sorted(args.openclip_accum_batches):
            rows.append(_run_openclip_case(args, b, b // args.openclip_accum_micro, mode))
    return rows


def fastest_openclip(rows: List[Dict], global_batch, gpus) -> Optional[Dict]:
    """The fastest OpenCLIP row that ran at ``global_batch`` on ``gpus`` GPUs, or ``None``. Rows
    as this module makes them, or as read back from its ``results.csv`` (strings)."""
    peers = [o for o in rows if o["phase"] == "openclip" and o["status"] == "ok"
             and int(o["global_batch"]) == int(global_batch) and int(o["gpus"]) == int(gpus)]
    return max(peers, key=lambda o: float(o["samples_per_s_per_gpu"]), default=None)


def best_openclip_lines(rows: List[Dict]) -> List[str]:
    """Markdown rows: each of our throughput rows beside the fastest OpenCLIP configuration that
    ran at the same global batch on the same GPUs (named), and their ratio; ``none ran`` where no
    OpenCLIP configuration reached that batch."""
    lines = ["| ours | global batch | samples/s per GPU | OpenCLIP's fastest at that batch | samples/s per GPU | ours / OpenCLIP |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["phase"] != "throughput" or r["status"] != "ok":
            continue
        best = fastest_openclip(rows, r["global_batch"], r["gpus"])
        if best is None:
            lines.append(f"| {r['impl']} | {r['global_batch']} | {r['samples_per_s_per_gpu']} | none ran | | |")
            continue
        ratio = r["samples_per_s_per_gpu"] / best["samples_per_s_per_gpu"]
        lines.append(f"| {r['impl']} | {r['global_batch']} | {r['samples_per_s_per_gpu']} | {best['impl']} | "
                     f"{best['samples_per_s_per_gpu']} | {ratio:.2f}x |")
    return lines


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


def _write_results(args, gpu: Dict[str, object], rows: List[Dict], largest: Dict[str, str]) -> List[str]:
    """Write ``results.csv`` and ``results.md`` (rewritten after every case, so that a run cut short
    keeps its finished rows) and return the markdown lines."""
    fields = ["phase", "impl", "gpus", "global_batch", "chunk", "steps", "status", "samples_per_s", "samples_per_s_per_gpu",
              "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "hfu", "kept", "step_time_s", "peak_mem_gib", "wall_s"]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"# Training-step benchmark: {_model_label(args)}, {args.label or os.path.basename(args.deepspeed_config)}"
        f"{' ' + ' '.join(args.ds_set) if args.ds_set else ''}{' ' + ' '.join(args.set) if args.set else ''}, "
        f"GradCache chunk {args.chunk_size}/GPU",
        "", f"Device: {gpu['name']} ({gpu['mem_gib'] or 0:.0f} GiB each); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        + (f"; side by side: ours on GPU(s) {','.join(args.sides[0])} while OpenCLIP ran on GPU(s) {','.join(args.sides[1])}"
           if getattr(args, "sides", None) else "")
        + (f"; ours timed over the steps after its first {args.warmup} of {args.steps} (per-step device times)"
           if getattr(args, "warmup", None) is not None else ""), "",
        "| impl | GPUs | global batch | chunk | kept | status | samples/s per GPU | tokens/s per GPU | MFU | HFU | "
        "step time (s) | peak memory / GPU (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["phase"] in ("throughput", "openclip", "st_cached"):
            mfu, hfu = (f"{100 * r[k]:.1f}%" if r.get(k) not in (None, "") else "" for k in ("mfu", "hfu"))
            lines.append(f"| {r['impl']} | {r['gpus']} | {r['global_batch']} | {r['chunk']} | {r.get('kept', '')} | "
                         f"{r['status']} | {r['samples_per_s_per_gpu']} | {r.get('tokens_per_s_per_gpu', '')} | {mfu} | {hfu} | "
                         f"{r['step_time_s']} | "
                         f"{r['peak_mem_gib']} |")
    if any(r["phase"] == "openclip" for r in rows):
        lines += ["", "Ours beside OpenCLIP's fastest configuration at the same global batch:", ""] + best_openclip_lines(rows)
    if largest:
        lines += ["", "| impl | largest global batch that ran (one step) | memory-limited estimate |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v} | {_linear_limit(rows, k, gpu['mem_gib']) if k.startswith('infcl') else ''} |"
                  for k, v in largest.items()]
        lines += ["", "Search rows (batch, status, peak GiB): " + "; ".join(
            f"{r['impl']} {r['global_batch']} {r['status']} {r['peak_mem_gib']}" for r in rows if r["phase"] == "search")]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--impls", nargs="+", default=["local", "infcl"],
                   help="loss impls, each optionally +compile, +auto (chunk_size auto) and/or +gcauto (grad_cache auto), "
                   "e.g. infcl+compile+gcauto, and openclip_step")
    p.add_argument("--arch", default="vit-b-16", choices=["vit-b-16", "vit-l-14", "tiny"],
                   help="bench_clip towers (tiny: CPU smoke test); openclip_step runs the same OpenCLIP model")
    p.add_argument("--task", default="bench_clip", choices=["bench_clip", "bench_decoder"],
                   help="bench_clip (CLIP towers) or bench_decoder (an LLM embedder, e.g. Qwen2-1.5B's shape)")
    p.add_argument("--task-args", default=None, metavar="JSON",
                   help='task arguments, e.g. \'{"arch": "qwen2-1.5b", "seq_len": 256, "lora": {"r": 16}}\'')
    p.add_argument("--chunk-size", type=int, default=256, help="GradCache chunk per GPU")
    p.add_argument("--throughput-batch", type=int, nargs="+", default=[16384],
                   help="global batch(es) of the throughput phase; 0 skips it")
    p.add_argument("--steps", type=int, default=4, help="throughput steps, the --warmup first untimed")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed first steps (compile, allocator, CUDA graph capture), of ours and of openclip_step alike "
                   "(0: time every step)")
    p.add_argument("--search-start", type=int, default=32768)
    p.add_argument("--search-max", type=int, default=1 << 20)
    p.add_argument("--case-timeout", type=int, default=420, help="seconds per launched case")
    p.add_argument("--no-search", action="store_true")
    p.add_argument("--deepspeed-config", default=os.path.join(_REPO, "ds_configs", "zero2.json"))
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                   help="more DeepSpeed JSON overrides for every case (repeatable), e.g. "
                   "zero_optimization.stage3_param_persistence_threshold=1e12")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="run-config overrides for every case of ours (repeatable), e.g. model.compile_mode=max-autotune-no-cudagraphs")
    p.add_argument("--openclip-batches", type=int, nargs="+", default=[256, 512, 768, 1024],
                   help="openclip_step: batches per GPU tried in ascending order until one fails (out of memory)")
    p.add_argument("--openclip-modes", nargs="+", default=["eager", "compile"], choices=OPENCLIP_MODES,
                   help="openclip_step: eager and/or compiled (open_clip_train's --torchcompile), +gc for its "
                   "--grad-checkpointing")
    p.add_argument("--openclip-accum-batches", type=int, nargs="*", default=[],
                   help="openclip_step: per-GPU batches run through OpenCLIP's accum_freq path (in micro-batches of "
                   "--openclip-accum-micro)")
    p.add_argument("--openclip-accum-freq", type=int, default=1,
                   help="openclip_step: also run the accum_freq path at --openclip-accum-micro x this (kept for old "
                   "command lines; --openclip-accum-batches is the general form)")
    p.add_argument("--openclip-accum-micro", type=int, default=256, help="openclip_step: micro-batch of the accum_freq runs")
    p.add_argument("--openclip-steps", type=int, default=5, help="openclip_step: timed steps (after 2 warm-up steps)")
    p.add_argument("--openclip-loss", default="clip", choices=["clip", "siglip"],
                   help="openclip_step: ClipLoss, or SigLipLoss as open_clip_train's --siglip (beside --impls siglip...)")
    p.add_argument("--st-batch", type=int, default=512, help="st_cached: global batch (pairs) of its timed steps")
    p.add_argument("--st-mini-batch", type=int, default=16, help="st_cached: CachedMNRL's mini_batch_size")
    p.add_argument("--st-steps", type=int, default=2, help="st_cached: timed steps (after a warm-up step)")
    p.add_argument("--st-lora-r", type=int, default=16, help="st_cached: LoRA rank when the task has no lora")
    p.add_argument("--label", default=None, help="title of the results table (default: the DeepSpeed config's name)")
    p.add_argument("--side-by-side", action="store_true",
                   help="with openclip_step: run OpenCLIP's cases on the next --num-gpus GPUs at the same time as ours "
                   "(needs 2 x --num-gpus GPUs; both sides then share the host alike, half the wall time)")
    p.add_argument("--out", default="runs/bench_gpu")
    args = p.parse_args(argv)
    ours = [i for i in args.impls if i not in ("openclip_step", "st_cached")]
    if args.side_by_side and ("openclip_step" not in args.impls or not ours or "st_cached" in args.impls):
        p.error("--side-by-side runs ours beside openclip_step: give both in --impls (and no st_cached)")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--steps {args.steps} --warmup {args.warmup}: the timed steps are those after the warm-up, "
                f"so give 0 <= --warmup < --steps (e.g. --steps {max(args.warmup, 0) + 2})")
    if "st_cached" in args.impls and args.task != "bench_decoder":
        p.error("--impls st_cached needs --task bench_decoder (the decoder shape it trains)")
    if args.openclip_accum_freq > 1:
        args.openclip_accum_batches = sorted(set(args.openclip_accum_batches) | {args.openclip_accum_micro * args.openclip_accum_freq})
    for b in args.openclip_accum_batches:
        if b <= args.openclip_accum_micro or b % args.openclip_accum_micro:
            p.error(f"--openclip-accum-batches {b}: must be a multiple (> 1) of --openclip-accum-micro {args.openclip_accum_micro}")
    for impl in ours:
        try:
            parse_impl(impl)
        except ValueError as e:
            p.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    gpu = _gpu_info()

    rows: List[Dict] = []
    if args.side_by_side:
        rows = _side_by_side(args, gpu)
    else:
        _our_rows(args, gpu, rows)
        if "openclip_step" in args.impls:
            rows += _openclip_rows(args)
            _write_results(args, gpu, rows, {})
    largest: Dict[str, str] = {}
    if not args.no_search:
        for impl in ours:
            B, best, why, label = args.search_start, None, "cap", impl
            while B <= args.search_max:
                row = dict(_run_case(args, impl, B, 1, f"{impl}_max_{B}"), phase="search")
                rows.append(row)
                label = row["impl"]  # with what --set adds (impl_label)
                if row["status"] != "ok":
                    why = row["status"]
                    break
                best = B
                B *= 2
            largest[label] = "none" if best is None else (f"{best}" if why == "oom" else f">= {best} ({why})")

    lines = _write_results(args, gpu, rows, largest)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
