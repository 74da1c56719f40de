"""Does this Triton warp-specialize (or flatten) a persistent GEMM + epilogue loop on Hopper?

    python tests/gpu/probe_warp_specialize.py

Compiles (never launches) a persistent tile loop of the shape of the LSE kernels (a K-loop of
``tl.dot``, an exponential epilogue, a store; pointer or TMA-descriptor loads; the epilogue with
or without a branch) under ``tl.range(..., warp_specialize=)`` and ``tl.range(..., flatten=)``
for the current GPU, and prints what the TTGIR holds: warp-specialized partitions, shared
memory (a flattened loop multi-buffers across tiles), wgmma ops. The kernels of
``ds_infcl/ops/triton_lse_kernels.py`` would need the first to overlap one tile's epilogue with
the next tile's MMA (docs/kernels.md). Triton 3.6.0 on an H200 (2026-11-26): no partitions with
either load kind; flatten works without a branch and fails in the loop-fusion pass with one
(docs/bench/probe_warp_specialize_h200.log).
"""
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget


@triton.jit
def g_persist(q_ptr, k_ptr, g_ptr, n_rows, n_cols, c, num_tiles, tiles_n,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr, FL: tl.constexpr,
              DESC: tl.constexpr, BRANCH: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if DESC:
        qd = tl.make_tensor_descriptor(q_ptr, shape=[n_rows, c], strides=[c, 1], block_shape=[BM, BK])
        kd = tl.make_tensor_descriptor(k_ptr, shape=[n_cols, c], strides=[c, 1], block_shape=[BN, BK])
    for t in tl.range(pid, num_tiles, nprog, warp_specialize=WS, flatten=FL):
        pm = t // tiles_n
        pn = t % tiles_n
        offs_m = pm * BM + tl.arange(0, BM)
        offs_n = pn * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, c, BK):
            if DESC:
                a = qd.load([pm * BM, k0])
                b = kd.load([pn * BN, k0])
            else:
                offs_k = k0 + tl.arange(0, BK)
                a = tl.load(q_ptr + offs_m[:, None] * c + offs_k[None, :])
                b = tl.load(k_ptr + offs_n[:, None] * c + offs_k[None, :])
            acc = tl.dot(a, tl.trans(b), acc)
        e = tl.exp2(acc * 1.4426950408889634)
        ptrs = g_ptr + offs_m[:, None].to(tl.int64) * n_cols + offs_n[None, :]
        if BRANCH:
            if (pm + 1) * BM <= n_rows:
                tl.store(ptrs, e.to(tl.bfloat16))
            else:
                tl.store(ptrs, e.to(tl.bfloat16), mask=(offs_m < n_rows)[:, None])
        else:
            tl.store(ptrs, e.to(tl.bfloat16))


import torch  # noqa: E402

cap = torch.cuda.get_device_capability()
target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)
print("triton", triton.__version__, "target", target)
sig = dict(q_ptr="*bf16", k_ptr="*bf16", g_ptr="*bf16", n_rows="i32", n_cols="i32", c="i32", num_tiles="i32", tiles_n="i32")
for ws, fl, desc, br in [(True, False, False, False), (True, False, True, False), (False, True, False, False),
                         (False, True, False, True), (False, True, True, False), (True, False, True, True)]:
    const = dict(BM=128, BN=128, BK=64, WS=ws, FL=fl, DESC=desc, BRANCH=br)
    s = dict(sig); [s.__setitem__(k, "constexpr") for k in const]
    names = g_persist.arg_names
    try:
        if desc:
            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        src = ASTSource(g_persist, {k: s[k] for k in names}, const,
                        attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ("q_ptr", "k_ptr", "g_ptr", "n_rows", "n_cols", "c")})
        ck = triton.compile(src, target=target, options=dict(num_warps=8, num_stages=3))
        ttg = ck.asm["ttgir"]
        print(f"ws={ws} flatten={fl} tma={desc} branch={br}: ok; warp_specialize ops {ttg.count('ttg.warp_specialize')}, "
              f"partitions {ttg.count('partition')}, num-warps attr {ttg.count('ttg.num-warps')}, smem {ck.metadata.shared}, "
              f"wgmma {ttg.count('warp_group_dot')}")
    except Exception as err:
        print(f"ws={ws} flatten={fl} tma={desc} branch={br}: failed {type(err).__name__}: {str(err).splitlines()[-1][:200]}")
