"""SigLIP's pairwise sigmoid loss over the global batch: the functional, the ring, the module.

The loss (DESIGN.md section 9) with ``x_ij = s * q_i . k_j + t`` over every query ``i`` of every
rank and every key ``j`` of every rank::

    L = -(1 / B) * sum_ij log sigmoid(z_ij x_ij),    z_ij = +1 for a positive pair, -1 otherwise

Unlike InfoNCE nothing is merged across blocks: each pair's term stands alone, so rank ``r``'s
share ``(1 / B) * sum_{i on r, all j} ...`` is a plain sum over the key blocks that pass it on the
ring, and the global loss is the sum of the shares.

The ring (DESIGN.md section 4 without the column statistics): at step ``t`` rank ``r`` holds the
key block (and its key ids) of rank ``(r - t) mod W``; the next block's exchange is posted before
the current block is computed. Backward rotates the key blocks again, and the float32 ``dk``
accumulator of each block travels with it: it arrives before the block's products, which add
into it, and the complete ``dk`` goes home (cast to the keys' dtype) after the last hop; ``dq``,
``ds`` and ``dt`` accumulate locally. Every received block is dropped when the next one arrives,
so a rank holds ``O((b + m) c)`` whatever the world size (two float32 accumulators, two key blocks
and one bounded block of ``G`` in the backward).

The gather path (``SigLIPGatherFunction``), taken at small per-GPU batches where the ring's ``W``
sequential hops (each a launch, a wait and a P2P exchange per pass) cost more than its work: one
all-gather of the keys ``K_all [M, c]`` (and, with user ids, of the key ids), rank ``r``'s share
``(1 / B) sum_{i on r, all j}`` as one fused call over ``(Q_r, K_all)``, one all-reduce of the
shares; backward: one fused backward over ``(Q_r, K_all)`` giving ``dq`` and the float32 gradient
of ``K_all``, one reduce-scatter of it back to the keys' owners. ``M c (e + 4)`` bytes per rank for
``e``-byte features (linear in the global batch, no ``b x M`` logits). The choice between the two
is ``ds_infcl.loss.algorithm.choose_algorithm``, the InfoNCE's rule and settings
(``DS_INFCL_ALGORITHM`` pins it); the local passes replay from CUDA graphs where the shapes repeat
(``ds_infcl.ops.siglip.siglip_passes``), between the collectives.

Gradient semantics: the shares are summed by ``global_sum_with_grad`` (the gather path does the
same in its own Function), whose backward multiplies by ``W``; after the data-parallel mean every
gradient (features, scale and bias) equals the single-device gradient of the global loss.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ds_infcl.loss.algorithm import algorithm_settings, choose_algorithm
from ds_infcl.loss.functional import _as_scale_tensor, check_plan
from ds_infcl.loss.module import ClampedScaleModule
from ds_infcl.loss.registry import register_loss_module
from ds_infcl.ops.lse import BACKENDS, resolve_backend
from ds_infcl.ops.infonce_graph import GATHER_MAX_LOGITS, inputs_of, run_graphed
from ds_infcl.ops.lse import refuse_double_backward
from ds_infcl.ops.precision import follows_autocast
from ds_infcl.ops.siglip import siglip_backward, siglip_forward, siglip_ids, siglip_loss_local, siglip_passes
from ds_infcl.ops.validation import check_inputs, check_tile_size, checks_read_after_launch
from ds_infcl.ring import (
    RingLayout,
    agree_on_input_errors,
    agree_on_value_checks,
    all_gather_rows,
    exchange_layout,
    global_sum_with_grad,
    group_size,
    layout_flags,
    post_ring_shift,
    reduce_scatter_rows,
    resolve_group,
    wait_all,
)

__all__ = ["siglip_loss", "SigLIPLoss", "SigLIPRingFunction", "SigLIPGatherFunction", "last_siglip_algorithm"]

Scalar = Union[float, torch.Tensor]
_F32 = torch.float32


def _ring_forward(query, key, s, t, qid, kid, backend, tile_size, layout: RingLayout, group):
    c = query.shape[1]
    total = torch.zeros((), device=query.device, dtype=_F32)
    cur_key, cur_kid = key, kid
    for step in range(layout.world):
        nxt = layout.block_owner(step + 1)
        works, next_key, next_kid = [], None, None
        if step < layout.world - 1:
            next_key = key.new_empty((layout.key_sizes[nxt], c))
            next_kid = kid.new_empty((layout.key_sizes[nxt],))
            works = post_ring_shift([cur_key, cur_kid], [next_key, next_kid], layout, group)
        total += siglip_forward(query, cur_key, s, t, qid, cur_kid, backend=backend, tile_size=tile_size)
        wait_all(works)
        if next_key is not None:
            cur_key, cur_kid = next_key, next_kid
    return total


def _pow2_scale(weight: torch.Tensor, group) -> torch.Tensor:
    """A power of two that brings the largest ``|weight|`` of all ranks to about 1 (device-side:
    one small all-reduce, no host sync)."""
    mx = weight.detach().abs().reshape(1).clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    mx = torch.where(torch.isfinite(mx) & (mx > 0), mx, torch.ones_like(mx))
    return torch.exp2(-torch.ceil(torch.log2(mx))).reshape(())


def _ring_backward(query, key, s, t, qid, kid, weight, backend, tile_size, layout: RingLayout, group):
    """``(dq, dk, ds, dt)`` of ``weight *`` rank ``r``'s sum; ``dq`` / ``dk`` in the features' dtype.

    Two float32 accumulators of the features' size: ``dq`` and the ``dk`` of the key block in
    hand. Before a block's products the ``dk`` of the block it replaces leaves for the next rank
    and the partial ``dk`` of the new block (from the ranks it visited before) arrives, and the
    products add into it; the next key block travels during the products. Both sums are taken
    without the factor ``s`` (and, in fp16, with the weight brought near 1 by a power of two that
    every rank shares, so that the kernels' fp16 ``G`` keeps its range); the factor is applied once
    at the end, before the gradients are cast to the features' dtype and ``dk`` goes home.
    """
    b, c = query.shape
    device = query.device
    gs = None
    if query.dtype == torch.float16 and layout.world > 1:
        gs = _pow2_scale(weight, group)
        weight = weight * gs
    dq = torch.zeros((b, c), device=device, dtype=_F32)
    ds = torch.zeros((), device=device, dtype=_F32)
    dt = torch.zeros((), device=device, dtype=_F32)
    cur_key, cur_kid = key, kid
    dk_acc = torch.zeros((key.shape[0], c), device=device, dtype=_F32)
    for step in range(layout.world):
        owner, nxt = layout.block_owner(step), layout.block_owner(step + 1)
        if step > 0:  # the previous block's dk moves on; the one of the block in hand comes in
            dk_in = torch.empty((layout.key_sizes[owner], c), device=device, dtype=_F32)
            wait_all(post_ring_shift([dk_acc], [dk_in], layout, group))
            dk_acc = dk_in
        works, next_key, next_kid = [], None, None
        if step < layout.world - 1:
            next_key = key.new_empty((layout.key_sizes[nxt], c))
            next_kid = kid.new_empty((layout.key_sizes[nxt],))
            works = post_ring_shift([cur_key, cur_kid], [next_key, next_kid], layout, group)
        _, _, ds_t, dt_t = siglip_backward(query, cur_key, s, t, qid, cur_kid, weight, backend=backend,
                                           tile_size=tile_size, accumulate=(dq, dk_acc))
        ds.add_(ds_t)
        dt.add_(dt_t)
        wait_all(works)
        if next_key is not None:
            cur_key, cur_kid = next_key, next_kid
    factor = s.float() if gs is None else s.float() / gs
    dq = dq.mul_(factor).to(query.dtype)
    # dk_acc is the complete gradient of rank (r + 1)'s keys (with one rank, of its own): scaled
    # and cast here (s and the power of two are the same on every rank), then sent home.
    dk_out = dk_acc.mul_(factor).to(key.dtype)
    del dk_acc
    if layout.world > 1:
        dk_home = torch.empty_like(key)
        wait_all(post_ring_shift([dk_out], [dk_home], layout, group))
        dk_out = dk_home
    if gs is not None:
        ds, dt = ds / gs, dt / gs
    return dq, dk_out, ds, dt


class SigLIPRingFunction(torch.autograd.Function):
    """Rank ``r``'s share of the SigLIP loss, ``(1 / B) sum_{i on r, all j}``, by the ring.

    Saves ``query``, ``key`` and the ids: ``O((b + m) c)`` per rank.
    """

    @staticmethod
    def forward(ctx, query, key, scale, bias, query_ids, key_ids, backend, tile_size, layout, group):
        s, t = scale.detach(), bias.detach()  # read on the device by the kernels: no host sync
        query, key = query.contiguous(), key.contiguous()
        total = _ring_forward(query, key, s, t, query_ids, key_ids, backend, tile_size, layout, group)
        ctx.save_for_backward(query, key, s, t, query_ids, key_ids)
        ctx.options = (backend, tile_size, layout, group, scale.shape, bias.shape)
        return total / layout.num_queries

    @staticmethod
    def backward(ctx, grad):
        query, key, s, t, query_ids, key_ids = ctx.saved_tensors
        backend, tile_size, layout, group, s_shape, t_shape = ctx.options
        weight = grad.float() / layout.num_queries
        dq, dk, ds, dt = _ring_backward(query, key, s, t, query_ids, key_ids, weight, backend, tile_size,
                                        layout, group)
        return (dq, dk,
                ds.reshape(s_shape) if ctx.needs_input_grad[2] else None,
                dt.reshape(t_shape) if ctx.needs_input_grad[3] else None,
                None, None, None, None, None, None)


class SigLIPGatherFunction(torch.autograd.Function):
    """The global SigLIP loss from gathered keys (see the module doc): every rank returns the
    global value, and its backward carries the ``W`` of the data-parallel contract (as
    ``global_sum_with_grad``). Owns its collectives, on every rank in the same order (a rank
    without queries takes part with a zero share and a zero gradient): forward, the all-gather of
    the keys (and of the key ids when ``gather_ids``; otherwise the ids are the keys' global
    positions) and the all-reduce of the shares; backward, the reduce-scatter of the float32
    gradient of the gathered keys. Saves the inputs, the gathered keys and their ids."""

    @staticmethod
    def forward(ctx, query, key, scale, bias, query_ids, key_ids, gather_ids, backend, tile_size, layout, group):
        s, t = scale.detach(), bias.detach()
        query, key = query.contiguous(), key.contiguous()
        key_all = all_gather_rows(key, layout.key_sizes, group)
        if gather_ids:
            kid_all = all_gather_rows(key_ids, layout.key_sizes, group)
        else:  # positions: rank r's keys are rows [key_offset(r), key_offset(r) + m_r) of key_all
            kid_all = torch.arange(layout.num_keys, device=key.device)
        b = query.shape[0]
        forward_fn, _ = siglip_passes(backend, tile_size, None, layout.num_queries, layout.world)
        args = (query, key_all, s, t, query_ids, kid_all)
        ctx.token = None
        if b:
            (share,), ctx.token = run_graphed(
                "siglip_gather_forward", forward_fn, args, options=(tile_size, layout.num_queries, layout.world),
                logits=b * layout.num_keys, backend=backend, max_logits=GATHER_MAX_LOGITS, token=True)
        else:
            share = torch.zeros((), device=query.device, dtype=torch.float32)
        share = share.reshape(1)
        dist.all_reduce(share, group=group)
        ctx.save_for_backward(*args)
        ctx.options = (backend, tile_size, layout, group, scale.shape, bias.shape, key.dtype)
        return share.reshape(())

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the distributed SigLIP")
        saved = ctx.saved_tensors
        backend, tile_size, layout, group, s_shape, t_shape, key_dtype = ctx.options
        query, key_all, s = saved[0], saved[1], saved[2]
        b = query.shape[0]
        if b:
            _, backward_fn = siglip_passes(backend, tile_size, None, layout.num_queries, layout.world)
            inputs = inputs_of(ctx.token)  # the forward graph's copies, while they hold this call's
            # d(key_all) is only read by the reduce-scatter below: a replay may hand over its buffer.
            dq, dk_all, ds, dt = run_graphed(
                "siglip_gather_backward", backward_fn, tuple(saved if inputs is None else inputs) + (grad,),
                options=(tile_size, layout.num_queries, layout.world), logits=b * layout.num_keys,
                backend=backend, max_logits=GATHER_MAX_LOGITS, borrow=(1,), static=(0, 1, 2, 3, 4, 5))
        else:  # zeros keep this rank in the reduce-scatter
            dq = torch.zeros(query.shape, device=query.device, dtype=torch.float32)
            dk_all = torch.zeros(key_all.shape, device=key_all.device, dtype=torch.float32)
            ds = dt = torch.zeros((), device=s.device, dtype=torch.float32)
        dk = reduce_scatter_rows(dk_all, layout.key_sizes, layout.rank, group)
        del dk_all
        return (dq.to(query.dtype), dk.to(key_dtype),
                ds.reshape(s_shape) if ctx.needs_input_grad[2] else None,
                dt.reshape(t_shape) if ctx.needs_input_grad[3] else None,
                None, None, None, None, None, None, None)


_LAST = {"algorithm": None}


def last_siglip_algorithm() -> Optional[str]:
    """The algorithm the last distributed ``siglip_loss`` call on this process used (``"ring"`` or
    ``"gather"``; ``None`` before any)."""
    return _LAST["algorithm"]


def _check_ids(query_ids, key_ids, labels, b: int, m: int) -> None:
    if (query_ids is None) != (key_ids is None):
        raise ValueError("pass both query_ids and key_ids (positives are the pairs with equal ids), or neither")
    if query_ids is None:
        return
    if labels is not None:
        raise ValueError("pass either labels or query_ids/key_ids, not both")
    for name, ids, n in (("query_ids", query_ids, b), ("key_ids", key_ids, m)):
        if not torch.is_tensor(ids) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() != 1 or ids.shape[0] != n:
            raise ValueError(f"{name} must have shape [{n}] (one id per row), got {tuple(ids.shape)}")


@follows_autocast("query", "key")
def siglip_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Scalar,
    bias: Scalar,
    labels: Optional[torch.Tensor] = None,
    *,
    query_ids: Optional[torch.Tensor] = None,
    key_ids: Optional[torch.Tensor] = None,
    backend: str = "auto",
    group=None,
    tile_size: Optional[int] = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """SigLIP's sigmoid loss over the global batch, exact, in linear memory.

    ``L = -(1/B) * sum_ij log sigmoid(z_ij (scale * q_i . k_j + bias))`` over the ``B`` queries of
    all ranks and every key of every rank, ``z_ij = +1`` for a positive pair and ``-1`` otherwise.

    Args:
        query: ``[b, c]`` local queries (images), fp32, bf16 or fp16 (accumulation is fp32); under
            autocast computed in autocast's dtype, float32 with TF32 where torch allows it
            (docs/loss.md, "Precision").
        key: ``[m, c]`` local keys (texts), same dim and dtype.
        scale: the logit multiplier ``s`` (pass ``logit_scale.exp()``); a tensor gets a gradient.
        bias: the logit bias ``t`` (SigLIP's init -10); a tensor gets a gradient.
        labels: ``[b]`` index of each query's positive among the local keys (default the
            diagonal, which needs ``m >= b``).
        query_ids, key_ids: ``[b]`` / ``[m]`` integer ids instead of labels: ``(i, j)`` is positive
            iff the ids are equal, on any ranks (several positives per query, e.g. one id per
            distinct caption so that duplicated captions are not pushed apart).
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        group: data-parallel process group (``None``: DeepSpeed's data-parallel group when set up,
            else the default group when distributed, else one process). With more than one rank
            the keys are all-gathered (small per-GPU batches) or travel around a ring, as
            ``ds_infcl.loss.algorithm.choose_algorithm`` decides (``DS_INFCL_ALGORITHM`` pins it).
        tile_size: tile edge of the torch backend.
        check_finite: raise on NaN/Inf features (one pass over the inputs).

    Returns:
        0-dim float32 tensor: the global loss, the same value on every rank. After the
        data-parallel mean the gradients of the features, the scale and the bias equal those of
        the single-device loss on the global batch.

    Raises:
        ValueError: malformed shapes, dims/dtypes that differ (also between ranks), labels out of
            range, ids of the wrong shape, a non-finite scale or bias, NaN/Inf features; raised on
            every rank at once.
    """
    world = group_size(group)
    checks_labels = labels is not None and query_ids is None
    plan = check_plan(world, True, check_finite, checks_labels)
    with checks_read_after_launch(plan.read_after_launch, agree=plan.agree) as checks:
        with agree_on_input_errors(group):  # a rank's bad input stops every rank (no hang)
            if backend not in BACKENDS:
                raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
            check_tile_size(tile_size)
            check_inputs(query, key, scale, labels, check_labels=query_ids is None, check_finite=check_finite,
                         allow_empty=world > 1, bias=bias, values=not plan.op_checks)
            _check_ids(query_ids, key_ids, labels, query.shape[0], key.shape[0])
            backend = resolve_backend(backend, query.device)
        device = query.device
        s, t = _as_scale_tensor(scale, device), _as_scale_tensor(bias, device)
        if world == 1:
            qid = kid = None  # the diagonal: made inside the loss's passes (in their CUDA graphs)
            if labels is not None or query_ids is not None:
                qid, kid = siglip_ids(query.shape[0], key.shape[0], device, labels=labels, query_ids=query_ids,
                                      key_ids=key_ids)
            return siglip_loss_local(query, key, s, t, qid, kid, backend=backend, tile_size=tile_size,
                                     validate=plan.op_checks, check_finite=check_finite, check_labels=checks_labels)
        return _siglip_distributed(query, key, s, t, labels, query_ids, key_ids, backend, tile_size, group, checks)


def _siglip_distributed(query, key, s, t, labels, query_ids, key_ids, backend, tile_size, group, checks):
    """``siglip_loss`` over several ranks, its inputs checked on this rank (``checks``: the value
    checks it queued, agreed on by every rank right after the layout exchange, or ``None``)."""
    group = resolve_group(group)
    with_ids = query_ids is not None
    # (ranks whose flags disagree would pair other collectives: the layout exchange refuses them)
    flags = layout_flags(with_ids=with_ids, agree=checks is not None)
    layout = exchange_layout(query, key, group, protocol="siglip", flags=flags, settings=algorithm_settings())
    if checks is not None:
        agree_on_value_checks(checks, layout, group, query.device)
    qid, kid = siglip_ids(query.shape[0], key.shape[0], query.device, labels=labels, query_ids=query_ids,
                          key_ids=key_ids, key_offset=layout.key_offset())
    algorithm = _LAST["algorithm"] = choose_algorithm(layout, query.shape[1], query.element_size())
    if algorithm == "gather":
        return SigLIPGatherFunction.apply(query, key, s, t, qid, kid, with_ids, backend, tile_size, layout, group)
    share = SigLIPRingFunction.apply(query, key, s, t, qid, kid, backend, tile_size, layout, group)
    return global_sum_with_grad(share, layout, group)


class SigLIPLoss(ClampedScaleModule):
    """SigLIP's sigmoid loss over the global batch with a learnable scale and bias.

    The scale is ``exp(logit_scale)`` (init ``log 10``, clamped to at most ``max_logit_scale`` in
    the forward) and the bias ``logit_bias`` (init ``-10``), as in SigLIP.

    Args:
        init_logit_scale: initial ``logit_scale`` (log of the scale).
        init_logit_bias: initial bias.
        max_logit_scale: upper clamp of ``logit_scale`` (default ``log 100``).
        learnable: ``False`` keeps scale and bias fixed (buffers).
        backend, group, tile_size: as in :func:`siglip_loss`.

    Inputs: ``query [b, c]``, ``key [m, c]``, optional ``labels [b]`` or ``query_ids [b]`` with
    ``key_ids [m]`` (given ids, ``labels`` is ignored: the ids name every positive pair).
    Returns: the global loss (0-dim float32).

    Relations: equals OpenCLIP's ``SigLipLoss`` (any ``dist_impl``) on the same global batch, in
    ``O((b + m) c)`` memory per rank whatever the number of ranks; ``ds_infcl.adapters.open_clip_loss``
    has a drop-in with OpenCLIP's signatures.

    Example::

        loss_fn = SigLIPLoss()
        loss = loss_fn(image_features, text_features)
        loss.backward()
    """

    def __init__(
        self,
        *,
        init_logit_scale: float = math.log(10.0),
        init_logit_bias: float = -10.0,
        max_logit_scale: float = math.log(100.0),
        learnable: bool = True,
        backend: str = "auto",
        group=None,
        tile_size: Optional[int] = None,
    ):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if init_logit_scale > max_logit_scale:
            raise ValueError(f"init_logit_scale {init_logit_scale} exceeds max_logit_scale {max_logit_scale}")
        check_tile_size(tile_size)
        for name, value in (("logit_scale", init_logit_scale), ("logit_bias", init_logit_bias)):
            tensor = torch.tensor(float(value))
            if learnable:
                setattr(self, name, nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
        self.max_logit_scale = float(max_logit_scale)
        self.backend = backend
        self.group = group
        self.tile_size = tile_size

    def forward(self, query: torch.Tensor, key: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                query_ids: Optional[torch.Tensor] = None, key_ids: Optional[torch.Tensor] = None):
        if query_ids is not None:
            # Ids define every positive pair (the trainer passes a batch's labels as well).
            labels = None
        return siglip_loss(
            query, key, self.scale.to(query.device), self.logit_bias.to(query.device), labels,
            query_ids=query_ids, key_ids=key_ids, backend=self.backend, group=self.group,
            tile_size=self.tile_size,
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, max_logit_scale={self.max_logit_scale:.4f}"


def _build_siglip_loss(settings) -> SigLIPLoss:
    """``loss.impl: siglip``: SigLIP's own defaults (scale 10, bias -10); a task's InfoNCE defaults
    do not apply. The config's ``learnable_scale`` fixes or frees both scale and bias."""
    config = settings.config
    kwargs = {key: config[key] for key in ("init_logit_scale", "max_logit_scale", "init_logit_bias") if key in config}
    if "learnable_scale" in config:
        kwargs["learnable"] = config["learnable_scale"]
    return SigLIPLoss(**settings.placement(), **kwargs)


register_loss_module("siglip", _build_siglip_loss, features=("logit_bias", "multi_positive", "run_config"))
