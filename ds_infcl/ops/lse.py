"""Backend dispatch and the single-device autograd Function of the contrastive LSE op.

``lse_forward`` / ``lse_backward`` are the block-level entry points (also used by the ring in
``ds_infcl.loss``); ``tiled_lse`` makes them differentiable on one device, as the custom ops
``ds_infcl::lse_forward`` / ``lse_backward`` (with fake implementations, so that ``torch.compile``
traces a caller).
Their settings travel in one ``LSEOptions`` (``ds_infcl.ops.options``); tensors are arguments.
The block entry points run with autocast off (``ds_infcl.ops.precision``): their matmuls run in
the dtype of the features they are given, which the loss entry points chose.

Backends: ``"torch"`` (tiled PyTorch, any device), ``"triton"`` (fused kernels, CUDA, or the
Triton interpreter when ``TRITON_INTERPRET=1``), ``"auto"`` (Triton on CUDA when available, else
torch).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch

from ds_infcl.ops.options import BACKENDS, LSEOptions
from ds_infcl.ops.precision import autocast_off
from ds_infcl.ops.tiled import lse_backward_torch, lse_forward_torch, positive_logits_torch
from ds_infcl.ops.validation import check_values

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
    if backend == "auto":
        if device.type == "cuda" and _triton_module()[0] is not None:
            return "triton"
        return "torch"
    if backend == "triton":
        mod, err = _triton_module()
        if mod is None:
            raise ValueError(f'backend="triton" needs the Triton kernels, which failed to import: {err}')
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f'backend="triton" runs on CUDA tensors (got {device}); use backend="torch" or '
                '"auto" on this device, or set TRITON_INTERPRET=1 before import to test kernels on CPU'
            )
    return backend


@autocast_off
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


@autocast_off
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


@autocast_off
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


@autocast_off
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


@torch.library.custom_op("ds_infcl::lse_forward", mutates_args=())
def _lse_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    labels: Optional[torch.Tensor],
    exclude_positive: bool,
    compute_col: bool,
    backend: str,
    tile_size: Optional[int],
    validate: bool,
    check_finite: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(row_lse [b], col_lse [m] or [0])`` on one device. ``validate``: first run the value
    checks (``check_values``: labels in range, a finite scale, with ``check_finite`` finite
    features), here where a compiled caller cannot read values."""
    if validate:
        check_values(query, key, scale, labels, key.shape[0], check_finite)
    options = LSEOptions(exclude_positive=exclude_positive, compute_col=compute_col, backend=backend,
                         tile_size=tile_size)
    row, col = lse_forward(query, key, scale, labels, options)
    return row, (row.new_empty((0,)) if col is None else col)


@_lse_forward_op.register_fake
def _(query, key, scale, labels, exclude_positive, compute_col, backend, tile_size, validate, check_finite):
    f32 = dict(device=query.device, dtype=torch.float32)
    return query.new_empty((query.shape[0],), **f32), query.new_empty((key.shape[0] if compute_col else 0,), **f32)


@torch.library.custom_op("ds_infcl::lse_backward", mutates_args=())
def _lse_backward_op(
    grad_row: torch.Tensor,
    grad_col: Optional[torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    labels: Optional[torch.Tensor],
    row_lse: torch.Tensor,
    col_lse: torch.Tensor,
    exclude_positive: bool,
    backend: str,
    tile_size: Optional[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dscale)`` of ``sum(grad_row * row_lse) + sum(grad_col * col_lse)`` (``grad_col``
    ``None``: no column term); ``dq`` / ``dk`` in the features' dtype, ``dscale`` float32 in
    ``scale``'s shape."""
    options = LSEOptions(exclude_positive=exclude_positive, backend=backend, tile_size=tile_size,
                         out_dtype=query.dtype)
    dq, dk, ds = lse_backward(query, key, scale, row_lse, None if grad_col is None else col_lse, grad_row,
                              grad_col, labels, options=options)
    return dq, dk, ds.reshape(scale.shape)


@_lse_backward_op.register_fake
def _(grad_row, grad_col, query, key, scale, labels, row_lse, col_lse, exclude_positive, backend, tile_size):
    return torch.empty_like(query), torch.empty_like(key), scale.new_empty(scale.shape, dtype=torch.float32)


def _lse_setup_context(ctx, inputs, output):
    query, key, scale, labels, exclude_positive, compute_col, backend, tile_size, _, _ = inputs
    row, col = output
    ctx.save_for_backward(query, key, scale.detach(), labels, row, col)
    ctx.options = (exclude_positive, compute_col, backend, tile_size)
    if not compute_col:
        ctx.mark_non_differentiable(col)


def _lse_op_backward(ctx, grad_row, grad_col):
    if not torch.compiler.is_compiling():  # (the compiler traces the backward with grad mode on)
        refuse_double_backward("the fused lse")
    query, key, s, labels, row, col = ctx.saved_tensors
    exclude_positive, compute_col, backend, tile_size = ctx.options
    dq, dk, ds = _lse_backward_op(grad_row, grad_col if compute_col else None, query, key, s, labels, row, col,
                                  exclude_positive, backend, tile_size)
    return (dq, dk, ds if ctx.needs_input_grad[2] else None, None, None, None, None, None, None, None)


_lse_forward_op.register_autograd(_lse_op_backward, setup_context=_lse_setup_context)


def tiled_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    options: LSEOptions = LSEOptions(backend="auto"),
    *,
    validate: bool = False,
    check_finite: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Differentiable single-device LSE op (no validation unless asked; see ``ds_infcl.loss.lse``):
    the custom ops ``ds_infcl::lse_forward`` / ``lse_backward`` (what ``torch.compile`` traces).
    ``options.backend`` may be ``"auto"``; ``options.out_dtype`` is ignored (the gradients come in
    the inputs' dtype). ``labels`` are read with ``options.exclude_positive`` only. ``validate``
    runs the value checks (labels in range, a finite scale, with ``check_finite`` finite features)
    inside the op. The upstream gradient of an unused ``col_lse`` arrives as zeros (custom ops
    materialize them): use ``compute_col=False`` when the column statistics are not needed."""
    backend = resolve_backend(options.backend, query.device)
    if not torch.is_tensor(scale):
        scale = torch.full((), float(scale), device=query.device, dtype=torch.float32)
    row, col = _lse_forward_op(query, key, scale, labels if options.exclude_positive else None,
                               options.exclude_positive, options.compute_col, backend, options.tile_size, validate,
                               check_finite)
    return row, (col if options.compute_col else None)
