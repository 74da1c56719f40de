"""SigLIP's pairwise sigmoid loss on one device: reference, tiled PyTorch path, dispatch, Function, custom ops.

Maths (DESIGN.md section 9). Queries ``q [b, c]``, keys ``k [m, c]``, scale ``s`` and bias ``t``;
the logits are ``x_ij = s * q_i . k_j + t`` and ``z_ij = +1`` for a positive pair, ``-1`` else.
With ``-log sigmoid(z x) = softplus(-z x)`` and ``softplus(-x) = softplus(x) - x``::

    L = (1 / B) * sum_ij softplus(-z_ij x_ij)
      = (1 / B) * [ sum_ij softplus(x_ij) - sum_{(i, j) positive} x_ij ]

where ``B`` is the number of queries of the global batch. Per pair the gradient is
``dL/dx_ij = (sigmoid(x_ij) - [positive]) / B =: G_ij``, so one recomputed tile gives

    dq = s * G @ k      dk = s * G^T @ q      ds = sum_ij G_ij (q_i . k_j)      dt = sum_ij G_ij

(``8 b m c`` FLOPs for forward and backward, as for InfoNCE). No running maximum is needed: each
pair's term is independent, so blocks (tiles, or ring blocks of other ranks) simply add.

Small repeated shapes replay from CUDA graphs (``SigLIPFunction``): the forward and the backward are
each one ``ds_infcl.ops.infonce_graph.run_graphed`` computation (``siglip_passes``), under the same
rules, settings and cache as the InfoNCE's graphs. The distributed gather path
(``ds_infcl.loss.siglip``) replays the same passes between its collectives.

Positive pairs are given by ids: ``(i, j)`` is positive iff ``query_ids[i] == key_ids[j]``. Labels
(query ``i``'s positive is key ``labels[i]``, default the diagonal) become ids through
:func:`siglip_ids`; user ids (for example a caption id) allow several positives per query, so that
duplicated captions are not pushed apart.

The block functions ``siglip_forward`` / ``siglip_backward`` are also the unit of work of the ring
(``ds_infcl.loss.siglip``); they run with autocast off (``ds_infcl.ops.precision``: the loss entry
point casts the features once). Everything accumulates in float32; memory is ``O((b + m) c)`` plus one
tile (torch) or one bounded block of ``G`` (Triton).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ds_infcl.ops.infonce_graph import graph_eligible, inputs_of, run_graphed
from ds_infcl.ops.lse import refuse_double_backward, resolve_backend
from ds_infcl.ops.precision import autocast_off
from ds_infcl.ops.tiled import default_tile_size, labels_or_diagonal
from ds_infcl.ops.pass_check import PassCheck
from ds_infcl.ops.validation import check_values

__all__ = [
    "siglip_ids",
    "siglip_reference",
    "siglip_forward_torch",
    "siglip_backward_torch",
    "siglip_forward",
    "siglip_backward",
    "siglip_loss_local",
    "siglip_passes",
    "SigLIPFunction",
]

Scalar = Union[float, torch.Tensor]
_F32 = torch.float32


def siglip_ids(
    num_queries: int,
    num_keys: int,
    device: torch.device,
    *,
    labels: Optional[torch.Tensor] = None,
    query_ids: Optional[torch.Tensor] = None,
    key_ids: Optional[torch.Tensor] = None,
    key_offset: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(query_ids [b], key_ids [m])`` whose equality marks the positive pairs.

    With ``query_ids`` / ``key_ids`` given they are used as they are (global ids: equal ids on any
    ranks are positives). Otherwise query ``i``'s positive is local key ``labels[i]`` (default
    ``i``), made global with ``key_offset`` (the number of keys of the ranks before this one), so
    that the ids of different ranks never collide.
    """
    if query_ids is not None:
        return (query_ids.to(device=device, dtype=torch.int64).contiguous(),
                key_ids.to(device=device, dtype=torch.int64).contiguous())
    lab = labels_or_diagonal(labels, num_queries, device)
    return lab + key_offset, torch.arange(key_offset, key_offset + num_keys, device=device)


def siglip_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scalar,
    bias: Scalar,
    *,
    labels: Optional[torch.Tensor] = None,
    query_ids: Optional[torch.Tensor] = None,
    key_ids: Optional[torch.Tensor] = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Materialized SigLIP loss ``mean_i sum_j -log sigmoid(z_ij x_ij)`` (the specification).

    ``upcast`` computes in float64 (the reference of the tests); ``False`` in the inputs' dtype
    (plain PyTorch's own rounding, for error bounds). Allocates ``b x m`` logits.
    """
    dtype = torch.float64 if upcast else query.dtype
    qids, kids = siglip_ids(query.shape[0], key.shape[0], query.device, labels=labels,
                            query_ids=query_ids, key_ids=key_ids)
    x = (query.to(dtype) @ key.to(dtype).T) * scale + bias
    z = torch.where(qids[:, None] == kids[None, :], 1.0, -1.0).to(x.dtype)
    return -F.logsigmoid(z * x).sum() / query.shape[0]


def _tile_logits(qf, kf, scale, bias):
    dots = qf @ kf.T
    return dots, dots * scale + bias


def siglip_forward_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scalar,
    bias: Scalar,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    *,
    tile_b: int,
    tile_m: int,
) -> torch.Tensor:
    """0-dim float32 ``sum_ij softplus(-z_ij x_ij)`` over the block (not divided by ``B``)."""
    b, m = query.shape[0], key.shape[0]
    total = torch.zeros((), device=query.device, dtype=_F32)
    if b == 0 or m == 0:
        return total
    qf, kf = query.float(), key.float()
    for i0 in range(0, b, tile_b):
        qid = query_ids[i0:i0 + tile_b, None]
        for j0 in range(0, m, tile_m):
            _, x = _tile_logits(qf[i0:i0 + tile_b], kf[j0:j0 + tile_m], scale, bias)
            pos = qid == key_ids[None, j0:j0 + tile_m]
            total += F.softplus(torch.where(pos, -x, x)).sum()
    return total


def siglip_backward_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scalar,
    bias: Scalar,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    tile_b: int,
    tile_m: int,
    accumulate: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [b, c], dk [m, c], dscale [], dbias [])``, all float32, of ``weight * forward``.

    ``weight`` is a 0-dim tensor (the upstream gradient over ``B``); each tile is recomputed once.
    ``accumulate``: as in :func:`siglip_backward`.
    """
    b, c = query.shape
    m = key.shape[0]
    device = query.device
    if accumulate is not None:
        dq, dk = accumulate
    else:
        dq = torch.zeros((b, c), device=device, dtype=_F32)
        dk = torch.zeros((m, c), device=device, dtype=_F32)
    ds = torch.zeros((), device=device, dtype=_F32)
    dt = torch.zeros((), device=device, dtype=_F32)
    if b == 0 or m == 0:
        return dq, dk, ds, dt
    qf, kf = query.float(), key.float()
    w = weight.float()
    for i0 in range(0, b, tile_b):
        i1 = min(i0 + tile_b, b)
        qid = query_ids[i0:i1, None]
        for j0 in range(0, m, tile_m):
            j1 = min(j0 + tile_m, m)
            dots, x = _tile_logits(qf[i0:i1], kf[j0:j1], scale, bias)
            g = torch.sigmoid(x)
            g.sub_((qid == key_ids[None, j0:j1]).to(_F32)).mul_(w)
            dq[i0:i1].addmm_(g, kf[j0:j1])
            dk[j0:j1].addmm_(g.T, qf[i0:i1])
            ds += (g * dots).sum()
            dt += g.sum()
    if accumulate is not None:
        return dq, dk, ds, dt
    s = scale.float() if torch.is_tensor(scale) else scale
    return dq.mul_(s), dk.mul_(s), ds, dt


def _triton_siglip():
    from ds_infcl.ops import triton_siglip

    return triton_siglip


def _tiles(query: torch.Tensor, tile_size: Optional[int]) -> int:
    return tile_size or default_tile_size(query.device)


@autocast_off
def siglip_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    *,
    backend: str = "auto",
    tile_size: Optional[int] = None,
) -> torch.Tensor:
    """Block sum ``sum_ij softplus(-z_ij x_ij)`` (0-dim float32) on the resolved backend."""
    if resolve_backend(backend, query.device) == "triton":
        return _triton_siglip().siglip_forward_triton(query, key, scale, bias, query_ids, key_ids)
    tile = _tiles(query, tile_size)
    return siglip_forward_torch(query, key, scale, bias, query_ids, key_ids, tile_b=tile, tile_m=tile)


@autocast_off
def siglip_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    backend: str = "auto",
    tile_size: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    accumulate: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dscale, dbias)`` of ``weight * siglip_forward(...)``.

    ``dq`` / ``dk`` are float32, or ``out_dtype`` when given (the Triton path then keeps only one
    side's float32 accumulator and a bounded chunk of the other).

    ``accumulate=(dq_acc [b, c], dk_acc [m, c])``, float32 (what the ring does): ``G @ k`` and
    ``G^T @ q`` with ``G = weight * (sigmoid(x) - [positive])`` are *added* into the accumulators
    (no factor ``scale``: the caller multiplies once when every block is in), which are returned;
    then no ``b x c`` or ``m x c`` buffer is allocated. ``G`` is stored in the operands' dtype on the
    Triton path, so with fp16 operands ``weight`` must be near 1 (a power-of-two factor the caller
    takes out again). ``dscale`` / ``dbias`` are as without ``accumulate``.
    """
    if accumulate is not None and out_dtype is not None:
        raise ValueError("siglip_backward: pass out_dtype or accumulate, not both")
    if resolve_backend(backend, query.device) == "triton":
        return _triton_siglip().siglip_backward_triton(
            query, key, scale, bias, query_ids, key_ids, weight, out_dtype=out_dtype, accumulate=accumulate
        )
    tile = _tiles(query, tile_size)
    dq, dk, ds, dt = siglip_backward_torch(query, key, scale, bias, query_ids, key_ids, weight,
                                           tile_b=tile, tile_m=tile, accumulate=accumulate)
    if out_dtype is not None:
        dq, dk = dq.to(out_dtype), dk.to(out_dtype)
    return dq, dk, ds, dt


@torch.library.custom_op("ds_infcl::siglip_forward", mutates_args=())
def _siglip_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    backend: str,
    tile_size: Optional[int],
    validate: bool,
    check_finite: bool,
    check_labels: bool,
) -> torch.Tensor:
    """0-dim float32 SigLIP loss of one device, ``siglip_forward(...) / b``. ``validate``: first
    run ``check_values`` (a finite scale and bias, with ``check_finite`` finite features, and with
    ``check_labels`` the query ids, which are then labels, in ``[0, m)``) here: where a compiled
    caller cannot read values, and for ``siglip_loss``'s one-device call without labels to check
    (read or queued as its caller's block says, ``ds_infcl.ops.validation``)."""
    if validate:
        check_values(query, key, scale, query_ids if check_labels else None, key.shape[0], check_finite, bias)
    total = siglip_forward(query, key, scale, bias, query_ids, key_ids, backend=backend, tile_size=tile_size)
    return total / query.shape[0]


@_siglip_forward_op.register_fake
def _(query, key, scale, bias, query_ids, key_ids, backend, tile_size, validate, check_finite, check_labels):
    return query.new_empty((), dtype=torch.float32)


@torch.library.custom_op("ds_infcl::siglip_backward", mutates_args=())
def _siglip_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    backend: str,
    tile_size: Optional[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dscale, dbias)`` of the op's loss with upstream ``grad``: the features' gradients
    in their dtype, those of the scale and the bias float32 in their shapes."""
    weight = grad.float() / query.shape[0]
    dq, dk, ds, dt = siglip_backward(query, key, scale, bias, query_ids, key_ids, weight, backend=backend,
                                     tile_size=tile_size, out_dtype=query.dtype)
    # ds and dt may be views of one sum (the Triton backward's): each its own tensor, whose storage
    # starts at offset 0 (a custom op's outputs may not alias, and inductor checks their alignment).
    return dq, dk, ds.reshape(scale.shape).clone(), dt.reshape(bias.shape).clone()


@_siglip_backward_op.register_fake
def _(grad, query, key, scale, bias, query_ids, key_ids, backend, tile_size):
    return (torch.empty_like(query), torch.empty_like(key), scale.new_empty(scale.shape, dtype=_F32),
            bias.new_empty(bias.shape, dtype=_F32))


def _siglip_setup_context(ctx, inputs, output):
    query, key, scale, bias, query_ids, key_ids, backend, tile_size, _, _, _ = inputs
    ctx.save_for_backward(query, key, scale.detach(), bias.detach(), query_ids, key_ids)
    ctx.options = (backend, tile_size)


def _siglip_op_backward(ctx, grad):
    query, key, s, t, query_ids, key_ids = ctx.saved_tensors
    backend, tile_size = ctx.options
    dq, dk, ds, dt = _siglip_backward_op(grad, query, key, s, t, query_ids, key_ids, backend, tile_size)
    return (dq, dk, ds if ctx.needs_input_grad[2] else None, dt if ctx.needs_input_grad[3] else None,
            None, None, None, None, None, None, None)


_siglip_forward_op.register_autograd(_siglip_op_backward, setup_context=_siglip_setup_context)


def siglip_passes(backend: str, tile_size: Optional[int], out_dtype: Optional[torch.dtype], count: int,
                  world: int = 1):
    """The block's forward and backward as functions of tensors only (what a CUDA graph captures,
    ``run_graphed``):

    - ``forward(q, k, s, t, qid, kid) -> (siglip_forward(...) / count,)``;
    - ``backward(q, k, s, t, qid, kid, grad) -> (dq, dk, dscale, dbias)`` of ``world`` times that,
      for the upstream gradient ``grad`` (0-dim), ``dq`` / ``dk`` in ``out_dtype`` (``None``:
      float32).

    ``qid`` / ``kid`` ``None``: query ``i``'s positive is key ``i`` (the ids are made inside the
    pass: in its graph, no launch of the host's). ``count`` is ``b`` on one device, the global number of queries ``B`` for a rank's share in the
    gather path, whose backward carries the ``W`` of the data-parallel contract (``world``, as
    ``ds_infcl.ring.global_sum_with_grad``). Both are constants of the graph."""

    def forward(q, k, s, t, qid, kid):
        qid, kid = _ids(q, k, qid, kid)
        return (siglip_forward(q, k, s, t, qid, kid, backend=backend, tile_size=tile_size) / count,)

    def backward(q, k, s, t, qid, kid, grad):
        qid, kid = _ids(q, k, qid, kid)
        g = grad.detach().float()
        weight = (g if world == 1 else g * world) / count
        dq, dk, ds, dt = siglip_backward(q, k, s, t, qid, kid, weight, backend=backend, tile_size=tile_size,
                                         out_dtype=out_dtype)
        # ds and dt may be views of one sum (the Triton backward's): each its own tensor.
        return dq, dk, ds.reshape(()).clone(), dt.reshape(()).clone()

    return forward, backward


def _ids(query: torch.Tensor, key: torch.Tensor, query_ids: Optional[torch.Tensor], key_ids: Optional[torch.Tensor]):
    """The ids of a pass: ``None`` stands for the diagonal (``siglip_ids`` without labels)."""
    if query_ids is None:
        return siglip_ids(query.shape[0], key.shape[0], query.device)
    return query_ids, key_ids


class SigLIPFunction(torch.autograd.Function):
    """The single-device SigLIP loss (``siglip_forward / b``) as one autograd Function whose passes
    replay from CUDA graphs where a small shape repeats (``run_graphed``; eager otherwise, and
    bitwise the eager result either way). What ``siglip_loss_local`` runs where a graph may replay
    (an eager Triton call on the current CUDA device: ``graph_eligible``); the custom ops
    otherwise. The backward reads the forward graph's copies of the inputs in place while they
    still hold this call's (``inputs_of``). With ``check``, the value checks without labels (finite
    features, scale and bias) run at the start of the forward, in its graph
    (``ds_infcl.ops.pass_check.PassCheck``). ``query_ids`` / ``key_ids`` ``None``: the diagonal,
    made inside the passes. Saves the inputs: ``O((b + m) c)``."""

    @staticmethod
    def forward(ctx, query, key, scale, bias, query_ids, key_ids, backend, tile_size, check=False):
        s, t = scale.detach(), bias.detach()
        b = query.shape[0]
        forward_fn, _ = siglip_passes(backend, tile_size, query.dtype, b)
        checker = PassCheck(query, key, s, t) if check else None
        if checker is not None:  # the value checks first, in the forward's own graph
            forward_fn = checker.wrap(forward_fn, bias_at=3)
        # (whether it checks is in the graphs' keys: calls with and without the check in one
        # process keep their own graphs)
        out, ctx.token = run_graphed("siglip_forward", forward_fn, (query, key, s, t, query_ids, key_ids),
                                     options=(tile_size, check), logits=b * key.shape[0],
                                     backend=backend, token=True, borrow=PassCheck.BORROW if check else ())
        (loss,) = out if checker is None else checker.submit(out, ctx.token)
        ctx.save_for_backward(query, key, s, t, query_ids, key_ids)
        ctx.options = (backend, tile_size, scale.shape, bias.shape, check)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the fused SigLIP")
        saved = ctx.saved_tensors
        backend, tile_size, s_shape, t_shape, check = ctx.options
        query, key = saved[0], saved[1]
        _, backward_fn = siglip_passes(backend, tile_size, query.dtype, query.shape[0])
        inputs = inputs_of(ctx.token)  # the forward graph's copies, while they hold this call's
        args = tuple(saved if inputs is None else inputs) + (grad,)
        dq, dk, ds, dt = run_graphed("siglip_backward", backward_fn, args, options=(tile_size, check),
                                     logits=query.shape[0] * key.shape[0], backend=backend,
                                     static=(0, 1, 2, 3, 4, 5))
        return (dq, dk, ds.reshape(s_shape) if ctx.needs_input_grad[2] else None,
                dt.reshape(t_shape) if ctx.needs_input_grad[3] else None, None, None, None, None, None)


def siglip_loss_local(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    query_ids: Optional[torch.Tensor],
    key_ids: Optional[torch.Tensor],
    *,
    backend: str = "auto",
    tile_size: Optional[int] = None,
    validate: bool = False,
    check_finite: bool = True,
    check_labels: bool = False,
) -> torch.Tensor:
    """The SigLIP loss of one device (``scale`` / ``bias`` 0-dim float32 tensors that may require
    grad), the custom ops ``ds_infcl::siglip_forward`` / ``siglip_backward`` (what
    ``torch.compile`` traces: two opaque ops of known output shapes). The inputs are validated by
    the caller, except for the value checks with ``validate`` (a finite scale and bias, and with
    ``check_finite`` finite features, with ``check_labels`` the query ids, made from labels, in
    ``[0, m)``), which then run inside the forward op. ``query_ids`` / ``key_ids`` ``None``: query
    ``i``'s positive is key ``i``.

    An eager call that a CUDA graph may replay (``graph_eligible``) runs ``SigLIPFunction``
    instead. Its value checks, if asked, run before it; without labels to check, they run in
    ``SigLIPFunction``, at the start of its forward, in the forward's CUDA graph where the shape
    repeats (``ds_infcl.ops.pass_check.PassCheck``: no launch of the host's)."""
    backend = resolve_backend(backend, query.device)
    query, key = query.contiguous(), key.contiguous()
    if check_labels and query_ids is None:
        raise ValueError("siglip_loss_local: check_labels needs the query ids made from the labels")
    if not torch.compiler.is_compiling() and graph_eligible(query, key, backend):
        graph_check = validate and check_finite and not check_labels
        if validate and not graph_check:  # (a check of labels is read at once: check_values)
            check_values(query, key, scale, query_ids if check_labels else None, key.shape[0], check_finite, bias)
        return SigLIPFunction.apply(query, key, scale, bias, query_ids, key_ids, backend, tile_size, graph_check)
    query_ids, key_ids = _ids(query, key, query_ids, key_ids)
    return _siglip_forward_op(query, key, scale, bias, query_ids, key_ids, backend,
                              tile_size, validate, check_finite, check_labels)
