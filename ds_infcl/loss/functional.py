"""Functional API of the contrastive losses.

The expensive part is one op, ``lse``: the row and column log-sum-exp vectors of the logits
``x = scale * query @ key.T`` over the *global* batch (all ranks of ``group``), computed tile by
tile in linear memory. The InfoNCE losses are a cheap composition of those vectors with the
positive logits; other losses (FastCLIP's global losses, weighted or masked variants) reuse
``lse`` the same way.

Shapes (per rank): ``query [b, c]``, ``key [m, c]``, ``labels [b]`` (index of each query's positive
among the *local* keys; default ``arange(b)``), ``scale`` a float or a 0-dim tensor (it receives
a gradient when it requires one).

Precision (``ds_infcl.ops.precision``, docs/loss.md "Precision"): every entry point follows torch's
rules for a matmul. Under autocast the features are cast once to autocast's dtype and the loss
runs with autocast off (gradients come back in the caller's dtype); float32 features outside
autocast use TF32 dot products where ``torch.backends.cuda.matmul.allow_tf32`` allows them. The
LSE vectors and the loss are float32 in every case.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch

from ds_infcl.loss.registry import get_loss_impl, register_loss_impl
from ds_infcl.ops import LSEOptions, compose_infonce, infonce_loss, labels_or_diagonal, tiled_lse
from ds_infcl.ops.precision import follows_autocast
from ds_infcl.ops.validation import check_inputs, check_tile_size, checks_read_after_launch
from ds_infcl.ring import agree_on_input_errors, group_size

__all__ = ["lse", "contrastive_loss", "clip_loss", "positive_logits", "compose_infonce"]

Scale = Union[float, torch.Tensor]


class CheckPlan(NamedTuple):
    """Where a loss call's value checks (finite features, scale and bias, labels in range) run and
    when they are read: one rule for ``contrastive_loss`` and ``siglip_loss`` (docs/loss.md,
    "Errors")."""

    op_checks: bool  # the fused op computes them: traced, or at the start of its forward (PassCheck)
    read_after_launch: bool  # read once the forward is queued (``checks_read_after_launch``)
    agree: bool  # across ranks: every rank's verdict all-gathered after the layout exchange


def check_plan(world: int, fused: bool, check_finite: bool, checks_labels: bool, in_forward: bool = True) -> CheckPlan:
    """The :class:`CheckPlan` of a call over ``world`` ranks; ``fused``: the loss is the fused
    single-device op there (``impl="infcl"``, SigLIP, ``lse``) and the ring's paths across ranks;
    ``checks_labels``: the call has labels to check (they are read before the forward);
    ``in_forward``: the eager op can run the checks at the start of its forward (not ``lse``'s).

    - Traced by ``torch.compile`` on one device, the fused op checks the values itself, in the
      graph. Eager on one device with no labels to check, so does it: at the start of its forward,
      in the forward's CUDA graph where one replays (``ds_infcl.ops.pass_check.PassCheck``).
    - Eager on one device, the checks are read once the loss's kernels are queued (no wait first);
      across ranks too (fused paths, ``check_finite``), once every rank's verdict is agreed in the
      loss's first collective (``ds_infcl.ring.agree_on_value_checks``)."""
    in_op = world == 1 and fused and torch.compiler.is_compiling()
    op_checks = in_op or (in_forward and world == 1 and fused and check_finite and not checks_labels)
    agree = world > 1 and fused and check_finite
    return CheckPlan(op_checks, (world == 1 and not in_op) or agree, agree)


def _as_scale_tensor(scale: Scale, device: torch.device) -> torch.Tensor:
    if torch.is_tensor(scale):
        if scale.dim() == 0 and scale.dtype == torch.float32 and scale.device == device:
            return scale  # (already one: a view and a no-op cast cost the host ~15 us per call)
        return scale.reshape(()).to(device=device, dtype=torch.float32)
    # a fill, not a host-to-device copy (which would wait for the GPU queue)
    return torch.full((), float(scale), device=device, dtype=torch.float32)


@follows_autocast("query", "key")
def lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    compute_col: bool = True,
    backend: str = "auto",
    group=None,
    tile_size: Optional[int] = None,
    check_finite: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row and column LSE of ``scale * query @ key.T`` over the global batch, differentiable.

    Args:
        query: ``[b, c]`` local queries (fp32, bf16 or fp16; accumulation is fp32). Under
            autocast, computed in autocast's dtype (see the module doc).
        key: ``[m, c]`` local keys, same dim and dtype as ``query``.
        scale: multiplier of the logits (``1 / temperature``); a tensor receives a gradient.
        labels: ``[b]`` local index of each query's positive key (default the diagonal); only read
            when ``exclude_positive``.
        exclude_positive: leave each query's positive pair out of both LSEs (FastCLIP's
            ``log g`` needs this).
        compute_col: also return the column LSE (the key-to-query direction).
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        group: process group of the data-parallel ranks. ``None``: DeepSpeed's data-parallel
            group when DeepSpeed is initialized with a mesh or model parallelism, else the world
            group if torch.distributed is initialized, else a single process (no communication).
            With more than one rank the key blocks travel around a ring.
        tile_size: tile edge of the torch backend, a positive integer (default
            ``ds_infcl.ops.default_tile_size``).
        check_finite: raise on NaN/Inf features (costs one pass over the inputs).

    Returns:
        ``row_lse [b]`` (float32, over all keys of all ranks) and ``col_lse [m]`` (float32, over
        all queries of all ranks) or ``None``.

    Raises:
        ValueError: malformed shapes, dims/dtypes that differ, labels out of range, empty inputs,
            non-finite features, an unknown backend.
    """
    world = group_size(group)
    plan = check_plan(world, True, check_finite, exclude_positive and labels is not None, in_forward=False)
    with checks_read_after_launch(plan.read_after_launch, agree=plan.agree) as checks:
        with agree_on_input_errors(group):  # a rank's bad input stops every rank (no hang)
            check_tile_size(tile_size)
            options = LSEOptions(exclude_positive=exclude_positive, compute_col=compute_col, backend=backend,
                                 tile_size=tile_size)
            check_inputs(query, key, scale, labels, check_labels=exclude_positive, check_finite=check_finite,
                         allow_empty=world > 1, values=not plan.op_checks)
        labels = labels_or_diagonal(labels, query.shape[0], query.device) if exclude_positive else None
        scale_t = _as_scale_tensor(scale, query.device)
        if world > 1:
            from ds_infcl.loss.ring import ring_lse

            return ring_lse(query, key, scale_t, labels, options, group, checks=checks)
        return tiled_lse(query, key, scale_t, labels, options, validate=plan.op_checks, check_finite=check_finite)


def positive_logits(query: torch.Tensor, key: torch.Tensor, scale: torch.Tensor, labels: torch.Tensor):
    """``[b]`` float32 logits of each query with its positive key: ``scale * q_i . k_{labels_i}``."""
    return scale * (query.float() * key[labels].float()).sum(dim=1)


@register_loss_impl("infcl", features=("directed", "retrieval", "run_config"))
def _infcl_loss(query, key, scale, labels, *, symmetric, backend, group, tile_size):
    """Inf-CL: tiled LSE on each device, key blocks around a ring across devices."""
    if group_size(group) > 1:
        from ds_infcl.loss.ring import ring_infonce

        return ring_infonce(
            query, key, scale, labels, symmetric=symmetric, backend=backend, group=group,
            tile_size=tile_size,
        )
    # One device: the whole loss is one autograd Function (ds_infcl.ops.infonce), equal to
    # compose_infonce over tiled_lse with fewer launches and no float32 copies of the inputs.
    return infonce_loss(query, key, scale, labels, symmetric=symmetric, backend=backend, tile_size=tile_size)


@follows_autocast("query", "key")
def contrastive_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scale,
    labels: Optional[torch.Tensor] = None,
    *,
    symmetric: bool = False,
    impl: str = "infcl",
    backend: str = "auto",
    group=None,
    tile_size: Optional[int] = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """InfoNCE over the global batch, exact, in linear memory.

    One direction (retrieval): ``mean_i (row_lse_i - x_{i, labels_i})`` over all queries of all
    ranks. Symmetric (CLIP): the mean of that and ``mean_i (col_lse_{labels_i} - x_{i, labels_i})``.
    With hard negatives (``m > b`` keys per rank) the key-to-query term covers the positive keys.

    Args:
        query: ``[b, c]`` local queries (images, or text queries); fp32, bf16 or fp16, under
            autocast computed in autocast's dtype, float32 with TF32 where torch allows it.
        key: ``[m, c]`` local keys (texts, or documents with hard negatives), ``m >= 1``.
        scale: ``1 / temperature`` as a float or a tensor that receives a gradient (pass
            ``logit_scale.exp()``).
        labels: ``[b]`` index of each query's positive among the local keys (default ``arange(b)``,
            which needs ``m >= b``). A positive always lives on its query's rank.
        symmetric: add the key-to-query direction (CLIP).
        impl: loss implementation by name; see ``available_loss_impls()``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``lse``).
        group: data-parallel process group (see ``lse``).
        tile_size: tile edge of the torch backend.
        check_finite: raise on NaN/Inf features.

    Returns:
        0-dim float32 tensor: the global loss, the same value on every rank.

    Under ``torch.compile`` (``fullgraph=True`` too) the single-device ``"infcl"`` loss is two
    custom ops (``ds_infcl::infonce_forward`` / ``infonce_backward``); the checks of shapes run
    while tracing and the checks of values (``check_finite``, labels in range) inside the forward
    op at every call, with the same errors. Distributed calls and the other ``impl`` are not
    made for the compiler (they read values and communicate on the host).

    Raises:
        ValueError: on the bad inputs listed in ``lse``, labels out of range, an unknown ``impl``.
    """
    world = group_size(group)
    plan = check_plan(world, impl == "infcl", check_finite, labels is not None)
    with checks_read_after_launch(plan.read_after_launch, agree=plan.agree) as checks:
        with agree_on_input_errors(group):  # a rank's bad input stops every rank (no hang)
            fn = get_loss_impl(impl)
            check_tile_size(tile_size)
            check_inputs(query, key, scale, labels, check_finite=check_finite, allow_empty=world > 1,
                         values=not plan.op_checks)
        labels_t = None if labels is None else labels.to(device=query.device, dtype=torch.long)
        scale_t = _as_scale_tensor(scale, query.device)
        if plan.op_checks:
            return infonce_loss(query, key, scale_t, labels_t, symmetric=symmetric, backend=backend,
                                tile_size=tile_size, validate=True, check_finite=check_finite)
        if plan.agree:
            from ds_infcl.loss.ring import ring_infonce

            return ring_infonce(query, key, scale_t, labels_t, symmetric=symmetric, backend=backend, group=group,
                                tile_size=tile_size, checks=checks)
        return fn(query, key, scale_t, labels_t, symmetric=symmetric, backend=backend, group=group,
                  tile_size=tile_size)


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, scale: Scale, **kwargs):
    """Symmetric CLIP loss: ``contrastive_loss(image, text, scale, symmetric=True, **kwargs)``."""
    return contrastive_loss(image_features, text_features, scale, symmetric=True, **kwargs)
