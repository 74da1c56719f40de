"""The gather path's local computations (``ds_infcl.loss.ring_fused.GatherInfoNCEFunction``) as
functions of tensors only: what its CUDA graphs capture (``ds_infcl.ops.infonce_graph.run_graphed``),
with every collective left to the Function between them. A rank holds its ``b`` queries ``Q_r``,
its ``m`` keys ``K_r`` (rows ``[offset, offset + m)`` of the gathered ``K_all`` ``[M, c]``) and
its labels (local key indices, ``None``: the diagonal).

- forward: ``gather_forward_fn`` (``Q_r`` against ``K_all``) or, when the own block ran before the
  layout exchange, ``own_block_fn`` then ``gather_rest_fn`` (the other ranks' keys, merged);
  ``forward_outputs`` forms what goes to the statistics' all-gather; ``merge_fn`` merges what
  comes back (``lse_over_ranks``);
- backward: ``gather_backward_fn`` (``Q_r`` against ``K_all`` at once) or ``own_backward_fn``
  (the own block, in the forward, for the unit weight) and ``rest_backward_fn`` (the other ranks'
  keys, ``other_ranges``); ``diagonal_column_weights`` forms the keys' column weights from every
  rank's weight when no rank passed labels.

The maths: ``ds_infcl.loss.ring_fused``'s module doc and DESIGN.md section 2.
"""

from __future__ import annotations

from typing import Optional

import torch

from ds_infcl.ops import LSEOptions, lse_backward, lse_forward, positive_logits_forward
from ds_infcl.ops.infonce import column_weights

__all__ = [
    "lse_over_ranks", "merge_fn", "diagonal_column_weights", "positive_weight", "gather_forward_fn", "forward_outputs",
    "own_block_fn", "gather_rest_fn", "gather_backward_fn", "own_backward_fn", "own_sums_weight", "own_share",
    "other_ranges",
    "rest_backward_fn",
]


def lse_over_ranks(parts: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp over dim 0 of ``[W, n]``: one kernel for ``W <= 2`` (``torch.logsumexp`` is
    several: its maximum, the shift, the exponentials, the sum, the logarithm)."""
    if parts.shape[0] == 1:
        return parts[0]
    if parts.shape[0] == 2:
        return torch.logaddexp(parts[0], parts[1])
    return torch.logsumexp(parts, dim=0)


def merge_fn(m: int, diagonal_spans, factor: Optional[float]):
    """The statistics' merge as a function of the gathered payloads ``parts [W, ...]`` (what a
    graph captures): the global column LSE ``[M]`` from each rank's partial one over its own
    queries (the first ``m`` floats of each row). With ``factor`` (the symmetric loss when no rank
    passed labels, without an all-reduce) also the loss: each row ends with its rank's row term
    ``sum_i (row_i - 2 pos_i)``, and the column term ``sum_i col_{offset_r + i}`` over every rank's
    queries is known to all once ``col`` is (query ``i`` of rank ``r`` is paired with key
    ``offset_r + i``; ``diagonal_spans``: those keys' ranges, ``None`` when they are all keys)."""

    def merge(parts):
        col = lse_over_ranks(parts[:, :m])
        if factor is None:
            return col, None
        if diagonal_spans is None:  # every key is some query's positive (CLIP)
            cols = col.sum()
        else:
            cols = torch.cat([col[lo:hi] for lo, hi in diagonal_spans]).sum()
        return col, (parts[:, m].sum() + cols) * factor

    return merge


def diagonal_column_weights(w_all: torch.Tensor, query_sizes, key_sizes) -> torch.Tensor:
    """``[M]`` upstream weights of the keys' column LSE when no rank passed labels: ``w`` of rank
    ``r`` (``w_all[r]``) for each of its first ``b_r`` keys, 0 for its keys beyond its queries
    (``column_weights`` of every rank, concatenated)."""
    if query_sizes == key_sizes and len(set(key_sizes)) == 1:
        return w_all.view(-1, 1).expand(-1, key_sizes[0]).reshape(-1)
    pieces = []
    for r, (b, m) in enumerate(zip(query_sizes, key_sizes)):
        pieces.append(w_all[r].expand(b))
        if m > b:
            pieces.append(w_all.new_zeros((m - b,)))
    return torch.cat(pieces)


def positive_weight(w: torch.Tensor, b: int, symmetric: bool) -> torch.Tensor:
    """The upstream weight ``[b]`` (expanded) of each positive logit for the weight ``w`` (0-dim) of
    the LSE terms: ``-w`` per direction it appears in (the loss subtracts it from each)."""
    return (w * (-2.0 if symmetric else -1.0)).expand(b)


def gather_forward_fn(symmetric, diagonal, backend, tile_size, offset, m):
    """The gather path's local forward kernels as a function of tensors (what a graph captures):
    ``(row [b], payload, positive logits [b] or None)``. The payload goes to the all-gather of the
    column statistics: the partial column statistics ``[M]`` (symmetric), followed by this rank's
    row term ``sum_i (row_i - 2 pos_i)`` when no rank has labels (``merge_fn``; ``pos`` is
    then not returned). This rank's keys are rows ``[offset, offset + m)`` of ``key_all``."""

    options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)

    def forward(query, key_all, s, labels):
        row, col_part = lse_forward(query, key_all, s, None, options)
        pos = positive_logits_forward(query, key_all[offset: offset + m], s, labels, options)
        return forward_outputs(row, col_part, pos, diagonal)

    return forward


def forward_outputs(row, col_part, pos, diagonal):
    """The local forward's ``(row, payload, pos)`` from its statistics: the payload is the partial
    column statistics (``None`` one-directional); with ``diagonal`` (symmetric, no labels on any
    rank) this rank's row term ``sum_i (row_i - 2 pos_i)`` ends it and ``pos`` is not returned."""
    if diagonal:
        return row, torch.cat([col_part, row.sub(pos, alpha=2.0).sum().reshape(1)]), None
    return row, col_part, pos


def own_block_fn(symmetric, backend, tile_size):
    """This rank's queries against its own keys, the block that needs no other rank's data:
    ``(row [b], partial column statistics [m] or None, positive logits [b])`` (what a graph
    captures; see ``GatherInfoNCEFunction``'s ``own``)."""

    options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)

    def own(query, key, s, labels):
        row, col = lse_forward(query, key, s, None, options)
        pos = positive_logits_forward(query, key, s, labels, options)
        return row, col, pos

    return own


def gather_rest_fn(symmetric, diagonal, backend, tile_size, offset, m):
    """The gather path's local forward when the own block ran early (``own_block_fn``): the
    queries against the other ranks' keys (rows ``[0, offset)`` and ``[offset + m, M)`` of
    ``key_all``), merged with the own block's statistics into the outputs of ``gather_forward_fn``."""

    options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)

    def forward(query, key_all, s, row_own, col_own, pos):
        row, cols = row_own, []
        for lo, hi in ((0, offset), (offset + m, key_all.shape[0])):
            if lo == hi:
                continue
            row_t, col_t = lse_forward(query, key_all[lo:hi], s, None, options)
            row = torch.logaddexp(row, row_t)
            cols.append(col_t)
        col_part = None
        if symmetric:
            cols.insert(1 if offset else 0, col_own)
            col_part = torch.cat(cols)
        return forward_outputs(row, col_part, pos, diagonal)

    return forward


def gather_backward_fn(symmetric, backend, tile_size, offset, diagonal_sizes=None):
    """The gather path's local backward: ``(dq in the queries' dtype, d key_all float32, dscale
    float32)`` for the upstream weight ``w`` (0-dim) of every LSE term and ``-w`` per direction for
    each positive logit. Query i's positive is key ``offset + l_i`` of ``key_all`` (``offset + i``
    for ``labels=None``). ``grad_col`` is the keys' column weights ``[M]``, or, with
    ``diagonal_sizes = (query sizes, key sizes)`` (no rank passed labels), every rank's ``w``
    ``[W]``, from which they are formed here (``diagonal_column_weights``)."""

    options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)

    def backward(query, key_all, s, row, col, w, grad_col, labels):
        b = query.shape[0]
        if diagonal_sizes is not None:
            grad_col = diagonal_column_weights(grad_col, *diagonal_sizes)
        if labels is not None:
            labels = labels + offset if offset else labels
        elif offset:
            labels = torch.arange(offset, offset + b, device=query.device)
        dq, dk_all, dscale = lse_backward(query, key_all, s, row, col, w.expand(b), grad_col, labels,
                                          positive_weight(w, b, symmetric), options)
        return dq.to(query.dtype), dk_all, dscale

    return backward


def own_backward_fn(symmetric, backend, tile_size, weight: float):
    """The backward of the own block (this rank's queries against its own keys, which hold every
    positive) for the weight ``w`` (a constant of the graph: float32 of ``weight``) of this rank's
    LSE terms: ``(dq, d key, dscale, factor)``. Every weight in this block is this rank's own: its
    row terms', its positives' and its keys' column weights (``column_weights``), so the block
    computed in the forward for the unit weight, times the upstream gradient ``g``, is exact
    whatever the other ranks' ``g`` (``GatherInfoNCEFunction``). With the Triton backend, the
    float32 sums before their scaling pass and that pass's factor (``lse_backward_triton(unscaled=True)``:
    the backward scales them once, with the other keys' block, ``rest_backward_fn``), ``dscale``
    ``None``; else the float32 gradients and ``dscale``, ``factor`` ``None``."""

    options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)

    def backward(query, key, s, row, col, labels):
        b, m = query.shape[0], key.shape[0]
        w = torch.full((), weight, device=query.device, dtype=torch.float32)
        grad_col = column_weights(w, labels, b, m) if symmetric else None
        args = (query, key, s, row, col, w.expand(b), grad_col)
        grad_pos = positive_weight(w, b, symmetric)
        if backend == "triton":
            from ds_infcl.ops.triton_lse import lse_backward_triton

            dq, dk, factor = lse_backward_triton(*args, labels=labels, grad_pos=grad_pos, unscaled=True)
            return dq, dk, None, factor
        dq, dk, dscale = lse_backward(*args, labels, grad_pos, options)
        return dq, dk, dscale, None

    return backward


def own_sums_weight(factor, g):
    """What ``own_backward_fn``'s ``dq`` / ``d key`` are multiplied by for the upstream gradient
    ``g``: ``g`` times their ``factor`` (Triton: unscaled sums), else ``g``."""
    return g if factor is None else g * factor


def own_share(query, s, dq_own, ds_own, factor, g):
    """The own block's ``(dq share, dscale share)`` for the upstream gradient ``g``, from
    ``own_backward_fn``'s outputs (``own_sums_weight``; Triton: ``unscaled_share``)."""
    if factor is None:
        return dq_own * g, ds_own * g
    from ds_infcl.ops.triton_lse import unscaled_share

    return unscaled_share(dq_own, query, s, own_sums_weight(factor, g))


def other_ranges(offset: int, m: int, num_keys: int):
    """The rows of the gathered keys owned by the other ranks, ``[0, offset)`` and
    ``[offset + m, M)`` (the empty ones left out), in rank order."""
    return tuple((lo, hi) for lo, hi in ((0, offset), (offset + m, num_keys)) if lo < hi)


def rest_backward_fn(symmetric, backend, tile_size, offset, m, diagonal_sizes=None):
    """The backward over the other ranks' keys (no positive lives there), summed with the own
    block's share: ``(dq in the queries' dtype, d(other keys) float32 [M - m, c] in rank order,
    dscale float32)`` for the weight ``w`` (0-dim) of this rank's LSE terms and the keys' column
    weights ``grad_col`` ``[M]``, or, with ``diagonal_sizes`` (no rank passed labels), every rank's
    ``w`` ``[W]`` from which they are formed (``diagonal_column_weights``). ``dq`` and ``dscale``
    add the own block's share for the upstream gradient ``g`` (``own_backward_fn``'s ``dq_own``,
    ``ds_own``, ``factor``; ``own_share``): with the Triton backend and one range of other keys,
    in the pass that scales this block's ``dq`` (``lse_backward_triton(dq_add=...)``: no pass of its own)."""

    options = LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)

    def backward(query, key_all, s, row, col, w, grad_col, dq_own, ds_own, factor, g):
        b = query.shape[0]
        if diagonal_sizes is not None:
            grad_col = diagonal_column_weights(grad_col, *diagonal_sizes)
        ranges = other_ranges(offset, m, key_all.shape[0])
        fused = backend == "triton" and len(ranges) == 1 and factor is not None
        dq = dscale = None
        dks = []
        for lo, hi in ranges:
            args = (query, key_all[lo:hi], s, row, col[lo:hi] if symmetric else None, w.expand(b),
                    grad_col[lo:hi] if symmetric else None)
            if fused:
                from ds_infcl.ops.triton_lse import lse_backward_triton

                dq_t, dk_t, ds_t = lse_backward_triton(*args, dq_add=(torch.empty_like(query), dq_own, g, factor))
            else:
                dq_t, dk_t, ds_t = lse_backward(*args, options=options)
            dq, dscale = (dq_t, ds_t) if dq is None else (dq.add_(dq_t), dscale + ds_t)
            dks.append(dk_t)
        if not fused:
            dq_share, ds_share = own_share(query, s, dq_own, ds_own, factor, g)
            dq, dscale = torch.add(dq, dq_share, out=torch.empty_like(query)), dscale + ds_share
        return dq, (dks[0] if len(dks) == 1 else torch.cat(dks)), dscale

    return backward
