"""Per-rank timing and kernel timeline of the distributed InfoNCE, to find where a slow rank waits.

    torchrun --nproc_per_node 2 ds_infcl/bench/ring_trace.py --batch 131072 --algorithm ring --out runs/trace

Every rank times ``--reps`` calls of the symmetric loss, forward + backward (as ``bench.ring``
runs it: bf16 on CUDA, c = ``--dim``, normalized random features, ``check_finite=False``) with CUDA
events and prints its own list of milliseconds per call (``bench.ring`` reports the slowest rank's
median only). Then it profiles two more calls with ``torch.profiler`` and writes, per rank, a
Chrome trace (``ring_<tag>_b<B>_rank<r>.json``) and a text timeline (``..._kernels.txt``): every
NCCL kernel and every LSE forward block with its start and duration, and the device time per call
of the heaviest kernels. A forward block that takes twice its usual time on one rank, spanned by
an NCCL kernel, is an SM held by a P2P kernel that waits for the peer.

Run by path (not ``-m``), the script imports ``ds_infcl`` from ``PYTHONPATH``, so an older tree
(``git archive <commit> ds_infcl | tar -x -C old``) can be timed with the same script:
``PYTHONPATH=old torchrun ... ds_infcl/bench/ring_trace.py --tag old``. On CPU it runs with gloo
and the torch backend (timings only, no kernel timeline).
"""

import argparse
import collections
import os
import time

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=131072, help="rows per rank")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--algorithm", choices=["auto", "ring", "gather"], default="auto",
                   help="DS_INFCL_ALGORITHM for these calls")
    p.add_argument("--tag", default="run", help="names the output files and prefixes every line")
    p.add_argument("--out", default="runs/ring_trace")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run under torchrun (one process per GPU), e.g. torchrun --nproc_per_node 2 ds_infcl/bench/ring_trace.py")

    import ds_infcl
    from ds_infcl.loss import contrastive_loss

    os.environ["DS_INFCL_ALGORITHM"] = args.algorithm
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
    scale = torch.tensor(14.3, device=device, requires_grad=True)
    backend = "auto" if cuda else "torch"

    def call():
        contrastive_loss(q, k, scale, symmetric=True, impl="infcl", backend=backend,
                         check_finite=False).backward()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):
        call()
    sync()
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

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            call()
            sync()
    stem = os.path.join(args.out, f"ring_{args.tag}_b{args.batch}_rank{rank}")
    prof.export_chrome_trace(stem + ".json")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    t0 = min((e.time_range.start for e in kernels), default=0)
    lines, per_call = [], collections.Counter()
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        dur = e.time_range.elapsed_us() / 1e3
        per_call[e.name[:60]] += dur / 2
        if "nccl" in e.name.lower() or "_lse_fwd" in e.name or dur > 5:
            lines.append(f"{tag} {e.name[:48]:48s} start {(e.time_range.start - t0) / 1e3:9.2f} ms dur {dur:8.2f} ms")
    lines += [f"{tag} per call {name:60s} {v:8.2f} ms" for name, v in per_call.most_common(12)]
    with open(stem + "_kernels.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    if lines:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
