"""``nn.Module`` wrappers: the loss owns the learnable logit scale, so ZeRO manages it like any
other parameter when the module sits inside the model given to ``deepspeed.initialize``."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ds_infcl.loss.functional import contrastive_loss
from ds_infcl.loss.registry import get_loss_impl
from ds_infcl.ops.lse import BACKENDS
from ds_infcl.ops.validation import check_tile_size

__all__ = ["ContrastiveLoss"]


class ClampedScaleModule(nn.Module):
    """Base of the loss modules with a learnable temperature: ``scale`` is
    ``exp(clamp(logit_scale, max=max_logit_scale))``; the subclass sets both attributes."""

    @property
    def scale(self) -> torch.Tensor:
        """The current scale ``exp(clamp(logit_scale, max=max_logit_scale))``."""
        return self.logit_scale.clamp(max=self.max_logit_scale).exp()


class ContrastiveLoss(ClampedScaleModule):
    """InfoNCE over the global batch with a learnable temperature.

    The scale is ``exp(logit_scale)``, with ``logit_scale`` initialised to ``log(1 / 0.07)`` and
    clamped to at most ``log(100)`` in the forward (as CLIP does), so the clamp never blocks the
    gradient below the bound.

    Args:
        symmetric: add the key-to-query direction (CLIP); ``False`` for retrieval.
        init_logit_scale: initial value of ``logit_scale`` (log of the scale).
        max_logit_scale: upper clamp of ``logit_scale``.
        learnable_scale: ``False`` keeps the scale fixed (a buffer, e.g. 20 for retrieval).
        impl: loss implementation name (``"infcl"``, or a baseline; see ``available_loss_impls``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        group: data-parallel process group; ``None`` is the default group when distributed.
        tile_size: tile edge of the torch backend.

    Inputs: ``query [b, c]``, ``key [m, c]``, optional ``labels [b]``.
    Returns: the global loss (0-dim float32).

    Relations: ``ContrastiveLoss()`` (symmetric, the CLIP loss) equals OpenCLIP's ``ClipLoss`` with
    ``local_loss=True, gather_with_grad=True`` (OpenCLIP users who want its constructor and
    ``forward(image_features, text_features, logit_scale)`` import the drop-in
    ``ds_infcl.adapters.open_clip_loss.ClipLoss``, the package's only ``ClipLoss``); ``symmetric=False`` with a fixed scale of 20
    equals sentence-transformers' ``MultipleNegativesRankingLoss``.

    Example::

        loss_fn = ContrastiveLoss(symmetric=True)
        loss = loss_fn(image_features, text_features)
        loss.backward()
    """

    def __init__(
        self,
        *,
        symmetric: bool = True,
        init_logit_scale: float = math.log(1 / 0.07),
        max_logit_scale: float = math.log(100.0),
        learnable_scale: bool = True,
        impl: str = "infcl",
        backend: str = "auto",
        group=None,
        tile_size: Optional[int] = None,
    ):
        super().__init__()
        get_loss_impl(impl)  # fail at construction on an unknown name
        check_tile_size(tile_size)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if init_logit_scale > max_logit_scale:
            raise ValueError(
                f"init_logit_scale {init_logit_scale} exceeds max_logit_scale {max_logit_scale}"
            )
        value = torch.tensor(float(init_logit_scale))
        if learnable_scale:
            self.logit_scale = nn.Parameter(value)
        else:
            self.register_buffer("logit_scale", value)
        self.symmetric = symmetric
        self.max_logit_scale = float(max_logit_scale)
        self.impl = impl
        self.backend = backend
        self.group = group
        self.tile_size = tile_size

    def forward(self, query: torch.Tensor, key: torch.Tensor, labels: Optional[torch.Tensor] = None):
        return contrastive_loss(
            query, key, self.scale.to(query.device), labels, symmetric=self.symmetric,
            impl=self.impl, backend=self.backend, group=self.group, tile_size=self.tile_size,
        )

    def extra_repr(self) -> str:
        return (
            f"symmetric={self.symmetric}, impl={self.impl!r}, backend={self.backend!r}, "
            f"max_logit_scale={self.max_logit_scale:.4f}"
        )
