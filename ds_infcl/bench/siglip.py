"""GPU benchmark of SigLIP's sigmoid loss: ours (fused Triton kernels; the ring across GPUs) vs
materialized PyTorch vs OpenCLIP's ``SigLipLoss``, in the same run.

One GPU (``python -m ds_infcl.bench.siglip``): providers ``ours`` (``siglip_loss``, Triton),
``materialized`` (``siglip_reference(upcast=False)``: ``b x m`` logits in the input dtype) and
``openclip`` (``open_clip.loss.SigLipLoss``, when open_clip_torch is installed; OpenCLIP 3.3 has
no ``chunk_size`` option, so its chunked variant is reported as unavailable). Square batches,
normalized random features, a learnable scale (10) and bias (-10); one step is forward +
backward. Reported: median ms (CUDA events), TFLOP/s and % of the bf16 matmul rate measured in the
same run (``8 b m c`` FLOPs), and ``extra_gib``: peak memory of a step beyond the inputs and the
gradients it returns.

Several GPUs (``torchrun --nproc_per_node 2 -m ds_infcl.bench.siglip --dist``): per-GPU batch
``b``; ours (the ring) and OpenCLIP's ``SigLipLoss(dist_impl="bidir")`` on NCCL; time of the
slowest rank, the largest rank's extra memory, and for ours the weak-scaling efficiency (the time
of the same loss on one GPU at the global batch ``W b``, divided by ``W``, over the ring's time).

    python -m ds_infcl.bench.siglip --out docs/bench --batch 8192 16384 32768 65536 131072 262144 --dim 512 768
    torchrun --nproc_per_node 2 -m ds_infcl.bench.siglip --dist --out docs/bench --batch 8192 32768 65536

Writes ``siglip_<gpu>[_w<W>].csv`` and a PNG (if matplotlib is installed) under ``--out`` and
prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone

import torch

from ds_infcl.bench.loss import _quantile, _time, matmul_tflops
from ds_infcl.bench.results import file_tag, write_rows_csv

PROVIDERS = ("ours", "materialized", "openclip")
FIELDS = ["gpu", "date", "world", "provider", "b", "global_batch", "c", "dtype", "ms", "p20_ms", "p80_ms",
          "tflops", "pct_matmul", "extra_gib", "single_gpu_ms", "weak_eff", "matmul_tflops", "note"]


def _openclip():
    try:
        from open_clip.loss import SigLipLoss
    except Exception as err:  # noqa: BLE001 - any import failure means the provider is unavailable
        return None, f"open_clip unavailable: {type(err).__name__}: {str(err)[:60]}"
    return SigLipLoss, ""


def _loss_fn(provider: str, world: int, rank: int):
    from ds_infcl.loss import siglip_loss
    from ds_infcl.ops.siglip import siglip_reference

    if provider == "ours":
        return lambda q, k, s, t: siglip_loss(q, k, s, t, backend="triton", check_finite=False)
    if provider == "materialized":
        return lambda q, k, s, t: siglip_reference(q, k, s, t, upcast=False)
    cls, why = _openclip()
    if cls is None:
        raise RuntimeError(why)
    mod = cls(rank=rank, world_size=world, dist_impl="bidir")
    return lambda q, k, s, t: mod(q, k, s, t)


def _materialized_too_big(provider: str, b: int, world: int, dtype: torch.dtype) -> str:
    if provider == "ours":
        return ""
    free = torch.cuda.mem_get_info()[0]
    # OpenCLIP / the reference: about five b x (W b) matrices (logits, labels, products,
    # logsigmoid, gradients) in the input dtype; a closer call is tried and an OOM recorded.
    need = 5 * b * b * world * (torch.finfo(dtype).bits // 8)
    return f"skipped: needs ~{need / 2**30:.0f} GiB" if need > free else ""


def step_stats(fn, b, c, dtype, reps, seed=0):
    """Median/p20/p80 ms of forward + backward, and the extra GiB of one step."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=-1).to(dtype).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=-1).to(dtype).requires_grad_()
    s = torch.tensor(10.0, device="cuda", requires_grad=True)
    t = torch.tensor(-10.0, device="cuda", requires_grad=True)

    def step():
        q.grad = k.grad = s.grad = t.grad = None
        fn(q, k, s, t).backward()

    step()
    q.grad = k.grad = s.grad = t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = sum(x.grad.numel() * x.grad.element_size() for x in (q, k, s, t))
    extra = (torch.cuda.max_memory_allocated() - base - grads) / 2**30
    times = _time(step, reps, warmup=2)
    q = k = s = t = None  # free the inputs (the closure holds the cells) before emptying the cache
    torch.cuda.empty_cache()
    return _quantile(times, 0.5), _quantile(times, 0.2), _quantile(times, 0.8), extra


def _row(provider, b, world, c, dname, stats, mm, note=""):
    row = dict(provider=provider, b=b, global_batch=b * world, c=c, dtype=dname, world=world, note=note,
               ms="", p20_ms="", p80_ms="", tflops="", pct_matmul="", extra_gib="", single_gpu_ms="", weak_eff="")
    if stats is not None:
        med, p20, p80, extra = stats
        tflops = 8 * b * (b * world) * c / (med * 1e-3) / 1e12
        row.update(ms=round(med, 3), p20_ms=round(p20, 3), p80_ms=round(p80, 3), tflops=round(tflops, 1),
                   pct_matmul=round(100 * tflops / mm, 1), extra_gib=round(extra, 3))
    return row


def _reps(b, world, c, mm, args):
    ideal = 8 * b * b * world * c / (mm * 1e12) * 1e3
    return int(max(3, min(args.reps, args.seconds_per_point * 1e3 / max(4 * ideal, 1e-3))))


def run_single(args, mm):
    rows = []
    for c in args.dim:
        for b in args.batch:
            for provider in args.providers:
                note, stats = _materialized_too_big(provider, b, 1, torch.bfloat16), None
                if provider == "openclip" and not note:
                    note = _openclip()[1]
                if not note:
                    try:
                        stats = step_stats(_loss_fn(provider, 1, 0), b, c, torch.bfloat16, _reps(b, 1, c, mm, args))
                    except torch.cuda.OutOfMemoryError:
                        note = "out of memory"
                        torch.cuda.empty_cache()
                rows.append(_row(provider, b, 1, c, "bf16", stats, mm, note))
                _print(rows[-1])
            rows.append(_row("openclip_chunked", b, 1, c, "bf16", None, mm,
                             "unavailable: OpenCLIP 3.3 SigLipLoss has no chunk_size option"))
    return rows


def run_dist(args, mm):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for c in args.dim:
        for b in args.batch:
            for provider in [p for p in args.providers if p != "materialized"]:
                note = _materialized_too_big(provider, b, world, torch.bfloat16)
                if provider == "openclip" and not note:
                    note = _openclip()[1]
                stats = None
                if not note:
                    try:
                        stats = step_stats(_loss_fn(provider, world, rank), b, c, torch.bfloat16,
                                           _reps(b, world, c, mm, args), seed=rank)
                        ok = torch.ones(1, device="cuda")
                    except torch.cuda.OutOfMemoryError:
                        ok = torch.zeros(1, device="cuda")
                        torch.cuda.empty_cache()
                    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                    if ok.item() == 0:
                        note, stats = "out of memory", None
                if stats is not None:  # slowest rank's time, largest rank's memory
                    t = torch.tensor([stats[0], stats[1], stats[2], stats[3]], device="cuda")
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    stats = tuple(t.tolist())
                row = _row(provider, b, world, c, "bf16", stats, mm, note)
                if provider == "ours" and stats is not None:
                    # Weak scaling: the same loss on one GPU at the global batch (every rank runs it
                    # alone at once; the fastest counts), divided by W, over the ring's time.
                    group = dist.new_group([rank])
                    from ds_infcl.loss import siglip_loss

                    try:
                        single = step_stats(
                            lambda q, k, s, t_: siglip_loss(q, k, s, t_, backend="triton", group=group,
                                                            check_finite=False),
                            b * world, c, torch.bfloat16, 3)[0]
                    except torch.cuda.OutOfMemoryError:
                        single = float("inf")
                        torch.cuda.empty_cache()
                    st = torch.tensor([single], device="cuda")
                    dist.all_reduce(st, op=dist.ReduceOp.MIN)
                    single = st.item()
                    if single != float("inf"):
                        row.update(single_gpu_ms=round(single, 3), weak_eff=round(single / world / stats[0], 3))
                rows.append(row)
                if rank == 0:
                    _print(row)
    return rows


def _print(r):
    head = f"{r['provider']:16s} W={r['world']} b={r['b']:7d} c={r['c']:4d}"
    if r["note"]:
        print(f"{head}  {r['note']}", flush=True)
    else:
        extra = f"  weak eff {r['weak_eff']}" if r.get("weak_eff") not in ("", None) else ""
        print(f"{head}  {r['ms']:9.3f} ms  {r['tflops']:7.1f} TFLOP/s  {r['pct_matmul']:5.1f}% mm  "
              f"+{r['extra_gib']:.3f} GiB{extra}", flush=True)


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written ({path}); the CSV has every number.")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key in sorted({(r["provider"], r["c"]) for r in rows if r["ms"] != ""}):
        pts = sorted((r["b"], r["ms"], r["extra_gib"]) for r in rows if (r["provider"], r["c"]) == key and r["ms"] != "")
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} c={key[1]}")
        axes[1].plot([p[0] for p in pts], [max(p[2], 1e-3) for p in pts], marker="o", label=f"{key[0]} c={key[1]}")
    for ax, label in zip(axes, ("ms per step (fwd + bwd)", "extra GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("b per GPU")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--batch", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072, 262144])
    ap.add_argument("--dim", type=int, nargs="+", default=[512, 768])
    ap.add_argument("--dist", action="store_true", help="run under torchrun, one process per GPU (NCCL)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seconds-per-point", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-png", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "0")
    rank, world = 0, 1
    if args.dist:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
    gpu = torch.cuda.get_device_name()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mm = matmul_tflops()
    if rank == 0:
        print(f"# SigLIP loss, {gpu} x {world}, {stamp}, torch {torch.__version__}; bf16 matmul {mm:.0f} TFLOP/s",
              flush=True)
    rows = run_dist(args, mm) if args.dist else run_single(args, mm)
    if rank == 0:
        for r in rows:
            r.update(gpu=gpu, date=stamp, matmul_tflops=round(mm, 1))
        print("\nprovider          world      b     c        ms   %mm  extra GiB  weak eff  note")
        for r in rows:
            print(f"{r['provider']:16s} {r['world']:5d} {r['b']:7d} {r['c']:5d} {str(r['ms']):>9s} "
                  f"{str(r['pct_matmul']):>5s} {str(r['extra_gib']):>9s} {str(r['weak_eff']):>9s}  {r['note']}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            tag = file_tag(gpu) + (f"_w{world}" if args.dist else "")
            path = os.path.join(args.out, f"siglip_{tag}.csv")
            write_rows_csv(path, rows, FIELDS, append=True)
            print(f"csv written: {path}")
            if not args.no_png:
                _plot(rows, os.path.join(args.out, f"siglip_{tag}.png"))
    if args.dist:
        from ds_infcl.train.dist import shutdown

        shutdown()
    return 0


if __name__ == "__main__":
    from ds_infcl.train.dist import exit_process

    exit_process(main())  # no interpreter finalization after the group is gone (exit_process says why)
