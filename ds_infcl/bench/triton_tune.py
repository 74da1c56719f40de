"""Sweep the Triton tile configurations of the LSE kernels at one shape (CUDA).

    python -m ds_infcl.bench.triton_tune --batch 65536 --dim 512 --dtype bf16
    python -m ds_infcl.bench.triton_tune --kinds fwd --configs 128,64,64,4,3,0,2 256,64,64,8,4,0,1

Times the forward launcher and the backward launcher separately (median of CUDA-event timings via
``triton.testing.do_bench``) for each "BM,BN,BK,warps,stages[,maxnreg[,programs_per_sm]]"
candidate, through the ``DS_INFCL_TRITON_FWD`` / ``DS_INFCL_TRITON_BWD`` overrides of
``_pick_config``, and the backward block sizes (``DS_INFCL_TRITON_CHUNK``) with their peak
memory. The backward is timed as the single-device loss calls it: both directions, the positive
term, gradients written in the inputs' dtype. Each line also gives the compiled kernel's
registers, spills and how many programs fit an SM. The winners are written into
``_pick_config`` by hand (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import sys

import torch

# (tiles, warps, stages, maxnreg, programs per SM): the persistent forward can run several
# programs per SM when the kernel's registers and shared memory allow (4-warp tiles: 2-3).
FWD_CANDIDATES = [
    "256,64,64,8,4,0,1", "128,128,64,8,3,0,1", "128,64,64,4,3,0,2", "128,64,64,4,4,0,2",
    "64,128,64,4,3,0,2", "128,32,64,4,4,0,2", "64,64,64,4,3,0,3", "64,64,64,4,4,0,3",
]
BWD_CANDIDATES = ["128,128,64,8,3", "128,128,64,8,4", "128,64,64,4,3", "64,128,64,4,3", "64,64,64,4,3"]


def _kernel_info(kernel) -> str:
    """Registers, spills and resident programs per SM of a compiled Triton kernel (if known)."""
    if kernel is None:
        return ""
    regs = getattr(kernel, "n_regs", None)
    spills = getattr(kernel, "n_spills", None)
    warps = getattr(getattr(kernel, "metadata", None), "num_warps", None)
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    fit = ""
    if regs and warps:
        by_regs = 65536 // (regs * 32 * warps)
        by_smem = (228 * 1024) // (shared + 1024) if shared else by_regs
        fit = f" fits {min(by_regs, by_smem)}/SM"
    return f"  regs {regs} spills {spills} smem {shared}{fit}"


def main(argv=None) -> int:
    import triton

    from ds_infcl import settings
    from ds_infcl.ops import triton_lse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--configs", nargs="+", default=None, help="candidates for every kind (default: per kind)")
    ap.add_argument("--chunks", nargs="*", default=["8192x8192", "8192x6144", "8192x4096", "16384x8192"])
    ap.add_argument("--kinds", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    args = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, c = args.batch, args.dim
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype)
    scale = torch.tensor(14.3, device="cuda")
    row, col = triton_lse.lse_forward_triton(q, k, scale)
    gr = torch.full_like(row, 0.5 / b)
    gc = torch.full_like(col, 0.5 / b)
    gp = torch.full_like(row, -1.0 / b)

    def backward():
        return triton_lse.lse_backward_triton(q, k, scale, row, col, gr, gc, grad_pos=gp, out_dtype=dtype)

    mm_ms = triton.testing.do_bench(lambda: torch.mm(q, k.T), warmup=25, rep=args.rep, return_mode="median")
    print(f"# {torch.cuda.get_device_name()} b={b} c={c} {args.dtype}: torch.mm q@k^T {mm_ms:.3f} ms "
          f"({2 * b * b * c / mm_ms / 1e9:.0f} TFLOP/s)", flush=True)
    print(f"addmm out_dtype in place works: {triton_lse._addmm_out_dtype_works(q.device)}", flush=True)
    for kind in args.kinds:
        configs = args.configs or (FWD_CANDIDATES if kind == "fwd" else BWD_CANDIDATES)
        for cfg in configs:
            pin = settings.override(f"DS_INFCL_TRITON_{kind.upper()}", cfg)
            if kind == "fwd":
                fn = lambda: triton_lse.lse_forward_triton(q, k, scale)  # noqa: E731
                flops = 2 * b * b * c
            else:
                fn = backward
                flops = 6 * b * b * c
            try:
                with pin:
                    ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
                info = _kernel_info(triton_lse._LAST_KERNELS.get(kind))
                print(f"{kind} {cfg:20s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s{info}", flush=True)
            except Exception as err:  # out of resources etc.
                print(f"{kind} {cfg:20s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
    if "bwd" in args.kinds:
        for ch in args.chunks:
            with settings.override("DS_INFCL_TRITON_CHUNK", ch):
                backward()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = backward()
                torch.cuda.synchronize()
                grads = sum(t.numel() * t.element_size() for t in out)
                extra = (torch.cuda.max_memory_allocated() - base - grads) / 2**30
                del out
                ms = triton.testing.do_bench(backward, warmup=25, rep=args.rep, return_mode="median")
            print(f"bwd chunk {ch:12s} {ms:8.3f} ms {6 * b * b * c / ms / 1e9:6.0f} TFLOP/s  "
                  f"extra beyond the gradients {extra:.3f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
