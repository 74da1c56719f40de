"""The backward's ``G`` kernel for Hopper (sm_90) in Gluon: TMA loads by producer warps,
asynchronous warpgroup MMAs, two consumer warpgroups taking turns at the tensor cores
(ping-pong), a persistent grid, and ``G`` leaving through TMA stores.

Why (issue 17): the Triton ``_lse_bwd_g_kernel`` spends as long on its matrix products and the
store of ``G`` alone (no exponential at all) as on the whole tile: 129 us per 8192 x 6144 block at
c = 512 on an H200, against 83 us for cuBLAS writing the same bf16 products. A Triton program runs
each tile's K-loop from a cold pipeline and stores ``G`` while no product runs, and Triton 3.6's
automatic warp specialization does not apply on Hopper (``tests/gpu/probe_warp_specialize.py``).
The same skeleton here (one producer warp, one MMA warpgroup, TMA stores) takes 82 us.

Layout of a program (one per SM, tiles ``p, p + P, ...`` of the block): each of the ``NCONS`` = 2
consumer warpgroups takes every other tile and has its own ring of ``STAGES`` shared-memory slots,
filled K step by K step by its own producer warp (one shared ring would let the second consumer,
a whole tile ahead, wait on a phase parity the first one completed). A pair of ``turn`` barriers
orders the consumers' products: one warpgroup's MMAs run while the other computes and stores its
tile's ``G`` (the epilogue is the maths of ``_lse_bwd_g_kernel`` in
``ds_infcl.ops.triton_lse_kernels``, with 16-bit operands and the fused exponent arguments of
``FMA_EXP``). Measured in docs/kernels.md: the backward 3-7% faster than with the Triton kernel on
H200 and H100; what is left is register pressure (a 128 x 128 fp32 tile per warpgroup, and the
two-exponential branch spills).

The forward's statistics run in the same structure: ``ds_infcl.ops.gluon_lse_forward``.

The launcher (``ds_infcl.ops.triton_lse``) picks these kernels on Hopper for 16-bit inputs whose
rows are 16-byte aligned (``DS_INFCL_GLUON``), and the Triton kernels elsewhere (other GPUs,
float32, the CPU interpreter). Importing this module needs a Triton with Gluon's Hopper API (3.6
and later); ``AVAILABLE`` says whether it has one. The CPU check is an ahead-of-time compile for
sm_90 (``ds_infcl.bench.triton_sass --kernels bwd_gluon fwd_gluon``, ``tests/ops/test_triton_compile.py``).
"""

from __future__ import annotations

from typing import Tuple

import torch

try:  # Gluon is experimental: absent from older Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE, UNAVAILABLE_WHY = True, ""
except Exception as err:  # pragma: no cover - depends on the installed Triton
    # An ImportError where Triton has no Gluon; other errors where its experimental API differs
    # (or, in one process, Triton's language was first imported under TRITON_INTERPRET=1 and
    # Gluon after it was unset): the Triton kernels run instead, and DS_INFCL_GLUON=1 says why.
    AVAILABLE, UNAVAILABLE_WHY = False, f"{type(err).__name__}: {err}"

__all__ = ["AVAILABLE", "FLAG_BITS", "REGS", "UNAVAILABLE_WHY", "g_flags", "gluon_config", "launch_g_hopper",
           "make_desc"]

# The epilogue's constexpr switches, carried into the warp-specialized partitions as the length of
# a small shared-memory buffer (a partition's arguments reach it as IR values, its buffers'
# shapes as constants).
FLAG_BITS = dict(HAS_ROW=1, HAS_COL=2, HAS_POS=4, EXCLUDE=8, HAS_LABELS=16, ONE_EXP=32)


# The register split of a warp-specialized kernel (measured, docs/kernels.md): ``setmaxnreg`` for
# the consumer warpgroups and for the producer warps, and the whole kernel's cap at launch.
REGS = dict(consumer_regs=240, producer_regs=24, maxnreg=168)


def gluon_config(text: str) -> Tuple[Tuple[int, ...], dict]:
    """``(tiles, regs)`` of a Gluon kernel's config "BM,BN,BK,stages,X[,consumer_regs,
    producer_regs,maxnreg]" (``X``: the G kernel's consumer warpgroups, the forward's turns);
    ``regs`` as ``REGS``, with the values given."""
    values = tuple(int(v) for v in text.split(","))
    return values[:5], dict(REGS, **dict(zip(REGS, values[5:])))


def g_flags(bits: dict = FLAG_BITS, **flags: bool) -> int:
    """The bit mask of ``bits`` (``FLAG_BITS``, or the forward's ``gluon_lse_forward.FLAG_BITS``)
    for the given switches."""
    return sum(bit for name, bit in bits.items() if flags.get(name))


if AVAILABLE:
    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _load_lse_g(ptr, offs, ok):
        """As ``_load_lse``: -inf reads as 0, masked entries 0."""
        x = gl.load(ptr + offs, mask=ok, other=0.0)
        return gl.where(x == float("-inf"), 0.0, x)

    @gluon.jit
    def _exp_rows(acc, x_log2, r):
        """``exp(s acc - r_i)``: the argument is one fused multiply-add per logit."""
        return gl.exp2(acc * x_log2 - gl.expand_dims(r * LOG2E, 1))

    @gluon.jit
    def _exp_cols(acc, x_log2, cl):
        """``exp(s acc - c_j)``, as ``_exp_rows``."""
        return gl.exp2(acc * x_log2 - gl.expand_dims(cl * LOG2E, 0))

    @gluon.jit
    def _ring_buffers(q_desc, k_desc, NCONS: gl.constexpr, STAGES: gl.constexpr):
        """One ring of ``STAGES`` operand slots per consumer warpgroup (each filled by its own
        producer warp: a shared ring would let the second consumer, a whole tile ahead, read a
        phase parity of the first's), their ``ready`` / ``empty`` barriers and the two ``turn``
        barriers of the ping-pong, initialised: ``(q_bufs, k_bufs, ready, empty, turn)``."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BK: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [NCONS * STAGES, BM, BK], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NCONS * STAGES, BN, BK], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NCONS * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NCONS * STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NCONS * STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(turn.index(s), count=1)
        return q_bufs, k_bufs, ready, empty, turn

    @gluon.jit
    def _ring_loads(q_desc, k_desc, q_bufs, k_bufs, ready, empty, off_m, off_n, cnt, ksteps,
                    WHICH: gl.constexpr, STAGES: gl.constexpr):
        """A producer warp's share of one tile: its ``ksteps`` operand tiles (rows ``off_m`` of
        ``q``, ``off_n`` of ``k``) into consumer ``WHICH``'s ring (slots ``WHICH * STAGES ...``),
        each slot once its last use is done; ``cnt`` counts the ring's fills, returned updated."""
        BK: gl.constexpr = q_bufs.type.shape[2]
        for kk in range(ksteps):
            s = WHICH * STAGES + cnt % STAGES
            mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)  # the slot's last use is done
            mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [off_m, kk * BK], ready.index(s), q_bufs.index(s))
            tma.async_copy_global_to_shared(k_desc, [off_n, kk * BK], ready.index(s), k_bufs.index(s))
            cnt += 1
        return cnt

    @gluon.jit
    def _ring_products(q_bufs, k_bufs, ready, empty, turn, acc, cnt, j, ksteps,
                       WHICH: gl.constexpr, STAGES: gl.constexpr, TURNS: gl.constexpr):
        """A consumer warpgroup's products of one tile (its ``j``-th) from its ring, into ``acc``;
        with ``TURNS`` it waits for its turn at the tensor cores first and hands the turn on once
        its products are issued (ping-pong). Each slot goes back to the producer when the product
        that read it is done. Returns ``(acc, cnt)``."""
        if TURNS:
            mbarrier.wait(turn.index(WHICH), (j & 1) ^ (1 - WHICH))
        for kk in range(ksteps):
            s = WHICH * STAGES + cnt % STAGES
            mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
            acc = warpgroup_mma(q_bufs.index(s), k_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if kk > 0:  # the previous step's product is done: its slot goes back to the producer
                mbarrier.arrive(empty.index(WHICH * STAGES + (cnt - 1) % STAGES), count=1)
            cnt += 1
        if TURNS:  # the other warpgroup's products may start behind ours
            mbarrier.arrive(turn.index(1 - WHICH), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(WHICH * STAGES + (cnt - 1) % STAGES), count=1)
        return acc, cnt

    @gluon.jit
    def _g_produce(q_desc, k_desc, q_bufs, k_bufs, g_bufs, ready, empty, i0, j0, rows, cols, ksteps,
                   WHICH: gl.constexpr):
        """One warp: the operands of consumer ``WHICH``'s tiles, K step by K step, into its ring
        (slots ``WHICH * STAGES ...`` of the buffers)."""
        NCONS: gl.constexpr = g_bufs.type.shape[0]
        STAGES: gl.constexpr = q_bufs.type.shape[0] // NCONS
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(cols, BN)
        num_tiles = gl.cdiv(rows, BM) * tiles_n
        cnt = 0
        for t in range(pid + WHICH * nprog, num_tiles, NCONS * nprog):
            cnt = _ring_loads(q_desc, k_desc, q_bufs, k_bufs, ready, empty, i0 + (t // tiles_n) * BM,
                              j0 + (t % tiles_n) * BN, cnt, ksteps, WHICH, STAGES)

    @gluon.jit
    def _g_consume(g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols,
                   ksteps, lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                   stride_a, stride_w, stride_p, num_rblocks, num_cblocks, WHICH: gl.constexpr):
        """One warpgroup: the products of every ``NCONS``-th tile of this program from its ring,
        then the tile's ``G`` out by a TMA store (while the other warpgroup runs its products)."""
        NCONS: gl.constexpr = g_bufs.type.shape[0]
        STAGES: gl.constexpr = q_bufs.type.shape[0] // NCONS
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        g_buf = g_bufs.index(WHICH)
        FLAGS: gl.constexpr = flag_buf.type.shape[0] - 1  # the bits of FLAG_BITS
        HAS_ROW: gl.constexpr = (FLAGS & 1) != 0
        HAS_COL: gl.constexpr = (FLAGS & 2) != 0
        HAS_POS: gl.constexpr = (FLAGS & 4) != 0
        EXCLUDE: gl.constexpr = (FLAGS & 8) != 0
        HAS_LABELS: gl.constexpr = (FLAGS & 16) != 0
        ONE_EXP: gl.constexpr = (FLAGS & 32) != 0
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(cols, BN)
        num_tiles = gl.cdiv(rows, BM) * tiles_n
        x_log2 = gl.load(scale_ptr) * LOG2E  # the scale fuses into each exponent's argument
        cnt = 0
        j = 0
        for t in range(pid + WHICH * nprog, num_tiles, NCONS * nprog):
            pid_m = t // tiles_n
            pid_n = t % tiles_n
            # Two warpgroups take turns at the tensor cores (ping-pong).
            acc, cnt = _ring_products(q_bufs, k_bufs, ready, empty, turn, gl.zeros((BM, BN), dtype=gl.float32, layout=mma),
                                      cnt, j, ksteps, WHICH, STAGES, NCONS == 2)
            j += 1

            loc_m = pid_m * BM + gl.arange(0, BM, layout=row_l)
            loc_n = pid_n * BN + gl.arange(0, BN, layout=col_l)
            row_ok = loc_m < rows
            col_ok = loc_n < cols
            offs_m = i0 + loc_m
            offs_n = j0 + loc_n
            if HAS_ROW:
                r = _load_lse_g(r_ptr, offs_m, row_ok)
                a = gl.load(a_ptr + offs_m.to(gl.int64) * stride_a, mask=row_ok, other=0.0)
            if HAS_COL and not HAS_ROW:
                cl = _load_lse_g(cl_ptr, offs_n, col_ok)
                w = gl.load(w_ptr + offs_n.to(gl.int64) * stride_w, mask=col_ok, other=0.0)
            if HAS_ROW and HAS_COL:
                if ONE_EXP:
                    r_hi = gl.load(rng_ptr + i0 // BM + pid_m)
                    c_lo = gl.load(rng_ptr + num_rblocks + j0 // BN + pid_n)
                    c_hi = gl.load(rng_ptr + num_rblocks + num_cblocks + j0 // BN + pid_n)
                    if (r_hi - c_lo <= 60.0) & (c_hi - c_lo <= 60.0):
                        v = gl.load(v_ptr + offs_n, mask=col_ok, other=0.0)
                        u = gl.exp2(gl.minimum(r - c_lo, 60.0) * LOG2E)
                        g = _exp_rows(acc, x_log2, r) * (gl.expand_dims(a, 1) + gl.expand_dims(u, 1) * gl.expand_dims(v, 0))
                    else:  # outside the range: two exponentials
                        g = _g_two_exp_g(acc, x_log2, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w)
                else:
                    g = _g_two_exp_g(acc, x_log2, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w)
            elif HAS_ROW:
                g = gl.expand_dims(a, 1) * _exp_rows(acc, x_log2, r)
            elif HAS_COL:
                g = gl.expand_dims(w, 0) * _exp_cols(acc, x_log2, cl)
            else:
                g = gl.zeros((BM, BN), dtype=gl.float32, layout=mma)
            if EXCLUDE or HAS_POS:
                if HAS_LABELS:
                    lab = gl.load(lab_ptr + offs_m, mask=row_ok, other=-1)
                else:
                    lab = offs_m
                hit = gl.expand_dims(offs_n, 0) == gl.expand_dims(lab, 1)
                if EXCLUDE:
                    g = gl.where(hit, 0.0, g)
                if HAS_POS:
                    p = gl.load(p_ptr + offs_m.to(gl.int64) * stride_p, mask=row_ok, other=0.0)
                    g = g + gl.where(hit, gl.expand_dims(p, 1), 0.0)
            tma.store_wait(pendings=0)  # the previous tile's store has left g_buf
            g_buf.store(g.to(g_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(g_desc, [pid_m * BM, pid_n * BN], g_buf)
        tma.store_wait(pendings=0)

    # The partitions: their arguments reach them as IR values, so each consumer / producer index
    # is a literal of its own function.
    @gluon.jit
    def _g_consumer0(q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols,
                     ksteps, lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                     stride_a, stride_w, stride_p, num_rblocks, num_cblocks):
        _g_consume(g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols, ksteps, lab_ptr, r_ptr,
                   a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr, stride_a, stride_w, stride_p,
                   num_rblocks, num_cblocks, 0)

    @gluon.jit
    def _g_consumer1(q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols,
                     ksteps, lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                     stride_a, stride_w, stride_p, num_rblocks, num_cblocks):
        _g_consume(g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols, ksteps, lab_ptr, r_ptr,
                   a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr, stride_a, stride_w, stride_p,
                   num_rblocks, num_cblocks, 1)

    @gluon.jit
    def _g_two_exp_g(acc, x_log2, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w):
        """``a_i exp(x - r_i) + w_j exp(x - c_j)`` (the columns read here, as ``_g_two_exp`` of
        the Triton kernel) holding one [BM, BN] value per logit: the second exponent is the first
        plus ``(r_i - c_j) log2(e)``, so the dot products are dead once the first argument is
        formed (both exponentials of ``acc`` at once would need two tiles of registers and spill)."""
        t = acc * x_log2 - gl.expand_dims(r * LOG2E, 1)
        BM: gl.constexpr = t.shape[0]
        BN: gl.constexpr = t.shape[1]
        # Two halves of the columns, one after the other (each with its own column vectors):
        # holding both exponentials of the whole tile at once spills.
        ta, tb = gl.split(gl.permute(gl.reshape(t, [BM, 2, BN // 2]), [0, 2, 1]))
        na, nb = gl.split(gl.permute(gl.reshape(offs_n, [2, BN // 2]), [1, 0]))
        oka, okb = gl.split(gl.permute(gl.reshape(col_ok, [2, BN // 2]), [1, 0]))
        ga = _g_two_exp_half(ta, r, a, cl_ptr, w_ptr, na, oka, stride_w)
        gb = _g_two_exp_half(tb, r, a, cl_ptr, w_ptr, nb, okb, stride_w)
        g = gl.reshape(gl.permute(gl.join(ga, gb), [0, 2, 1]), [BM, BN])
        return gl.convert_layout(g, acc.type.layout)

    @gluon.jit
    def _g_two_exp_half(t, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w):
        """``a_i exp2(t) + w_j exp2(t + (r_i - c_j) log2(e))`` for ``t = x log2(e) - r_i log2(e)``
        over some of the tile's columns (``offs_n``), reading their statistics here."""
        cols: gl.constexpr = gl.SliceLayout(0, t.type.layout)
        rows: gl.constexpr = gl.SliceLayout(1, t.type.layout)
        offs_n = gl.convert_layout(offs_n, cols)
        col_ok = gl.convert_layout(col_ok, cols)
        cl = _load_lse_g(cl_ptr, offs_n, col_ok)
        w = gl.load(w_ptr + offs_n.to(gl.int64) * stride_w, mask=col_ok, other=0.0)
        rl = gl.expand_dims(gl.convert_layout(r * LOG2E, rows), 1)
        return (gl.expand_dims(gl.convert_layout(a, rows), 1) * gl.exp2(t)
                + gl.expand_dims(w, 0) * gl.exp2(t + (rl - gl.expand_dims(cl * LOG2E, 0))))

    @gluon.jit
    def _g_producer0(q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols,
                     ksteps, lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                     stride_a, stride_w, stride_p, num_rblocks, num_cblocks):
        _g_produce(q_desc, k_desc, q_bufs, k_bufs, g_bufs, ready, empty, i0, j0, rows, cols, ksteps, 0)

    @gluon.jit
    def _g_producer1(q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols,
                     ksteps, lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                     stride_a, stride_w, stride_p, num_rblocks, num_cblocks):
        _g_produce(q_desc, k_desc, q_bufs, k_bufs, g_bufs, ready, empty, i0, j0, rows, cols, ksteps, 1)

    @gluon.jit
    def _lse_bwd_g_hopper_kernel(q_desc, k_desc, g_desc, i0, j0, rows, cols, ksteps,
                                 lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                                 stride_a, stride_w, stride_p, num_rblocks, num_cblocks,
                                 STAGES: gl.constexpr, FLAGS: gl.constexpr, NCONS: gl.constexpr,
                                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """``G`` for the block ``[i0, i0 + rows) x [j0, j0 + cols)`` into ``g_desc`` (``[rows,
        cols]``), over a persistent grid: program ``p`` takes the tiles ``p, p + P, ...``."""
        q_bufs, k_bufs, ready, empty, turn = _ring_buffers(q_desc, k_desc, NCONS, STAGES)
        BM: gl.constexpr = g_desc.block_type.shape[0]
        BN: gl.constexpr = g_desc.block_type.shape[1]
        g_bufs = gl.allocate_shared_memory(g_desc.dtype, [NCONS, BM, BN], g_desc.layout)
        flag_buf = gl.allocate_shared_memory(gl.int8, [FLAGS + 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        args = (q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, flag_buf, ready, empty, turn, i0, j0, rows, cols, ksteps,
                lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, scale_ptr, rng_ptr, v_ptr,
                stride_a, stride_w, stride_p, num_rblocks, num_cblocks)
        if NCONS == 2:
            gl.warp_specialize([(_g_consumer0, args), (_g_consumer1, args), (_g_producer0, args), (_g_producer1, args)],
                               [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_g_consumer0, args), (_g_producer0, args)], [1], [PRODUCER_REGS])

    _LAYOUTS: dict = {}

    def make_desc(t, block):
        """A TMA descriptor of the 2-D 16-bit tensor ``t`` in ``block``-shaped tiles (host side,
        passed by value at launch: a backward makes one per operand and one per shape of G)."""
        dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
        key = (dtype, tuple(block))
        if key not in _LAYOUTS:
            _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(block), dtype)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _LAYOUTS[key])

    def launch_g_hopper(q_desc, k_desc, g_desc, c, i0, j0, lab, r, a, cl, w, p, scale, rng, v, stride_a, stride_w,
                        stride_p, num_rblocks, num_cblocks, flags, stages, programs,
                        consumers=2, consumer_regs=REGS["consumer_regs"], producer_regs=REGS["producer_regs"],
                        maxnreg=REGS["maxnreg"]):
        """Launch ``_lse_bwd_g_hopper_kernel`` for one block of ``G`` (``g_desc`` over ``[rows,
        cols]``, row-major; descriptors from ``make_desc``); returns the compiled kernel."""
        rows, cols = g_desc.shape
        block_m, block_n = g_desc.block_shape
        block_k = q_desc.block_shape[1]
        tiles = -(-rows // block_m) * -(-cols // block_n)
        return _lse_bwd_g_hopper_kernel[(max(1, min(programs, tiles)),)](
            q_desc, k_desc, g_desc,
            i0, j0, rows, cols, -(-c // block_k), lab, r, a, cl, w, p, scale, rng, v,
            stride_a, stride_w, stride_p, num_rblocks, num_cblocks,
            STAGES=stages, FLAGS=flags, NCONS=consumers, CONSUMER_REGS=consumer_regs,
            PRODUCER_REGS=producer_regs, num_warps=4,
            **(dict(maxnreg=maxnreg) if consumers == 2 else {}),
        )
