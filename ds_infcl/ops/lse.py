"""Backend dispatch and the single-device autograd Function of the contrastive LSE op.

``lse_forward`` / ``lse_backward`` are the block-level entry points (also used by the ring in
``ds_infcl.loss``); ``TiledLSEFunction`` / ``tiled_lse`` make them differentiable on one device.

Backends: ``"torch"`` (tiled PyTorch, any device), ``"triton"`` (fused kernels, CUDA, or the
Triton interpreter when ``TRITON_INTERPRET=1``), ``"auto"`` (Triton on CUDA when available, else
torch).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch

from ds_infcl.ops.tiled import (
    default_tile_size,
    lse_backward_torch,
    lse_forward_torch,
    positive_logits_torch,
)

Scale = Union[float, torch.Tensor]

__all__ = [
    "BACKENDS",
    "resolve_backend",
    "lse_forward",
    "lse_backward",
    "positive_logits_forward",
    "infonce_forward",
    "compose_infonce",
    "TiledLSEFunction",
    "tiled_lse",
]

BACKENDS = ("auto", "torch", "triton")


def _triton_module():
    try:
        from ds_infcl.ops import triton_lse  # noqa: F401  (imports triton)
    except ImportError as err:  # triton missing, or the kernels are not built in this version
        return None, err
    return triton_lse, None


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend for ``device`` and check that it can run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "auto":
        if device.type == "cuda" and _triton_module()[0] is not None:
            return "triton"
        return "torch"
    if backend == "triton":
        mod, err = _triton_module()
        if mod is None:
            raise ValueError(f'backend="triton" needs the Triton kernels, which failed to import: {err}')
        if device.type != "cuda" and not interpret:
            raise ValueError(
                f'backend="triton" runs on CUDA tensors (got {device}); use backend="torch" or '
                '"auto" on this device, or set TRITON_INTERPRET=1 before import to test kernels on CPU'
            )
    return backend


def lse_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    compute_col: bool = True,
    backend: str = "torch",
    tile_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Float32 ``(row_lse [b], col_lse [m] or None)`` of ``scale * query @ key.T`` on one block.

    ``scale`` is a number or a one-element tensor (a device tensor is read on the device, never
    synchronized). ``backend`` must already be resolved (``resolve_backend``). ``tile_size``
    applies to the torch backend (default ``default_tile_size``); the Triton backend picks its own
    tiles.
    """
    if backend == "triton":
        from ds_infcl.ops.triton_lse import lse_forward_triton

        return lse_forward_triton(
            query, key, scale, labels=labels, exclude_positive=exclude_positive, compute_col=compute_col
        )
    tile = tile_size or default_tile_size(query.device)
    return lse_forward_torch(
        query, key, scale, labels=labels, exclude_positive=exclude_positive,
        compute_col=compute_col, tile_b=tile, tile_m=tile,
    )


def lse_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    row_lse: torch.Tensor,
    col_lse: Optional[torch.Tensor],
    grad_row: Optional[torch.Tensor],
    grad_col: Optional[torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    grad_pos: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    backend: str = "torch",
    tile_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dscale)`` of ``sum(grad_row * row_lse) + sum(grad_col * col_lse)
    + sum(grad_pos * pos)`` (``pos_i = scale * q_i . k_{labels_i}``, default the diagonal).

    ``dq`` / ``dk`` are float32 (what the ring accumulates), or ``out_dtype`` when given (the
    single-device loss writes its gradients in the inputs' dtype, with bounded float32 scratch).
    """
    if backend == "triton":
        from ds_infcl.ops.triton_lse import lse_backward_triton

        return lse_backward_triton(
            query, key, scale, row_lse, col_lse, grad_row, grad_col,
            labels=labels, exclude_positive=exclude_positive, grad_pos=grad_pos, out_dtype=out_dtype,
        )
    tile = tile_size or default_tile_size(query.device)
    return lse_backward_torch(
        query, key, scale, row_lse, col_lse, grad_row, grad_col,
        labels=labels, exclude_positive=exclude_positive, grad_pos=grad_pos, out_dtype=out_dtype,
        tile_b=tile, tile_m=tile,
    )


def positive_logits_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    labels: Optional[torch.Tensor] = None,
    *,
    backend: str = "torch",
    tile_size: Optional[int] = None,
) -> torch.Tensor:
    """``[b]`` float32 ``scale * q_i . k_{labels_i}`` (default the diagonal), no autograd."""
    if backend == "triton":
        from ds_infcl.ops.triton_lse import positive_logits_triton

        return positive_logits_triton(query, key, scale, labels)
    return positive_logits_torch(query, key, scale, labels, tile_b=tile_size or default_tile_size(query.device))


def infonce_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    labels: Optional[torch.Tensor] = None,
    *,
    symmetric: bool = False,
    backend: str = "torch",
    tile_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(loss [], row_lse [b], col_lse [m] or None)`` of the InfoNCE over one block (no autograd):
    ``mean_i (row_i - pos_i)``, symmetric ``mean_i (row_i + col_{labels_i} - 2 pos_i) / 2``."""
    if backend == "triton":
        from ds_infcl.ops.triton_lse import infonce_forward_triton

        return infonce_forward_triton(query, key, scale, labels, symmetric=symmetric)
    row, col = lse_forward(query, key, scale, compute_col=symmetric, backend=backend, tile_size=tile_size)
    pos = positive_logits_forward(query, key, scale, labels, backend=backend, tile_size=tile_size)
    return compose_infonce(row, col, pos, labels, query.shape[0], symmetric), row, col


def compose_infonce(
    row_lse: torch.Tensor,
    col_lse: Optional[torch.Tensor],
    pos: torch.Tensor,
    labels: Optional[torch.Tensor],
    num_queries: int,
    symmetric: bool,
) -> torch.Tensor:
    """This rank's share of the InfoNCE loss: local sums divided by the global query count.

    One direction: ``sum_i (row_lse_i - pos_i) / B``; symmetric adds the key-to-query term of each
    query's positive key, ``sum_i (col_lse_{labels_i} - pos_i) / B`` (``labels=None``: key i), and
    halves the sum. The shares of all ranks add up to the global loss. Differentiable.
    """
    loss = (row_lse - pos).sum() / num_queries
    if symmetric:
        col_pos = col_lse[: pos.shape[0]] if labels is None else col_lse[labels]
        loss = (loss + (col_pos - pos).sum() / num_queries) / 2
    return loss


def refuse_double_backward(what: str) -> None:
    """Raise in a fused Function's backward when autograd records it (``create_graph=True``).

    The backward's kernels (and, distributed, its collectives) build no graph (Triton's outputs
    have none at all), so a second derivative would silently miss terms. Distributed, every rank
    raises the same error before any collective (``create_graph`` is the same on every rank), so
    none is left waiting.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} is differentiable once: backward(create_graph=True) or a second derivative "
            "(e.g. a gradient penalty through the loss) is not supported; call backward without "
            "create_graph"
        )


class TiledLSEFunction(torch.autograd.Function):
    """``(row_lse, col_lse) = f(query, key, scale)`` with tile recomputation in backward.

    Saves only ``query``, ``key``, ``labels`` and the two LSE vectors: O((b + m) * c).
    ``col_lse`` is an empty tensor when ``compute_col`` is false.
    """

    @staticmethod
    def forward(ctx, query, key, scale, labels, exclude_positive, compute_col, backend, tile_size):
        s = scale.detach()  # read by the kernels on the device: no host sync
        row, col = lse_forward(
            query, key, s, labels=labels, exclude_positive=exclude_positive,
            compute_col=compute_col, backend=backend, tile_size=tile_size,
        )
        if col is None:
            col = row.new_empty((0,))
        ctx.save_for_backward(query, key, labels, row, col, s)
        ctx.scale_shape = scale.shape
        ctx.options = (exclude_positive, compute_col, backend, tile_size)
        ctx.set_materialize_grads(False)
        if not compute_col:
            ctx.mark_non_differentiable(col)
        return row, col

    @staticmethod
    def backward(ctx, grad_row, grad_col):
        refuse_double_backward("the fused lse")
        query, key, labels, row, col, s = ctx.saved_tensors
        exclude_positive, compute_col, backend, tile_size = ctx.options
        if not compute_col:
            grad_col = None
        dq, dk, ds = lse_backward(
            query, key, s, row, col if compute_col else None, grad_row, grad_col,
            labels=labels, exclude_positive=exclude_positive, out_dtype=query.dtype, backend=backend,
            tile_size=tile_size,
        )
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq, dk, dscale, None, None, None, None, None


def tiled_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    compute_col: bool = True,
    backend: str = "auto",
    tile_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Differentiable single-device LSE op (no validation; see ``ds_infcl.loss.lse``)."""
    backend = resolve_backend(backend, query.device)
    if not torch.is_tensor(scale):
        scale = torch.full((), float(scale), device=query.device, dtype=torch.float32)
    row, col = TiledLSEFunction.apply(
        query, key, scale, labels, exclude_positive, compute_col, backend, tile_size
    )
    return row, (col if compute_col else None)
