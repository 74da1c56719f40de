"""The settings of one LSE op call, carried as one object from the loss API down to the launchers.

The functional API (``ds_infcl.loss.lse``), the single-device Function, the ring's block steps and
the backend dispatch (``lse_forward`` / ``lse_backward``) all need the same handful of settings.
They travel as one frozen ``LSEOptions`` instead of a list of 5-8 parameters repeated at every
layer; tensors (features, scale, labels, LSE vectors, upstream gradients) stay arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ds_infcl.ops.tiled import default_tile_size

__all__ = ["LSEOptions", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton")


@dataclasses.dataclass(frozen=True)
class LSEOptions:
    """Labels-independent settings of the LSE op.

    Attributes:
        exclude_positive: leave each query's positive pair (``labels``, default the diagonal) out
            of both LSEs (FastCLIP's ``log g``).
        compute_col: also compute the column LSE (the key-to-query direction).
        backend: ``"torch"`` or ``"triton"`` once resolved (``resolve_backend``); the API layers
            also carry ``"auto"`` until they resolve it for the inputs' device.
        tile_size: tile edge of the torch backend (``None``: ``default_tile_size`` of the device);
            the Triton backend picks its own tiles.
        out_dtype: dtype of the backward's ``dq`` / ``dk`` (``None``: float32, what the ring
            accumulates; the single-device op writes the inputs' dtype).
    """

    exclude_positive: bool = False
    compute_col: bool = True
    backend: str = "torch"
    tile_size: Optional[int] = None
    out_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def tile(self, device: torch.device) -> int:
        """The tile edge of the torch backend on ``device``."""
        return self.tile_size or default_tile_size(device)

    def replace(self, **changes) -> "LSEOptions":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def on_block(self, own: bool) -> "LSEOptions":
        """The options for one ring block: the positive pairs live on the own block only, so any
        other block excludes nothing."""
        return self if own or not self.exclude_positive else self.replace(exclude_positive=False)
