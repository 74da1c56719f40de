"""Drop-ins for OpenCLIP's ``ClipLoss`` and ``SigLipLoss``: same constructor and ``forward``, the
exact global loss through this package, in linear memory.

An OpenCLIP training script changes one import::

    -from open_clip.loss import ClipLoss, SigLipLoss
    +from ds_infcl.adapters.open_clip_loss import ClipLoss, SigLipLoss

Differences a user should know (docs/siglip.md has the whole migration):

- The value returned on every rank is the *global* loss (OpenCLIP returns each rank's local
  mean, whose mean over ranks is the same number). The gradients after DDP's / DeepSpeed's
  mean over ranks are the exact global ones in both, so training is the same.
- ``ClipLoss``: ``local_loss`` and ``gather_with_grad`` are accepted and make no difference:
  the loss is always the exact one that OpenCLIP gives with ``local_loss=True,
  gather_with_grad=True`` (its other settings scale the tower gradients by ``1 / W`` after DDP
  averaging); nothing of size ``B x B`` (or ``b x B``) is allocated.
- ``SigLipLoss``: every ``dist_impl`` computes the same loss; ours is one ring of key blocks whose
  memory per GPU does not grow with the number of GPUs.
- ``logit_scale`` is the exponentiated scale, as OpenCLIP passes it (``model.logit_scale.exp()``).
- The process group is ``group=`` (default: DeepSpeed's data-parallel group when set up, else the
  default group); ``rank`` / ``world_size`` are checked against it. Horovod is not supported.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ds_infcl.loss import clip_loss, group_rank, group_size, siglip_loss

__all__ = ["ClipLoss", "SigLipLoss"]


def _check_world(rank: int, world_size: int, use_horovod: bool, group) -> None:
    if use_horovod:
        raise ValueError("use_horovod=True is not supported: ds_infcl communicates through torch.distributed "
                         "(launch with torchrun or the deepspeed launcher)")
    actual = group_size(group)
    if world_size != actual or (actual > 1 and rank != group_rank(group)):
        raise ValueError(
            f"rank={rank}, world_size={world_size} do not match the process group (rank "
            f"{group_rank(group) if actual > 1 else 0} of {actual}); pass the values of "
            "torch.distributed (or leave the defaults when running one process)"
        )


class ClipLoss(nn.Module):
    """OpenCLIP's ``ClipLoss`` interface over ``ds_infcl.loss.clip_loss`` (symmetric InfoNCE).

    Args:
        local_loss, gather_with_grad, cache_labels: accepted for compatibility; no effect (the
            loss is always the exact global one).
        rank, world_size: this process's rank and the data-parallel world size (checked).
        use_horovod: must be ``False``.
        group: the data-parallel process group (default as in ``ds_infcl.loss``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Inputs: ``image_features [b, c]``, ``text_features [b, c]``, ``logit_scale`` (exponentiated,
    a tensor that may require grad), ``logit_bias`` (optional; a constant added to every logit
    cancels in the softmax), ``output_dict``.
    Returns: the global loss, or ``{"contrastive_loss": loss}`` with ``output_dict=True``.
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        group=None,
        backend: str = "auto",
    ):
        super().__init__()
        _check_world(rank, world_size, use_horovod, group)
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.backend = backend

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: Optional[torch.Tensor] = None, output_dict: bool = False):
        loss = clip_loss(image_features, text_features, logit_scale, group=self.group, backend=self.backend)
        if torch.is_tensor(logit_bias) and logit_bias.requires_grad:
            # One bias added to every logit cancels in the softmax: the value is unchanged and its
            # gradient is zero (a zero, not None, as in OpenCLIP, so DDP sees the parameter used).
            loss = loss + 0.0 * logit_bias.sum()
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(nn.Module):
    """OpenCLIP's ``SigLipLoss`` interface over ``ds_infcl.loss.siglip_loss``.

    Args:
        cache_labels: accepted for compatibility; no effect.
        rank, world_size: this process's rank and the data-parallel world size (checked).
        dist_impl: ``None``, ``"bidir"``, ``"shift"``, ``"reduce"`` or ``"gather"``, accepted for
            compatibility (OpenCLIP's exchange strategies); all give the same loss here.
        group: the data-parallel process group (default as in ``ds_infcl.loss``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Inputs: ``image_features [b, c]``, ``text_features [b, c]``, ``logit_scale`` (exponentiated),
    ``logit_bias``, ``output_dict``. Positives are the diagonal (image i with text i).
    Returns: the global loss, or ``{"contrastive_loss": loss}`` with ``output_dict=True``.
    """

    DIST_IMPLS = (None, "bidir", "shift", "reduce", "gather")

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Optional[str] = None,
        *,
        group=None,
        backend: str = "auto",
    ):
        super().__init__()
        if dist_impl not in self.DIST_IMPLS:
            raise ValueError(f"dist_impl must be one of {self.DIST_IMPLS}, got {dist_impl!r}")
        _check_world(rank, world_size, False, group)
        self.rank, self.world_size = rank, world_size
        self.dist_impl = dist_impl or "bidir"
        self.group = group
        self.backend = backend

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor, output_dict: bool = False):
        loss = siglip_loss(image_features, text_features, logit_scale, logit_bias, group=self.group,
                           backend=self.backend)
        return {"contrastive_loss": loss} if output_dict else loss
