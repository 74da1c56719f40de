"""Matryoshka settings and prefixes shared by the retrieval loss (``ds_infcl.loss.retrieval``) and
its float64 reference (``ds_infcl.loss.retrieval_reference``): the checks of ``matryoshka_dims`` /
``matryoshka_weights`` and the truncated, re-normalized prefix of an embedding. Both modules import
this one, so that the reference never imports the implementation it checks."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["check_matryoshka", "matryoshka_options", "matryoshka_prefix"]


def check_matryoshka(
    dims: Sequence[int], weights: Optional[Sequence[float]] = None, embedding_dim: Optional[int] = None
) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """Validated ``(dims, weights)`` of a Matryoshka loss, as tuples.

    ``dims`` are distinct positive integers, largest first, each at most ``embedding_dim`` (when
    given); ``weights`` (default all 1) are finite, non-negative and as many as ``dims``.

    Raises:
        ValueError: naming what is wrong and the value that would be accepted.
    """
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
        raise ValueError(f"matryoshka_dims must be a list of positive integers, largest first "
                         f"(e.g. [768, 512, 256, 128, 64]), got {dims!r}")
    dims = list(dims)
    if not dims:
        raise ValueError("matryoshka_dims is empty: give at least one dimension (e.g. [768, 512, 256]) "
                         "or None for the plain loss")
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1]
    if bad:
        raise ValueError(f"matryoshka_dims must be positive integers, got {bad} in {dims}")
    dims = [int(d) for d in dims]
    dups = sorted({d for d in dims if dims.count(d) > 1}, reverse=True)
    if dups:
        raise ValueError(f"matryoshka_dims has duplicates {dups} in {dims}: list each dimension once")
    if any(a < b for a, b in zip(dims, dims[1:])):
        raise ValueError(f"matryoshka_dims must be in descending order (largest first), got {dims}; pass "
                         f"{sorted(dims, reverse=True)} and reorder matryoshka_weights the same way")
    if embedding_dim is not None and dims[0] > embedding_dim:
        raise ValueError(f"matryoshka_dims {dims}: {[d for d in dims if d > embedding_dim]} exceed the "
                         f"embedding dimension c={embedding_dim}; every dimension must be <= c")
    if weights is None:
        return tuple(dims), (1.0,) * len(dims)
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__"):
        raise ValueError(f"matryoshka_weights must be a list of numbers, one per dimension, got {weights!r}")
    weights = list(weights)
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka_weights has {len(weights)} entries but matryoshka_dims {dims} has "
                         f"{len(dims)}: give one weight per dimension (or None for all 1)")
    bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real)
           or not math.isfinite(float(w)) or float(w) < 0]
    if bad:
        raise ValueError(f"matryoshka_weights must be finite numbers >= 0, got {bad} in {weights}")
    return tuple(dims), tuple(float(w) for w in weights)


def matryoshka_options(dims, weights=None, embedding_dim: Optional[int] = None):
    """A loss module's Matryoshka settings: ``(None, None)`` when ``dims`` is ``None`` (weights
    without dims are an error), else ``check_matryoshka(dims, weights, embedding_dim)``."""
    if dims is None:
        if weights is not None:
            raise ValueError("matryoshka_weights is set but matryoshka_dims is None: give the dims "
                             "(largest first) or drop the weights")
        return None, None
    return check_matryoshka(dims, weights, embedding_dim)


def matryoshka_prefix(x: torch.Tensor, dim: int, normalize: bool) -> torch.Tensor:
    """``x[:, :dim]``, L2-normalized per row when ``normalize`` (as sentence-transformers'
    ``MatryoshkaLoss`` does: truncate, then normalize)."""
    if not normalize:
        return x if dim == x.shape[1] else x[:, :dim].contiguous()
    return F.normalize(x[:, :dim], p=2, dim=-1)
