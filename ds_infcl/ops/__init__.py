"""Single-device maths of the contrastive loss: reference, tiled PyTorch path, Triton kernels.

Never imports torch.distributed or deepspeed (DESIGN.md section 1).
"""

from ds_infcl.ops.infonce import InfoNCEFunction, infonce_loss
from ds_infcl.ops.lse import (
    BACKENDS,
    compose_infonce,
    lse_backward,
    lse_forward,
    positive_logits_forward,
    resolve_backend,
    tiled_lse,
)
from ds_infcl.ops.options import LSEOptions
from ds_infcl.ops.reference import contrastive_loss_reference, logits_reference, lse_reference
from ds_infcl.ops.tiled import (
    DEFAULT_TILE,
    default_tile_size,
    labels_or_diagonal,
    lse_backward_torch,
    lse_forward_torch,
    positive_logits_torch,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TILE",
    "InfoNCEFunction",
    "LSEOptions",
    "compose_infonce",
    "contrastive_loss_reference",
    "default_tile_size",
    "infonce_loss",
    "labels_or_diagonal",
    "logits_reference",
    "lse_backward",
    "lse_backward_torch",
    "lse_forward",
    "lse_forward_torch",
    "lse_reference",
    "positive_logits_forward",
    "positive_logits_torch",
    "resolve_backend",
    "tiled_lse",
]
