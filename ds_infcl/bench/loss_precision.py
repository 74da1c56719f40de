"""Our losses against OpenCLIP's on float32 features, under torch's three precision settings.

OpenCLIP's and sentence-transformers' loops hand the loss float32 features (what ``F.normalize``
returns, also under bf16 autocast). This benchmark times forward + backward for each per-GPU
batch ``b`` (8,192 to 65,536, ``c`` = 512 by default): the median of ``--precision-reps`` calls
(3) after 2 warm-up calls (Triton's compile, then the capture of a CUDA graph for small shapes),
each call synchronized; under torchrun, the slowest rank's time of each call. The grid:

- settings: ``tf32_off`` (``torch.backends.cuda.matmul.allow_tf32 = False``), ``tf32_on`` (True,
  as OpenCLIP's trainer sets it), ``bf16_autocast`` (the forward inside
  ``torch.autocast(dtype=torch.bfloat16)``, TF32 on, the backward outside, as OpenCLIP's loop);
- the CLIP loss: ours (``ds_infcl.loss.clip_loss`` at default arguments: one GPU, or the default
  distributed path over the world group) against OpenCLIP's ``ClipLoss``. On several GPUs OpenCLIP
  runs both as its trainer defaults (``local_loss=False, gather_with_grad=False``: ``openclip``)
  and as ``local_loss=True, gather_with_grad=True`` (``openclip_local``, its faster and exact
  configuration);
- the SigLIP loss: ours (``siglip_loss``) against OpenCLIP's ``SigLipLoss`` (its default
  ``dist_impl``).

One command per GPU count::

    python -m ds_infcl.bench.loss --precision --out docs/bench
    torchrun --nproc_per_node 2 -m ds_infcl.bench.loss --precision --out docs/bench

It prints a table (ours, OpenCLIP's fastest configuration, their ratio) and appends every
timing to ``loss_precision_<gpu>_w<world>.csv`` under ``--out``. ``--smoke`` runs a tiny grid on
CPU (or whatever device there is) for the tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from datetime import datetime, timezone
from typing import Callable, Dict, List

import torch

from ds_infcl.bench.results import file_tag, write_rows_csv

SETTINGS = ("tf32_off", "tf32_on", "bf16_autocast")
LOSSES = ("clip", "siglip")
FIELDS = ["gpu", "date", "world", "setting", "loss", "provider", "b", "global_batch", "c", "median_ms", "p20_ms",
          "p80_ms", "reps", "note"]


def _openclip_classes():
    """OpenCLIP's ``(ClipLoss, SigLipLoss)``, or ``None`` with the reason. Where ``import open_clip``
    fails for want of torchvision (CPU machines), its ``loss.py``, which needs only torch, is
    loaded from the installed package."""
    try:
        from open_clip.loss import ClipLoss, SigLipLoss
    except Exception as err:  # noqa: BLE001 - any import failure: try the file, else unavailable
        spec = importlib.util.find_spec("open_clip")
        if spec is None or not spec.submodule_search_locations:
            return None, f"open_clip unavailable: {type(err).__name__}: {str(err)[:80]}"
        path = os.path.join(list(spec.submodule_search_locations)[0], "loss.py")
        file_spec = importlib.util.spec_from_file_location("_open_clip_loss_file", path)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        return (module.ClipLoss, module.SigLipLoss), ""
    return (ClipLoss, SigLipLoss), ""


def providers(loss: str, world: int, rank: int) -> Dict[str, Callable]:
    """Name -> ``fn(q, k, scale, bias) -> loss`` for ``loss`` ("clip" / "siglip") on this world."""
    from ds_infcl.loss import clip_loss, siglip_loss

    out: Dict[str, Callable] = {}
    if loss == "clip":
        out["ours"] = lambda q, k, s, t: clip_loss(q, k, s)
    else:
        out["ours"] = lambda q, k, s, t: siglip_loss(q, k, s, t)
    classes, _ = _openclip_classes()
    if classes is None:
        return out
    clip_cls, siglip_cls = classes
    if loss == "siglip":
        mod = siglip_cls(rank=rank, world_size=world)
        out["openclip"] = lambda q, k, s, t: mod(q, k, s, t)
        return out
    mod = clip_cls(rank=rank, world_size=world)  # its trainer's defaults
    out["openclip"] = lambda q, k, s, t: mod(q, k, s)
    if world > 1:
        local = clip_cls(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
        out["openclip_local"] = lambda q, k, s, t: local(q, k, s)
    return out


@contextlib.contextmanager
def tf32(setting: str):
    """The TF32 flag of ``setting`` for the whole step, forward and backward (on but in ``tf32_off``)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = setting != "tf32_off"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def autocast(setting: str, device: torch.device):
    """bf16 autocast around the forward in ``bf16_autocast`` (the backward runs outside it)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=setting == "bf16_autocast")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(fn, b: int, c: int, setting: str, device: torch.device, reps: int, warmup: int, seed: int,
              group=None) -> List[float]:
    """Milliseconds of ``reps`` forward + backward calls of ``fn`` on float32 unit features
    ``[b, c]`` (learnable scale and bias), after ``warmup`` calls; under a group, the slowest
    rank's time of each call."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, device=device, generator=g), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(b, c, device=device, generator=g), dim=-1).requires_grad_()
    s = torch.tensor(14.3, device=device, requires_grad=True)
    t = torch.tensor(-10.0, device=device, requires_grad=True)
    times = []
    with tf32(setting):
        for i in range(warmup + reps):
            q.grad = k.grad = s.grad = t.grad = None
            _sync(device)
            if group is not None:
                torch.distributed.barrier(group)
            start = time.perf_counter()
            with autocast(setting, device):
                loss = fn(q, k, s, t)
            loss.backward()  # outside autocast, as OpenCLIP's loop
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
    if group is not None:  # the slowest rank's time of each call
        tt = torch.tensor(times, device=device, dtype=torch.float64)
        torch.distributed.all_reduce(tt, op=torch.distributed.ReduceOp.MAX, group=group)
        times = tt.tolist()
    return times


def _quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)


def run(batches, c: int, reps: int, warmup: int, device: torch.device, group=None,
        settings=SETTINGS, losses=LOSSES) -> List[dict]:
    """Every (setting, loss, b, provider) point as a row (``FIELDS`` but gpu and date)."""
    world = torch.distributed.get_world_size(group) if group is not None else 1
    rank = torch.distributed.get_rank(group) if group is not None else 0
    rows = []
    for setting in settings:
        for loss in losses:
            fns = providers(loss, world, rank)
            for b in batches:
                for name, fn in fns.items():
                    row = dict(world=world, setting=setting, loss=loss, provider=name, b=b, global_batch=b * world,
                               c=c, median_ms="", p20_ms="", p80_ms="", reps=reps, note="")
                    try:
                        times = time_step(fn, b, c, setting, device, reps, warmup, seed=rank, group=group)
                        row.update(median_ms=round(_quantile(times, 0.5), 3), p20_ms=round(_quantile(times, 0.2), 3),
                                   p80_ms=round(_quantile(times, 0.8), 3))
                    except RuntimeError as err:
                        if not _is_oom(err):
                            raise
                        row["note"] = "out of memory"
                    _release(device)
                    if group is not None:  # one rank out of memory: every rank says so
                        row["note"] = _any_note(row["note"], device, group)
                        if row["note"]:
                            row.update(median_ms="", p20_ms="", p80_ms="")
                    rows.append(row)
                    if rank == 0:
                        print(_line(row), flush=True)
    missing = _openclip_classes()[1]
    if missing and rank == 0:
        print(f"# OpenCLIP left out: {missing}")
    return rows


def _any_note(note: str, device: torch.device, group) -> str:
    flag = torch.tensor([1.0 if note else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return note or ("out of memory on another rank" if flag.item() else "")


def _release(device: torch.device) -> None:
    from ds_infcl.ops.infonce_graph import clear_graphs

    clear_graphs()  # every point starts with no CUDA graph of ours cached (as bench.loss does)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _line(r: dict) -> str:
    ms = f"{r['median_ms']:9.2f}" if r["median_ms"] != "" else f"{'-':>9s}"
    return f"{r['setting']:14s} {r['loss']:7s} W={r['world']} b={r['b']:7d} {r['provider']:15s} {ms} ms {r['note']}"


def summary(rows: List[dict]) -> str:
    """The table: per (setting, loss, b) ours, OpenCLIP's fastest configuration and its time, and
    OpenCLIP's time / ours (above 1: ours is faster)."""
    lines = ["| setting | loss | GPUs | b per GPU | ours ms | OpenCLIP ms (fastest) | OpenCLIP / ours |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    keys = []
    for r in rows:
        k = (r["setting"], r["loss"], r["world"], r["b"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        pts = [r for r in rows if (r["setting"], r["loss"], r["world"], r["b"]) == k]
        ours = next((r["median_ms"] for r in pts if r["provider"] == "ours"), "")
        theirs = [(r["median_ms"], r["provider"]) for r in pts if r["provider"] != "ours" and r["median_ms"] != ""]
        best = min(theirs) if theirs else None
        ratio = f"{best[0] / ours:.2f}x" if best and ours not in ("", 0) else "-"
        their_text = f"{best[0]:.2f} ({best[1]})" if best else "-"
        ours_text = f"{ours:.2f}" if ours != "" else "-"
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {ours_text} | {their_text} | {ratio} |")
    return "\n".join(lines)


def main(args) -> int:
    """``python -m ds_infcl.bench.loss --precision`` (``args`` from that command line)."""
    group = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available() and not args.smoke:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        os.environ.setdefault("TRITON_INTERPRET", "0")
    elif args.smoke:
        device = torch.device("cpu")
    else:
        print("--precision needs a CUDA GPU (or --smoke)")
        return 2
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if torch.distributed.is_initialized():
        group = torch.distributed.group.WORLD
    batches = args.batch or ([48, 80] if args.smoke else [8192, 16384, 32768, 65536])
    c = args.dim[0] if args.dim else (32 if args.smoke else 512)
    reps, warmup = (2, 1) if args.smoke else (args.precision_reps, 2)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rank = torch.distributed.get_rank() if group is not None else 0
    if rank == 0:
        print(f"# float32 features, forward + backward, median of {reps} after {warmup}; {gpu} x {world}, {stamp}, "
              f"torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    rows = run(batches, c, reps, warmup, device, group)
    if rank == 0:
        for r in rows:
            r.update(gpu=gpu, date=stamp)
        print()
        print(summary(rows))
        print(f"# {time.perf_counter() - start:.0f} s", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"loss_precision_{file_tag(gpu)}_w{world}.csv")
            write_rows_csv(path, rows, FIELDS, append=True)
            print(f"csv written: {path}")
    if group is not None and world > 1:
        torch.distributed.destroy_process_group()
    return 0
