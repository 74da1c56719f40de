"""Per-rank timing and kernel timeline of the distributed InfoNCE or SigLIP loss, to find where a slow
rank waits, or where the GPU idles in a call.

    torchrun --nproc_per_node 2 ds_infcl/bench/ring_trace.py --batch 131072 --algorithm ring --out runs/trace

Every rank times ``--reps`` calls of the symmetric loss (``--loss siglip``: ``siglip_loss``), forward
+ backward (as ``bench.ring`` runs it: bf16 on CUDA, c = ``--dim``, normalized random features,
``check_finite=False``; ``--check default``: the default call, with its input check read before it
returns; ``--check queued``: the check computed and left unread, as the trainer queues it) with CUDA
events and prints its own list of milliseconds per call (``bench.ring`` reports the slowest rank's
median only). Then it profiles three more calls with ``torch.profiler`` and writes, per rank, a
Chrome trace (``<loss>_<tag>_b<B>_rank<r>.json``) and a text timeline (``..._kernels.txt``): every
NCCL kernel and every LSE forward block with its start and duration, and the device time per call
of the heaviest kernels (the mean of the three). A forward block that takes twice its usual time on one rank, spanned by
an NCCL kernel, is an SM held by a P2P kernel that waits for the peer.

Then, for the second and third profiled calls (the first carries the profiler's start-up), where
the GPU sat idle (:func:`idle_gaps`): the call's host time, the
span of its GPU work, the time that work kept the GPU busy (the union over streams), and the
largest gaps, each with the activity after it, how far into the gap the host launched that
activity (a launch late in the gap: the GPU waited for the host; early: for a dependency, an
event or a peer) and what the host ran at that launch: the operators, or with ``--stack`` the
Python frames of ``ds_infcl`` (which slow the host several times: read the names, not the sizes).

Run by path (not ``-m``), the script imports ``ds_infcl`` from ``PYTHONPATH``, so an older tree
(``git archive <commit> ds_infcl | tar -x -C old``) can be timed with the same script:
``PYTHONPATH=old torchrun ... ds_infcl/bench/ring_trace.py --tag old``. On CPU it runs with gloo
and the torch backend (timings only, no kernel timeline).
"""

import argparse
import bisect
import collections
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def _frames_at(frames, ts, limit=3):
    """The innermost ``limit`` Python frames of ds_infcl (``file(line): name``) around ``ts``; without
    Python frames in the trace (no ``--stack``), the innermost operators (``cpu_op``, user ranges)."""
    around = [f for f in frames if f["ts"] <= ts <= f["ts"] + f.get("dur", 0)]
    inner = [f for f in around if f.get("cat") == "python_function" and "ds_infcl" in f["name"]]
    if not inner:
        inner = [f for f in around if f.get("cat") != "python_function"]
    inner.sort(key=lambda f: f.get("dur", 0))
    return " < ".join(f["name"].split("ds_infcl/")[-1] for f in inner[:limit]) or "-"


def idle_gaps(events, window, top=8):
    """Where the GPU idled during one call: ``events`` are a Chrome trace's ``traceEvents`` (as
    ``torch.profiler`` exports them; the launching frames are Python's with ``with_stack=True``,
    else the operators), ``window`` the call's
    host interval ``(ts0, ts1)`` in the trace's microseconds. The GPU activities (kernels, copies,
    memsets) of the call are those launched inside the window. Returns a dict: ``host_us`` (the
    window), ``span_us`` (first GPU start to last GPU end), ``busy_us`` (their union over
    streams), ``idle_us`` (span - busy), ``lead_us`` (call start to the first GPU start) and
    ``gaps``: the ``top`` largest idle intervals as ``(gap_us, before, after, launch_into_gap_us,
    frames)``, where ``launch_into_gap_us`` is when the host launched ``after``, counted from the
    gap's start (negative: launched before the GPU went idle)."""
    ts0, ts1 = window
    launches = {}
    for e in events:
        if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    acts = []
    for e in events:
        if e.get("cat") not in _GPU_CATS or e.get("ph") != "X":
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None and ts0 <= launch["ts"] <= ts1:
            acts.append((e["ts"], e["ts"] + e.get("dur", 0), e["name"], launch))
    out = {"host_us": ts1 - ts0, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "lead_us": 0.0, "gaps": []}
    if not acts:
        return out
    acts.sort(key=lambda a: a[0])
    frames = sorted((e for e in events if e.get("cat") in ("python_function", "cpu_op", "user_annotation")
                     and e.get("ph") == "X" and not e["name"].startswith("ds_infcl_trace_call")),
                    key=lambda f: f["ts"])
    starts = [f["ts"] for f in frames]
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = acts[0][0], acts[0][1], acts[0][2]
    for start, end, name, launch in acts[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            near = frames[:bisect.bisect_right(starts, launch["ts"])]
            near = [f for f in near if f["tid"] == launch["tid"]][-400:]
            gaps.append((start - cur_end, cur_name, name, launch["ts"] - cur_end, _frames_at(near, launch["ts"])))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = cur_end - acts[0][0]
    out.update(span_us=span, busy_us=busy, idle_us=span - busy, lead_us=acts[0][0] - ts0,
               gaps=sorted(gaps, reverse=True)[:top])
    return out


def format_gaps(tag, i, g):
    """Lines for one call's :func:`idle_gaps`."""
    lines = [f"{tag} call {i}: host {g['host_us'] / 1e3:.2f} ms, GPU span {g['span_us'] / 1e3:.2f} ms, busy "
             f"{g['busy_us'] / 1e3:.2f} ms, idle {g['idle_us'] / 1e3:.2f} ms; first GPU work "
             f"{g['lead_us'] / 1e3:.2f} ms after the call began"]
    for gap, before, after, into, frames in g["gaps"]:
        lines.append(f"{tag}   gap {gap:7.1f} us  {before[:34]:34s} -> {after[:34]:34s} launched "
                     f"{into:+8.1f} us into it, from {frames}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=131072, help="rows per rank")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--algorithm", choices=["auto", "ring", "gather"], default="auto",
                   help="DS_INFCL_ALGORITHM for these calls")
    p.add_argument("--loss", choices=["infonce", "siglip"], default="infonce",
                   help="contrastive_loss (symmetric InfoNCE) or siglip_loss (with SigLIP's bias)")
    p.add_argument("--check", choices=["off", "default", "queued"], default="off",
                   help="the input check: off (check_finite=False), default (the default call: computed, "
                        "copied and read before the call returns) or queued (computed and left unread, as the "
                        "trainer queues it inside deferred_value_checks)")
    p.add_argument("--tag", default="run", help="names the output files and prefixes every line")
    p.add_argument("--out", default="runs/ring_trace")
    p.add_argument("--warmup-seconds", type=float, default=0.5,
                   help="warm-up time after the first call (at least three calls: compile, capture, replay)")
    p.add_argument("--stack", action="store_true",
                   help="record Python frames (names the code behind each gap; slows the host several times)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run under torchrun (one process per GPU), e.g. torchrun --nproc_per_node 2 ds_infcl/bench/ring_trace.py")

    import ds_infcl
    from ds_infcl import settings
    from ds_infcl.bench.ring import MIN_WARMUP_STEPS, warm_up_steps
    from ds_infcl.loss import contrastive_loss, siglip_loss
    from ds_infcl.ops.validation import deferred_value_checks

    settings.put("DS_INFCL_ALGORITHM", args.algorithm)  # for every call of this run
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    os.makedirs(args.out, exist_ok=True)
    tag = f"[{args.tag}] rank {rank}"
    print(f"{tag} ds_infcl from {os.path.dirname(ds_infcl.__file__)}", flush=True)

    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    dtype = torch.bfloat16 if cuda else torch.float32

    def features():
        x = torch.randn(args.batch, args.dim, device=device, generator=gen)
        return torch.nn.functional.normalize(x, dim=1).to(dtype).requires_grad_()

    q, k = features(), features()
    siglip = args.loss == "siglip"
    scale = torch.tensor(10.0 if siglip else 14.3, device=device, requires_grad=True)
    bias = torch.tensor(-10.0, device=device, requires_grad=True)
    backend = "auto" if cuda else "torch"
    checks = {"check_finite": False} if args.check == "off" else {}
    queued = deferred_value_checks if args.check == "queued" else contextlib.nullcontext

    def call():
        with queued():
            if siglip:
                loss = siglip_loss(q, k, scale, bias, backend=backend, **checks)
            else:
                loss = contrastive_loss(q, k, scale, symmetric=True, impl="infcl", backend=backend, **checks)
        loss.backward()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm_up_steps(call, steps=MIN_WARMUP_STEPS, seconds=args.warmup_seconds, device=device)
    dist.barrier()
    ms = []
    for _ in range(args.reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            sync()
            ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            ms.append((time.perf_counter() - t0) * 1e3)
    print(f"{tag} b {args.batch} ms per call: {[round(x, 1) for x in ms]}", flush=True)
    dist.barrier()

    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    with profile(activities=activities, with_stack=args.stack) as prof:
        for i in range(3):  # the first profiled call carries the profiler's own start-up
            with record_function(f"ds_infcl_trace_call{i}"):
                call()
                sync()
    stem = os.path.join(args.out, f"{args.loss}_{args.tag}_b{args.batch}_rank{rank}")
    prof.export_chrome_trace(stem + ".json")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    t0 = min((e.time_range.start for e in kernels), default=0)
    lines, per_call = [], collections.Counter()
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        dur = e.time_range.elapsed_us() / 1e3
        per_call[e.name[:60]] += dur / 3
        if "nccl" in e.name.lower() or "_lse_fwd" in e.name or dur > 5:
            lines.append(f"{tag} {e.name[:48]:48s} start {(e.time_range.start - t0) / 1e3:9.2f} ms dur {dur:8.2f} ms")
    summary = [f"{tag} per call {name:60s} {v:8.2f} ms" for name, v in per_call.most_common(12)]
    if cuda:
        with open(stem + ".json") as f:
            events = json.load(f)["traceEvents"]
        for i in (1, 2):
            win = [e for e in events if e.get("name") == f"ds_infcl_trace_call{i}" and e.get("cat") == "user_annotation"]
            if win:
                summary += format_gaps(tag, i, idle_gaps(events, (win[0]["ts"], win[0]["ts"] + win[0]["dur"])))
    with open(stem + "_kernels.txt", "w") as f:
        f.write("\n".join(lines + summary) + "\n")
    if summary:
        print("\n".join(summary), flush=True)
    from ds_infcl.train.dist import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    from ds_infcl.train.dist import exit_process

    exit_process(main())  # no interpreter finalization after the group is gone (exit_process says why)
