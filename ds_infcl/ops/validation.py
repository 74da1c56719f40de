"""Input checks shared by every loss path: a clear ``ValueError`` instead of a silent NaN or a hang.

Everything here is local (no communication). The cross-rank check of dims, dtypes and sizes lives
in ``ds_infcl.ring`` (a small metadata all-gather on every call, which also carries each rank's
local check result so that a bad input on one rank raises on every rank instead of hanging).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["SUPPORTED_DTYPES", "check_features", "check_labels", "check_scale"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def check_features(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    check_finite: bool = True,
    allow_empty: bool = False,
) -> None:
    """Check that ``query [b, c]`` and ``key [m, c]`` can be contrasted.

    Raises:
        ValueError: not tensors, not 2-D, feature dims or dtypes that differ, unsupported dtype,
            empty inputs (unless ``allow_empty``), or rows with NaN/Inf (the count is given).
    """
    for name, t in (("query", query), ("key", key)):
        if not torch.is_tensor(t):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [batch, feature_dim], got {_describe(t)}; "
                "flatten extra dimensions before the loss"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} has dtype {t.dtype}; supported dtypes are float32, bfloat16, float16"
            )
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query and key feature dims differ: query {_describe(query)}, key {_describe(key)}; "
            "project both towers to the same embedding size"
        )
    if query.dtype != key.dtype:
        raise ValueError(
            f"query and key dtypes differ: query {query.dtype}, key {key.dtype}; "
            "cast both to the same dtype"
        )
    if query.device != key.device:
        raise ValueError(f"query is on {query.device} but key is on {key.device}")
    if query.shape[1] == 0:
        raise ValueError(f"feature dim is 0 (query {_describe(query)}); it must be at least 1")
    if not allow_empty:
        for name, t in (("query", query), ("key", key)):
            if t.shape[0] == 0:
                raise ValueError(f"{name} is empty ({_describe(t)}); the batch needs at least 1 row")
    if check_finite:
        for name, t in (("query", query), ("key", key)):
            bad = int((~torch.isfinite(t)).any(dim=1).sum()) if t.numel() else 0
            if bad:
                raise ValueError(
                    f"{name} has {bad} of {t.shape[0]} rows with NaN or Inf values; "
                    "check the encoder (fp16 overflow, a bad sample, a diverged step)"
                )


def check_labels(labels: Optional[torch.Tensor], num_queries: int, num_keys: int) -> None:
    """Check ``labels [b]``: integer indices of each query's positive among the local keys."""
    if labels is None:
        if num_keys < num_queries:
            raise ValueError(
                f"without labels query i's positive is key i, which needs at least as many keys as "
                f"queries; got {num_queries} queries and {num_keys} keys: pass labels"
            )
        return
    if not torch.is_tensor(labels):
        raise ValueError(f"labels must be a torch.Tensor of int64, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != num_queries:
        raise ValueError(
            f"labels must have shape [{num_queries}] (one per query), got {tuple(labels.shape)}"
        )
    if num_queries:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_keys:
            raise ValueError(
                f"labels must lie in [0, {num_keys}) (indices into the local keys); "
                f"got values from {lo} to {hi}"
            )


def check_scale(scale: Union[float, int, torch.Tensor]) -> None:
    """Check that the scale (``1 / temperature``) is a finite number or a one-element tensor."""
    if torch.is_tensor(scale):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
        if not scale.dtype.is_floating_point:
            raise ValueError(f"a scale tensor must be floating point, got {scale.dtype}")
        value = float(scale.detach())
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        value = float(scale)
    else:
        raise ValueError(f"scale must be a float or a tensor, got {type(scale).__name__}")
    if not (value == value and abs(value) != float("inf")):
        raise ValueError(f"scale must be finite, got {value}")
