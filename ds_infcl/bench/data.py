"""Data-path benchmark: how many training images per second the image loader delivers, on the CPU
(PIL decode + random-resized crop + resize, per core and through the real loader's workers) and
on the GPU (batched nvjpeg ``decode_jpeg`` + crop/resize on the device).

    python -m ds_infcl.bench.data --shards data/jpeg256 --workers 1 8 16 --out runs/bench_data

Rows (each after a warm-up batch that is not timed):

- ``cpu in-process``: one core (``torch.set_num_threads(1)``, no worker process) decoding and
  augmenting as a loader worker does: ``ImageTextShards`` with the clip task's training transform
  (``--random-crop-scale``, default OpenCLIP's 0.9-1.0; ``uint8`` output).
- ``cpu loader``: ``image_text_loader`` with ``N`` workers (each builds whole batches), endless
  resampled stream: the rate a rank's loader sustains on ``N`` cores.
- ``gpu decode``: the main process's part of ``decode: gpu``: worker batches of packed JPEG bytes
  and crop boxes read first (untimed), then ``JpegBatchDecoder`` on them (``cuda.synchronize``
  after each batch): decoded images/s of one GPU.
- ``gpu loader``: the whole ``decode: gpu`` stream: ``N`` workers reading headers and drawing
  boxes, the main process decoding on the device (``Rebatch``).

GPU rows are ``skipped`` (with the reason) without CUDA and torchvision. Results: a printed table
(last), ``<out>/results.csv`` and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from ds_infcl.bench.results import write_rows_csv
from ds_infcl.data import BadSampleTally, ImageTextShards, ImageTransform, image_text_loader
from ds_infcl.data.device_decode import EncodedImages, JpegBatchDecoder, gpu_decode_problem
from ds_infcl.data.rebatch import Rebatch
from ds_infcl.data.transforms import check_crop_scale

__all__ = ["main"]

FIELDS = ["path", "workers", "batch_size", "images", "seconds", "images_per_s", "images_per_s_per_worker",
          "bad_images", "status", "device"]


def _transform(args) -> ImageTransform:
    scale = check_crop_scale(args.random_crop_scale)
    return ImageTransform(args.image_size, train=scale is not None, random_crop_scale=scale, output="uint8")


def _dataset(args, transform) -> ImageTextShards:
    return ImageTextShards(args.shards, image_transform=transform, batch_size=args.batch_size,
                           resampled=True, shuffle_buffer=0, seed=args.seed)


def _row(path: str, workers: int, images: int, seconds: float, bad: int, device: str,
         status: str = "ok", batch_size: int = 0) -> Dict[str, Any]:
    rate = images / seconds if seconds > 0 else 0.0
    return {"path": path, "workers": workers, "batch_size": batch_size, "images": images,
            "seconds": round(seconds, 3), "images_per_s": round(rate, 1),
            "images_per_s_per_worker": round(rate / max(workers, 1), 1) if workers else "",
            "bad_images": bad, "status": status, "device": device}


def _skipped(path: str, workers: int, why: str) -> Dict[str, Any]:
    row = {k: "" for k in FIELDS}
    row.update(path=path, workers=workers, status=f"skipped: {why}")
    return row


def _timed_batches(stream, num_batches: int, count, sync=lambda: None, warmup: int = 1):
    """``(images, seconds)`` over ``num_batches`` batches after ``warmup`` untimed ones (a loader's
    first batch from every worker: worker start-up, and batches that were in flight together)."""
    for _ in range(warmup):
        count(next(stream))
    sync()
    t0, images = time.perf_counter(), 0
    for _ in range(num_batches):
        images += count(next(stream))
    sync()
    return images, time.perf_counter() - t0


def bench_cpu_in_process(args) -> Dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = _dataset(args, _transform(args))
        num = max(1, -(-args.num_images // args.batch_size))
        images, seconds = _timed_batches(iter(dataset), num, lambda b: len(b["idx"]))
        bad = sum(dataset.bad_samples.values())
    finally:
        torch.set_num_threads(threads)
    return _row("cpu in-process (1 core)", 1, images, seconds, bad, "cpu", batch_size=args.batch_size)


def bench_cpu_loader(args, workers: int) -> Dict[str, Any]:
    tally = BadSampleTally()
    loader = image_text_loader(_dataset(args, _transform(args)), num_workers=workers,
                               prefetch_factor=args.prefetch_factor)

    def count(batch):
        tally.update(batch)
        return len(batch["idx"])

    images, seconds = _timed_batches(iter(loader), args.batches_per_worker * workers, count, warmup=workers)
    return _row("cpu loader", workers, images, seconds, tally.total, "cpu", batch_size=args.batch_size)


def _device(args) -> torch.device:
    return torch.device(args.device) if args.device else torch.device("cuda", torch.cuda.current_device())


def bench_gpu_decode(args, decode=None) -> Dict[str, Any]:
    device = _device(args)
    workers = max(args.workers) if args.workers else 0
    loader = image_text_loader(_dataset(args, EncodedImages(_transform(args))), num_workers=workers,
                               **({"prefetch_factor": args.prefetch_factor} if workers else {}))
    stream = iter(loader)
    num = max(1, -(-args.num_images // args.batch_size))
    raw = [next(stream)["image"] for _ in range(num + 1)]  # read before timing: only the device work counts
    del stream, loader
    decoder = JpegBatchDecoder(args.image_size, device, decode=decode, decode_batch=args.decode_batch)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    bad = [0]

    def count(packed):
        images, ok, _ = decoder(packed)
        bad[0] += int((~ok).sum())
        return int(ok.sum())

    images, seconds = _timed_batches(iter(raw), num, count, sync)
    return _row("gpu decode (main process)", 0, images, seconds, bad[0], str(device), batch_size=args.batch_size)


def bench_gpu_loader(args, workers: int, decode=None) -> Dict[str, Any]:
    device = _device(args)
    tally = BadSampleTally()
    loader = image_text_loader(_dataset(args, EncodedImages(_transform(args))), num_workers=workers,
                               **({"prefetch_factor": args.prefetch_factor} if workers else {}))
    decoder = JpegBatchDecoder(args.image_size, device, decode=decode, decode_batch=args.decode_batch)
    stream = iter(Rebatch(iter(loader), args.batch_size, tally, decoder=decoder))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    images, seconds = _timed_batches(stream, args.batches_per_worker * max(workers, 1),
                                     lambda b: len(b["idx"]), sync, warmup=max(workers, 1))
    return _row("gpu loader", workers, images, seconds, tally.total, str(device), batch_size=args.batch_size)


def _table(rows: List[Dict[str, Any]], header: str) -> str:
    lines = [header, "", "| path | workers | batch | images | seconds | images/s | per worker | bad | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['workers']} | {r['batch_size']} | {r['images']} | {r['seconds']} | "
                     f"{r['images_per_s']} | {r['images_per_s_per_worker']} | {r['bad_images']} | {r['status']} |")
    return "\n".join(lines)


def run(args, *, decode=None) -> List[Dict[str, Any]]:
    """The benchmark's rows. ``decode`` replaces ``decode_jpeg`` (a CPU test's stand-in; with one,
    the GPU rows run on ``args.device`` even without CUDA)."""
    rows: List[Dict[str, Any]] = []
    if not args.no_cpu:
        rows.append(bench_cpu_in_process(args))
        for n in args.workers:
            if n > 0:
                rows.append(bench_cpu_loader(args, n))
    problem = None if decode is not None else gpu_decode_problem()
    if args.no_gpu:
        problem = "--no-gpu"
    if problem is not None:
        rows.append(_skipped("gpu decode (main process)", 0, problem))
        rows.append(_skipped("gpu loader", max(args.workers or [0]), problem))
    else:
        rows.append(bench_gpu_decode(args, decode))
        for n in args.gpu_workers if args.gpu_workers is not None else [max(args.workers or [0])]:
            rows.append(bench_gpu_loader(args, n, decode))
    return rows


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(prog="python -m ds_infcl.bench.data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shards", required=True, help="a shard folder, brace pattern or patterns joined by '::'")
    p.add_argument("--image-size", type=int, default=224, help="output edge (ViT-B/16: 224)")
    p.add_argument("--random-crop-scale", type=float, nargs=2, default=[0.9, 1.0], metavar=("LO", "HI"))
    p.add_argument("--no-crop", action="store_true", help="the evaluation transform (resize + centre crop)")
    p.add_argument("--batch-size", type=int, default=256, help="images per worker batch")
    p.add_argument("--num-images", type=int, default=2048, help="timed images of the in-process and GPU-decode rows")
    p.add_argument("--workers", type=int, nargs="*", default=[8], help="loader worker counts to measure")
    p.add_argument("--gpu-workers", type=int, nargs="*", default=None,
                   help="worker counts of the gpu loader rows (default: the largest of --workers)")
    p.add_argument("--batches-per-worker", type=int, default=4, help="timed batches per worker in the loader rows")
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--decode-batch", type=int, default=1024, help="images per decode_jpeg call")
    p.add_argument("--device", default=None, help="device of the GPU rows (default: the current CUDA device)")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU rows")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for results.csv and results.json")
    args = p.parse_args(argv)
    if args.no_crop:
        args.random_crop_scale = None
    for name in ("image_size", "batch_size", "num_images", "batches_per_worker", "prefetch_factor", "decode_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[List[str]] = None, *, decode=None) -> int:
    args = parse_args(argv)
    rows = run(args, decode=decode)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    header = (f"# Data path: {args.shards}, {args.image_size} px, crop scale {args.random_crop_scale}, "
              f"batch {args.batch_size}; {os.cpu_count()} CPUs, {device}; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    table = _table(rows, header)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_rows_csv(os.path.join(args.out, "results.csv"), rows, FIELDS)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"header": header, "args": vars(args), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(table + "\n")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
