"""The InfoNCE loss on one device as one autograd Function over the LSE kernels.

Maths (DESIGN.md section 2), ``b`` queries, ``m`` keys, positives ``l_i`` (default ``i``)::

    one direction   L = (1/b) sum_i (r_i - x_{i,l_i})
    symmetric       L = (1/2b) sum_i (r_i - x_{i,l_i}) + (1/2b) sum_i (c_{l_i} - x_{i,l_i})

with ``r``/``c`` the row/column LSE of ``x = s q k^T``. With upstream gradient ``g`` the backward
is one call of the LSE backward with the weights

    a_i = g / b  (one direction) or g / 2b        b_j = (g / 2b) #{i : l_i = j}  (symmetric)
    p_i = -g / b   (upstream gradient of the positive logit x_{i,l_i}, added to G at (i, l_i))

so the positive terms cost no pass and no memory of their own, and ``dq``/``dk`` are written in
the inputs' dtype with bounded float32 scratch. The composition by autograd
(``ds_infcl.loss.functional.compose_infonce`` over ``tiled_lse``) gives the same values; this
Function is what the single-device ``infcl`` loss runs: fewer kernel launches (the small-batch
cost is the host's), and no ``[b, c]`` float32 copies for the positive logits.

The same two passes are also the torch.library custom ops ``ds_infcl::infonce_forward`` and
``ds_infcl::infonce_backward`` (with fake implementations and an autograd formula), so that
``torch.compile(fullgraph=True)`` traces a step that calls the loss: the compiler sees two opaque
ops of known output shapes. ``infonce_loss`` runs the ops, except where a CUDA graph may replay
the call (eager Triton calls on the current CUDA device, ``ds_infcl.ops.infonce_graph``): those
keep ``InfoNCEFunction``, whose forward and backward share the graph between them.
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from ds_infcl.ops.infonce_graph import Borrowed, graph_eligible, inputs_of, run_graphed
from ds_infcl.ops.lse import compose_infonce, infonce_forward, lse_backward, refuse_double_backward, resolve_backend
from ds_infcl.ops.options import LSEOptions
from ds_infcl.ops.pass_check import PassCheck
from ds_infcl.ops.validation import check_values

__all__ = ["InfoNCEFunction", "infonce_loss", "compose_infonce", "column_weights"]


class InfoNCEFunction(torch.autograd.Function):
    """``L = InfoNCE(query, key, scale, labels)`` (0-dim float32); saves only the inputs, the two
    LSE vectors and the scale: O((b + m) c).

    Its forward and backward are each one ``run_graphed`` computation (``_passes``), replayed
    from a CUDA graph where a small shape repeats (``ds_infcl.ops.infonce_graph``; bitwise the
    eager result either way). The backward reads the forward graph's copies of the inputs and its
    LSE vectors in place while they still hold this call's (``inputs_of``; ``Borrowed`` copies the
    LSE vectors only if another call of the graph comes first).
    With ``check``, the value checks without labels (finite features and scale) run at the start of
    the forward, in its graph (``ds_infcl.ops.pass_check.PassCheck``)."""

    @staticmethod
    def forward(ctx, query, key, scale, labels, options: LSEOptions, check: bool = False):
        s = scale.detach()
        forward_fn, _ = _passes(options)
        checker = PassCheck(query, key, s) if check else None
        if checker is not None:  # the value checks first, in the forward's own graph
            forward_fn = checker.wrap(forward_fn)
        skip = 0 if checker is None else PassCheck.OUTPUTS
        # (whether it checks is in the graphs' keys, as in ds_infcl.ops.siglip.SigLIPFunction)
        out, ctx.token = run_graphed("infonce_forward", forward_fn, (query, key, s, labels),
                                     options=(options, check), logits=query.shape[0] * key.shape[0],
                                     backend=options.backend, token=True,
                                     borrow=(skip + 1, skip + 2) + (PassCheck.BORROW if check else ()))
        loss, row, col = out if checker is None else checker.submit(out, ctx.token)
        # The graph's buffers, copied only if a later call of the graph comes while a backward
        # may still read them: autograd frees ``alive`` after the backward (unless the graph is
        # retained for another), or at once where no backward will come.
        alive = torch.empty(0)
        ctx.stats = Borrowed(ctx.token, (row, col), needed=weakref.ref(alive))
        ctx.save_for_backward(query, key, labels, s, alive)
        ctx.scale_shape = scale.shape
        ctx.options, ctx.check = options, check
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the fused InfoNCE")
        query, key, labels, s, _ = ctx.saved_tensors
        options = ctx.options
        row, col = ctx.stats.tensors
        inputs = inputs_of(ctx.token)  # the forward graph's copies, while they hold this call's
        args = tuple((query, key, s, labels) if inputs is None else inputs) + (row, col, grad)
        _, backward_fn = _passes(options)
        dq, dk, ds = run_graphed("infonce_backward", backward_fn, args, options=(options, ctx.check),
                                 logits=query.shape[0] * key.shape[0], backend=options.backend,
                                 static=(0, 1, 2, 3, 4, 5))
        dscale = ds.reshape(ctx.scale_shape) if ctx.needs_input_grad[2] else None
        return dq, dk, dscale, None, None, None


def _infonce_backward(query, key, s, labels, row, col, grad, options: LSEOptions):
    """``(dq, dk, dscale)`` of the InfoNCE with upstream ``grad`` (see the module doc); symmetric
    when ``options.compute_col``, ``dq`` / ``dk`` in the features' dtype."""
    b, m = query.shape[0], key.shape[0]
    symmetric = options.compute_col
    grad = grad.float()
    w = grad * ((0.5 if symmetric else 1.0) / b)  # a_i (and b_j per positive) for every row
    grad_pos = (grad * (-1.0 / b)).expand(b)
    grad_col = column_weights(w, labels, b, m) if symmetric else None
    return lse_backward(
        query, key, s, row, col, w.expand(b), grad_col,
        labels, grad_pos, options.replace(out_dtype=query.dtype),
    )


def column_weights(w: torch.Tensor, labels: Optional[torch.Tensor], b: int, m: int) -> torch.Tensor:
    """``[m]`` float32 upstream weights of the keys' column LSE: ``w`` (0-dim) times the number of
    the ``b`` queries whose positive is key j (``labels``, default the diagonal). No bincount: that
    would sync. Also the distributed InfoNCE's (``ds_infcl.loss.ring_fused``)."""
    if labels is None and m == b:  # CLIP: every key is one query's positive
        return w.expand(m)
    out = torch.zeros((m,), device=w.device, dtype=torch.float32)
    if labels is None:
        out[:b] = w
    elif b:
        out.index_add_(0, labels, w.expand(b))
    return out


def _passes(options: LSEOptions):
    """The eager forward and backward as functions of tensors only (what a CUDA graph captures)."""

    def forward_fn(q, k, s, labels):
        return infonce_forward(q, k, s, labels, options)

    def backward_fn(q, k, s, labels, row, col, grad):
        return _infonce_backward(q, k, s, labels, row, col, grad, options)

    return forward_fn, backward_fn


def _options(symmetric: bool, backend: str, tile_size: Optional[int]) -> LSEOptions:
    # The custom ops take the settings as plain arguments (a schema has no dataclass type).
    return LSEOptions(compute_col=symmetric, backend=backend, tile_size=tile_size)


@torch.library.custom_op("ds_infcl::infonce_forward", mutates_args=())
def _infonce_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    labels: Optional[torch.Tensor],
    symmetric: bool,
    backend: str,
    tile_size: Optional[int],
    validate: bool,
    check_finite: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss [], row_lse [b], col_lse [m] or [0])``, all float32. ``validate``: first run the
    value checks of ``ds_infcl.ops.validation.check_values`` (labels out of range, a non-finite
    scale, and with ``check_finite`` NaN/Inf features), here where a compiled caller cannot read
    values."""
    if validate:
        check_values(query, key, scale, labels, key.shape[0], check_finite)
    loss, row, col = infonce_forward(query, key, scale, labels, _options(symmetric, backend, tile_size))
    return loss, row, (row.new_empty((0,)) if col is None else col)


@_infonce_forward_op.register_fake
def _(query, key, scale, labels, symmetric, backend, tile_size, validate, check_finite):
    f32 = dict(device=query.device, dtype=torch.float32)
    return (query.new_empty((), **f32), query.new_empty((query.shape[0],), **f32),
            query.new_empty((key.shape[0] if symmetric else 0,), **f32))


@torch.library.custom_op("ds_infcl::infonce_backward", mutates_args=())
def _infonce_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    labels: Optional[torch.Tensor],
    row_lse: torch.Tensor,
    col_lse: torch.Tensor,
    symmetric: bool,
    backend: str,
    tile_size: Optional[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [b, c], dk [m, c], dscale [])`` of the InfoNCE with upstream ``grad`` (0-dim); ``dq`` /
    ``dk`` in the features' dtype, ``dscale`` float32 in ``scale``'s shape."""
    dq, dk, ds = _infonce_backward(query, key, scale, labels, row_lse, col_lse if symmetric else None, grad,
                                   _options(symmetric, backend, tile_size))
    return dq, dk, ds.reshape(scale.shape)


@_infonce_backward_op.register_fake
def _(grad, query, key, scale, labels, row_lse, col_lse, symmetric, backend, tile_size):
    return (torch.empty_like(query), torch.empty_like(key),
            scale.new_empty(scale.shape, dtype=torch.float32))


def _infonce_setup_context(ctx, inputs, output):
    query, key, scale, labels, symmetric, backend, tile_size, _, _ = inputs
    _, row, col = output
    ctx.save_for_backward(query, key, scale.detach(), labels, row, col)
    ctx.options = (symmetric, backend, tile_size)
    ctx.mark_non_differentiable(row, col)


def _infonce_op_backward(ctx, grad, _grad_row, _grad_col):
    if not torch.compiler.is_compiling():  # (the compiler traces the backward with grad mode on)
        refuse_double_backward("the fused InfoNCE")
    query, key, s, labels, row, col = ctx.saved_tensors
    symmetric, backend, tile_size = ctx.options
    dq, dk, ds = _infonce_backward_op(grad, query, key, s, labels, row, col, symmetric, backend, tile_size)
    return (dq, dk, ds if ctx.needs_input_grad[2] else None, None, None, None, None, None, None)


_infonce_forward_op.register_autograd(_infonce_op_backward, setup_context=_infonce_setup_context)


def infonce_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    symmetric: bool = False,
    backend: str = "auto",
    tile_size: Optional[int] = None,
    validate: bool = False,
    check_finite: bool = True,
) -> torch.Tensor:
    """InfoNCE of ``query [b, c]`` against ``key [m, c]`` on one device (no validation unless
    asked; see ``ds_infcl.loss.contrastive_loss``). ``scale`` is a 0-dim float32 tensor (it
    receives a gradient if it requires one); ``labels [b]`` int64 local indices, or ``None`` for
    the diagonal (``m >= b``). ``validate`` runs the value checks (labels in range, a finite scale,
    and with ``check_finite`` finite features) inside the op: what a compiled caller uses, since
    no value may be read back while tracing.

    Runs the custom ops ``ds_infcl::infonce_forward`` / ``infonce_backward``; an eager call that
    a CUDA graph may replay runs ``InfoNCEFunction`` (see the module doc).
    """
    backend = resolve_backend(backend, query.device)
    if not torch.compiler.is_compiling() and graph_eligible(query, key, backend):
        graph_check = validate and check_finite and labels is None
        if validate and not graph_check:  # (labels index the keys: checked, and read, before)
            check_values(query, key, scale, labels, key.shape[0], check_finite)
        return InfoNCEFunction.apply(query, key, scale, labels, _options(symmetric, backend, tile_size), graph_check)
    loss, _, _ = _infonce_forward_op(query, key, scale, labels, symmetric, backend, tile_size, validate,
                                     check_finite)
    return loss
