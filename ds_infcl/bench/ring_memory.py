"""CPU benchmark: peak memory per rank of the ring against the all-gather baselines.

Runs ``world`` gloo ranks in CPU processes (``torch.multiprocessing``), each with ``b`` queries
and ``b`` keys of dim ``c`` (symmetric loss, float32, forward + backward). Every (impl, b) point
is measured in the same processes one after the other: the peak resident set is reset before
each point (``/proc/self/clear_refs``, Linux) and read after it (``VmHWM``); glibc returns large
freed blocks to the system (``MALLOC_MMAP_THRESHOLD_``), so a point does not inherit the previous
one's heap. Memory is reported beyond the inputs and their (pre-allocated) gradients, the
largest over the ranks, next to ``(b + m) * c * 4`` bytes (the local features) and
``B * M * 4`` (one global logits matrix).

    python -m ds_infcl.bench.ring_memory --out docs/bench          # 4 ranks, b in {512..4096}
    python -m ds_infcl.bench.ring_memory --world 2 --batch 256 512 --impls infcl local
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import socket
import tempfile
import time
from typing import Dict, List, Sequence
from unittest import mock

import torch
import torch.multiprocessing as mp

from ds_infcl.bench.results import write_rows_csv

IMPLS = ("infcl", "local", "vanilla")
# infcl with its algorithm pinned (DS_INFCL_ALGORITHM): the ring, or one all-gather of the features
PINNED = {"infcl_ring": "ring", "infcl_gather": "gather"}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _point(impl: str, b: int, c: int, tile: int, rank: int) -> Dict:
    from ds_infcl import settings
    from ds_infcl.loss import contrastive_loss

    g = torch.Generator().manual_seed(1000 + rank)
    q = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1).requires_grad_()
    q.grad, k.grad = torch.zeros_like(q), torch.zeros_like(k)
    scale = torch.tensor(14.3, requires_grad=True)
    scale.grad = torch.zeros_like(scale)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set to the current one
    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    with settings.override("DS_INFCL_ALGORITHM", PINNED.get(impl)):
        loss = contrastive_loss(q, k, scale, symmetric=True, impl="infcl" if impl in PINNED else impl,
                                backend="torch", tile_size=tile)
        loss.backward()
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    return {"impl": impl, "b": b, "extra_bytes": peak - base, "seconds": seconds, "loss": loss.item()}


def _worker(rank, world, port, out_dir, points, c, tile):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from ds_infcl.train.dist import exit_process, shutdown

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for impl in sorted({p[0] for p in points}):  # warm-up: gloo buffers, lazy imports
            _point(impl, 8, c, tile, rank)
        rows = []
        for impl, b in points:
            dist.barrier()
            rows.append(_point(impl, b, c, tile, rank))
        torch.save(rows, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise  # the parent reports this rank's traceback
    # Leave without interpreter finalization: the gather baselines' autograd collectives can leave
    # work objects to gloo's threads, and a rank then aborted at exit ("terminate called without an
    # active exception") after its rows were written, failing a whole run now and then.
    shutdown()
    exit_process(0)


def measure(world: int, batch: Sequence[int], impls: Sequence[str] = IMPLS, c: int = 128,
            tile: int = 256, max_global_logits: float = 2**26, timeout: float = 600) -> List[Dict]:
    """Peak extra memory per rank for every (impl, b); rows sorted by impl then b.

    Points whose materialized logits would exceed ``max_global_logits`` elements (``vanilla``:
    ``B * M``; ``local``/``disco``: ``b * M``) are skipped to protect the machine.
    """
    points = []
    for impl in impls:
        for b in batch:
            n = (world * b) ** 2 if impl == "vanilla" else (b * world * b if not impl.startswith("infcl") else 0)
            if n <= max_global_logits:
                points.append((impl, b))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    # inherited by the spawned ranks (glibc reads them at start); the previous values afterwards
    with mock.patch.dict(os.environ, env):
        with tempfile.TemporaryDirectory() as out_dir:
            ctx = mp.start_processes(_worker, args=(world, port, out_dir, points, c, tile),
                                     nprocs=world, join=False, start_method="spawn")
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"memory benchmark did not finish within {timeout} s")
            per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    rows = []
    for i, (impl, b) in enumerate(points):
        pts = [pr[i] for pr in per_rank]
        rows.append({
            "impl": impl, "world": world, "b": b, "c": c, "global_batch": world * b,
            "extra_mib": max(p["extra_bytes"] for p in pts) / 2**20,
            "features_mib": 2 * b * c * 4 / 2**20,
            "global_logits_mib": (world * b) ** 2 * 4 / 2**20,
            "seconds": max(p["seconds"] for p in pts),
        })
    return rows


def format_table(rows: List[Dict]) -> str:
    lines = ["| impl | ranks | per-rank b | global B | extra MiB per rank | local features MiB | "
             "one B x M fp32 matrix MiB | s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['world']} | {r['b']:,} | {r['global_batch']:,} | "
                     f"{r['extra_mib']:.1f} | {r['features_mib']:.2f} | {r['global_logits_mib']:.0f} | "
                     f"{r['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS) + list(PINNED))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--max-logits", type=float, default=2**26,
                        help="skip points whose materialized logits exceed this many elements")
    parser.add_argument("--out", default=None, help="folder for ring_memory.csv")
    args = parser.parse_args(argv)
    rows = measure(args.world, args.batch, args.impls, args.dim, args.tile, args.max_logits)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_rows_csv(os.path.join(args.out, "ring_memory.csv"), rows)
    print(format_table(rows))


if __name__ == "__main__":
    main()
