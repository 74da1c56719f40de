"""What the default loss call's input check costs one process, and where (issue 37, item 7).

At small batches on one GPU a loss call is bound by the host, and the check of the default call
(``check_finite=True``: NaN/Inf rows, a finite scale and bias) adds host work, not GPU work. This
script times, in one process and in rotating rounds (so that the machine's drift falls on all of
them alike), isolated calls of these variants on the same inputs:

- ``sig_off`` / ``nce_off``: ``siglip_loss`` / ``contrastive_loss`` (symmetric) with
  ``check_finite=False``, forward and backward;
- ``sig_default`` / ``nce_default``: the default call, which computes the check (at the start of
  the forward, in its CUDA graph where the shape repeats, ``ds_infcl.ops.pass_check.PassCheck``)
  and reads it before returning (``checks_read_after_launch``: the host waits for the check's
  kernels, not for the loss's);
- ``sig_queued``: the default call inside ``deferred_value_checks``: computed, not read (what the
  trainer does), so ``sig_default - sig_queued`` is the read and ``sig_queued - sig_off`` the
  computation;
- ``sig_eager_check``: the default call with the check's operators run eagerly before the forward,
  its whole vector copied to the host (what the code before the graphed check did);
- ``sig_fwd_off`` / ``sig_fwd_default``: the forward alone.

Each row gives the median over ``--rounds x --calls`` calls of the host's time (until the call
returns) and of the GPU's (CUDA events around the call, then a synchronize). With ``--profile``
it then prints cProfile's top functions for ``sig_off`` and ``sig_default``.

    python -m ds_infcl.bench.check_cost --batch 4096 --profile

On a machine without CUDA it runs the same variants on the CPU (the torch backend, host times
only): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Callable, Dict, List

import torch

from ds_infcl.loss import contrastive_loss, siglip_loss
from ds_infcl.ops import validation


def variants(b: int, c: int, device: str) -> Dict[str, Callable[[], None]]:
    """The timed calls, on one set of inputs (bf16 on CUDA, float32 on the CPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def features():
        x = torch.randn(b, c, device=device, generator=gen)
        return torch.nn.functional.normalize(x, dim=1).to(dtype).requires_grad_()

    q, k = features(), features()
    s = torch.tensor(10.0, device=device, requires_grad=True)
    t = torch.tensor(-10.0, device=device, requires_grad=True)

    def sig(**kw):
        return siglip_loss(q, k, s, t, **kw)

    def queued():
        with validation.deferred_value_checks():
            sig().backward()

    def eager_check():  # the check's operators before the unchecked forward, as before the graphed check
        with validation.checks_read_after_launch():
            validation.check_values(q, k, s, None, k.shape[0], True, t)
            loss = sig(check_finite=False)
        loss.backward()

    return {
        "sig_off": lambda: sig(check_finite=False).backward(),
        "sig_default": lambda: sig().backward(),
        "sig_queued": queued,
        "sig_eager_check": eager_check,
        "sig_fwd_off": lambda: sig(check_finite=False),
        "sig_fwd_default": lambda: sig(),
        "nce_off": lambda: contrastive_loss(q, k, s, symmetric=True, check_finite=False).backward(),
        "nce_default": lambda: contrastive_loss(q, k, s, symmetric=True).backward(),
    }


def time_variants(calls: Dict[str, Callable[[], None]], rounds: int, per_round: int, cuda: bool):
    """``{name: (median host ms, median GPU ms or None)}`` over isolated calls in rotating rounds."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in calls.values():  # compile the kernels, capture the graphs, replay them once
        for _ in range(4):
            fn()
    sync()
    host: Dict[str, List[float]] = {n: [] for n in calls}
    gpu: Dict[str, List[float]] = {n: [] for n in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(per_round):
                sync()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                calls[name]()
                host[name].append((time.perf_counter() - t0) * 1e3)
                if cuda:
                    end.record()
                    sync()
                    gpu[name].append(start.elapsed_time(end))
    return {n: (statistics.median(host[n]), statistics.median(gpu[n]) if gpu[n] else None) for n in names}


def profile(fn: Callable[[], None], calls: int, cuda: bool, top: int = 28) -> str:
    """cProfile's top functions by own time over ``calls`` calls of ``fn`` (a synchronize after each)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(calls):
        fn()
        sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4096, help="rows of the queries and of the keys")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="isolated calls per variant and round")
    ap.add_argument("--profile", action="store_true", help="then cProfile sig_off and sig_default, 200 calls each")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.dim < 1 or args.rounds < 1 or args.calls < 1:
        ap.error("--batch, --dim, --rounds and --calls must be positive")
    cuda = torch.cuda.is_available()
    calls = variants(args.batch, args.dim, "cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else "CPU (a check of the script, not a measurement)"
    print(f"b = {args.batch}, c = {args.dim}, {where}; median over {args.rounds} x {args.calls} isolated calls")
    print("| variant | host ms | GPU ms |\n| --- | --- | --- |")
    for name, (host_ms, gpu_ms) in time_variants(calls, args.rounds, args.calls, cuda).items():
        print(f"| {name} | {host_ms:.3f} | {'-' if gpu_ms is None else f'{gpu_ms:.3f}'} |")
    if args.profile:
        for name in ("sig_off", "sig_default"):
            print(f"\n==== cProfile {name} (200 calls, a synchronize after each) ====")
            print(profile(calls[name], 200, cuda))


if __name__ == "__main__":
    main()
