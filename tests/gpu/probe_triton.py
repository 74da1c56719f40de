"""Profiling probe for the Triton LSE kernels (CUDA): is the tile GEMM itself at speed?

    python tests/gpu/probe_triton.py [b] [c]

Prints whether the compiled kernels use Hopper's wgmma, their registers/spills/shared memory, and
times a bare tile-GEMM kernel (the same ``_tile_dot`` main loop, a trivial epilogue) next to the
forward and backward launchers and torch.mm.
"""

import sys

import torch
import triton
import triton.language as tl

from ds_infcl.ops import triton_lse as T


@triton.jit
def _bare_gemm_kernel(q_ptr, k_ptr, out_ptr, b, m, c, stride_q, stride_k,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = T._tile_dot(q_ptr, k_ptr, offs_m, offs_n, offs_m < b, offs_n < m, c, stride_q, stride_k,
                      BLOCK_M, BLOCK_N, BLOCK_K, True, 0, False)
    tl.store(out_ptr + pid_m * tl.num_programs(1) + pid_n, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _plain_gemm_kernel(q_ptr, k_ptr, out_ptr, b, m, c, stride_q, stride_k,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # textbook form: B loaded as [BK, BN] through transposed strides, no masks
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = q_ptr + offs_m[:, None] * stride_q + offs_k[None, :]
    b_ptrs = k_ptr + offs_n[None, :] * stride_k + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, c, BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    tl.store(out_ptr + pid_m * tl.num_programs(1) + pid_n, tl.sum(tl.sum(acc, 1), 0))


def info(kk):
    ptx = kk.asm["ptx"]
    return (f"regs {kk.n_regs} spills {kk.n_spills} smem {kk.metadata.shared} warps {kk.metadata.num_warps} "
            f"wgmma {ptx.count('wgmma.mma_async')} mma.sync {ptx.count('mma.sync')} ex2 {ptx.count('ex2.approx')} "
            f"bar {ptx.count('bar.sync')}")


b = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
c = int(sys.argv[2]) if len(sys.argv) > 2 else 512
q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=-1).bfloat16()
bench = lambda f: triton.testing.do_bench(f, warmup=20, rep=200, return_mode="median")  # noqa: E731
f2 = 2 * b * b * c
print(f"# {torch.cuda.get_device_name()} b={b} c={c} bf16")
print(f"torch.mm q@k^T (writes bf16 b x b): {bench(lambda: q @ k.T):.3f} ms")
for bm, bn, bk, w, st in [(128, 128, 64, 8, 3)]:
    out = torch.empty(triton.cdiv(b, bm) * triton.cdiv(b, bn), device="cuda")
    grid = (triton.cdiv(b, bm), triton.cdiv(b, bn))
    for name, kern in (("bare", _bare_gemm_kernel), ("plain", _plain_gemm_kernel)):
        h = kern[grid](q, k, out, b, b, c, q.stride(0), k.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       num_warps=w, num_stages=st)
        ms = bench(lambda: kern[grid](q, k, out, b, b, c, q.stride(0), k.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                      BLOCK_K=bk, num_warps=w, num_stages=st))
        print(f"{name} gemm {bm}x{bn}x{bk} w{w} s{st}: {ms:.3f} ms ({f2 / ms / 1e9:.0f} TFLOP/s)  {info(h)}")
row, col = T.lse_forward_triton(q, k, 14.3)
gr, gc = torch.full_like(row, 1 / b), torch.full_like(col, 1 / b)
for cc in (True, False):
    ms = bench(lambda: T.lse_forward_triton(q, k, 14.3, compute_col=cc))
    print(f"fwd compute_col={cc}: {ms:.3f} ms ({f2 / ms / 1e9:.0f} TFLOP/s)  "
          f"{info(T._LAST_KERNELS['fwd'])}", flush=True)
ms = bench(lambda: T.lse_backward_triton(q, k, 14.3, row, col, gr, gc))
print(f"bwd: {ms:.3f} ms ({3 * f2 / ms / 1e9:.0f} TFLOP/s)  {info(T._LAST_KERNELS['bwd'])}", flush=True)
T.CHUNK_ROWS = T.CHUNK_COLS = b
G = torch.randn(b, b, device="cuda").bfloat16()
dq = torch.zeros(b, c, device="cuda")
ms1 = bench(lambda: torch.addmm(dq, G, k, out_dtype=torch.float32, out=dq))
ms2 = bench(lambda: torch.addmm(dq, G.t(), q, out_dtype=torch.float32, out=dq))
ms = bench(lambda: T.lse_backward_triton(q, k, 14.3, row, col, gr, gc))
print(f"bwd one block {ms:.3f} ms = addmm G@k {ms1:.3f} ms ({f2 / ms1 / 1e9:.0f}) + G^T@q {ms2:.3f} ms "
      f"({f2 / ms2 / 1e9:.0f}) + recompute ~{ms - ms1 - ms2:.3f} ms ({f2 / (ms - ms1 - ms2) / 1e9:.0f} TFLOP/s)")
