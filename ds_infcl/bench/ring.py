"""GPU benchmark of the loss across GPUs: the ring (``infcl``) against ``local``, ``disco`` and
``vanilla``, per-GPU memory and time per step, and the ring's weak-scaling efficiency.

Run under torchrun on NCCL (one process per GPU)::

    torchrun --nproc_per_node 2 -m ds_infcl.bench.ring --out docs/bench
    torchrun --nproc_per_node 4 -m ds_infcl.bench.ring --out docs/bench --batch 16384 65536

Every point: symmetric loss (CLIP), per-GPU batch ``b`` queries and ``b`` keys of dim ``c``
(default 512) in bf16, normalized random features, a learnable scale tensor; one step is the loss
forward and backward (``check_finite=False``). Reported per point, over the ranks:

- ``ms``: median time of a step (CUDA events), the slowest rank;
- ``extra_gib``: peak CUDA memory beyond the inputs and their preallocated gradients, from after
  the first step over the rest of the warm-up and one timed step (so the buffers of CUDA graphs
  captured in the warm-up count), the largest rank; with ``--paired``, over each
  implementation's own warm-up;
- ``tflops``: ``8 * b * B * c`` FLOPs per GPU (the work of its share: one forward tile GEMM and
  three backward GEMMs over its ``b`` queries against all ``B`` keys) per second;
- ``weak_eff`` (``infcl``): the single-GPU time of the same loss on the global batch ``W * b``
  (every GPU runs it alone at once, the fastest counts) divided by ``W``, over the ring's time.

``--paired N --base REV`` adds the row ``infcl@REV``: the ``infcl`` loss of another version of
this package (a git revision of this checkout, or a folder holding its ``ds_infcl/``), imported
beside the current one (``ds_infcl.bench.base_tree``) and timed in the same rounds, with its own
single-GPU reference for its weak scaling: a change against the code before it, on one machine
at one time. ``infcl_checked``/``siglip_checked``: the default calls, the input check's cost in one set of rounds.

Baselines materialize float32 logits (they upcast bf16 features for exact gradients); TF32
matmuls are allowed for them unless ``--no-tf32``. Points whose logits would not fit in free
memory are skipped (``skipped``); an out-of-memory error gives ``oom``. Rank 0 writes
``ring_<gpu>_w<W>.csv`` under ``--out`` and prints the table last, then the largest global batch
each implementation ran.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from ds_infcl.bench.ring_table import _backend_label, _fmt, format_table, write_outputs

IMPLS = ("infcl", "infcl_ring", "infcl_gather", "local", "disco", "vanilla", "openclip")
# infcl picks its algorithm by size (ds_infcl.loss.algorithm.choose_algorithm); infcl_ring and
# infcl_gather pin one (DS_INFCL_ALGORITHM) to compare them at every size. The same for SigLIP
# (siglip_loss with a scale and a bias: siglip, siglip_ring, siglip_gather) against OpenCLIP's
# SigLipLoss with its default arguments (siglip_openclip); not run by default.
_PINNED = {"infcl_ring": "ring", "infcl_gather": "gather", "siglip_ring": "ring", "siglip_gather": "gather"}
SIGLIP_IMPLS = ("siglip", "siglip_ring", "siglip_gather", "siglip_openclip")
# infcl with the gather path's own block backward pinned in the forward or in the backward
# (DS_INFCL_GATHER_OWN_BACKWARD_MIN_LOGITS, set on every rank around each call); not run by
# default: the paired comparison of docs/distributed.md, "The own block's backward in the forward".
_OWN_BACKWARD = {"infcl_own_early": 0, "infcl_own_late": 1 << 62}
CHECKED = "_checked"  # infcl_checked, siglip_checked: the default call (check_finite=True); not run by default
CHOICES = IMPLS + tuple(_OWN_BACKWARD) + SIGLIP_IMPLS + ("infcl" + CHECKED, "siglip" + CHECKED)
# The other version's infcl under --base (ds_infcl.bench.base_tree); its table row is infcl@REV.
BASE_IMPL = "infcl_base"

def _logit_bytes(impl: str, b: int, world: int) -> float:
    """Rough peak of the materialized float32 logits and their temporaries (5 matrices)."""
    if impl == "vanilla":
        return 5 * 4 * (world * b) ** 2
    if impl in ("local", "disco"):
        return 5 * 4 * 2 * b * (world * b)
    if impl == "openclip":  # its logits stay in the features' dtype (bf16: 2 bytes)
        return 5 * 2 * 2 * b * (world * b)
    if impl == "siglip_openclip":  # b x b logits per neighbour block (and its backward's), bf16
        return 5 * 2 * b * b * min(world, 2)
    return 0.0


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _all_reduce(value: float, op, group, device=None) -> float:
    """``value`` reduced over ``group`` (a float64 on ``device``, default this script's)."""
    t = torch.tensor([value], device=device or _DEVICE, dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return t.item()


# "cuda" on GPUs (NCCL); "cpu" only for a functional smoke run of this script on gloo
# (``--cpu-smoke``): no memory numbers, wall-clock times.
_DEVICE = "cuda"


def _sync(device=None):
    if torch.device(device or _DEVICE).type == "cuda":
        torch.cuda.synchronize()


def _now_ms() -> float:
    _sync()
    return time.perf_counter() * 1e3


def _openclip_loss(impl, group):
    """``(module, status)``: OpenCLIP's ``ClipLoss`` as its users run it across GPUs
    (``local_loss``, ``gather_with_grad``) or its ``SigLipLoss`` with default arguments; ``None``
    for our impls, or with a status when open_clip is not importable."""
    if impl not in ("openclip", "siglip_openclip"):
        return None, "ok"
    try:
        from open_clip.loss import ClipLoss, SigLipLoss
    except Exception as err:  # noqa: BLE001 - any import failure means the provider is unavailable
        return None, f"skipped (open_clip unavailable: {type(err).__name__})"
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if impl == "siglip_openclip":
        return SigLipLoss(rank=rank, world_size=world), "ok"
    return ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world), "ok"


def _make_step(impl, b, c, dtype, group, args):
    """``(step, status)`` for one (impl, b) point on ``group``: ``step()`` runs one forward and
    backward on fixed inputs (made here), ``None`` with a status when the point is skipped."""
    from ds_infcl.loss import contrastive_loss, siglip_loss

    openclip, status = _openclip_loss(impl, group)
    if status != "ok":
        return None, status
    world = dist.get_world_size(group)
    free = torch.cuda.mem_get_info()[0] if _DEVICE == "cuda" else float("inf")
    need = _logit_bytes(impl, b, world)
    fits = _all_reduce(float(need < 0.9 * free), dist.ReduceOp.MIN, group)
    if not fits:
        return None, f"skipped (~{need / 2**30:.0f} GiB of logits)"
    g = torch.Generator(device=_DEVICE).manual_seed(1234 + dist.get_rank())
    q = torch.nn.functional.normalize(torch.randn(b, c, device=_DEVICE, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(b, c, device=_DEVICE, generator=g), dim=1)
    q, k = q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
    checked, impl = impl.endswith(CHECKED), impl.removesuffix(CHECKED)
    siglip = impl.startswith("siglip")
    scale = torch.tensor(10.0 if siglip else 14.3, device=_DEVICE, requires_grad=True)
    bias = torch.tensor(-10.0, device=_DEVICE, requires_grad=True)  # (SigLIP's)
    q.grad, k.grad, scale.grad, bias.grad = (torch.zeros_like(x) for x in (q, k, scale, bias))
    # check_finite=False unless --check-finite or a *_checked impl (the default call)
    checks = {} if checked or getattr(args, "check_finite", False) else {"check_finite": False}
    pinned, own_min = _PINNED.get(impl), _OWN_BACKWARD.get(impl)
    if impl == BASE_IMPL:  # the other version's loss (--base), as its users call it
        loss_fn, impl = importlib.import_module(f"{args.base_module.__name__}.loss").contrastive_loss, "infcl"
    else:
        loss_fn = contrastive_loss
    if (pinned is not None or own_min is not None) and not siglip:
        impl = "infcl"
    from ds_infcl import settings
    from ds_infcl.loss import algorithm

    def step():
        if openclip is not None:
            loss = openclip(q, k, scale, bias) if siglip else openclip(q, k, scale)
        elif siglip:
            with settings.override("DS_INFCL_ALGORITHM", pinned) if pinned is not None else contextlib.nullcontext():
                loss = siglip_loss(q, k, scale, bias, backend=args.backend, group=group, **checks)
        else:
            pin = settings.override("DS_INFCL_ALGORITHM", pinned) if pinned is not None else contextlib.nullcontext()
            saved_min = algorithm.GATHER_OWN_BACKWARD_MIN_LOGITS
            if own_min is not None:  # (read in the forward, which decides for the backward)
                algorithm.GATHER_OWN_BACKWARD_MIN_LOGITS = own_min
            try:
                with pin:
                    loss = loss_fn(q, k, scale, symmetric=True, impl=impl, backend=args.backend, group=group,
                                   **checks)
            finally:
                algorithm.GATHER_OWN_BACKWARD_MIN_LOGITS = saved_min
        loss.backward()

    return step, "ok"


def _timed(step) -> float:
    """Milliseconds of one isolated step: CUDA events around it, then a synchronize."""
    if _DEVICE != "cuda":
        t0 = _now_ms()
        step()
        return _now_ms() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


# --quick: the isolated steps timed after one warm-up step (issue 37's measurement).
QUICK_CALLS = 3

# Warm-up steps every point takes at least: the first compiles the kernels, the second captures
# the CUDA graphs of the gather path (ds_infcl.ops.infonce_graph), the third replays them.
MIN_WARMUP_STEPS = 3


def _warm_up(step, group, args, after_first=None) -> None:
    """``warm_up_steps`` with ``--warmup`` and ``--warmup-seconds`` on this script's device."""
    warm_up_steps(step, steps=args.warmup, seconds=args.warmup_seconds, device=_DEVICE, group=group,
                  after_first=after_first)


def warm_up_steps(step, *, steps: int, seconds: float, device, group=None, after_first=None) -> int:
    """Run ``step()`` at least ``steps`` times (and ``MIN_WARMUP_STEPS``), and for ``seconds`` after
    the first (the first point of a process otherwise carries NCCL's and the allocator's first-use
    costs into its times); returns the count. The ranks of ``group`` agree after each step (an
    all-reduce on ``device``), so they run the same number of them (a rank that ran one more would
    post collectives nobody answers). ``after_first()`` runs after the first step. Why the minimum
    and the clock from the first: a first step that compiled for longer than ``seconds`` ended the
    warm-up there, so the graphs were captured in the timed steps and the extra-memory column,
    taken over the warm-up, read 0.00 GiB (``--paired`` at 4k and 8k rows per GPU, 2 x H100,
    2026-11-26). Shared with ``ds_infcl.bench.ring_trace``."""
    n_warm = 0
    t_warm = None
    while True:
        step()
        n_warm += 1
        _sync(device)
        if n_warm == 1:
            t_warm = time.perf_counter()
            if after_first is not None:
                after_first()
        more = n_warm < max(steps, MIN_WARMUP_STEPS) or time.perf_counter() - t_warm < seconds
        if not _all_reduce(float(more), dist.ReduceOp.MAX, group, device):
            return n_warm


def _memory_probe():
    """``(start, extra_gib)``: ``start()`` (a warm-up's ``after_first``) takes the allocated bytes
    as the base and resets the peak; ``extra_gib()`` is the peak beyond that base since, in GiB
    (NaN off CUDA). From after the first step (it compiles), over the rest of the warm-up and
    what follows: CUDA graphs captured on a later step hold their buffers from then on, so they
    count, as in bench.loss."""
    base = [0]

    def start():
        if _DEVICE == "cuda":
            base[0] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def extra_gib():
        if _DEVICE != "cuda":
            return float("nan")
        return (torch.cuda.max_memory_allocated() - base[0]) / 2**30

    return start, extra_gib


def run_point(impl, b, c, dtype, group, args):
    """One (impl, b) point on ``group``: (median ms, extra GiB, status), reduced over the group."""
    from ds_infcl.ops.infonce_graph import clear_graphs

    # Each point starts without cached CUDA graphs, as a training run of one shape would: the
    # cache keeps the first shapes' graphs (MAX_GRAPHS) and would run later points eagerly.
    clear_graphs()
    status, ms, extra = "ok", float("nan"), float("nan")
    oom = torch.cuda.OutOfMemoryError if _DEVICE == "cuda" else MemoryError
    step = None
    start_memory, extra_gib = _memory_probe()
    try:
        step, status = _make_step(impl, b, c, dtype, group, args)
        if step is None:
            return float("nan"), float("nan"), status
        if args.quick:  # issue 37's method: one warm-up step, the median of three (graphs captured in them)
            step()
            _sync()
            start_memory()
            times = [_timed(step) for _ in range(QUICK_CALLS)]
            extra, ms = extra_gib(), _quantile(times, 0.5)
        else:
            _warm_up(step, group, args, after_first=start_memory)
            first = _timed(step)  # (its memory counts too)
            extra = extra_gib()
            # The same count on every rank (each step is collective): from the slowest rank's first.
            first = _all_reduce(first, dist.ReduceOp.MAX, group)
            reps = int(max(args.min_reps, min(args.reps, args.seconds_per_point * 1e3 / max(first, 1e-3))))
            ms = _quantile([_timed(step) for _ in range(reps)], 0.5)
    except oom:
        status = "oom"
    step = None
    if _DEVICE == "cuda":
        torch.cuda.empty_cache()
    ok = _all_reduce(float(status == "ok"), dist.ReduceOp.MIN, group)
    if not ok:
        return float("nan"), float("nan"), "oom"
    return (_all_reduce(ms, dist.ReduceOp.MAX, group), _all_reduce(extra, dist.ReduceOp.MAX, group),
            "ok")


def run_paired(b, impls, c, dtype, solo, args):
    """``--paired``: every implementation at per-GPU batch ``b`` and the single-GPU reference
    (``infcl`` at ``W b`` on each rank alone, ``solo``) timed in one process, in ``--paired``
    rounds of ``--paired-calls`` isolated steps each, the order rotating every round, so that the
    machine's drift over a run falls on all of them alike. ``{impl: (median ms, extra GiB,
    status)}``, the slowest rank's median for the distributed points and the fastest rank's for
    the reference (key ``"single"``), as the unpaired points are reduced; the extra memory as
    ``run_point`` measures it, over each variant's own warm-up (after its first step: the others'
    inputs and graphs are then part of the base); ``"algorithm"``: the one ``infcl`` chose.
    Separate runs of one point spread by 0.3 ms at 16k rows per GPU and by more than the two
    losses differ at 4k (2 x H100, docs/distributed.md); paired, the differences stand out."""
    from ds_infcl.ops import infonce_graph

    world = dist.get_world_size()
    variants = [(impl, None, b) for impl in impls]
    if world > 1 and not args.no_weak_scaling and any(i.startswith("infcl") for i in impls):
        variants.append(("single", solo, world * b))
        if BASE_IMPL in impls:  # the other version's own single-GPU reference
            variants.append(("single_base", solo, world * b))
    graph_modules = [infonce_graph]
    if BASE_IMPL in impls:
        graph_modules.append(importlib.import_module(f"{args.base_module.__name__}.ops.infonce_graph"))
    for module in graph_modules:
        module.clear_graphs()
    # Every variant keeps the graphs it would capture alone (each infcl variant up to MAX_GRAPHS).
    saved_max = [module.MAX_GRAPHS for module in graph_modules]
    for module, most in zip(graph_modules, saved_max):
        module.MAX_GRAPHS = most * max(1, len(variants))
    oom = torch.cuda.OutOfMemoryError if _DEVICE == "cuda" else MemoryError
    steps, out, extra = {}, {}, {}
    try:
        for name, group, rows in variants:
            status = "oom"
            start_memory, extra_gib = _memory_probe()
            try:
                impl = {"single": "infcl", "single_base": BASE_IMPL}.get(name, name)
                step, status = _make_step(impl, rows, c, dtype, group, args)
                if step is not None:
                    _warm_up(step, group, args, after_first=start_memory)
                    extra[name] = extra_gib()
                    if name == "infcl":
                        from ds_infcl.loss.ring import last_algorithm

                        out["algorithm"] = last_algorithm()
                    elif name == "siglip":
                        from ds_infcl.loss.siglip import last_siglip_algorithm

                        out["algorithm_siglip"] = last_siglip_algorithm()
            except oom:
                step, status = None, "oom"
            # Every rank must agree before the rounds: a variant one rank dropped is dropped by all.
            if not _all_reduce(float(step is not None and status == "ok"), dist.ReduceOp.MIN, None):
                out[name] = (float("nan"), float("nan"), status if status != "ok" else "oom")
                continue
            steps[name] = step
        times = {name: [] for name in steps}
        names = list(steps)
        for r in range(args.paired):
            for name in names[r % len(names):] + names[: r % len(names)] if names else ():
                _all_reduce(0.0, dist.ReduceOp.MAX, None)  # start each block together
                times[name] += [_timed(steps[name]) for _ in range(args.paired_calls)]
        for name in names:
            med = _quantile(times[name], 0.5)
            op = dist.ReduceOp.MIN if name.startswith("single") else dist.ReduceOp.MAX
            out[name] = (_all_reduce(med, op, None), _all_reduce(extra[name], dist.ReduceOp.MAX, None), "ok")
    finally:
        for module, most in zip(graph_modules, saved_max):
            module.MAX_GRAPHS = most
            module.clear_graphs()
        steps = None
        if _DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=CHOICES)
    ap.add_argument("--batch", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072],
                    help="per-GPU batch sizes")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--warmup", type=int, default=MIN_WARMUP_STEPS,
                    help=f"warm-up steps per point (at least; never fewer than {MIN_WARMUP_STEPS})")
    ap.add_argument("--warmup-seconds", type=float, default=0.5,
                    help="warm-up time per point after its first step (at least)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--seconds-per-point", type=float, default=3.0)
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="time every impl and the single-GPU reference in the same rounds, ROUNDS of them, "
                         "the order rotating (the paired comparison; memory over each impl's warm-up)")
    ap.add_argument("--paired-calls", type=int, default=12, help="isolated steps per impl and round (--paired)")
    ap.add_argument("--base", default=None, metavar="REV_OR_FOLDER",
                    help="with --paired: also time infcl of another version of this package (a git revision "
                         "of this checkout, or a folder holding its ds_infcl/) in the same rounds, as infcl@REV")
    ap.add_argument("--no-weak-scaling", action="store_true", help="skip the single-GPU runs")
    ap.add_argument("--quick", action="store_true",
                    help=f"one warm-up step, then the median of {QUICK_CALLS} isolated steps per point (issue 37's "
                         "method: CUDA graphs are captured in the first timed step)")
    ap.add_argument("--check-finite", action="store_true",
                    help="call our losses with check_finite=True (their default: one readback per call); "
                         "without it, check_finite=False (the *_checked impls always check)")
    ap.add_argument("--no-tf32", action="store_true")
    ap.add_argument("--out", default=None, help="folder for the CSV (rank 0)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run on CPU processes with gloo (checks the script, not the numbers)")
    args = ap.parse_args(argv)
    if args.base is not None and not args.paired:
        ap.error("--base compares the two versions in the same rounds: add --paired ROUNDS")
    if args.quick and args.paired:
        ap.error("--quick times each point alone; leave out --paired")
    impls = list(args.impls)
    args.base_module = None
    if args.base is not None:
        from ds_infcl.bench.base_tree import load_base

        try:  # before the process group: a bad --base stops every rank alike, at once
            args.base_module = load_base(args.base)
        except ValueError as err:
            ap.error(str(err))
        impls.append(BASE_IMPL)

    global _DEVICE
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu_smoke:
        _DEVICE = "cpu"
        dist.init_process_group("gloo")
        device_name = "cpu-smoke"
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        torch.backends.cuda.matmul.allow_tf32 = not args.no_tf32
        device_name = torch.cuda.get_device_name()
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    solo, _ = dist.new_subgroups(group_size=1)  # every rank alone: the single-GPU reference
    from ds_infcl.ops import resolve_backend

    backend = resolve_backend(args.backend, torch.device(_DEVICE))
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-")
    rows = []
    single_ms = {}
    for b in args.batch:
        paired = run_paired(b, impls, args.dim, dtype, solo, args) if args.paired else None
        if paired is not None:
            paired_algorithm = paired.pop("algorithm", None)
            paired_siglip_algorithm = paired.pop("algorithm_siglip", None)
            if "single" in paired:
                single_ms[b] = paired["single"][0]
        for impl in impls:
            if paired is not None:
                ms, extra, status = paired[impl]
            else:
                ms, extra, status = run_point(impl, b, args.dim, dtype, None, args)
            single = eff = float("nan")
            if impl.startswith("infcl") and status == "ok" and world > 1 and not args.no_weak_scaling:
                if b not in single_ms:  # one single-GPU run per b, shared by the infcl variants
                    s_ms, _, s_status = run_point("infcl", world * b, args.dim, dtype, solo, args)
                    # Ranks ran alone: agree on the status before reducing the times (no hang).
                    ok = _all_reduce(float(s_status == "ok"), dist.ReduceOp.MIN, None)
                    single_ms[b] = _all_reduce(s_ms, dist.ReduceOp.MIN, None) if ok else float("nan")
                single = single_ms[b] if impl != BASE_IMPL else paired.get("single_base", (float("nan"),))[0]
                eff = single / world / ms
            flops = 8 * b * world * b * args.dim
            name = impl if impl != BASE_IMPL else f"infcl@{args.base_module._base_label}"
            row = dict(gpu=gpu, date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), world=world,
                       impl=name, b=b, global_batch=world * b, c=args.dim, dtype=args.dtype,
                       backend=_backend_label(impl, backend),
                       ms=ms,
                       extra_gib=extra, tflops=flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan"),
                       single_gpu_ms=single, weak_eff=eff, status=status)
            if impl == "infcl" and world > 1:
                from ds_infcl.loss.ring import last_algorithm

                # the algorithm auto chose (paired: recorded after infcl's own warm-up)
                chosen = paired_algorithm if paired is not None else last_algorithm()
                row["status"] = f"{status} ({chosen})"
            elif impl == "siglip" and world > 1:
                from ds_infcl.loss.siglip import last_siglip_algorithm

                chosen = paired_siglip_algorithm if paired is not None else last_siglip_algorithm()
                row["status"] = f"{status} ({chosen})"
            if paired is not None:
                row["status"] += f" (paired, {args.paired} x {args.paired_calls} calls)"
            rows.append(row)
            if rank == 0:
                print(f"[{impl} b={b}] {row['status']} ms={_fmt(ms, '.1f')} extra={_fmt(extra, '.2f')} GiB "
                      f"eff={_fmt(eff, '.2f')}", flush=True)
    if rank == 0:
        if args.out:
            write_outputs(rows, args.out, f"ring_{gpu}_w{world}")
        print(f"\n{world} x {device_name}, c = {args.dim}, {args.dtype}, symmetric, "
              f"ring backend {backend}, torch {torch.__version__}")
        print(format_table(rows))
    from ds_infcl.train.dist import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    from ds_infcl.train.dist import exit_process

    exit_process(main())  # no interpreter finalization after the group is gone (exit_process says why)
