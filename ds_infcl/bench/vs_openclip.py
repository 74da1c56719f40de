"""The training step against OpenCLIP's best compiled configuration, every table in one command.

At each per-GPU batch, OpenCLIP's best is the fastest configuration that reaches that batch on
the same GPUs: its compiled plain step where the batch fits, else compiled ``accum_freq`` over its
largest micro-batch that fits. Our step is ZeRO-1, ``grad_cache: "auto"``, with compiled blocks.
Each table is one ``ds_infcl.bench.engine`` command. Where the machine has twice the table's GPUs,
OpenCLIP's cases run on the other half at the same time (``--side-by-side``), so both sides share
the host alike::

    python -m ds_infcl.bench.vs_openclip --out runs/vs_openclip
    python -m ds_infcl.bench.vs_openclip --parallel --out runs/vs_openclip
    python -m ds_infcl.bench.vs_openclip --tables clip-1 --batches 512 --out runs/quick

The tables run one after another (5-9 minutes each on H200s, mostly compilation). ``--parallel``
runs them at once on disjoint GPUs instead, each table's cases one after the other on its own
GPUs (no side by side). Each table starts, in order, as soon as enough GPUs are free: on 4 GPUs
the five tables (7 GPU-tables) take about the time of two or three. The run of 2026-11-28 was
made that way, by hand.

The tables (``--tables``; the default is every one the visible GPUs allow):

- ``clip-1`` / ``clip-2``: ViT-B/16 with the CLIP loss on 1 or 2 GPUs, at 512, 2,048 and 16,384
  per GPU;
- ``siglip-1`` / ``siglip-2``: the same with the SigLIP loss (OpenCLIP's ``--siglip``);
- ``vitl-1``: ViT-L/14 with the CLIP loss on 1 GPU, at 2,048.

OpenCLIP's micro-batches follow the GPU's memory. With more than 100 GiB (an H200), ViT-B/16 uses
1,024 and ViT-L/14 512. Otherwise (an 80 GB H100), 512 and 256.

Every engine command's own output and folder are kept under ``--out/<table>``. ``results.md`` /
``results.csv`` under ``--out`` hold the combined table, rewritten after each table, and the table
is printed last. Samples/s are per GPU, both sides over the same steps: ``--steps`` 8, the first
``--warmup`` 3 untimed (the first two compile and capture the loss's CUDA graphs; on a fresh H100
our third step took 0.52-0.59 s instead of 0.18 s in 2 of 3 runs on 2026-12-07, cause not
found); ours on the device clock (``ds_infcl/train/inflight.py``), OpenCLIP's by its own loop.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ds_infcl.bench.engine import fastest_openclip
from ds_infcl.bench.launching import _gpu_info, _visible_gpu_ids

__all__ = ["TABLES", "Table", "engine_command", "best_rows", "main"]


@dataclass(frozen=True)
class Table:
    model: str
    loss: str  # "clip" or "siglip"
    gpus: int
    arch: str
    batches: Tuple[int, ...]  # per GPU
    chunk: int

    @property
    def ours(self) -> str:
        return ("siglip" if self.loss == "siglip" else "infcl") + "+compile+gcauto"


TABLES: Dict[str, Table] = {
    "clip-1": Table("ViT-B/16", "clip", 1, "vit-b-16", (512, 2048, 16384), 512),
    "clip-2": Table("ViT-B/16", "clip", 2, "vit-b-16", (512, 2048, 16384), 512),
    "siglip-1": Table("ViT-B/16", "siglip", 1, "vit-b-16", (512, 2048, 16384), 512),
    "siglip-2": Table("ViT-B/16", "siglip", 2, "vit-b-16", (512, 2048, 16384), 512),
    "vitl-1": Table("ViT-L/14", "clip", 1, "vit-l-14", (2048,), 256),
}


def openclip_micro(table: Table, mem_gib: Optional[float]) -> int:
    """OpenCLIP's largest compiled micro-batch per GPU that fits (measured on H100 and H200)."""
    large = mem_gib is not None and mem_gib > 100
    if table.arch == "vit-l-14":
        return 512 if large else 256
    return 1024 if large else 512


def engine_command(table: Table, batches: Sequence[int], micro: int, side_by_side: bool, out: str,
                   steps: int = 8, warmup: int = 3) -> List[str]:
    """The ``ds_infcl.bench.engine`` command of one table at ``batches`` per GPU."""
    plain = sorted(b for b in batches if b <= micro) or [micro]  # its plain step where the batch fits
    accum = [b for b in batches if b > micro]
    cmd = [sys.executable, "-m", "ds_infcl.bench.engine", "--num-gpus", str(table.gpus), "--arch", table.arch,
           "--no-search", "--deepspeed-config", "ds_configs/zero1.json", "--chunk-size", str(table.chunk),
           "--steps", str(steps), "--warmup", str(warmup), "--throughput-batch", *[str(b * table.gpus) for b in batches],
           "--impls", table.ours, "openclip_step", "--openclip-modes", "compile",
           "--openclip-batches", *map(str, plain), "--openclip-accum-micro", str(micro),
           "--openclip-steps", str(steps - warmup),
           "--case-timeout", "600", "--label", f"{table.model} {table.loss}, {table.gpus} GPU(s), vs OpenCLIP",
           "--out", out]
    if accum:
        cmd[cmd.index("--openclip-accum-micro"):cmd.index("--openclip-accum-micro")] = \
            ["--openclip-accum-batches", *map(str, accum)]
    if table.loss == "siglip":
        cmd += ["--openclip-loss", "siglip"]
    if side_by_side:
        cmd.append("--side-by-side")
    return cmd


def best_rows(name: str, table: Table, rows: List[Dict[str, str]], batches: Sequence[int]) -> List[Dict[str, object]]:
    """For each per-GPU batch: our row of the engine's ``results.csv`` rows, and the fastest
    OpenCLIP row at the same global batch (``engine.fastest_openclip``; ``none ran`` where none did)."""
    out = []
    for b in batches:
        ours = [r for r in rows if r["phase"] == "throughput" and r["impl"] == table.ours and r["status"] == "ok"
                and int(r["global_batch"]) == b * table.gpus]
        best = fastest_openclip(rows, b * table.gpus, table.gpus)
        row: Dict[str, object] = {"table": name, "model": table.model, "loss": table.loss, "gpus": table.gpus,
                                  "per_gpu_batch": b, "ours": "", "openclip_best": "none ran", "openclip": "",
                                  "ratio": ""}
        if ours:
            row["ours"] = float(ours[0]["samples_per_s_per_gpu"])
        if best is not None:
            row["openclip_best"] = best["impl"].replace("openclip_step ", "")
            row["openclip"] = float(best["samples_per_s_per_gpu"])
        if ours and best is not None:
            row["ratio"] = f"{row['ours'] / row['openclip']:.2f}x"
        out.append(row)
    return out


def _markdown(rows: List[Dict[str, object]], header: str) -> str:
    lines = [header, "", "| model, loss | GPUs | per-GPU batch | ours | OpenCLIP's best | samples/s | ours / OpenCLIP |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']}, {r['loss'].upper() if r['loss'] == 'clip' else 'SigLIP'} | {r['gpus']} | "
                     f"{r['per_gpu_batch']:,} | {r['ours'] or 'failed'} | {r['openclip_best']} | {r['openclip']} | "
                     f"{r['ratio']} |")
    return "\n".join(lines) + "\n"


def _write(out: str, rows: List[Dict[str, object]], header: str) -> str:
    text = _markdown(rows, header)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["table"])
        writer.writeheader()
        writer.writerows(rows)
    return text


def _read_rows(path: str) -> List[Dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


_POLL_S = 1.0  # how often the running engine commands are polled


@dataclass
class _Job:
    """One table's engine command: the GPUs it needs at once (twice the table's side by side)."""

    name: str
    table: Table
    batches: Tuple[int, ...]
    cmd: List[str]
    folder: str
    gpus: int


def _run_jobs(jobs: List[_Job], ids: List[str], parallel: bool, done: Callable[[_Job, int], None]) -> None:
    """Run every job's command, its output in ``<folder>/engine.log``. With ``parallel``, jobs run
    at once on disjoint subsets of the GPUs ``ids`` (``CUDA_VISIBLE_DEVICES``), each started in
    order as soon as enough GPUs are free; otherwise one after the other on every visible GPU.
    ``done(job, exit code)`` is called as each one finishes. On an error or Ctrl-C the running
    commands are stopped."""
    pending, running, free = list(jobs), [], list(ids)
    try:
        while pending or running:
            for job in list(pending):
                if running and not (parallel and job.gpus <= len(free)):
                    continue
                env, taken = dict(os.environ), list(ids)
                if parallel:
                    taken, free = free[:job.gpus], free[job.gpus:]
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(taken)
                print(f"[vs_openclip] {job.name} on GPU(s) {','.join(taken)}: {' '.join(job.cmd[1:])}", flush=True)
                os.makedirs(job.folder, exist_ok=True)
                log = open(os.path.join(job.folder, "engine.log"), "w")
                running.append((job, subprocess.Popen(job.cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, taken))
                pending.remove(job)
            finished = [r for r in running if r[1].poll() is not None]
            for job, proc, log, taken in finished:
                log.close()
                running.remove((job, proc, log, taken))
                if parallel:
                    free = sorted(free + taken, key=ids.index)
                done(job, proc.returncode)
            if not finished:
                time.sleep(_POLL_S)
    finally:
        for _, proc, log, _ in running:
            proc.terminate()
            proc.wait()
            log.close()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tables", nargs="+", choices=sorted(TABLES), default=None,
                   help="the tables to run (default: every one the visible GPUs allow)")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="per-GPU batches instead of each table's own (e.g. 512 for a quick check)")
    p.add_argument("--steps", type=int, default=8, help="steps of each case, both sides, the --warmup first untimed")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed first steps of each case, both sides (compile, CUDA graph capture, the first "
                   "launches of each kernel)")
    p.add_argument("--no-side-by-side", action="store_true",
                   help="run OpenCLIP's cases after ours on the same GPUs even where twice the GPUs are visible")
    p.add_argument("--parallel", action="store_true",
                   help="run tables at once on disjoint GPUs (CUDA_VISIBLE_DEVICES), each table's cases (ours, then "
                   "OpenCLIP's) one after the other on its own GPUs; each table starts, in order, once enough GPUs are free")
    p.add_argument("--out", default="runs/vs_openclip")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--steps {args.steps} --warmup {args.warmup}: give 0 <= --warmup < --steps (the timed steps are "
                "those after the warm-up)")
    ids, info = _visible_gpu_ids(), _gpu_info()
    gpus = len(ids)
    names = args.tables or [n for n, t in TABLES.items() if t.gpus <= gpus]
    if not names:
        raise SystemExit(f"no table fits the {gpus} visible GPU(s): each needs at least 1 (CUDA_VISIBLE_DEVICES, nvidia-smi)")
    too_big = [n for n in names if TABLES[n].gpus > gpus]
    if too_big:
        raise SystemExit(f"--tables {' '.join(too_big)} need(s) more GPUs than the {gpus} visible")
    os.makedirs(args.out, exist_ok=True)
    header = f"# Ours against OpenCLIP's best compiled configuration, {info['name']} ({gpus} visible)"
    jobs = []
    for name in names:
        table = TABLES[name]
        batches = tuple(args.batches or table.batches)
        side = not (args.no_side_by_side or args.parallel) and gpus >= 2 * table.gpus
        folder = os.path.join(args.out, name)
        cmd = engine_command(table, batches, openclip_micro(table, info["mem_gib"]), side, folder, args.steps,
                             args.warmup)
        jobs.append(_Job(name, table, batches, cmd, folder, table.gpus * (2 if side else 1)))
    results: Dict[str, List[Dict[str, object]]] = {}
    written: List[str] = []  # the combined table as last written

    def done(job: _Job, code: int) -> None:
        engine_rows = _read_rows(os.path.join(job.folder, "results.csv"))
        if code != 0 or not engine_rows:
            print(f"[vs_openclip] {job.name}: the engine exited {code}; see {job.folder}/engine.log", flush=True)
        results[job.name] = best_rows(job.name, job.table, engine_rows, job.batches)
        print(f"[vs_openclip] {job.name} done ({len(results)} of {len(jobs)} tables)", flush=True)
        written[:] = [_write(args.out, [r for j in jobs for r in results.get(j.name, [])], header)]

    _run_jobs(jobs, ids, args.parallel, done)
    print(written[0], flush=True)
    return 0 if all(r["ratio"] for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
