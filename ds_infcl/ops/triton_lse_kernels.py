# Over 500 lines on purpose: the forward, backward and merge kernels share one set of tile helpers (_tile_dot, _scaled, _exp_shifted, _valid, _load_lse, _merge_max_sum).
"""The Triton kernels of the contrastive LSE op (their launchers, grid and chunking are in
``ds_infcl.ops.triton_lse``; the maths and the reading order are in that module's docstring)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_N]`` tile of ``q @ k^T`` (K-loop over the feature dim)."""
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + offs_m.to(tl.int64)[:, None] * stride_q + offs_k[None, :]
    k_ptrs = k_ptr + offs_n.to(tl.int64)[:, None] * stride_k + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, c, BLOCK_K):
        if EVEN_K:
            qt = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            kt = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < c
            qt = tl.load(q_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            kt = tl.load(k_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
            kt = kt.to(tl.float32)
        if PRECISION == 2:
            acc = tl.dot(qt, tl.trans(kt), acc, input_precision="tf32")
        elif PRECISION == 1:
            acc = tl.dot(qt, tl.trans(kt), acc, input_precision="ieee")
        else:  # 16-bit operands
            acc = tl.dot(qt, tl.trans(kt), acc)
        q_ptrs += BLOCK_K
        k_ptrs += BLOCK_K
    return acc


@triton.jit
def _scaled(acc, scale, EXACT_MUL: tl.constexpr):
    """Logits ``acc * scale`` rounded once to fp32, never contracted into a later FMA: with float32
    inputs forward and backward must see bit-identical logits, or at |x| ~ 1e3 a probability near
    1 would be off by ~1e-4 (the LSE of a row dominated by one logit is that very logit), which
    float32 gradients would show. 16-bit inputs fuse the exponent arguments instead
    (``_exp_shifted``): their ``G`` is rounded to 2^-9 / 2^-11 anyway."""
    if EXACT_MUL:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f",
            [acc, tl.zeros(acc.shape, tl.float32) + scale],
            dtype=tl.float32, is_pure=True, pack=1,
        )
    else:
        return acc * scale


@triton.jit
def _exp_shifted(x, x_log2, shift, FMA_EXP: tl.constexpr):
    """``exp(x - shift)`` for logits ``x`` (shapes broadcast). With ``FMA_EXP`` (16-bit inputs)
    the exponent's argument is one fused multiply-add per logit, ``x * x_log2 - shift log2(e)``:
    ``x_log2`` is ``log2(e)`` for logits, or ``scale log2(e)`` when ``x`` is the raw dot product
    (the backward: the scale multiply fuses too), instead of two or three instructions. Its
    relative error in the result is ~2^-24 |x| (1e-5 at |x| = 100), far below the 16-bit
    rounding of what it feeds. Float32 inputs keep the subtraction first (``x_log2`` unused),
    exact where ``x`` is near the shift."""
    if FMA_EXP:
        return tl.exp2(x * x_log2 - shift * LOG2E)
    else:
        return tl.exp2((x - shift) * LOG2E)


@triton.jit
def _valid(lab_ptr, offs_m, offs_n, row_ok, col_ok, EXCLUDE: tl.constexpr, HAS_LABELS: tl.constexpr):
    """The tile's entries that count: in bounds and, with ``EXCLUDE``, not a row's positive
    (``labels[i]``, or the diagonal without labels)."""
    valid = row_ok[:, None] & col_ok[None, :]
    if EXCLUDE:
        if HAS_LABELS:
            lab = tl.load(lab_ptr + offs_m, mask=row_ok, other=-1)
        else:
            lab = offs_m
        valid = valid & (offs_n[None, :] != lab[:, None])
    return valid


@triton.jit
def _load_lse(ptr, offs, ok):
    """LSE statistics as the backward reads them: a statistic of -inf (every entry of that row or
    column excluded) reads as 0, so its probabilities come out 0, never NaN; masked entries read 0."""
    x = tl.load(ptr + offs, mask=ok, other=0.0)
    return tl.where(x == float("-inf"), 0.0, x)


@triton.jit
def _merge_max_sum(m1, s1, m2, s2):
    """Merge two (max, sum of exp(x - max)) statistics; a max of -inf carries a sum of 0."""
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, s1 * tl.exp2((m1 - m_safe) * LOG2E) + s2 * tl.exp2((m2 - m_safe) * LOG2E)


@triton.jit
def _lse_fwd_rows_kernel(
    q_ptr, k_ptr, lab_ptr, row_part_ptr, scale_ptr,
    b, m, c, stride_q, stride_k,
    num_qblocks, kblocks_per_split, num_kblocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
    EXCLUDE: tl.constexpr, HAS_LABELS: tl.constexpr, FMA_EXP: tl.constexpr,
):
    """Row statistics only: ``row_part[s, i]`` = LSE of row i over the keys of split ``s``.
    Program ``(g, s)`` walks the query blocks ``g, g + G, ...`` and, for each, the key blocks of
    split ``s``, keeping each row's online (max, sum) in registers."""
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_g = tl.num_programs(0)
    scale = tl.load(scale_ptr)  # a device scalar: a learnable scale costs no host sync
    kb_lo = pid_s * kblocks_per_split
    kb_hi = tl.minimum(kb_lo + kblocks_per_split, num_kblocks)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    for qb in range(pid_g, num_qblocks, num_g):
        offs_m = qb * BLOCK_M + arange_m
        row_ok = offs_m < b
        if EXCLUDE:
            if HAS_LABELS:
                lab = tl.load(lab_ptr + offs_m, mask=row_ok, other=-1)
            else:
                lab = offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            offs_n = kb * BLOCK_N + arange_n
            col_ok = offs_n < m
            acc = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST)
            valid = row_ok[:, None] & col_ok[None, :]
            if EXCLUDE:
                valid = valid & (offs_n[None, :] != lab[:, None])
            x = tl.where(valid, _scaled(acc, scale, EXACT_MUL), float("-inf"))
            t_rmax = tl.max(x, axis=1)
            r_safe = tl.where(t_rmax == float("-inf"), 0.0, t_rmax)
            t_rsum = tl.sum(_exp_shifted(x, LOG2E, r_safe[:, None], FMA_EXP), axis=1)
            m_i, l_i = _merge_max_sum(m_i, l_i, t_rmax, t_rsum)
        row_lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)) * LN2, float("-inf"))
        tl.store(row_part_ptr + pid_s.to(tl.int64) * b + offs_m, row_lse, mask=row_ok)


@triton.jit
def _lse_fwd_kernel(
    q_ptr, k_ptr, lab_ptr, row_max_ptr, row_sum_ptr, col_max_ptr, col_sum_ptr, scale_ptr,
    b, m, c, stride_q, stride_k,
    num_qblocks, kblocks_per_split, num_kblocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
    EXCLUDE: tl.constexpr, HAS_LABELS: tl.constexpr, FMA_EXP: tl.constexpr,
):
    """Both directions' partial statistics (``(row_max, row_sum)[s, i]`` and
    ``(col_max, col_sum)[g, j]``, max and sum of ``exp(x - max)``), with no exchange between warps
    per tile.

    Program ``(g, s)`` takes each key block of split ``s`` in turn and walks the query blocks
    ``g, g + G, ...`` under it. Every tile is shifted per row by the row's own maximum ``r_i``
    (a reduction inside one warp), so ``e = exp(x - r_i)`` gives the row sums, which are merged
    into the program's slot ``(row_max, row_sum)[s, i]`` (no other program touches it). The same
    ``e`` feeds the columns without reducing them per tile: a ``[BLOCK_M / 2, BLOCK_N]`` register
    accumulator keeps ``S += e * exp(r - M)`` summed over rows i and i + 8 of each 16 (one thread
    holds both in the MMA layout), with ``M`` the running maximum of each such pair of row
    positions, and only after the last query block are ``S`` and ``M`` reduced across threads,
    once per key block, into ``(col_max, col_sum)[g, j]``. ``M`` bounds every logit it covers, so the pair is
    exact when the column's sum is at least 2^-80 (what underflows is then below 2^-30 of it); a
    key block that fails the check takes its columns again with per-tile column shifts.
    """
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_g = tl.num_programs(0)
    scale = tl.load(scale_ptr)
    kb_lo = pid_s * kblocks_per_split
    kb_hi = tl.minimum(kb_lo + kblocks_per_split, num_kblocks)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    for kb in range(kb_lo, kb_hi):
        offs_n = kb * BLOCK_N + arange_n
        col_ok = offs_n < m
        cols_full = (kb + 1) * BLOCK_N <= m
        # Rows i and i + 8 of each 16 sit in one thread of the MMA layout: pairing them halves
        # the column accumulator (the sum over the pair is inside the thread).
        acc_s = tl.zeros([BLOCK_M // 16, 8, BLOCK_N], dtype=tl.float32)
        run_m = tl.full([BLOCK_M // 16, 8], float("-inf"), dtype=tl.float32)
        for qb in range(pid_g, num_qblocks, num_g):
            offs_m = qb * BLOCK_M + arange_m
            row_ok = offs_m < b
            # This program's row slot, loaded before the GEMM so its latency hides behind it; the
            # first key block of the split starts it (no fill kernel).
            slot = pid_s.to(tl.int64) * b + offs_m
            seen = row_ok & (kb != kb_lo)
            old_max = tl.load(row_max_ptr + slot, mask=seen, other=float("-inf"))
            old_sum = tl.load(row_sum_ptr + slot, mask=seen, other=0.0)
            acc = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST)
            x = _scaled(acc, scale, EXACT_MUL)
            if EXCLUDE or (not cols_full) or ((qb + 1) * BLOCK_M > b):
                x = tl.where(_valid(lab_ptr, offs_m, offs_n, row_ok, col_ok, EXCLUDE, HAS_LABELS), x, float("-inf"))
                t_max = tl.max(x, axis=1)
                t_safe = tl.where(t_max == float("-inf"), 0.0, t_max)
            else:  # an inner tile: nothing to mask, every row has a finite maximum
                t_max = tl.max(x, axis=1)
                t_safe = t_max
            e = _exp_shifted(x, LOG2E, t_safe[:, None], FMA_EXP)
            t_sum = tl.sum(e, axis=1)
            new_max, new_sum = _merge_max_sum(old_max, old_sum, t_max, t_sum)
            tl.store(row_max_ptr + slot, new_max, mask=row_ok)
            tl.store(row_sum_ptr + slot, new_sum, mask=row_ok)
            # Columns: S = S * exp(M_old - M) + sum over the pair of e * exp(r - M), M the running
            # maximum of each pair of row positions.
            t_pair = tl.reshape(t_max, [BLOCK_M // 16, 2, 8])
            m_new = tl.maximum(run_m, tl.max(t_pair, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            keep = tl.exp2((run_m - m_safe) * LOG2E)
            gain = tl.exp2((t_pair - m_safe[:, None, :]) * LOG2E)
            e_pair = tl.reshape(e, [BLOCK_M // 16, 2, 8, BLOCK_N])
            acc_s = acc_s * keep[:, :, None] + tl.sum(e_pair * gain[:, :, :, None], axis=1)
            run_m = m_new
        c_max = tl.max(tl.max(run_m, axis=1), axis=0)
        c_safe = tl.where(c_max == float("-inf"), 0.0, c_max)
        c_sum = tl.sum(tl.sum(acc_s * tl.exp2((run_m - c_safe) * LOG2E)[:, :, None], axis=1), axis=0)
        c_max_v = tl.zeros_like(c_sum) + c_max
        least = tl.min(tl.where(col_ok, c_sum, 1.0), axis=0)
        if least < 8.271806125530277e-25:  # 2^-80: take this key block's columns exactly
            c_max_v, c_sum = _exact_cols(q_ptr, k_ptr, lab_ptr, scale, b, c, stride_q, stride_k, offs_n, col_ok,
                                         pid_g, num_qblocks, num_g, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
                                         UPCAST, EXACT_MUL, EXCLUDE, HAS_LABELS)
        cslot = pid_g.to(tl.int64) * m + offs_n
        tl.store(col_max_ptr + cslot, c_max_v, mask=col_ok)
        tl.store(col_sum_ptr + cslot, c_sum, mask=col_ok)


@triton.jit
def _exact_cols(q_ptr, k_ptr, lab_ptr, scale, b, c, stride_q, stride_k, offs_n, col_ok, g, num_qblocks, num_g,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
                EXCLUDE: tl.constexpr, HAS_LABELS: tl.constexpr):
    """(max, sum of exp(x - max)) of the columns ``offs_n`` over the query blocks ``g, g + num_g,
    ...``, each tile shifted by its own column maxima: exact whatever the rows hold (the forward
    kernels' fallback for a key block that fails their 2^-80 check)."""
    arange_m = tl.arange(0, BLOCK_M)
    c_max_v = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    c_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for qb in range(g, num_qblocks, num_g):
        offs_m = qb * BLOCK_M + arange_m
        row_ok = offs_m < b
        acc = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST)
        valid = _valid(lab_ptr, offs_m, offs_n, row_ok, col_ok, EXCLUDE, HAS_LABELS)
        x = tl.where(valid, _scaled(acc, scale, EXACT_MUL), float("-inf"))
        t_cmax = tl.max(x, axis=0)
        t_csafe = tl.where(t_cmax == float("-inf"), 0.0, t_cmax)
        t_csum = tl.sum(tl.exp2((x - t_csafe[None, :]) * LOG2E), axis=0)
        c_max_v, c_sum = _merge_max_sum(c_max_v, c_sum, t_cmax, t_csum)
    return c_max_v, c_sum


@triton.jit
def _lse_fwd_cols_redo_kernel(
    q_ptr, k_ptr, lab_ptr, redo_ptr, col_max_ptr, col_sum_ptr, scale_ptr,
    b, m, c, stride_q, stride_k, num_qblocks, num_kblocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
    EXCLUDE: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    """Program ``(g, kb)``: if the Gluon forward (``_lse_fwd_hopper_kernel``) marked key block
    ``kb`` of query group ``g`` in ``redo_ptr`` (its columns failed the 2^-80 check), their
    (max, sum) slots ``[g, j]`` again, exactly (``_exact_cols``); otherwise nothing."""
    g = tl.program_id(0)
    kb = tl.program_id(1)
    if tl.load(redo_ptr + g * num_kblocks + kb) != 0:
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < m
        c_max_v, c_sum = _exact_cols(q_ptr, k_ptr, lab_ptr, tl.load(scale_ptr), b, c, stride_q, stride_k, offs_n,
                                     col_ok, g, num_qblocks, tl.num_programs(0), BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                     PRECISION, UPCAST, EXACT_MUL, EXCLUDE, HAS_LABELS)
        cslot = g.to(tl.int64) * m + offs_n
        tl.store(col_max_ptr + cslot, c_max_v, mask=col_ok)
        tl.store(col_sum_ptr + cslot, c_sum, mask=col_ok)


@triton.jit
def _lse_bwd_g_kernel(
    q_ptr, k_ptr, lab_ptr, r_ptr, a_ptr, cl_ptr, w_ptr, p_ptr, g_ptr, scale_ptr, rng_ptr, v_ptr,
    i0, j0, rows, cols, c, stride_q, stride_k, stride_a, stride_w, stride_p, num_rblocks, num_cblocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
    EXCLUDE: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
    HAS_POS: tl.constexpr, ONE_EXP: tl.constexpr, FMA_EXP: tl.constexpr,
):
    """One tile of ``G`` for the block ``[i0, i0 + rows) x [j0, j0 + cols)``, stored row-major
    ``[rows, cols]`` at ``g_ptr``.

    ``r_ptr`` / ``cl_ptr`` hold the LSEs, read by ``_load_lse`` (a statistic of -inf reads as 0,
    so its probabilities are 0, never NaN; ``_bwd_prep_kernel`` reads them the same way). The weight vectors may have
    stride 0 (one weight for all rows/columns). The logits are rounded
    exactly as in the forward (``_scaled``), so a probability near 1 comes out as 1. With
    ``HAS_POS``, ``p_ptr[i]`` (the upstream gradient of the positive logit ``x_{i, labels_i}``) is
    added to ``G`` at each row's positive, so the loss's positive terms need no pass of their own.
    The scale gradient is not formed here: ``sum_ij G_ij q_i.k_j = sum_i q_i . (G k)_i`` comes from
    the float32 accumulator of the product that follows (see the launcher).

    With both directions and ``ONE_EXP``, one exponential per logit serves both terms:
    ``exp(x - c_j) = exp(x - r_i) * exp(r_i - L) * exp(L - c_j)``, ``L`` the smallest column LSE
    of the tile's block of columns, so ``G_ij = exp(x_ij - r_i) * (a_i + u_i v_j)`` with
    ``u_i = exp(r_i - L)`` per row and ``v_j = b_j exp(L - c_j)`` per column, which
    ``_bwd_prep_kernel`` forms once for the whole backward (``v_ptr``), with the ranges per block
    (``rng_ptr``: the largest row LSE of each block of rows, the smallest and largest column LSE
    of each block of columns). Exact when ``max r - L <= 60`` (no ``u_i`` overflows, and a term
    lost to an underflowing ``exp(x - r_i)`` is below ``e^-27`` of its column's total; a ``u_i``
    that underflows carries terms below ``e^-87`` of it) and ``max c - L <= 60`` (no ``v_j``
    underflows); a tile outside that range takes two exponentials. So a tile reduces nothing
    across its warps and holds one column vector through its products. A tile inside the block
    with no positive in it (the diagonal without labels) is stored without masks.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    scale = tl.load(scale_ptr)
    loc_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    loc_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = loc_m < rows
    col_ok = loc_n < cols
    offs_m = i0 + loc_m
    offs_n = j0 + loc_n
    if HAS_ROW:
        r = _load_lse(r_ptr, offs_m, row_ok)
        a = tl.load(a_ptr + offs_m.to(tl.int64) * stride_a, mask=row_ok, other=0.0)
    if HAS_ROW and HAS_COL:
        if ONE_EXP:
            r_hi = tl.load(rng_ptr + i0 // BLOCK_M + pid_m)
            c_lo = tl.load(rng_ptr + num_rblocks + j0 // BLOCK_N + pid_n)
            c_hi = tl.load(rng_ptr + num_rblocks + num_cblocks + j0 // BLOCK_N + pid_n)
            one_exp = (r_hi - c_lo <= 60.0) & (c_hi - c_lo <= 60.0)
            v = tl.load(v_ptr + offs_n, mask=col_ok, other=0.0)
    elif HAS_COL:
        cl = _load_lse(cl_ptr, offs_n, col_ok)
        w = tl.load(w_ptr + offs_n.to(tl.int64) * stride_w, mask=col_ok, other=0.0)
    acc = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST)
    if FMA_EXP:  # the raw dot products: the scale fuses into each exponent (_exp_shifted)
        x = acc
        x_log2 = scale * LOG2E
    else:
        x = _scaled(acc, scale, EXACT_MUL)
        x_log2 = LOG2E  # unused
    if HAS_ROW and HAS_COL:
        if ONE_EXP:
            if one_exp:
                u = tl.exp2(tl.minimum(r - c_lo, 60.0) * LOG2E)  # the bound holds in range; rows past the end read r = 0
                g = _exp_shifted(x, x_log2, r[:, None], FMA_EXP) * (a[:, None] + u[:, None] * v[None, :])
            else:  # outside the range: two exponentials
                g = _g_two_exp(x, x_log2, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w, FMA_EXP)
        else:
            g = _g_two_exp(x, x_log2, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w, FMA_EXP)
    elif HAS_ROW:
        g = a[:, None] * _exp_shifted(x, x_log2, r[:, None], FMA_EXP)
    elif HAS_COL:
        g = w[None, :] * _exp_shifted(x, x_log2, cl[None, :], FMA_EXP)
    else:
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_ptrs = g_ptr + loc_m.to(tl.int64)[:, None] * cols + loc_n[None, :]
    inside = ((pid_m + 1) * BLOCK_M <= rows) & ((pid_n + 1) * BLOCK_N <= cols)
    plain = inside
    if EXCLUDE or HAS_POS:
        if HAS_LABELS:
            plain = False
        else:  # the positives are the diagonal: does it cross this tile?
            top = i0 + pid_m * BLOCK_M
            left = j0 + pid_n * BLOCK_N
            plain = inside & ((top >= left + BLOCK_N) | (left >= top + BLOCK_M))
    if plain:
        tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty))
    else:
        in_bounds = row_ok[:, None] & col_ok[None, :]
        valid = in_bounds
        if EXCLUDE or HAS_POS:
            if HAS_LABELS:
                lab = tl.load(lab_ptr + offs_m, mask=row_ok, other=-1)
            else:
                lab = offs_m
        if EXCLUDE:
            valid = valid & (offs_n[None, :] != lab[:, None])
        g = tl.where(valid, g, 0.0)
        if HAS_POS:
            p = tl.load(p_ptr + offs_m.to(tl.int64) * stride_p, mask=row_ok, other=0.0)
            g += tl.where(in_bounds & (offs_n[None, :] == lab[:, None]), p[:, None], 0.0)
        tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _g_two_exp(x, x_log2, r, a, cl_ptr, w_ptr, offs_n, col_ok, stride_w, FMA_EXP: tl.constexpr):
    """``G`` of both directions with one exponential per direction (the columns read here)."""
    cl = _load_lse(cl_ptr, offs_n, col_ok)
    w = tl.load(w_ptr + offs_n.to(tl.int64) * stride_w, mask=col_ok, other=0.0)
    return a[:, None] * _exp_shifted(x, x_log2, r[:, None], FMA_EXP) + w[None, :] * _exp_shifted(x, x_log2, cl[None, :], FMA_EXP)


@triton.jit
def _bwd_prep_kernel(r_ptr, b, cl_ptr, w_ptr, stride_w, m, rng_ptr, v_ptr, num_rblocks, num_cblocks,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the one-exponential backward reads per block (``_lse_bwd_g_kernel``), a statistic of
    -inf read as 0: ``rng = [max r of each BLOCK_M rows, min c of each BLOCK_N columns, max c of
    each]`` and ``v_j = w_j exp(min c of j's block - c_j)``. Programs below ``num_rblocks`` take
    the rows, the others the columns."""
    pid = tl.program_id(0)
    if pid < num_rblocks:
        offs_r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        ok_r = offs_r < b
        r = _load_lse(r_ptr, offs_r, ok_r)
        tl.store(rng_ptr + pid, tl.max(tl.where(ok_r, r, float("-inf")), axis=0))
    else:
        blk = pid - num_rblocks
        offs_c = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_c = offs_c < m
        cl = _load_lse(cl_ptr, offs_c, ok_c)
        lo = tl.min(tl.where(ok_c, cl, float("inf")), axis=0)
        tl.store(rng_ptr + num_rblocks + blk, lo)
        tl.store(rng_ptr + num_rblocks + num_cblocks + blk, tl.max(tl.where(ok_c, cl, float("-inf")), axis=0))
        w = tl.load(w_ptr + offs_c.to(tl.int64) * stride_w, mask=ok_c, other=0.0)
        tl.store(v_ptr + offs_c, w * tl.exp2((lo - tl.where(ok_c, cl, lo)) * LOG2E), mask=ok_c)


@triton.jit
def _positive_kernel(q_ptr, k_ptr, lab_ptr, out_ptr, scale_ptr, row_ptr, col_ptr, b, c, stride_q, stride_k,
                     weight, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LABELS: tl.constexpr,
                     EXACT_MUL: tl.constexpr, MODE: tl.constexpr):
    """Positive logits ``pos_i = scale * q_i . k_{labels_i}`` in fp32, read row by row (``O(b c)``,
    never a ``[b, c]`` float32 copy), rounded like the tile logits.

    ``MODE`` 0 stores ``pos`` at ``out_ptr``; 1 stores this block's share of the one-direction
    InfoNCE, ``weight * sum_i (row_i - pos_i)``, at ``out_ptr[block]``; 2 the symmetric one,
    ``weight * sum_i (row_i - pos_i + col_{labels_i} - pos_i)`` (deterministic: one slot a block).
    """
    pid = tl.program_id(0)
    scale = tl.load(scale_ptr)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < b
    if HAS_LABELS:
        lab = tl.load(lab_ptr + offs_m, mask=row_ok, other=0)
    else:
        lab = offs_m
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + offs_m.to(tl.int64)[:, None] * stride_q + offs_k[None, :]
    k_ptrs = k_ptr + lab.to(tl.int64)[:, None] * stride_k + offs_k[None, :]
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, c, BLOCK_K):
        ok = row_ok[:, None] & ((k0 + offs_k) < c)[None, :]
        qt = tl.load(q_ptrs, mask=ok, other=0.0).to(tl.float32)
        kt = tl.load(k_ptrs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(qt * kt, axis=1)
        q_ptrs += BLOCK_K
        k_ptrs += BLOCK_K
    pos = _scaled(acc, scale, EXACT_MUL)
    if MODE == 0:
        tl.store(out_ptr + offs_m, pos, mask=row_ok)
    else:
        term = tl.load(row_ptr + offs_m, mask=row_ok, other=0.0) - pos
        if MODE == 2:
            term += tl.load(col_ptr + lab, mask=row_ok, other=0.0) - pos
        tl.store(out_ptr + pid, tl.sum(tl.where(row_ok, term, 0.0), axis=0) * weight)


@triton.jit
def _merge_parts(max_ptr, sum_ptr, num_parts, n, offs, ok, HAS_SUM: tl.constexpr):
    """LSE over ``num_parts`` partial statistics of ``n`` entries: the partials are LSE values
    (``HAS_SUM`` false) or (max, sum of exp(x - max)) pairs, where a sum of 0 means nothing was
    summed. An entry with nothing to sum stays ``-inf``."""
    mx = tl.full(offs.shape, float("-inf"), dtype=tl.float32)
    for p in range(num_parts):
        v = tl.load(max_ptr + p * n + offs, mask=ok, other=float("-inf"))
        if HAS_SUM:
            v = tl.where(tl.load(sum_ptr + p * n + offs, mask=ok, other=0.0) > 0.0, v, float("-inf"))
        mx = tl.maximum(mx, v)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.zeros(offs.shape, dtype=tl.float32)
    for p in range(num_parts):
        e = tl.exp2((tl.load(max_ptr + p * n + offs, mask=ok, other=float("-inf")) - safe) * LOG2E)
        if HAS_SUM:
            sm = tl.load(sum_ptr + p * n + offs, mask=ok, other=0.0)
            e = tl.where(sm > 0.0, sm * e, 0.0)
        tot += e
    return tl.where(tot > 0.0, safe + tl.log2(tl.where(tot > 0.0, tot, 1.0)) * LN2, float("-inf"))


@triton.jit
def _merge_stats_kernel(row_part_ptr, row_sum_ptr, num_splits, b, row_out_ptr, col_max_ptr, col_sum_ptr,
                        num_groups, m, col_out_ptr, num_row_blocks, BLOCK: tl.constexpr,
                        COMPUTE_COL: tl.constexpr, ROW_HAS_SUM: tl.constexpr):
    """The forward's partial statistics into LSE vectors, in one launch: programs below
    ``num_row_blocks`` merge the ``[S, b]`` row partials (LSE values, or (max, sum of exp) pairs
    with ``ROW_HAS_SUM``), the others the ``[G, m]`` column (max, sum of exp) pairs."""
    pid = tl.program_id(0)
    if pid < num_row_blocks:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        ok = offs < b
        lse = _merge_parts(row_part_ptr, row_sum_ptr, num_splits, b, offs, ok, ROW_HAS_SUM)
        tl.store(row_out_ptr + offs, lse, mask=ok)
    elif COMPUTE_COL:
        offs = (pid - num_row_blocks) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < m
        lse = _merge_parts(col_max_ptr, col_sum_ptr, num_groups, m, offs, ok, True)
        tl.store(col_out_ptr + offs, lse, mask=ok)


@triton.jit
def _scale_out_kernel(acc_ptr, factor_ptr, out_ptr, own_ptr, ds_ptr, add_ptr, add_factor_ptr, rows, c, stride_own,
                      stride_add, ds_offset, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_DOT: tl.constexpr,
                      HAS_ADD: tl.constexpr):
    """``out = acc * factor`` (rounded once into the dtype of ``out``; in place when ``out`` is
    ``acc``) for ``rows`` rows of a float32 accumulator; with ``HAS_ADD``, ``acc`` stands for
    ``acc + add * add_factor`` throughout (another block's sums, before the scale: the gather path's
    two blocks of ``dq``); with ``HAS_DOT`` also this block's share of the scale gradient,
    ``sum(acc * own)`` (before scaling), at ``ds_ptr[ds_offset + block]``."""
    pid = tl.program_id(0)
    factor = tl.load(factor_ptr)
    offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    offs_c = tl.arange(0, BLOCK_C)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, c, BLOCK_C):
        ok = r_ok[:, None] & ((c0 + offs_c) < c)[None, :]
        idx = offs_r.to(tl.int64)[:, None] * c + (c0 + offs_c)[None, :]
        acc = tl.load(acc_ptr + idx, mask=ok, other=0.0)
        if HAS_ADD:
            add = tl.load(add_ptr + offs_r.to(tl.int64)[:, None] * stride_add + (c0 + offs_c)[None, :],
                          mask=ok, other=0.0)
            acc += add * tl.load(add_factor_ptr)
        if HAS_DOT:
            own = tl.load(own_ptr + offs_r.to(tl.int64)[:, None] * stride_own + (c0 + offs_c)[None, :],
                          mask=ok, other=0.0)
            dot += tl.sum(acc * own.to(tl.float32), axis=1)
        tl.store(out_ptr + idx, (acc * factor).to(out_ptr.dtype.element_ty), mask=ok)
    if HAS_DOT:
        tl.store(ds_ptr + ds_offset + pid, tl.sum(dot, axis=0))
