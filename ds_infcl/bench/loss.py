"""GPU benchmark of the symmetric contrastive loss: Triton kernels vs tiled torch vs materialized.

Providers: ``triton`` (``contrastive_loss(..., backend="triton")``), ``torch`` (the tiled PyTorch
path, ``backend="torch"``), ``materialized`` (``contrastive_loss_reference(upcast=False)``: the
textbook loss with ``b x m`` logits in the input dtype). Square batches (``m = b``), symmetric
loss, CLIP-like normalized features, scale 14.3.

Modes: ``forward`` (the loss value, with autograd recording), ``backward`` (``loss.backward()``
alone), ``total`` (both, one timed region), ``graph`` (the ``total`` step captured once in a CUDA
graph and replayed: the GPU's own time, without the host's launch overhead, which is what the
step costs inside a training step whose host runs ahead of the GPU, or under
``torch.compile(mode="reduce-overhead")``; a provider whose step cannot be captured gets a note). Times are medians of CUDA-event timings (with 20/80
percentiles); TFLOP/s counts ``8 b m c`` for total, ``2 b m c`` for forward, ``6 b m c`` for
backward; ``pct_matmul`` compares with the bf16 matmul rate (8192^3 ``torch.mm``) measured at the
start of the same run (measured again after it and printed), or with ``--matmul-tflops`` (a
fixed rate: the percentages of docs/kernels.md divide by the highest rate read on each GPU,
``--matmul-tflops 793`` on an H200, ``781`` on an H100). Each step starts with the gradients set to ``None`` (``zero_grad``'s
default), so the gradients it returns become ``.grad``; ``extra_gib`` is the peak CUDA memory of
one ``total`` step beyond the inputs and those gradients.

    python -m ds_infcl.bench.loss --out docs/bench                       # the full grid
    python -m ds_infcl.bench.loss --providers triton --batch 65536 --dim 512 --modes total
    python -m ds_infcl.bench.loss --dtypes bf16 fp32 --batch 8192 16384 --no-png

Writes ``loss_<gpu>.csv`` (rows appended when the file exists) and ``loss_<gpu>.png`` (if
matplotlib is installed) under ``--out``, and prints a table.

``--precision``: ours against OpenCLIP's ``ClipLoss`` / ``SigLipLoss`` on float32 features with TF32
off, TF32 on and under bf16 autocast, one GPU or under torchrun (``ds_infcl.bench.loss_precision``)::

    python -m ds_infcl.bench.loss --precision --out docs/bench
    torchrun --nproc_per_node 2 -m ds_infcl.bench.loss --precision --out docs/bench
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone

import torch

from ds_infcl.bench.results import file_tag, write_rows_csv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVIDERS = ("triton", "torch", "materialized", "openclip")


def _openclip_loss():
    """OpenCLIP's ``ClipLoss`` (when ``open_clip_torch`` imports), else ``(None, why)``."""
    try:
        from open_clip.loss import ClipLoss
    except Exception as err:  # noqa: BLE001 - any import failure means the provider is unavailable
        return None, f"open_clip unavailable: {type(err).__name__}: {str(err)[:60]}"
    return ClipLoss, ""
MODES = ("forward", "backward", "total", "graph")
FLOPS_PER_PAIR = {"forward": 2, "backward": 6, "total": 8, "graph": 8}
FIELDS = ["gpu", "date", "provider", "b", "c", "dtype", "mode", "median_ms", "p20_ms", "p80_ms",
          "tflops", "pct_matmul", "ideal_ms", "extra_gib", "matmul_tflops", "note"]


def matmul_tflops(n: int = 8192, reps: int = 20, warmup_s: float = 1.0) -> float:
    """bf16 ``torch.mm`` rate on random data: the median of ``reps`` timed products after
    ``warmup_s`` seconds of products. A fresh process's first products run before the GPU's
    clocks settle (an H100 measured 672 TFLOP/s with 5 warm-up products, 781 with a second's
    worth, 2026-11-26), and every "% of the matmul rate" of a run divides by this number."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        for _ in range(10):
            torch.mm(a, b)
        torch.cuda.synchronize()
    times = _time(lambda: torch.mm(a, b), reps=reps, warmup=1)
    return 2 * n**3 / (_quantile(times, 0.5) * 1e-3) / 1e12


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _time(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return out


def _loss_fn(provider: str):
    from ds_infcl.loss import contrastive_loss
    from ds_infcl.ops import contrastive_loss_reference

    if provider == "triton":
        return lambda q, k, s: contrastive_loss(q, k, s, symmetric=True, backend="triton", check_finite=False)
    if provider == "torch":
        return lambda q, k, s: contrastive_loss(q, k, s, symmetric=True, backend="torch", check_finite=False)
    if provider == "materialized":
        return lambda q, k, s: contrastive_loss_reference(q, k, s, symmetric=True, upcast=False)
    if provider == "openclip":  # OpenCLIP's own loss, one GPU: its [b, b] logits in the inputs' dtype
        cls, why = _openclip_loss()
        if cls is None:
            raise RuntimeError(why)
        loss = cls()
        return lambda q, k, s: loss(q, k, s)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def _skip_reason(provider: str, b: int, c: int, dtype: torch.dtype, args) -> str:
    free = torch.cuda.mem_get_info()[0]
    if provider == "openclip":
        if _openclip_loss()[0] is None:
            return "skipped: " + _openclip_loss()[1]
        need = b * b * (4 * torch.finfo(dtype).bits // 8)  # logits both ways, softmax, gradient
        if need > 0.85 * free:
            return f"skipped: needs ~{need / 2**30:.0f} GiB"
    if provider == "materialized":
        # logits, their softmax and gradient in the input dtype, plus fp32 temporaries
        need = b * b * (3 * torch.finfo(dtype).bits // 8 + 8)
        if need > 0.85 * free:
            return f"skipped: needs ~{need / 2**30:.0f} GiB"
        if b > args.max_b_materialized:
            return "skipped: b > --max-b-materialized"
    if provider == "torch" and b > args.max_b_torch:
        return "skipped: b > --max-b-torch"
    return ""


def bench_point(provider, b, c, dtype, modes, args, mm_rate):
    # Each point starts with no CUDA graphs of the fused loss cached (ds_infcl.ops.infonce_graph
    # keeps the first 4 shapes that repeat, per process): its small shapes replay from their own
    # graphs as in a run of that one shape, whatever points came before.
    from ds_infcl.ops.infonce_graph import clear_graphs

    clear_graphs()
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype).requires_grad_()
    scale = torch.tensor(14.3, device="cuda", requires_grad=True)
    fn = _loss_fn(provider)
    ideal_total = 8 * b * b * c / (mm_rate * 1e12) * 1e3
    # Repetitions: enough for a median, bounded in time (ideal x 4 as a time guess).
    reps = int(max(3, min(args.reps, args.seconds_per_point * 1e3 / max(ideal_total * 4, 1e-3))))
    warmup = 1 if ideal_total > 100 else 3

    def zero_grad():
        q.grad = k.grad = scale.grad = None

    def total():
        zero_grad()
        fn(q, k, scale).backward()

    rows = []
    # Memory: one total step from a clean peak, beyond the inputs and the gradients it returns.
    total()
    zero_grad()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    total()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, scale))
    extra = (torch.cuda.max_memory_allocated() - base - grads) / 2**30
    results, notes = {}, {}
    if "total" in modes:
        results["total"] = _time(total, reps, warmup)
    if "graph" in modes:
        try:
            graph = capture_graph(total)
            results["graph"] = _time(graph.replay, reps, warmup)
        except RuntimeError as err:  # not capturable: say so in the row
            notes["graph"] = f"graph capture failed: {str(err).splitlines()[0][:80]}"
            torch.cuda.synchronize()
    if "forward" in modes:
        results["forward"] = _time(lambda: fn(q, k, scale), reps, warmup)
    if "backward" in modes:
        times = []
        for i in range(reps + warmup):
            zero_grad()
            loss = fn(q, k, scale)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            loss.backward()
            e.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(s.elapsed_time(e))
        results["backward"] = times
    for mode in modes:
        if mode in notes:
            rows.append(dict(provider=provider, b=b, c=c, dtype=_dtype_name(dtype), mode=mode, median_ms="",
                             p20_ms="", p80_ms="", tflops="", pct_matmul="", ideal_ms="", extra_gib="",
                             note=notes[mode]))
            continue
        t = results[mode]
        med = _quantile(t, 0.5)
        flops = FLOPS_PER_PAIR[mode] * b * b * c
        tflops = flops / (med * 1e-3) / 1e12
        rows.append(dict(
            provider=provider, b=b, c=c, dtype=_dtype_name(dtype), mode=mode, median_ms=round(med, 4),
            p20_ms=round(_quantile(t, 0.2), 4), p80_ms=round(_quantile(t, 0.8), 4), tflops=round(tflops, 1),
            pct_matmul=round(100 * tflops / mm_rate, 1), ideal_ms=round(flops / (mm_rate * 1e12) * 1e3, 3),
            extra_gib=round(extra, 3), note="",
        ))
    q = k = scale = None  # (the closures above share these cells: this frees the inputs for the next point)
    torch.cuda.empty_cache()
    return rows


def capture_graph(step) -> "torch.cuda.CUDAGraph":
    """``step`` captured in a CUDA graph (after warm-up on a side stream, as PyTorch requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _dtype_name(dtype):
    return {v: k for k, v in DTYPES.items()}[dtype]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="batch sizes (default 8192 .. 262144; with --precision 8192 .. 65536 per GPU)")
    ap.add_argument("--dim", type=int, nargs="+", default=None,
                    help="feature dims (default 256 512 768 1024; with --precision 512)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--reps", type=int, default=20, help="most timed repetitions per point")
    ap.add_argument("--seconds-per-point", type=float, default=2.0, help="time budget that bounds reps")
    ap.add_argument("--max-b-torch", type=int, default=65536, help="largest b for the tiled torch provider")
    ap.add_argument("--max-b-materialized", type=int, default=65536)
    ap.add_argument("--out", default=None, help="folder for the CSV and PNG")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--matmul-tflops", type=float, default=None,
                    help="divide every %% mm by this bf16 matmul rate (TFLOP/s) instead of the one measured at "
                         "the start, e.g. the highest rate read on this GPU: a GPU held below its clocks on "
                         "random-data GEMMs reads low and flatters every %% (both readings are still printed)")
    ap.add_argument("--precision", action="store_true",
                    help="float32 features: ours against OpenCLIP's losses with TF32 off, TF32 on and under bf16 "
                         "autocast (ds_infcl.bench.loss_precision); under torchrun, one process per GPU")
    ap.add_argument("--precision-reps", type=int, default=3,
                    help="--precision: timed calls per point (after 2 warm-up calls: Triton's compile, then a CUDA "
                         "graph's capture for the small shapes)")
    ap.add_argument("--smoke", action="store_true", help="--precision: a tiny grid on CPU (tests)")
    args = ap.parse_args(argv)
    if args.precision:
        from ds_infcl.bench import loss_precision

        return loss_precision.main(args)
    args.batch = args.batch or [8192, 16384, 32768, 65536, 131072, 262144]
    args.dim = args.dim or [256, 512, 768, 1024]
    if args.matmul_tflops is not None and not args.matmul_tflops > 0:
        ap.error(f"--matmul-tflops must be a positive rate in TFLOP/s, got {args.matmul_tflops}")
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "0")
    gpu = torch.cuda.get_device_name()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mm_start = matmul_tflops()
    mm = args.matmul_tflops or mm_start
    given = f"; the % mm below divide by the given {mm:.0f}" if args.matmul_tflops else ""
    print(f"# {gpu}, {stamp}, torch {torch.__version__}; bf16 matmul (8192^3) {mm_start:.0f} TFLOP/s{given}",
          flush=True)
    rows = []
    hdr = f"{'provider':12s} {'dtype':5s} {'b':>7s} {'c':>5s} {'mode':8s} {'median ms':>10s} {'TFLOP/s':>8s} {'% mm':>6s} {'ideal ms':>9s} {'extra GiB':>9s}"
    print(hdr, flush=True)
    for dname in args.dtypes:
        for c in args.dim:
            for b in args.batch:
                for provider in args.providers:
                    dtype = DTYPES[dname]
                    why = _skip_reason(provider, b, c, dtype, args)
                    if not why:
                        try:
                            pts = bench_point(provider, b, c, dtype, args.modes, args, mm)
                        except torch.cuda.OutOfMemoryError:
                            why = "out of memory"
                            torch.cuda.empty_cache()
                    if why:
                        pts = [dict(provider=provider, b=b, c=c, dtype=dname, mode=mode, median_ms="", p20_ms="",
                                    p80_ms="", tflops="", pct_matmul="", ideal_ms="", extra_gib="", note=why)
                               for mode in args.modes]
                    for r in pts:
                        r.update(gpu=gpu, date=stamp, matmul_tflops=round(mm, 1))
                        rows.append(r)
                        if r["note"]:
                            print(f"{provider:12s} {dname:5s} {b:7d} {c:5d} {r['mode']:8s} {r['note']}", flush=True)
                        else:
                            print(f"{provider:12s} {dname:5s} {b:7d} {c:5d} {r['mode']:8s} {r['median_ms']:10.3f} "
                                  f"{r['tflops']:8.1f} {r['pct_matmul']:6.1f} {r['ideal_ms']:9.3f} {r['extra_gib']:9.3f}",
                                  flush=True)
    # The rate again after the run: a GPU whose clocks moved during the run (power, heat, a
    # neighbour) shows here, and every "% mm" above divides by the first reading.
    mm_end = matmul_tflops(warmup_s=0.5)
    divisor = f"the given {mm:.0f}" if args.matmul_tflops else "the start's"
    print(f"# bf16 matmul (8192^3) after the run: {mm_end:.0f} TFLOP/s ({100 * (mm_end / mm_start - 1):+.1f}% against "
          f"the start's {mm_start:.0f}; the % mm above divide by {divisor})", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = file_tag(gpu)
        path = os.path.join(args.out, f"loss_{tag}.csv")
        write_rows_csv(path, rows, FIELDS, append=True)
        print(f"csv written: {path}")
        if not args.no_png:
            from ds_infcl.bench.plots import loss_plot

            loss_plot(rows, os.path.join(args.out, f"loss_{tag}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
