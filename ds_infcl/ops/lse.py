"""Backend dispatch and the single-device autograd Function of the contrastive LSE op.

``lse_forward`` / ``lse_backward`` are the block-level entry points (also used by the ring in
``ds_infcl.loss``); ``TiledLSEFunction`` / ``tiled_lse`` make them differentiable on one device.
Their settings travel in one ``LSEOptions`` (``ds_infcl.ops.options``); tensors are arguments.

Backends: ``"torch"`` (tiled PyTorch, any device), ``"triton"`` (fused kernels, CUDA, or the
Triton interpreter when ``TRITON_INTERPRET=1``), ``"auto"`` (Triton on CUDA when available, else
torch).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch

from ds_infcl.ops.options import BACKENDS, LSEOptions
from ds_infcl.ops.tiled import lse_backward_torch, lse_forward_torch, positive_logits_torch

Scale = Union[float, torch.Tensor]

__all__ = [
    "BACKENDS",
    "LSEOptions",
    "resolve_backend",
    "lse_forward",
    "lse_backward",
    "positive_logits_forward",
    "infonce_forward",
    "compose_infonce",
    "TiledLSEFunction",
    "tiled_lse",
]

_DEFAULT = LSEOptions()


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
    labels: Optional[torch.Tensor] = None,
    options: LSEOptions = _DEFAULT,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Float32 ``(row_lse [b], col_lse [m] or None)`` of ``scale * query @ key.T`` on one block.

    ``scale`` is a number or a one-element tensor (a device tensor is read on the device, never
    synchronized). ``labels`` are read with ``options.exclude_positive`` only. ``options.backend``
    must already be resolved (``resolve_backend``); ``options.tile_size`` applies to the torch
    backend, the Triton backend picks its own tiles.
    """
    if options.backend == "triton":
        from ds_infcl.ops.triton_lse import lse_forward_triton

        return lse_forward_triton(query, key, scale, labels=labels, exclude_positive=options.exclude_positive,
                                  compute_col=options.compute_col)
    tile = options.tile(query.device)
    return lse_forward_torch(query, key, scale, labels=labels, exclude_positive=options.exclude_positive,
                             compute_col=options.compute_col, tile_b=tile, tile_m=tile)


def lse_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    row_lse: torch.Tensor,
    col_lse: Optional[torch.Tensor],
    grad_row: Optional[torch.Tensor],
    grad_col: Optional[torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    grad_pos: Optional[torch.Tensor] = None,
    options: LSEOptions = _DEFAULT,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dscale)`` of ``sum(grad_row * row_lse) + sum(grad_col * col_lse)
    + sum(grad_pos * pos)`` (``pos_i = scale * q_i . k_{labels_i}``, default the diagonal).

    ``dq`` / ``dk`` are float32 (what the ring accumulates), or ``options.out_dtype`` when set (the
    single-device loss writes its gradients in the inputs' dtype, with bounded float32 scratch).
    ``options.compute_col`` is not read here: ``grad_col`` given or ``None`` says it.
    """
    ep, out_dtype = options.exclude_positive, options.out_dtype
    if options.backend == "triton":
        from ds_infcl.ops.triton_lse import lse_backward_triton

        return lse_backward_triton(query, key, scale, row_lse, col_lse, grad_row, grad_col, labels=labels,
                                   exclude_positive=ep, grad_pos=grad_pos, out_dtype=out_dtype)
    tile = options.tile(query.device)
    return lse_backward_torch(query, key, scale, row_lse, col_lse, grad_row, grad_col, labels=labels,
                              exclude_positive=ep, grad_pos=grad_pos, out_dtype=out_dtype, tile_b=tile, tile_m=tile)


def positive_logits_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    labels: Optional[torch.Tensor] = None,
    options: LSEOptions = _DEFAULT,
) -> torch.Tensor:
    """``[b]`` float32 ``scale * q_i . k_{labels_i}`` (default the diagonal), no autograd; reads
    ``options.backend`` and ``options.tile_size``."""
    if options.backend == "triton":
        from ds_infcl.ops.triton_lse import positive_logits_triton

        return positive_logits_triton(query, key, scale, labels)
    return positive_logits_torch(query, key, scale, labels, tile_b=options.tile(query.device))


def infonce_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    labels: Optional[torch.Tensor] = None,
    options: LSEOptions = _DEFAULT,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(loss [], row_lse [b], col_lse [m] or None)`` of the InfoNCE over one block (no autograd):
    ``mean_i (row_i - pos_i)``, symmetric (``options.compute_col``)
    ``mean_i (row_i + col_{labels_i} - 2 pos_i) / 2``."""
    symmetric = options.compute_col
    if options.backend == "triton":
        from ds_infcl.ops.triton_lse import infonce_forward_triton

        return infonce_forward_triton(query, key, scale, labels, symmetric=symmetric)
    row, col = lse_forward(query, key, scale, None, options)
    pos = positive_logits_forward(query, key, scale, labels, options)
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
    """``(row_lse, col_lse) = f(query, key, scale, labels, options)`` with tile recomputation in
    backward.

    Saves only ``query``, ``key``, ``labels`` and the two LSE vectors: O((b + m) * c).
    ``col_lse`` is an empty tensor when ``options.compute_col`` is false.
    """

    @staticmethod
    def forward(ctx, query, key, scale, labels, options: LSEOptions):
        s = scale.detach()  # read by the kernels on the device: no host sync
        row, col = lse_forward(query, key, s, labels, options)
        if col is None:
            col = row.new_empty((0,))
        ctx.save_for_backward(query, key, labels, row, col, s)
        ctx.scale_shape = scale.shape
        ctx.options = options.replace(out_dtype=query.dtype)
        ctx.set_materialize_grads(False)
        if not options.compute_col:
            ctx.mark_non_differentiable(col)
        return row, col

    @staticmethod
    def backward(ctx, grad_row, grad_col):
        refuse_double_backward("the fused lse")
        query, key, labels, row, col, s = ctx.saved_tensors
        options = ctx.options
        if not options.compute_col:
            grad_col = None
        dq, dk, ds = lse_backward(query, key, s, row, col if options.compute_col else None, grad_row, grad_col,
                                  labels, options=options)
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq, dk, dscale, None, None


def tiled_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    options: LSEOptions = LSEOptions(backend="auto"),
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Differentiable single-device LSE op (no validation; see ``ds_infcl.loss.lse``).
    ``options.backend`` may be ``"auto"``; ``options.out_dtype`` is ignored (the gradients come
    in the inputs' dtype)."""
    options = options.replace(backend=resolve_backend(options.backend, query.device))
    if not torch.is_tensor(scale):
        scale = torch.full((), float(scale), device=query.device, dtype=torch.float32)
    row, col = TiledLSEFunction.apply(query, key, scale, labels, options)
    return row, (col if options.compute_col else None)
