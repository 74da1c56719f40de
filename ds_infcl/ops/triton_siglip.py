"""Triton kernels of SigLIP's sigmoid loss: one pass forward, one recompute backward.

Maths (``ds_infcl.ops.siglip``, DESIGN.md section 9). Logits ``x_ij = s * q_i . k_j + t``,
``(i, j)`` positive iff ``query_ids[i] == key_ids[j]``::

    forward    sum_ij softplus(-z_ij x_ij)          (z = +1 positive, -1 negative)
    backward   G_ij = w (sigmoid(x_ij) - [positive])
               dq = s G @ k      dk = s G^T @ q      ds = sum_ij G_ij (q_i . k_j)      dt = sum_ij G_ij

with ``w`` the upstream weight (a device scalar: the loss gradient over ``B``).

* ``_siglip_fwd_kernel``: program ``(i, p)`` takes query block ``i`` against the key blocks of
  split ``p`` (splits keep every SM busy when ``b`` is small), one GEMM per ``[BLOCK_M, BLOCK_N]``
  tile with fp32 accumulation and a softplus epilogue; it writes one float32 partial sum, so the
  scratch is a few floats per program and nothing of size ``b x m`` exists.
  ``softplus(z) = max(z, 0) + log1p(exp(-|z|))`` with an accurate ``log1p`` (a polynomial, see
  ``_softplus``): most SigLIP pairs sit near ``x = -10``, where ``log(1 + exp(x))`` in float32
  would lose 0.1% of every term.
* ``_siglip_bwd_g_kernel``: recomputes a tile of logits once and writes ``G`` (in the operands'
  dtype, weights pre-scaled by a power of two in fp16) for a bounded block; the partial sums of
  ``G`` (for ``dt``) are taken in float32 before the cast. The products ``G @ k`` and ``G^T @ q``
  and the scale gradient run on the vendor GEMM through ``triton_lse.chunked_g_products``, shared
  with the InfoNCE backward.

The scale and the bias are read through pointers (no host sync); a loss step can be captured in a
CUDA graph.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ds_infcl.ops.triton_lse_kernels import LOG2E, _scaled, _tile_dot
from ds_infcl.ops.triton_lse import (
    _LAST_KERNELS,
    _check_inputs,
    _grad_scale,
    _kernel_flags,
    _num_sms,
    _on_device,
    _pick_config,
    _scale_arg,
    chunk_blocks,
    chunked_g_products,
)

__all__ = ["siglip_forward_triton", "siglip_backward_triton"]


@triton.jit
def _softplus(z):
    """``log(1 + exp(z)) = max(z, 0) + log1p(u)``, ``u = exp(-|z|)`` in ``(0, 1]``, without overflow.

    ``log1p(u) = u * P(u)`` with ``P`` a degree-8 polynomial fitted to ``log1p(u) / u`` on
    ``[0, 1]`` (relative error 3.5e-8, 2.3e-7 evaluated in float32): one exponential and eight
    FMAs per logit, where ``log(1 + u)`` would lose 0.1% of the small terms near SigLIP's start
    (``z ~ -10``) and the exact ``u log(1 + u) / ((1 + u) - 1)`` costs a logarithm and a division
    (the forward ran at 28% of the matmul rate with it, docs/siglip.md).
    """
    u = tl.exp2(-tl.abs(z) * LOG2E)
    p = 0.00510749968 * u - 0.0289988678
    p = p * u + 0.0773923569
    p = p * u - 0.135916199
    p = p * u + 0.19071807
    p = p * u - 0.248340779
    p = p * u + 0.333179518
    p = p * u - 0.499994366
    p = p * u + 0.999999965
    return tl.maximum(z, 0.0) + u * p


@triton.jit
def _siglip_fwd_kernel(
    q_ptr, k_ptr, qid_ptr, kid_ptr, part_ptr, scale_ptr, bias_ptr,
    b, m, c, stride_q, stride_k, kblocks_per_split, num_kblocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
):
    """``part[p, i]`` = sum of ``softplus(-z x)`` over query block ``i`` and the key blocks of
    split ``p``."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    scale = tl.load(scale_ptr)
    bias = tl.load(bias_ptr)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < b
    qid = tl.load(qid_ptr + offs_m, mask=row_ok, other=-1)
    arange_n = tl.arange(0, BLOCK_N)
    rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    kb_lo = pid_s * kblocks_per_split
    kb_hi = tl.minimum(kb_lo + kblocks_per_split, num_kblocks)
    for kb in range(kb_lo, kb_hi):
        offs_n = kb * BLOCK_N + arange_n
        col_ok = offs_n < m
        kid = tl.load(kid_ptr + offs_n, mask=col_ok, other=-1)
        acc = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST)
        x = _scaled(acc, scale, EXACT_MUL) + bias
        z = tl.where(qid[:, None] == kid[None, :], -x, x)
        sp = tl.where(row_ok[:, None] & col_ok[None, :], _softplus(z), 0.0)
        rows += tl.sum(sp, axis=1)
    tl.store(part_ptr + pid_s * tl.num_programs(0) + pid_m, tl.sum(rows, axis=0))


@triton.jit
def _siglip_bwd_g_kernel(
    q_ptr, k_ptr, qid_ptr, kid_ptr, g_ptr, sums_ptr, scale_ptr, bias_ptr, w_ptr,
    i0, j0, rows, cols, c, stride_q, stride_k, sums_offset, sums_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EXACT_MUL: tl.constexpr,
):
    """One tile of ``G = w (sigmoid(x) - [positive])`` for the block ``[i0, i0 + rows) x
    [j0, j0 + cols)``, stored row-major ``[rows, cols]`` at ``g_ptr``; the tile's float32 sums of
    ``G`` (for ``dt``) and of ``G * (q . k)`` (for ``ds``) at ``sums_ptr[sums_offset + tile]`` and
    one ``sums_stride`` further, from ``G`` before its rounding to the operands' dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    scale = tl.load(scale_ptr)
    bias = tl.load(bias_ptr)
    w = tl.load(w_ptr)
    loc_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    loc_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = loc_m < rows
    col_ok = loc_n < cols
    offs_m = i0 + loc_m
    offs_n = j0 + loc_n
    qid = tl.load(qid_ptr + offs_m, mask=row_ok, other=-1)
    kid = tl.load(kid_ptr + offs_n, mask=col_ok, other=-1)
    acc = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, row_ok, col_ok, c, stride_q, stride_k,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST)
    x = _scaled(acc, scale, EXACT_MUL) + bias
    sig = 1.0 / (1.0 + tl.exp2(-x * LOG2E))
    pos = qid[:, None] == kid[None, :]
    in_bounds = row_ok[:, None] & col_ok[None, :]
    g = tl.where(in_bounds, w * (sig - tl.where(pos, 1.0, 0.0)), 0.0)
    g_ptrs = g_ptr + loc_m.to(tl.int64)[:, None] * cols + loc_n[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=in_bounds)
    tile = sums_offset + pid_m * tl.num_programs(1) + pid_n
    tl.store(sums_ptr + tile, tl.sum(tl.sum(g, axis=1), axis=0))
    tl.store(sums_ptr + sums_stride + tile, tl.sum(tl.sum(g * acc, axis=1), axis=0))


def _ids_arg(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    return ids.to(device=device, dtype=torch.int64).contiguous()


def siglip_forward_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
) -> torch.Tensor:
    """0-dim float32 ``sum_ij softplus(-z_ij x_ij)``: one tile launch and one sum."""
    query, key = _check_inputs(query, key)
    b, c = query.shape
    m = key.shape[0]
    device = query.device
    if b == 0 or m == 0:
        return torch.zeros((), device=device, dtype=torch.float32)
    cfg = _pick_config("fwd", b, m, c, query.dtype, device)
    num_qblocks = triton.cdiv(b, cfg.block_m)
    num_kblocks = triton.cdiv(m, cfg.block_n)
    # Split the keys until there are about two programs per SM.
    splits = max(1, min(num_kblocks, triton.cdiv(2 * _num_sms(device), num_qblocks)))
    kblocks_per_split = triton.cdiv(num_kblocks, splits)
    splits = triton.cdiv(num_kblocks, kblocks_per_split)
    part = torch.empty((splits, num_qblocks), device=device, dtype=torch.float32)
    with _on_device(query):
        _LAST_KERNELS["siglip_fwd"] = _siglip_fwd_kernel[(num_qblocks, splits)](
            query, key, _ids_arg(query_ids, device), _ids_arg(key_ids, device), part,
            _scale_arg(scale, device), _scale_arg(bias, device),
            b, m, c, query.stride(0), key.stride(0), kblocks_per_split, num_kblocks,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            **cfg.launch_opts(), **_kernel_flags(query, c, cfg.block_k),
        )
    return part.sum()


def siglip_backward_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: Optional[torch.dtype] = None,
    accumulate: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [b, c], dk [m, c], dscale [], dbias [])`` of ``weight * forward``; ``dq`` / ``dk``
    float32 or ``out_dtype`` (see ``triton_lse.chunked_g_products``).

    With ``accumulate=(dq_acc, dk_acc)`` (float32) ``G @ k`` and ``G^T @ q`` are added into them
    *without* the factor ``scale`` and they are returned; ``G`` is stored with ``weight`` as given
    (fp16 operands: the caller keeps ``weight`` near 1, see ``ds_infcl.loss.siglip``)."""
    query, key = _check_inputs(query, key)
    b, c = query.shape
    m = key.shape[0]
    device = query.device
    f32 = torch.float32
    res_dtype = out_dtype or f32
    if b == 0 or m == 0:
        zero = torch.zeros((), device=device, dtype=f32)
        if accumulate is not None:
            return accumulate[0], accumulate[1], zero, zero.clone()
        return (torch.zeros((b, c), device=device, dtype=res_dtype),
                torch.zeros((m, c), device=device, dtype=res_dtype), zero, zero.clone())
    s_t, t_t = _scale_arg(scale, device), _scale_arg(bias, device)
    w = weight.detach().reshape(1).to(device=device, dtype=f32)
    # fp16 G needs the weight brought near 1 (1/B underflows fp16); bf16 and fp32 have the range.
    gs = _grad_scale(w) if query.dtype == torch.float16 and accumulate is None else None
    if gs is not None:
        w = w * gs
    cfg = _pick_config("bwd", b, m, c, query.dtype, device)
    flags = _kernel_flags(query, c, cfg.block_k)
    qid, kid = _ids_arg(query_ids, device), _ids_arg(key_ids, device)
    # Per tile of every block, the float32 partial sums of G and of G (q . k) (a block has at most
    # the tiles of the largest one; zeros where a ragged block has fewer). The scale gradient is
    # taken here rather than from the products of the rounded G: sigmoid terms of both signs
    # cancel in it, and a 16-bit G would cost it ~1e-3 of relative accuracy.
    g_dtype = f32 if flags["UPCAST"] else query.dtype
    max_rows, max_cols = chunk_blocks(b, m, c, out_dtype, g_dtype, device, accumulate=accumulate is not None)
    blocks = triton.cdiv(b, max_rows) * triton.cdiv(m, max_cols)
    tiles_per_block = triton.cdiv(max_rows, cfg.block_m) * triton.cdiv(max_cols, cfg.block_n)
    num_tiles = blocks * tiles_per_block
    sums = torch.zeros((2, num_tiles), device=device, dtype=f32)

    def launch_g(g, i0, j0, rows, cols, block):
        grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(cols, cfg.block_n))
        _LAST_KERNELS["siglip_bwd"] = _siglip_bwd_g_kernel[grid](
            query, key, qid, kid, g, sums, s_t, t_t, w,
            i0, j0, rows, cols, c, query.stride(0), key.stride(0), block * tiles_per_block, num_tiles,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            **cfg.launch_opts(), **flags,
        )

    factor = s_t / gs if gs is not None else s_t
    dq, dk, _ = chunked_g_products(query, key, factor, launch_g, out_dtype, flags["UPCAST"],
                                   with_dscale=False, accumulate=accumulate)
    dt, ds = sums.sum(dim=1)
    if gs is not None:
        ds, dt = ds / gs, dt / gs
    return dq, dk, ds.reshape(()), dt.reshape(())
