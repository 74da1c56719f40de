"""What the gather path's transfers cost between the GPUs of one host, alone and beside a matmul.

    torchrun --nproc_per_node 2 -m ds_infcl.bench.comm_probe --batch 16384 --dim 512

Times (median of ``--reps``, CUDA events; the host's clock on CPU), for ``b`` rows per rank:

- the keys' all-gather (``[b, c]`` per rank, ``--dtype``), the float32 reduce-scatter of their
  gradient (``[W b, c]``) and a small all-gather (the column statistics of one rank);
- a ``b x W b x c`` matmul alone, and with the keys' all-gather issued on a side stream just
  before it (how much an NCCL collective overlaps a kernel that fills the GPU);
- on CUDA with 2 ranks, the same keys pulled from the peer's symmetric memory
  (``torch.distributed._symmetric_memory``) by a device-to-device copy, with and without the
  barriers that make it safe, alone and beside the matmul.

Rank 0 prints one table. On CPU (gloo) only the collectives are timed. Issue 17's 2 x H200 numbers
and what they mean for the gather path are in docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from ds_infcl.bench.loss import _time
from ds_infcl.ring.layout import all_gather_single, reduce_scatter_single


def _median(fn, reps, cuda):
    """Median ms of ``fn`` after a warm-up, the ranks starting together (CUDA events on CUDA)."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        times = _time(fn, reps, 0)
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16384, help="rows per rank")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run under torchrun, one process per GPU: torchrun --nproc_per_node 2 -m ds_infcl.bench.comm_probe")
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        dev = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    b, c, dtype = args.batch, args.dim, getattr(torch, args.dtype)
    keys = torch.randn(b, c, device=dev).to(dtype if cuda else torch.float32)
    keys_all = torch.empty(world * b, c, device=dev, dtype=keys.dtype)
    grad_all = torch.randn(world * b, c, device=dev)
    grad_mine = torch.empty(b, c, device=dev)
    stats = torch.randn(world * b, device=dev)
    stats_all = torch.empty(world * world * b, device=dev)
    rows = [
        (f"all-gather of the keys [{b}, {c}] {keys.dtype}".replace("torch.", ""),
         _median(lambda: all_gather_single(keys_all, keys), args.reps, cuda)),
        (f"reduce-scatter of their gradient [{world * b}, {c}] float32",
         _median(lambda: reduce_scatter_single(grad_mine, grad_all), args.reps, cuda)),
        (f"all-gather of column statistics [{world * b}] float32",
         _median(lambda: all_gather_single(stats_all, stats), args.reps, cuda)),
    ]
    if cuda:
        a, kt = keys, keys_all
        side = torch.cuda.Stream()

        def matmul():
            torch.mm(a, kt.t())

        def beside(transfer):
            def both():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    transfer()
                matmul()
                torch.cuda.current_stream().wait_stream(side)
            return both

        rows.append((f"matmul {b} x {world * b} x {c} alone", _median(matmul, args.reps, cuda)))
        rows.append(("matmul + the keys' all-gather on a side stream",
                     _median(beside(lambda: all_gather_single(keys_all, keys)), args.reps, cuda)))
        if world == 2:
            try:
                import torch.distributed._symmetric_memory as symm

                buf = symm.empty(b * c, dtype=keys.dtype, device=dev)
                handle = symm.rendezvous(buf, dist.group.WORLD)
                peer = handle.get_buffer(1 - rank, (b, c), keys.dtype)
                dst = torch.empty(b, c, device=dev, dtype=keys.dtype)

                def pull():
                    dst.copy_(peer)

                def pull_safe():
                    handle.barrier()
                    dst.copy_(peer)
                    handle.barrier()

                rows.append(("peer keys by copy from symmetric memory", _median(pull, args.reps, cuda)))
                rows.append(("  ... with a barrier before and after", _median(pull_safe, args.reps, cuda)))
                rows.append(("  barrier alone", _median(lambda: handle.barrier(), args.reps, cuda)))
                rows.append(("matmul + the copy on a side stream", _median(beside(pull), args.reps, cuda)))
                rows.append(("matmul + the copy with barriers on a side stream",
                             _median(beside(pull_safe), args.reps, cuda)))
            except Exception as err:  # noqa: BLE001 - report what this torch/driver cannot do
                rows.append((f"symmetric memory unavailable: {type(err).__name__}: {str(err)[:120]}", float("nan")))
    if rank == 0:
        where = torch.cuda.get_device_name() if cuda else "cpu (gloo)"
        print(f"{world} x {where}, torch {torch.__version__}, NCCL_PROTO={os.environ.get('NCCL_PROTO', '-')}")
        print("| transfer | ms (median) |\n| --- | --- |")
        for name, ms in rows:
            print(f"| {name} | {ms:.3f} |")
    from ds_infcl.train.dist import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    from ds_infcl.train.dist import exit_process

    exit_process(main())  # no interpreter finalization after the group is gone (exit_process says why)
