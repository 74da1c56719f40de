"""Registry of loss implementations, selectable by name (``impl=`` in the loss API).

Every implementation computes the same global InfoNCE loss and keeps the contract of DESIGN.md
section 3.1; they differ in how they communicate and how much memory they hold. An
implementation is a callable::

    fn(query, key, scale, labels, *, symmetric, backend, group, tile_size) -> loss

called with validated inputs, where ``scale`` is a 0-dim float tensor (it may require grad) and
``labels`` an int64 tensor of local indices or ``None`` for the diagonal (query i's positive is
key i; ``ds_infcl.ops.labels_or_diagonal`` makes the tensor where one is needed). It returns the global loss (the same value on every
rank of ``group``), and after the data-parallel mean of gradients over ``group`` every gradient
equals the single-device gradient on the global batch.

This module imports none of the implementations: they register themselves when their modules
are imported, which ``ds_infcl.loss`` (the package) does.
"""

from __future__ import annotations

from typing import Callable, Dict

__all__ = ["register_loss_impl", "get_loss_impl", "available_loss_impls"]

_IMPLS: Dict[str, Callable] = {}


def register_loss_impl(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` under ``name`` (names are unique)."""

    def deco(fn: Callable) -> Callable:
        if name in _IMPLS and _IMPLS[name] is not fn:
            raise ValueError(f"loss implementation {name!r} is already registered")
        _IMPLS[name] = fn
        return fn

    return deco


def available_loss_impls() -> tuple:
    """Names of the registered implementations, sorted."""
    return tuple(sorted(_IMPLS))


def get_loss_impl(name: str) -> Callable:
    """The implementation registered as ``name``; ``ValueError`` listing the valid names if none."""
    if name not in _IMPLS:
        raise ValueError(f"unknown loss implementation {name!r}; choose one of {sorted(_IMPLS)}")
    return _IMPLS[name]

