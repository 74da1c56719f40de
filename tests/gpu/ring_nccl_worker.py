"""Worker of ``test_ring_nccl.py``: the ring losses (InfoNCE and SigLIP) on NCCL, one process per GPU (run by torchrun).

Every rank draws the whole global batch from the case's seed (so no gather is needed for the
reference), runs its share through ``contrastive_loss(..., group=world)`` on its GPU and compares
with the float64 materialized loss of the global batch on the same GPU: the loss on every rank,
and ``W * dL/dF_r`` for its own features (the data-parallel mean then gives the exact gradient,
DESIGN.md 3.1) and the scale gradient after the mean. Prints one line per case and exits with 1
if any case is out of tolerance.

    torchrun --nproc_per_node 2 tests/gpu/ring_nccl_worker.py

Without CUDA it runs the torch-backend cases on gloo and CPU (a check of the script itself).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_infcl import settings  # noqa: E402
from ds_infcl.loss import contrastive_loss, siglip_loss  # noqa: E402
from ds_infcl.loss.siglip import last_siglip_algorithm  # noqa: E402
from ds_infcl.ops import contrastive_loss_reference  # noqa: E402
from ds_infcl.ops.siglip import siglip_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative to the largest reference magnitude. fp32: fp32 accumulation (no TF32). bf16: inputs
# are the same bf16 values in the reference; gradients come back rounded to bf16 and the kernels
# keep the G tile in bf16 for the dq/dk products.
TOL = {"fp32": (1e-5, 1e-4), "bf16": (1e-4, 1.5e-2), "fp16": (1e-4, 3e-3)}


def cases(world):
    unequal = [1000 + 1537 * r for r in range(world)]  # not multiples of any tile
    out = []
    for backend in ("triton", "torch"):
        for dtype in ("bf16", "fp32"):
            out.append(dict(backend=backend, dtype=dtype, symmetric=True, hard=0, sizes=unequal, c=500, scale=14.3))
            out.append(dict(backend=backend, dtype=dtype, symmetric=False, hard=1, sizes=unequal, c=384, scale=20.0))
    out.append(dict(backend="triton", dtype="bf16", symmetric=True, hard=0, sizes=[8192] * world, c=512, scale=100.0))
    out.append(dict(backend="triton", dtype="bf16", symmetric=True, hard=0, sizes=[1] + [5] * (world - 1), c=64, scale=5.0))
    # SigLIP (the bias gradient is checked too): diagonal, and labels with hard negatives; the ring
    # and the gather path each (DS_INFCL_ALGORITHM pinned).
    for algorithm in ("ring", "gather"):
        for backend in ("triton", "torch"):
            for dtype in ("bf16", "fp32"):
                out.append(dict(loss="siglip", backend=backend, dtype=dtype, symmetric=False, hard=0,
                                sizes=unequal, c=500, scale=10.0, bias=-10.0, algorithm=algorithm))
        out.append(dict(loss="siglip", backend="triton", dtype="bf16", symmetric=False, hard=1, sizes=unequal, c=768,
                        scale=10.0, bias=-3.0, algorithm=algorithm))
        # fp16: the ring scales G's weight by a power of two that every rank shares (one all-reduce).
        out.append(dict(loss="siglip", backend="triton", dtype="fp16", symmetric=False, hard=0, sizes=unequal,
                        c=500, scale=10.0, bias=-10.0, algorithm=algorithm))
    # The default choice at 8,192 rows per GPU, three calls of one shape: the first eager, the
    # second captures the gather path's CUDA graphs, the third replays them.
    for _ in range(3):
        out.append(dict(loss="siglip", backend="triton", dtype="bf16", symmetric=False, hard=0, sizes=[8192] * world,
                        c=512, scale=10.0, bias=-10.0, algorithm="auto"))
    return out


def run(case, seed, rank, world, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    sizes, hard = case["sizes"], case["hard"]
    key_sizes = [b * (1 + hard) for b in sizes]
    q = torch.nn.functional.normalize(torch.randn(sum(sizes), case["c"], generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(sum(key_sizes), case["c"], generator=g), dim=1)
    labels = [torch.randperm(m, generator=g)[:b] if hard else torch.arange(b) for b, m in zip(sizes, key_sizes)]
    dtype = DTYPES[case["dtype"]]
    q, k = q.to(device, dtype), k.to(device, dtype)

    qs, ks = sum(sizes[:rank]), sum(key_sizes[:rank])
    q_local = q[qs:qs + sizes[rank]].clone().requires_grad_(True)
    k_local = k[ks:ks + key_sizes[rank]].clone().requires_grad_(True)
    scale = torch.tensor(case["scale"], device=device, requires_grad=True)
    siglip = case.get("loss") == "siglip"
    if siglip:
        bias = torch.tensor(case["bias"], device=device, requires_grad=True)
        with settings.override("DS_INFCL_ALGORITHM", case.get("algorithm", "auto")):
            loss = siglip_loss(q_local, k_local, scale, bias, labels[rank].to(device), backend=case["backend"],
                               group=dist.group.WORLD)
    else:
        loss = contrastive_loss(q_local, k_local, scale, labels[rank].to(device), symmetric=case["symmetric"],
                                backend=case["backend"], group=dist.group.WORLD)
    loss.backward()
    ds = torch.stack([scale.grad, bias.grad]) if siglip else scale.grad.clone()
    dist.all_reduce(ds)
    ds /= world

    offsets = torch.tensor([0] + key_sizes[:-1]).cumsum(0).tolist()
    glabels = torch.cat([lab + off for lab, off in zip(labels, offsets)]).to(device)
    qr, kr = q.double().requires_grad_(True), k.double().requires_grad_(True)
    sr = torch.tensor(case["scale"], dtype=torch.float64, device=device, requires_grad=True)
    if siglip:
        tr = torch.tensor(case["bias"], dtype=torch.float64, device=device, requires_grad=True)
        ref = siglip_reference(qr, kr, sr, tr, labels=glabels)
    else:
        ref = contrastive_loss_reference(qr, kr, sr, glabels, symmetric=case["symmetric"])
    ref.backward()

    def rel(got, want):
        want = want.double()
        return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()

    if siglip and case.get("algorithm", "auto") != "auto":
        assert last_siglip_algorithm() == case["algorithm"], (last_siglip_algorithm(), case)
    return {
        "loss": abs(loss.item() - ref.item()) / max(abs(ref.item()), 1e-12),
        "dq": rel(q_local.grad / world, qr.grad[qs:qs + sizes[rank]]),
        "dk": rel(k_local.grad / world, kr.grad[ks:ks + key_sizes[rank]]),
        "ds": rel(ds, torch.stack([sr.grad, tr.grad]) if siglip else sr.grad),
    }


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    failed = 0
    for seed, case in enumerate(cases(world)):
        if not cuda and (case["backend"] == "triton" or max(case["sizes"]) > 5000):
            continue
        err = run(case, seed, rank, world, device)
        worst = torch.tensor([err["loss"], err["dq"], err["dk"], err["ds"]], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        loss_tol, grad_tol = TOL[case["dtype"]]
        ok = worst[0].item() <= loss_tol and max(worst[1:].tolist()) <= grad_tol
        failed += not ok
        if rank == 0:
            desc = (f"{case.get('loss', 'infonce')} {case.get('algorithm', '')} {case['backend']:6s} {case['dtype']} "
                    f"{'sym' if case['symmetric'] else 'one'} hard={case['hard']} "
                    f"sizes={case['sizes']} c={case['c']} s={case['scale']}")
            print(f"{'ok  ' if ok else 'FAIL'} W={world} {desc}: rel err loss {worst[0]:.2e} dq {worst[1]:.2e} "
                  f"dk {worst[2]:.2e} ds {worst[3]:.2e} (tol {loss_tol:.0e}/{grad_tol:.0e})", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
