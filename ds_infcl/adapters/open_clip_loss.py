"""Drop-ins for OpenCLIP's ``ClipLoss`` and ``SigLipLoss``: same constructor and ``forward``, the
exact global loss through this package, in linear memory.

An OpenCLIP training script changes one import::

    -from open_clip.loss import ClipLoss, SigLipLoss
    +from ds_infcl.adapters.open_clip_loss import ClipLoss, SigLipLoss

Differences a user should know (docs/siglip.md has the whole migration):

- ``SigLipLoss`` returns the *global* loss on every rank (OpenCLIP returns each rank's local
  mean, whose mean over ranks is the same number). The gradients after DDP's / DeepSpeed's
  mean over ranks are the exact global ones in both, so training is the same.
- ``ClipLoss``: ``local_loss`` and ``gather_with_grad`` do what they do in OpenCLIP, on every
  rank: the same loss value and the same gradients of the local features and of the scale (see
  the class); nothing of size ``B x B`` (or ``b x B``) is allocated. Only ``local_loss=True,
  gather_with_grad=True`` (or one rank) gives the exact global-batch gradients after DDP's mean:
  OpenCLIP's defaults give ``1 / W`` of the tower gradients, and ``gather_with_grad=False`` with
  ``local_loss=True`` leaves out the gradients that the other ranks' logits send back.
  ``cache_labels`` is accepted (a pure caching flag in OpenCLIP; nothing to cache here).
- ``SigLipLoss``: every ``dist_impl`` computes the same loss; ours is one ring of key blocks whose
  memory per GPU does not grow with the number of GPUs.
- ``logit_scale`` is the exponentiated scale, as OpenCLIP passes it (``model.logit_scale.exp()``).
- Precision follows torch's rules as OpenCLIP's logits matmul does: inside
  ``torch.autocast(dtype=torch.bfloat16)`` the float32 features that ``F.normalize`` returns are
  computed in bf16 (gradients come back float32), and float32 outside autocast uses TF32 where
  ``torch.backends.cuda.matmul.allow_tf32`` allows it (OpenCLIP's trainer sets it). The loss value
  is float32 (docs/loss.md, "Precision").
- The process group is ``group=`` (default: DeepSpeed's data-parallel group when set up, else the
  default group); ``rank`` / ``world_size`` are checked against it. Horovod is not supported.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ds_infcl.loss import (
    clip_loss, follows_autocast, group_rank, group_size, lse, positive_logits, resolve_group, siglip_loss,
)

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


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over the ranks of ``group``, times
    ``factor`` (a collective: every rank's backward reaches it)."""

    @staticmethod
    def forward(ctx, x, group, factor):
        ctx.group, ctx.factor = group, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.factor, None, None


class ClipLoss(nn.Module):
    """OpenCLIP's ``ClipLoss`` interface over ``ds_infcl.loss`` (symmetric InfoNCE).

    With one rank every flag gives the plain loss. With ``W > 1`` ranks, rank ``r`` (``b_r`` rows
    of ``B``) returns what OpenCLIP's ``ClipLoss`` returns there, with the same gradients of its
    features and of ``logit_scale`` (``x = s I T^T`` over the global batch, ``row_i`` /
    ``col_j`` the log-sum-exp of image ``i`` over all texts / of text ``j`` over all images):

    - ``local_loss=True``: ``loss_r = (sum_{i in r} (row_i - x_ii) + sum_{j in r} (col_j - x_jj))
      / (2 b_r)``, rank r's share of the logits against the gathered features; with
      ``gather_with_grad=True`` its gradient flows to every rank's features (the exact global
      gradient after DDP's mean), with ``False`` the gathered features are constants: the images
      receive only the image-to-text gradient, the texts only the text-to-image one.
    - ``local_loss=False``: the global loss ``L`` on every rank, whose scale gradient is
      ``dL/ds``; the features receive ``dL/dF_r`` (OpenCLIP's gather without grad: ``1 / W`` of
      the exact tower gradient after DDP's mean) or, with ``gather_with_grad=True``, ``W dL/dF_r``.

    OpenCLIP needs the same ``b`` on every rank; here unequal sizes follow the same formulas.

    Args:
        local_loss, gather_with_grad: as in OpenCLIP (above).
        cache_labels: accepted (OpenCLIP caches its label tensor; there is none here).
        rank, world_size: this process's rank and the data-parallel world size (checked).
        use_horovod: must be ``False``.
        group: the data-parallel process group (default as in ``ds_infcl.loss``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Inputs: ``image_features [b, c]``, ``text_features [b, c]``, ``logit_scale`` (exponentiated,
    a tensor that may require grad), ``logit_bias`` (optional; a constant added to every logit
    cancels in the softmax), ``output_dict``.
    Returns: the loss above, or ``{"contrastive_loss": loss}`` with ``output_dict=True``.
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
        self.local_loss, self.gather_with_grad, self.cache_labels = bool(local_loss), bool(gather_with_grad), cache_labels
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.backend = backend

    @follows_autocast("image_features", "text_features")  # (once for the two lse and positive_logits)
    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: Optional[torch.Tensor] = None, output_dict: bool = False):
        if group_size(self.group) == 1:
            loss = clip_loss(image_features, text_features, logit_scale, group=self.group, backend=self.backend)
        else:
            loss = self._distributed(image_features, text_features, logit_scale)
        if torch.is_tensor(logit_bias) and logit_bias.requires_grad:
            # One bias added to every logit cancels in the softmax: the value is unchanged and its
            # gradient is zero (a zero, not None, as in OpenCLIP, so DDP sees the parameter used).
            loss = loss + 0.0 * logit_bias.sum()
        return {"contrastive_loss": loss} if output_dict else loss

    def _distributed(self, image: torch.Tensor, text: torch.Tensor, logit_scale) -> torch.Tensor:
        """OpenCLIP's loss on this rank (see the class) from the linear-memory LSE op."""
        if image.dim() != 2 or image.shape != text.shape:
            raise ValueError(f"image_features {tuple(image.shape)} and text_features {tuple(text.shape)} must both "
                             "be [b, c] with the same b and c (one text per image, as in OpenCLIP)")
        group = resolve_group(self.group)
        world = group_size(group)
        scale = logit_scale if torch.is_tensor(logit_scale) else torch.tensor(float(logit_scale))
        scale = scale.reshape(()).to(device=image.device, dtype=torch.float32)
        if not self.local_loss and scale.requires_grad:
            # OpenCLIP computes the whole global loss on every rank: its scale gradient is dL/ds there.
            scale = _SumGradOverRanks.apply(scale, group, 1.0 / world if self.gather_with_grad else 1.0)
        kw = dict(backend=self.backend, group=group)
        labels = torch.arange(image.shape[0], device=image.device)
        if self.local_loss:
            # One op per direction, so that the scale gradient on this rank is that of this rank's
            # rows (OpenCLIP's); without gather_with_grad the gathered features are constants:
            # each direction differentiates its queries only.
            const = (lambda t: t) if self.gather_with_grad else (lambda t: t.detach())
            row, _ = lse(image, const(text), scale, compute_col=False, **kw)
            col, _ = lse(text, const(image), scale, compute_col=False, **kw)
            terms = ((row - positive_logits(image, const(text), scale, labels)).sum()
                     + (col - positive_logits(text, const(image), scale, labels)).sum())
        else:
            row, col = lse(image, text, scale, **kw)
            pos = positive_logits(image, text, scale, labels)
            terms = (row - pos).sum() + (col - pos).sum()
        b = image.shape[0]
        if self.local_loss:
            return terms / (2 * max(b, 1))
        # The global loss L on every rank; rank r's graph carries its share of the gradient
        # (dL/dF_r through the ring, W times that with gather_with_grad).
        total = torch.stack([terms.detach(), torch.full_like(terms.detach(), float(b))])  # (a fill: no copy)
        dist.all_reduce(total, group=group)
        global_loss = total[0] / (2 * total[1])
        share = terms / (2 * total[1]) * (world if self.gather_with_grad else 1)
        return share + (global_loss - share).detach()


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
