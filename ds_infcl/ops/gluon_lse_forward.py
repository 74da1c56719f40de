"""The forward's statistics for Hopper (sm_90) in Gluon: ``_lse_fwd_hopper_kernel``, the maths
and outputs of the Triton ``_lse_fwd_kernel`` (``ds_infcl.ops.triton_lse_kernels``) in the
structure of the backward's Gluon ``G`` kernel (``ds_infcl.ops.gluon_lse_kernels``).

Why (issue 17): the Triton forward runs each tile's K-loop from a cold pipeline and its epilogue
while no product runs: 11.6 ms at 65,536 x 512 on an H200, for the work of one 5.8 ms GEMM.

Two consumer warpgroups per program, each one program ``(g, s)`` of the Triton kernel's grid
(virtual program ``v = pid + which * P``) with its own producer warp and ring of TMA slots,
take turns at the tensor cores; the one with fewer tiles keeps passing the turn until the other
is done. Rows are merged per tile into their ``[S, b]`` (max, sum) slots as in the Triton
kernel. For the columns each thread folds its own four rows of a tile (``_fold_rows``: rows
``64 a + 16 w + 8 h + l`` of a 4-warp MMA tile, ``a`` and ``h`` in its registers) into a
``[4, 8, BN]`` accumulator under one running maximum per thread, reduced across the warpgroup
once per key block into the ``[G, m]`` slots. A key block whose columns fail the 2^-80 check is
marked in ``redo`` for the exact Triton pass ``_lse_fwd_cols_redo_kernel``. Measured
(docs/kernels.md): 7.1-7.6 against 11.6 ms at 65,536 x 512 on an H200.

The launcher (``ds_infcl.ops.triton_lse``) takes it on Hopper for 16-bit inputs whose rows are
16-byte aligned, with at least two 128-tiles per SM (``DS_INFCL_GLUON``). Its CPU check is an
ahead-of-time compile for sm_90 (``ds_infcl.bench.triton_sass --kernels fwd_gluon``).
"""

from __future__ import annotations

from ds_infcl.ops.gluon_lse_kernels import AVAILABLE, REGS

if AVAILABLE:  # Gluon is experimental: absent from older Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from ds_infcl.ops.gluon_lse_kernels import LOG2E, _ring_buffers, _ring_loads, _ring_products

__all__ = ["FLAG_BITS", "launch_fwd_hopper"]

# The kernel's constexpr switches, carried into the warp-specialized partitions as the length of a
# small shared-memory buffer (as ``gluon_lse_kernels.FLAG_BITS``); ``gluon_lse_kernels.g_flags``
# makes the mask.
FLAG_BITS = dict(EXCLUDE=1, HAS_LABELS=2, PINGPONG=4)

if AVAILABLE:

    @gluon.jit
    def _fwd_work(which, groups, num_virtual, kblocks_per_split, num_kblocks):
        """Virtual program ``v`` of this partition (consumer / producer ``which``): query group
        ``g``, key split ``s``, its key blocks ``[kb_lo, kb_hi)``; ``v >= num_virtual`` has none."""
        v = gl.program_id(0) + which * gl.num_programs(0)
        g = v % groups
        kb_lo = (v // groups) * kblocks_per_split
        kb_hi = gl.minimum(kb_lo + kblocks_per_split, num_kblocks)
        kb_hi = gl.where(v < num_virtual, kb_hi, kb_lo)
        return v, g, kb_lo, kb_hi

    @gluon.jit
    def _fwd_tiles(which, num_qblocks, groups, num_virtual, kblocks_per_split, num_kblocks):
        """The number of tiles of partition ``which``'s virtual program."""
        v, g, kb_lo, kb_hi = _fwd_work(which, groups, num_virtual, kblocks_per_split, num_kblocks)
        return (kb_hi - kb_lo) * ((num_qblocks - g + groups - 1) // groups)

    @gluon.jit
    def _f_produce(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, num_qblocks, kblocks_per_split, num_kblocks,
                   groups, num_virtual, ksteps, WHICH: gl.constexpr):
        """One warp: the operands of consumer ``WHICH``'s tiles (key block by key block, the
        group's query blocks under each), K step by K step, into its ring."""
        STAGES: gl.constexpr = q_bufs.type.shape[0] // 2
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        v, g, kb_lo, kb_hi = _fwd_work(WHICH, groups, num_virtual, kblocks_per_split, num_kblocks)
        cnt = 0
        for kb in range(kb_lo, kb_hi):
            for qb in range(g, num_qblocks, groups):
                cnt = _ring_loads(q_desc, k_desc, q_bufs, k_bufs, ready, empty, qb * BM, kb * BN, cnt, ksteps,
                                  WHICH, STAGES)

    @gluon.jit
    def _fold_rows(x, op: gl.constexpr):
        """``[BM, BN]`` (or ``[BM]``) in the MMA layout -> ``[4, 8, BN]`` (``[4, 8]``): each
        thread's own rows (i, i + 8 of every 16, every 64th) combined by ``op`` (0 sum, 1 max),
        with no exchange between threads: row ``r`` of a 4-warp MMA tile is ``r = 64 a + 16 w +
        8 h + l``, ``w`` the warp, ``l`` the lane's row, ``a`` and ``h`` in one thread's
        registers."""
        if len(x.shape) == 2:
            x5 = gl.reshape(x, [x.shape[0] // 64, 4, 2, 8, x.shape[1]])
        else:
            x5 = gl.reshape(x, [x.shape[0] // 64, 4, 2, 8])
        if op == 0:
            return gl.sum(gl.sum(x5, axis=2), axis=0)
        else:
            return gl.max(gl.max(x5, axis=2), axis=0)

    @gluon.jit
    def _unfold_rows(t, like):
        """``[4, 8]`` per-thread values back onto the thread's rows: ``[BM]`` in ``like``'s layout."""
        BM: gl.constexpr = like.shape[0]
        t = gl.convert_layout(t, _fold_rows(like, 1).type.layout)  # (the fold itself is dead code)
        t4 = gl.expand_dims(gl.expand_dims(t, 0), 2)
        t4 = t4.broadcast_to(BM // 64, 4, 2, 8)
        return gl.convert_layout(gl.reshape(t4, [BM]), like.type.layout)

    @gluon.jit
    def _merge_max_sum_g(m1, s1, m2, s2):
        """As ``_merge_max_sum``: two (max, sum of exp(x - max)) into one; a max of -inf carries 0."""
        mx = gl.maximum(m1, m2)
        safe = gl.where(mx == float("-inf"), 0.0, mx)
        return mx, s1 * gl.exp2((m1 - safe) * LOG2E) + s2 * gl.exp2((m2 - safe) * LOG2E)

    @gluon.jit
    def _f_consume(q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr, col_max_ptr,
                   col_sum_ptr, redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks, groups,
                   num_virtual, ksteps, WHICH: gl.constexpr):
        """One warpgroup, as one program ``(g, s)`` of ``_lse_fwd_kernel``: for each key block of
        split ``s``, the tiles of query group ``g`` under it; rows merged per tile into the slots
        ``[s, i]``, columns into a register accumulator of each thread's own rows, reduced across
        the warpgroup once per key block into ``[g, j]``. A key block whose columns fail the 2^-80
        check is marked in ``redo_ptr[g, kb]`` for ``_lse_fwd_cols_redo_kernel``."""
        FLAGS: gl.constexpr = flag_buf.type.shape[0] - 1  # the bits of FLAG_BITS
        EXCLUDE: gl.constexpr = (FLAGS & 1) != 0
        HAS_LABELS: gl.constexpr = (FLAGS & 2) != 0
        PINGPONG: gl.constexpr = (FLAGS & 4) != 0
        STAGES: gl.constexpr = q_bufs.type.shape[0] // 2
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        v, g, kb_lo, kb_hi = _fwd_work(WHICH, groups, num_virtual, kblocks_per_split, num_kblocks)
        s_id = v // groups
        scale = gl.load(scale_ptr)
        arange_m = gl.arange(0, BM, layout=row_l)
        arange_n = gl.arange(0, BN, layout=col_l)
        zero = gl.zeros((BM, BN), dtype=gl.float32, layout=mma)
        cnt = 0
        j = 0  # turns taken at the tensor cores (ping-pong with the other warpgroup)
        for kb in range(kb_lo, kb_hi):
            offs_n = kb * BN + arange_n
            col_ok = offs_n < m
            cols_full = (kb + 1) * BN <= m
            acc_s = _fold_rows(zero, 0)  # the column sums of each thread's rows, shifted by run_m
            run_m = gl.max(acc_s, axis=2) - float("inf")  # [4, 8]: the threads' running maxima
            for qb in range(g, num_qblocks, groups):
                offs_m = qb * BM + arange_m
                row_ok = offs_m < b
                slot = s_id.to(gl.int64) * b + offs_m
                seen = row_ok & (kb != kb_lo)
                old_max = gl.load(row_max_ptr + slot, mask=seen, other=float("-inf"))
                old_sum = gl.load(row_sum_ptr + slot, mask=seen, other=0.0)
                acc, cnt = _ring_products(q_bufs, k_bufs, ready, empty, turn, zero, cnt, j, ksteps, WHICH, STAGES,
                                          PINGPONG)
                j += 1
                x = acc * scale
                masked = (not cols_full) or ((qb + 1) * BM > b)
                if EXCLUDE:
                    if HAS_LABELS:
                        masked = True
                    else:  # only the tiles that the diagonal crosses hold positives
                        masked = masked or ((qb * BM < (kb + 1) * BN) and (kb * BN < (qb + 1) * BM))
                if masked:
                    valid = gl.expand_dims(row_ok, 1) & gl.expand_dims(col_ok, 0)
                    if EXCLUDE:
                        if HAS_LABELS:
                            lab = gl.load(lab_ptr + offs_m, mask=row_ok, other=-1)
                        else:
                            lab = offs_m
                        valid = valid & (gl.expand_dims(offs_n, 0) != gl.expand_dims(lab, 1))
                    x = gl.where(valid, x, float("-inf"))
                    t_max = gl.max(x, axis=1)
                    t_safe = gl.where(t_max == float("-inf"), 0.0, t_max)
                else:  # an inner tile: nothing to mask, every row has a finite maximum
                    t_max = gl.max(x, axis=1)
                    t_safe = t_max
                e = gl.exp2(x * LOG2E - gl.expand_dims(t_safe * LOG2E, 1))
                new_max, new_sum = _merge_max_sum_g(old_max, old_sum, t_max, gl.sum(e, axis=1))
                gl.store(row_max_ptr + slot, new_max, mask=row_ok)
                gl.store(row_sum_ptr + slot, new_sum, mask=row_ok)
                # Columns: S = S exp(M_old - M) + sum over the thread's rows of e exp(t_i - M), M
                # the running maximum of the thread's row maxima (a bound on every logit it holds).
                m_new = gl.maximum(run_m, gl.convert_layout(_fold_rows(t_max, 1), run_m.type.layout))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                keep = gl.exp2((run_m - m_safe) * LOG2E)
                gain = gl.exp2((t_max - _unfold_rows(m_safe, t_max)) * LOG2E)
                acc_s = acc_s * gl.expand_dims(keep, 2) + gl.convert_layout(
                    _fold_rows(e * gl.expand_dims(gain, 1), 0), acc_s.type.layout)
                run_m = m_new
            c_max = gl.max(gl.max(run_m, axis=1), axis=0)
            c_safe = gl.where(c_max == float("-inf"), 0.0, c_max)
            c_sum = gl.sum(gl.sum(acc_s * gl.expand_dims(gl.exp2((run_m - c_safe) * LOG2E), 2), axis=1), axis=0)
            c_sum = gl.convert_layout(c_sum, col_l)
            least = gl.min(gl.where(col_ok, c_sum, 1.0), axis=0)
            gl.store(redo_ptr + g * num_kblocks + kb, (least < 8.271806125530277e-25).to(gl.int32))
            cslot = g.to(gl.int64) * m + offs_n
            gl.store(col_max_ptr + cslot, gl.zeros_like(c_sum) + c_max, mask=col_ok)
            gl.store(col_sum_ptr + cslot, c_sum, mask=col_ok)
        # The virtual programs' tile counts may differ: the warpgroup with fewer tiles passes the
        # turn on until the other one is done.
        other = _fwd_tiles(1 - WHICH, num_qblocks, groups, num_virtual, kblocks_per_split, num_kblocks)
        if not PINGPONG:
            other = 0
        for jj in range(j, other):
            mbarrier.wait(turn.index(WHICH), (jj & 1) ^ (1 - WHICH))
            mbarrier.arrive(turn.index(1 - WHICH), count=1)

    @gluon.jit
    def _f_consumer0(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr,
                     col_max_ptr, col_sum_ptr, redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks,
                     groups, num_virtual, ksteps):
        _f_consume(q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr, col_max_ptr, col_sum_ptr,
                   redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks, groups, num_virtual, ksteps, 0)

    @gluon.jit
    def _f_consumer1(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr,
                     col_max_ptr, col_sum_ptr, redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks,
                     groups, num_virtual, ksteps):
        _f_consume(q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr, col_max_ptr, col_sum_ptr,
                   redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks, groups, num_virtual, ksteps, 1)

    @gluon.jit
    def _f_producer0(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr,
                     col_max_ptr, col_sum_ptr, redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks,
                     groups, num_virtual, ksteps):
        _f_produce(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, num_qblocks, kblocks_per_split, num_kblocks,
                   groups, num_virtual, ksteps, 0)

    @gluon.jit
    def _f_producer1(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr,
                     col_max_ptr, col_sum_ptr, redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks,
                     groups, num_virtual, ksteps):
        _f_produce(q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, num_qblocks, kblocks_per_split, num_kblocks,
                   groups, num_virtual, ksteps, 1)

    @gluon.jit
    def _lse_fwd_hopper_kernel(q_desc, k_desc, lab_ptr, row_max_ptr, row_sum_ptr, col_max_ptr, col_sum_ptr, redo_ptr,
                               scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks, groups, num_virtual, ksteps,
                               STAGES: gl.constexpr, FLAGS: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """The forward's partial statistics (``_lse_fwd_kernel``'s ``[S, b]`` row and ``[G, m]``
        column (max, sum) slots) over ``G x S`` virtual programs, two per program (one per
        consumer warpgroup: ``v = pid + which * P``), each with its own producer warp and ring."""
        q_bufs, k_bufs, ready, empty, turn = _ring_buffers(q_desc, k_desc, 2, STAGES)
        flag_buf = gl.allocate_shared_memory(gl.int8, [FLAGS + 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        args = (q_desc, k_desc, q_bufs, k_bufs, flag_buf, ready, empty, turn, lab_ptr, row_max_ptr, row_sum_ptr, col_max_ptr,
                col_sum_ptr, redo_ptr, scale_ptr, b, m, num_qblocks, kblocks_per_split, num_kblocks, groups,
                num_virtual, ksteps)
        gl.warp_specialize([(_f_consumer0, args), (_f_consumer1, args), (_f_producer0, args), (_f_producer1, args)],
                           [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])

    def launch_fwd_hopper(q_desc, k_desc, lab, row_max, row_sum, col_max, col_sum, redo, scale, b, m, num_qblocks,
                          kblocks_per_split, num_kblocks, groups, splits, c, flags, stages,
                          consumer_regs=REGS["consumer_regs"], producer_regs=REGS["producer_regs"],
                          maxnreg=REGS["maxnreg"]):
        """Launch ``_lse_fwd_hopper_kernel`` over ``groups x splits`` virtual programs (two per
        program); returns the compiled kernel."""
        num_virtual = groups * splits
        return _lse_fwd_hopper_kernel[(-(-num_virtual // 2),)](
            q_desc, k_desc, lab, row_max, row_sum, col_max, col_sum, redo, scale,
            b, m, num_qblocks, kblocks_per_split, num_kblocks, groups, num_virtual, -(-c // q_desc.block_shape[1]),
            STAGES=stages, FLAGS=flags, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
            num_warps=4, maxnreg=maxnreg,
        )
