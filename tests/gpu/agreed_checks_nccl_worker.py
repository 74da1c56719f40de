"""Worker of ``test_ring_fused_nccl.py``'s agreed-checks test (run by torchrun, one process per
GPU): the default distributed call (``check_finite=True``) of InfoNCE and SigLIP, by the gather path
and the ring, with the Triton kernels on NCCL. Its input checks are agreed by every rank in one
all-gather after the layout exchange and read once the forward is queued
(``ds_infcl.ring.agree_on_value_checks``): a call makes no synchronizing CUDA operation; NaN rows on
rank 1 raise there with its own count and on every other rank with an error that names rank 1; the
next good call equals the call with ``check_finite=False``. Exit status 1 on any failure."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from ds_infcl.loss import contrastive_loss, siglip_loss

CALLS = {
    "infonce": lambda q, k, **kw: contrastive_loss(q, k, 10.0, symmetric=True, **kw),
    "siglip": lambda q, k, **kw: siglip_loss(q, k, 10.0, -10.0, **kw),
}


def _syncs(fn) -> int:
    """How many synchronizing CUDA operations ``fn()`` makes (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing" in str(w.message) for w in caught)


def check(rank, device, name, algorithm):
    os.environ["DS_INFCL_ALGORITHM"] = algorithm
    call = CALLS[name]
    g = torch.Generator().manual_seed(7 + rank)
    q = torch.nn.functional.normalize(torch.randn(4096, 512, generator=g), dim=1).to(device, torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(4096, 512, generator=g), dim=1).to(device, torch.bfloat16)
    for _ in range(3):  # (the host channel's setup, the CUDA graphs' capture)
        call(q, k).item()
    syncs = _syncs(lambda: call(q, k))
    bad = q.clone()
    if rank == 1:
        bad[[5, 4000]] = float("nan")
    try:
        call(bad, k)
        msg = "no error"
    except ValueError as err:
        msg = str(err)
    want = ("query has 2 of 4096 rows with NaN or Inf" if rank == 1
            else "rank(s) [1] of the process group rejected their local inputs")
    good, unchecked = call(q, k).item(), call(q, k, check_finite=False).item()
    ok = syncs == 0 and want in msg and good == unchecked
    return ok, f"{name} {algorithm} rank {rank}: {syncs} syncs, error {msg[:90]!r}, loss {good:.6f} / {unchecked:.6f}"


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    failed = 0
    for name in CALLS:
        for algorithm in ("gather", "ring"):
            ok, line = check(rank, device, name, algorithm)
            flag = torch.tensor([float(not ok)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed += int(flag.item())
            print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
