"""Loss API: the functional ``lse`` op and InfoNCE losses, ``nn.Module`` wrappers, the registry of
implementations (Inf-CL and the baselines), SigLIP's sigmoid loss (``siglip_loss``,
``SigLIPLoss``), and the one factory from a name to its module (``build_loss``). Every loss follows
torch's precision rules as a matmul does (``follows_autocast``, ``cast_for_autocast``: the one
mechanism, ``ds_infcl.ops.precision``, re-exported for the adapters)."""

# Importing the implementations registers them (``functional``: infcl; ``baselines``: the peers';
# ``siglip``, ``fastclip`` and ``retrieval``: their modules).
from ds_infcl.loss import baselines as _baselines  # noqa: F401
from ds_infcl.loss import retrieval as _retrieval  # noqa: F401
from ds_infcl.loss.functional import clip_loss, compose_infonce, contrastive_loss, lse, positive_logits
from ds_infcl.loss.module import ContrastiveLoss
from ds_infcl.loss.factory import build_loss, check_loss
from ds_infcl.loss.registry import (
    LossSettings, available_loss_impls, available_loss_modules, get_loss_impl, loss_features, losses_with,
    register_loss_impl, register_loss_module,
)
from ds_infcl.loss.siglip import SigLIPLoss, siglip_loss
from ds_infcl.loss.fastclip import FastCLIPLoss, available_fastclip_losses, build_fastclip_loss, fastclip_num_samples
from ds_infcl.ring.groups import group_rank, group_size, resolve_group
from ds_infcl.ops.precision import cast_for_autocast, follows_autocast

__all__ = [
    "ContrastiveLoss",
    "FastCLIPLoss",
    "available_fastclip_losses",
    "build_fastclip_loss",
    "available_loss_impls",
    "available_loss_modules",
    "build_loss",
    "cast_for_autocast",
    "check_loss",
    "fastclip_num_samples",
    "follows_autocast",
    "LossSettings",
    "clip_loss",
    "compose_infonce",
    "contrastive_loss",
    "get_loss_impl",
    "group_rank",
    "group_size",
    "lse",
    "positive_logits",
    "loss_features",
    "losses_with",
    "register_loss_impl",
    "register_loss_module",
    "resolve_group",
    "SigLIPLoss",
    "siglip_loss",
]
