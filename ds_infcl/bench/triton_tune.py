"""Sweep the Triton tile configurations of the LSE kernels at one shape (CUDA).

    python -m ds_infcl.bench.triton_tune --batch 65536 --dim 512 --dtype bf16

Times the forward launcher and the backward launcher separately (median of CUDA-event timings via
``triton.testing.do_bench``) for each "BM,BN,BK,warps,stages" candidate, through the
``DS_INFCL_TRITON_FWD`` / ``DS_INFCL_TRITON_BWD`` overrides of ``_pick_config``, and the backward
block sizes. The winners are written into ``_pick_config`` by hand (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

CANDIDATES = [
    "128,128,64,8,3", "128,128,64,8,4", "128,128,64,4,3", "128,256,64,8,3", "256,128,64,8,3",
    "128,128,128,8,2", "128,64,64,4,4", "64,128,64,4,4",
]


def main(argv=None) -> int:
    import triton

    from ds_infcl.ops import triton_lse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--configs", nargs="+", default=CANDIDATES)
    ap.add_argument("--chunks", nargs="*", default=["8192x8192", "16384x8192", "4096x4096", "16384x16384"])
    ap.add_argument("--kinds", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    args = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, c = args.batch, args.dim
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype)
    row, col = triton_lse.lse_forward_triton(q, k, 14.3)
    gr, gc = torch.full_like(row, 1 / b), torch.full_like(col, 1 / b)
    mm_ms = triton.testing.do_bench(lambda: torch.mm(q, k.T), warmup=25, rep=200, return_mode="median")
    print(f"# {torch.cuda.get_device_name()} b={b} c={c} {args.dtype}: torch.mm q@k^T {mm_ms:.3f} ms "
          f"({2 * b * b * c / mm_ms / 1e9:.0f} TFLOP/s)", flush=True)
    print(f"addmm out_dtype in place works: {triton_lse._addmm_out_dtype_works(q.device)}", flush=True)
    for kind in args.kinds:
        for cfg in args.configs:
            os.environ[f"DS_INFCL_TRITON_{kind.upper()}"] = cfg
            if kind == "fwd":
                fn = lambda: triton_lse.lse_forward_triton(q, k, 14.3)  # noqa: E731
                flops = 2 * b * b * c
            else:
                fn = lambda: triton_lse.lse_backward_triton(q, k, 14.3, row, col, gr, gc)  # noqa: E731
                flops = 6 * b * b * c
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
                print(f"{kind} {cfg:18s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
            except Exception as err:  # out of resources etc.
                print(f"{kind} {cfg:18s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
            del os.environ[f"DS_INFCL_TRITON_{kind.upper()}"]
    for ch in args.chunks:
        r, cc = (int(v) for v in ch.split("x"))
        triton_lse.CHUNK_ROWS, triton_lse.CHUNK_COLS = r, cc
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = triton.testing.do_bench(lambda: triton_lse.lse_backward_triton(q, k, 14.3, row, col, gr, gc),
                                     warmup=25, rep=300, return_mode="median")
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"bwd chunk {ch:12s} {ms:8.3f} ms {6 * b * b * c / ms / 1e9:6.0f} TFLOP/s  peak extra {extra:.3f} GiB",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
