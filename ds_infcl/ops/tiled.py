"""Tiled log-sum-exp of contrastive logits in pure PyTorch (any device, linear memory).

Maths (DESIGN.md section 2). For queries ``q [b, c]``, keys ``k [m, c]`` and scale ``s``, the
logits are ``x_ij = s * q_i . k_j``; with ``exclude_positive`` the pair ``(i, labels_i)`` is left
out (``x = -inf`` there). The forward returns

    row_lse_i = log sum_j exp(x_ij)        col_lse_j = log sum_i exp(x_ij)

one ``[tile_b, tile_m]`` tile at a time, merging tile results with ``logaddexp``. Given upstream
gradients ``a_i = dL/d row_lse_i`` and ``b_j = dL/d col_lse_j`` the backward recomputes each tile
once and forms

    G_ij = a_i exp(x_ij - row_lse_i) + b_j exp(x_ij - col_lse_j)
    dq_i = s * sum_j G_ij k_j     dk_j = s * sum_i G_ij q_i     ds = sum_i q_i . (sum_j G_ij k_j)

so the scale gradient needs no extra pass. Everything accumulates in float32 whatever the input
dtype. Memory is O((b + m) * c) plus O(tile_b * tile_m) scratch.

These block functions are also the unit of work of the ring (``ds_infcl.loss``): ``row_lse`` and
``col_lse`` passed to the backward may be the *global* statistics of a larger matrix of which
``(q, k)`` is one block.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = [
    "DEFAULT_TILE",
    "default_tile_size",
    "lse_forward_torch",
    "lse_backward_torch",
    "positive_logits_torch",
    "labels_or_diagonal",
]

# Tile edges measured to be fastest: on CPU a 1024 x 1024 float32 tile (4 MiB) stays in cache
# (1024: 0.36 s, 2048: 0.39 s, 4096: 0.73 s for b = m = 4096, c = 256, forward + backward, 2
# cores); on GPUs larger tiles cut kernel launches, and 4096 x 4096 (64 MiB) is still far below
# the inputs at the batch sizes where this path is used.
DEFAULT_TILE = 1024
DEFAULT_TILE_CUDA = 4096


def default_tile_size(device: torch.device) -> int:
    """Tile edge used when none is given: ``DEFAULT_TILE`` on CPU, ``DEFAULT_TILE_CUDA`` on GPUs."""
    return DEFAULT_TILE_CUDA if device.type == "cuda" else DEFAULT_TILE


def _positive_mask_coords(
    labels: Optional[torch.Tensor], i0: int, i1: int, j0: int, j1: int
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Tile-local (row, col) coordinates of the excluded positives that fall in this tile."""
    lab = labels[i0:i1]
    hit = (lab >= j0) & (lab < j1)
    rows = hit.nonzero(as_tuple=True)[0]
    if rows.numel() == 0:
        return None
    return rows, lab[rows] - j0


def _tile_logits(qf_tile, kf_tile, scale, labels, exclude_positive, i0, i1, j0, j1):
    x = qf_tile @ kf_tile.T
    x.mul_(scale)
    if exclude_positive:
        coords = _positive_mask_coords(labels, i0, i1, j0, j1)
        if coords is not None:
            x[coords] = float("-inf")
    return x


def labels_or_diagonal(labels: Optional[torch.Tensor], b: int, device) -> torch.Tensor:
    """int64 ``[b]`` labels on ``device``; ``None`` means the diagonal (query i's positive is key i)."""
    return torch.arange(b, device=device) if labels is None else labels.to(device=device, dtype=torch.long)


def lse_forward_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    compute_col: bool = True,
    tile_b: int = DEFAULT_TILE,
    tile_m: int = DEFAULT_TILE,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row LSE ``[b]`` and (if ``compute_col``) column LSE ``[m]``, both float32.

    A row or column whose every entry is excluded gets ``-inf``. Empty ``query`` or ``key`` give
    ``-inf`` statistics of the right length (useful for ring blocks of size 0).
    """
    b, m = query.shape[0], key.shape[0]
    device = query.device
    row = torch.full((b,), float("-inf"), device=device, dtype=torch.float32)
    col = torch.full((m,), float("-inf"), device=device, dtype=torch.float32) if compute_col else None
    if b == 0 or m == 0:
        return row, col
    qf, kf = query.float(), key.float()
    lab = labels_or_diagonal(labels, b, device) if exclude_positive else None
    for i0 in range(0, b, tile_b):
        i1 = min(i0 + tile_b, b)
        row_i = row[i0:i1]
        for j0 in range(0, m, tile_m):
            j1 = min(j0 + tile_m, m)
            x = _tile_logits(qf[i0:i1], kf[j0:j1], scale, lab, exclude_positive, i0, i1, j0, j1)
            torch.logaddexp(row_i, torch.logsumexp(x, dim=1), out=row_i)
            if compute_col:
                col_j = col[j0:j1]
                torch.logaddexp(col_j, torch.logsumexp(x, dim=0), out=col_j)
    return row, col


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    # A statistic of -inf means every entry of that row/column is excluded (x = -inf), so its
    # probabilities must be 0: exp(-inf - 0) = 0, whereas exp(-inf - (-inf)) would be NaN.
    return torch.where(torch.isfinite(lse), lse, 0.0)


def lse_backward_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    row_lse: torch.Tensor,
    col_lse: Optional[torch.Tensor],
    grad_row: Optional[torch.Tensor],
    grad_col: Optional[torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    grad_pos: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    tile_b: int = DEFAULT_TILE,
    tile_m: int = DEFAULT_TILE,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``sum_i grad_row_i * row_lse_i + sum_j grad_col_j * col_lse_j
    + sum_i grad_pos_i * x_{i, labels_i}`` (the last: the positive logits, default the diagonal).

    Returns ``(dq [b, c], dk [m, c], dscale [])``: float32, or ``out_dtype`` for ``dq`` / ``dk``
    when given. ``grad_row`` / ``grad_col`` / ``grad_pos`` may be ``None`` (zero); ``col_lse`` is
    only read when ``grad_col`` is given.
    """
    b, m, c = query.shape[0], key.shape[0], query.shape[1]
    device = query.device
    dq = torch.zeros((b, c), device=device, dtype=torch.float32)
    dk = torch.zeros((m, c), device=device, dtype=torch.float32)
    if b == 0 or m == 0 or (grad_row is None and grad_col is None and grad_pos is None):
        return _cast(dq, out_dtype), _cast(dk, out_dtype), torch.zeros((), device=device, dtype=torch.float32)
    qf, kf = query.float(), key.float()
    # Index vectors only where needed: the diagonal's positive terms use slices (no gather).
    need_lab = exclude_positive or (grad_pos is not None and labels is not None)
    lab = labels_or_diagonal(labels, b, device) if need_lab else None
    r = _finite_or_zero(row_lse.float()) if grad_row is not None else None
    cl = _finite_or_zero(col_lse.float()) if grad_col is not None else None
    a = grad_row.float() if grad_row is not None else None
    bw = grad_col.float() if grad_col is not None else None
    col_starts = range(0, m, tile_m) if (a is not None or bw is not None) else ()  # LSE terms?
    pw = grad_pos.float()[:, None] if grad_pos is not None else None
    for i0 in range(0, b, tile_b):
        i1 = min(i0 + tile_b, b)
        q_i = qf[i0:i1]
        for j0 in col_starts:
            j1 = min(j0 + tile_m, m)
            k_j = kf[j0:j1]
            x = _tile_logits(q_i, k_j, scale, lab, exclude_positive, i0, i1, j0, j1)
            if a is not None:
                g = torch.exp(x - r[i0:i1, None]).mul_(a[i0:i1, None])
                if bw is not None:
                    g.add_(x.sub_(cl[None, j0:j1]).exp_().mul_(bw[None, j0:j1]))
            else:
                g = x.sub_(cl[None, j0:j1]).exp_().mul_(bw[None, j0:j1])
            dq[i0:i1].addmm_(g, k_j)
            dk[j0:j1].addmm_(g.T, q_i)
        if grad_pos is not None:  # G_{i, labels_i} += grad_pos_i
            p = pw[i0:i1]
            if labels is None:  # the diagonal: key i
                dq[i0:i1].add_(kf[i0:i1] * p)
                dk[i0:i1].add_(q_i * p)
            else:
                lab_i = lab[i0:i1]
                dq[i0:i1].add_(kf[lab_i] * p)
                dk.index_add_(0, lab_i, q_i * p)
    dscale = (qf * dq).sum()
    dq.mul_(scale)
    dk.mul_(scale)
    return _cast(dq, out_dtype), _cast(dk, out_dtype), dscale


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def positive_logits_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    tile_b: int = DEFAULT_TILE,
) -> torch.Tensor:
    """``[b]`` float32 positive logits ``scale * q_i . k_{labels_i}`` (default labels: the
    diagonal), ``tile_b`` rows at a time so that no float32 copy of the inputs is made."""
    b = query.shape[0]
    out = torch.empty((b,), device=query.device, dtype=torch.float32)
    lab = None if labels is None else labels_or_diagonal(labels, b, query.device)
    for i0 in range(0, b, tile_b):
        i1 = min(i0 + tile_b, b)
        k_rows = key[i0:i1] if lab is None else key[lab[i0:i1]]  # the diagonal: a slice, no gather
        torch.sum(query[i0:i1].float() * k_rows.float(), dim=1, out=out[i0:i1])
    return out.mul_(scale)
