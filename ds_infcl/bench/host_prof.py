"""Host cost of one distributed loss call: operators, launches and CPU milliseconds per call.

At a small per-GPU batch the distributed InfoNCE is host-bound (issue 17): the GPU work of one
call is ~1 ms, the Python and dispatcher work around it several. This script counts what one call
of ``contrastive_loss(q, k, scale, symmetric=True, impl="infcl")`` (forward + backward) costs the
host, per algorithm (``DS_INFCL_ALGORITHM`` = ``gather`` / ``ring``), with ``torch.profiler``:

- ``aten ops/call``: every ``aten::`` operator the dispatcher runs (nested ones included);
- ``top ops/call``: the ``aten::`` operators called from Python or autograd directly (not nested);
- ``glue ops/call``: the top-level ones outside the backends' block functions (``lse_forward_*``,
  ``lse_backward_*``, ``positive_logits_*``): autograd, collectives, casts, the loss composition,
  which the torch and Triton backends share;
- ``kernels/call``: CUDA kernel launches (GPU runs only);
- ``host ms/call``: the loop's wall time per call without the profiler, no synchronization
  inside the loop (on CPU this includes the arithmetic itself: use a small ``--batch`` to see
  the host overhead alone).

With ``--phases`` (distributed only) every rank also prints where the host's time of a call goes,
without the profiler (which slows every operator): the host milliseconds per call spent inside
each step of the call (``_PHASES``: the layout exchange, the collectives, the CUDA-graph replays,
the merges, the Function's forward and backward; inclusive, so nested steps count in both), the
host time of every timed call (a stall shows as one outlier) and the call's GPU time (CUDA
events). A call whose host time is close to its GPU time is bound by the host.

Run on every rank of a group, e.g. ``torchrun --nproc_per_node 2 -m ds_infcl.bench.host_prof
--batch 4096 --dim 512`` (gloo on CPU, NCCL on CUDA). Rank 0 prints one table row per algorithm
and, with ``--detail``, the operator counts per call. As one plain process (``python -m
ds_infcl.bench.host_prof --batch 8192``) it measures the single-device call instead (row
``single``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time

import torch
import torch.distributed as dist

from ds_infcl import settings
from ds_infcl.loss import contrastive_loss


def _one_call(q, k, s, backend, tile_size=None):
    contrastive_loss(q, k, s, symmetric=True, impl="infcl", backend=backend, tile_size=tile_size,
                     check_finite=False).backward()


# The block-level maths of each backend (what runs per LSE call); everything else in a loss call
# is "glue": autograd, collectives, casts, the composition of the loss.
_KERNEL_OPS = {
    "ds_infcl.ops.lse": ("lse_forward_torch", "lse_backward_torch", "positive_logits_torch"),
    "ds_infcl.ops.triton_lse": ("lse_forward_triton", "lse_backward_triton", "positive_logits_triton"),
}


@contextlib.contextmanager
def _patched(replacements):
    """Set ``owner.name = value`` for each ``(owner, name, value)`` (a module's function, a class's
    attribute); put the originals back on exit."""
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _label_kernel_ops():
    """Wrap the backends' block functions in profiler ranges named ``kernel_op::<name>``."""
    import importlib

    from torch.profiler import record_function

    def labelled(fn, name):
        def wrapped(*a, **kw):
            with record_function("kernel_op::" + name):
                return fn(*a, **kw)
        return wrapped

    replacements = []
    for mod_name, names in _KERNEL_OPS.items():
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # no Triton here
            continue
        replacements += [(mod, name, labelled(getattr(mod, name), name)) for name in names]
    return _patched(replacements)


# Steps of a distributed call timed by --phases: module -> functions looked up there at call time.
_PHASES = {
    "ds_infcl.loss.ring": ("exchange_layout",),
    "ds_infcl.loss.ring_fused": ("all_gather_rows", "reduce_scatter_rows", "run_graphed", "_merge_statistics",
                                 "_gather_payloads", "_share_and_sum", "_weight", "column_weights"),
}


def _timed_phases(spent, calls):
    """Add each step's host seconds to ``spent[name]`` and its calls to ``calls[name]``."""
    import importlib

    from ds_infcl.loss.ring_fused import GatherInfoNCEFunction, RingInfoNCEFunction

    def timed(fn, name):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapped

    replacements = []
    for mod_name, names in _PHASES.items():
        mod = importlib.import_module(mod_name)
        replacements += [(mod, name, timed(getattr(mod, name), name)) for name in names]
    for cls in (GatherInfoNCEFunction, RingInfoNCEFunction):
        for name in ("forward", "backward"):
            fn = vars(cls)[name].__func__
            replacements.append((cls, name, staticmethod(timed(fn, f"{cls.__name__}.{name}"))))
    return _patched(replacements)


def _phases(q, k, s, args, rank, world, label) -> None:
    """``--phases``: per rank, the host time per step of a call (see the module doc)."""
    spent, calls = collections.Counter(), collections.Counter()
    per_call, gpu = [], []
    with _timed_phases(spent, calls):
        for _ in range(args.calls):
            if q.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            _one_call(q, k, s, args.backend, args.tile_size)
            per_call.append((time.perf_counter() - t0) * 1e3)
            if q.is_cuda:
                end.record()
                torch.cuda.synchronize()
                gpu.append(start.elapsed_time(end))
    n = args.calls
    med = sorted(per_call)[n // 2]
    lines = [f"== {label} rank {rank}: host ms per call median {med:.2f}, max {max(per_call):.2f} "
             f"(call {per_call.index(max(per_call))} of {n})"
             + (f"; GPU ms per call (CUDA events) median {sorted(gpu)[n // 2]:.2f}" if gpu else "")]
    lines += [f"   {name:36s} {t / n * 1e3:8.3f} ms/call  ({calls[name] / n:g} calls)"
              for name, t in spent.most_common()]
    for r in range(world):  # one rank after the other
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()


def _inside_kernel_op(e) -> bool:
    while e is not None:
        if e.name.startswith("kernel_op::"):
            return True
        e = e.cpu_parent
    return False


def _profile(q, k, s, backend, calls, tile_size=None):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with _label_kernel_ops(), profile(activities=acts) as prof:
        for _ in range(calls):
            _one_call(q, k, s, backend, tile_size)
        if q.is_cuda:
            torch.cuda.synchronize()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    glue = [e for e in top if not _inside_kernel_op(e)]
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    counts = collections.Counter(e.name for e in glue)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    return (len(aten) / calls, len(top) / calls, len(glue) / calls, launches / calls, counts, table)


def _python_profile(q, k, s, args, rank, label) -> None:
    """Where the host's Python time goes (Triton launchers, autograd, c10d), by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        _one_call(q, k, s, args.backend, args.tile_size)
    prof.disable()
    if q.is_cuda:
        torch.cuda.synchronize()
    if rank == 0:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        print(f"== {label}: cProfile of {args.calls} calls (own time)")
        print(buf.getvalue())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[4096], help="rows per rank")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--backend", default="auto", help='"torch" on CPU; "auto" picks Triton on CUDA')
    p.add_argument("--tile-size", type=int, default=None,
                   help="tile edge of the torch backend (default: the device's; 4096 = the CUDA default)")
    p.add_argument("--algorithms", nargs="+", default=["gather", "ring"])
    p.add_argument("--calls", type=int, default=20, help="timed calls per point")
    p.add_argument("--profiled-calls", type=int, default=5)
    p.add_argument("--detail", action="store_true", help="print the operator counts per call")
    p.add_argument("--cprofile", action="store_true",
                   help="also print the Python functions with the most own time (cProfile, rank 0)")
    p.add_argument("--phases", action="store_true",
                   help="also print, per rank, the host time of each step of a call (no profiler; distributed only)")
    args = p.parse_args(argv)
    if args.phases and "RANK" not in os.environ:
        p.error("--phases times the steps of the distributed call: run under torchrun")

    cuda = torch.cuda.is_available()
    # Under torchrun: the distributed loss, per algorithm. One plain process: the single-device
    # call (the "single" row; issue 17's eager b = 8,192 call), no process group.
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    algorithms = args.algorithms if distributed else ["single"]
    barrier = dist.barrier if distributed else (lambda: None)
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    rows = []
    for b in args.batch:
        gen = torch.Generator().manual_seed(rank)
        q = torch.nn.functional.normalize(torch.randn(b, args.dim, generator=gen), dim=1)
        k = torch.nn.functional.normalize(torch.randn(b, args.dim, generator=gen), dim=1)
        q = q.to(device, dtype).requires_grad_()
        k = k.to(device, dtype).requires_grad_()
        s = torch.tensor(14.3, device=device, requires_grad=True)
        for alg in algorithms:
            if distributed:
                settings.put("DS_INFCL_ALGORITHM", alg)
            for _ in range(3):
                _one_call(q, k, s, args.backend, args.tile_size)
            if cuda:
                torch.cuda.synchronize()
            barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                _one_call(q, k, s, args.backend, args.tile_size)
            host = (time.perf_counter() - t0) / args.calls * 1e3
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.calls * 1e3
            barrier()
            aten, top, glue, launches, counts, table = _profile(q, k, s, args.backend, args.profiled_calls,
                                                                args.tile_size)
            rows.append((alg, b, aten, top, glue, launches, host, wall))
            if args.cprofile:
                _python_profile(q, k, s, args, rank, f"{alg} b={b}")
            if args.phases:
                _phases(q, k, s, args, rank, dist.get_world_size(), f"{alg} b={b}")
            if rank == 0 and args.detail:
                print(f"== {alg} b={b}: top-level aten ops per call outside the backends' block functions")
                for name, n in counts.most_common():
                    print(f"  {n / args.profiled_calls:6.1f}  {name}")
                print(f"== {alg} b={b}: {args.profiled_calls} calls by CPU time")
                print(table)
            settings.put("DS_INFCL_ALGORITHM", None)
    if rank == 0:
        print(f"\nworld {dist.get_world_size() if distributed else 1}, {device.type}, {dtype}, c = {args.dim}, "
              f"backend {args.backend}, "
              f"tile {args.tile_size or 'default'}")
        print("| algorithm | b per rank | aten ops/call | top ops/call | glue ops/call | kernels/call "
              "| host ms/call | wall ms/call |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for alg, b, aten, top, glue, launches, host, wall in rows:
            print(f"| {alg} | {b} | {aten:.0f} | {top:.0f} | {glue:.0f} | {launches:.0f} "
                  f"| {host:.2f} | {wall:.2f} |")
    if distributed:
        from ds_infcl.train.dist import shutdown

        shutdown()
    return 0


if __name__ == "__main__":
    from ds_infcl.train.dist import exit_process

    exit_process(main())  # no interpreter finalization after the group is gone (exit_process says why)
