"""Torch's precision rules, applied to every loss as torch applies them to a matmul (one place).

Two rules, the same ones ``query @ key.T`` follows:

* **Autocast.** Where autocast is on for the features' device (``torch.autocast("cuda",
  dtype=torch.bfloat16)``, or ``"cpu"``), the loss computes in autocast's dtype: a loss entry point
  (``@follows_autocast``) casts its float32 (or other 16-bit) features to that dtype *once, before
  anything else*, and runs its body with autocast off. The cast is an ordinary ``Tensor.to``
  outside the fused ops, so autograd returns the gradients in the dtype the caller passed
  (float32). The result is, bit for bit, the loss called on ``features.to(dtype)`` outside
  autocast. float64 features are left alone (autocast does not cast them either). The op bodies
  (forward and backward) also run with autocast off (``@autocast_off``): a ``backward()`` called
  inside an autocast region must not re-cast the tiles of the torch backend.
* **TF32.** float32 features (outside autocast) use TF32 dot products where torch's float32
  matmul precision allows them: ``torch.backends.cuda.matmul.allow_tf32`` (which
  ``torch.set_float32_matmul_precision("high")`` also sets). The Triton kernels read it at every
  launch (``tf32_allowed``); the torch backend's matmuls follow it by themselves.
  ``DS_INFCL_ALLOW_TF32=1`` / ``0`` pins the Triton kernels' choice whatever torch says.

Whatever the dtype of the dot products, the log-sum-exp statistics, their accumulators and the
loss value are float32.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from ds_infcl import settings

__all__ = ["autocast_dtype", "compute_dtype", "cast_for_autocast", "follows_autocast", "autocast_off",
           "tf32_allowed", "precision_key"]

# What autocast casts (float64 it leaves alone, as it does for a matmul).
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(x) -> Optional[torch.dtype]:
    """The dtype autocast runs a matmul of ``x`` in now: autocast's dtype when it is on for ``x``'s
    device type and ``x`` is a float32/16-bit tensor; ``None`` otherwise (no cast)."""
    if not torch.is_tensor(x) or x.dtype not in _CASTABLE:
        return None
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the losses compute ``x``'s dot products in: autocast's where it applies, else
    ``x``'s own (float32 with TF32 where ``tf32_allowed()``)."""
    return autocast_dtype(x) or x.dtype


def cast_for_autocast(*tensors):
    """The tensors in the dtype of the first one's autocast (``autocast_dtype``); those autocast
    would not cast (``None``, integers, float64) unchanged. A tuple, one entry per argument."""
    dtype = next((autocast_dtype(t) for t in tensors if torch.is_tensor(t)), None)
    if dtype is None:
        return tensors
    return tuple(_cast(t, dtype) for t in tensors)


def follows_autocast(*names: str) -> Callable:
    """Decorator of a loss entry point whose parameters ``names`` are the features (positional or
    keyword): under autocast they arrive cast to autocast's dtype (``cast_for_autocast``) and the
    body runs with autocast off; outside autocast the call is unchanged.

    Example::

        @follows_autocast("query", "key")
        def contrastive_loss(query, key, scale, ...): ...
    """

    def wrap(fn):
        params = list(inspect.signature(fn).parameters)
        positions = tuple(params.index(n) for n in names)

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            first = args[positions[0]] if len(args) > positions[0] else kwargs.get(names[0])
            dtype = autocast_dtype(first)
            if dtype is None:
                return fn(*args, **kwargs)
            args = list(args)
            for pos, name in zip(positions, names):
                if pos < len(args):
                    args[pos] = _cast(args[pos], dtype)
                elif name in kwargs:
                    kwargs[name] = _cast(kwargs[name], dtype)
            with torch.autocast(first.device.type, enabled=False):
                return fn(*args, **kwargs)

        return entry

    return wrap


def _cast(x, dtype: torch.dtype):
    return x.to(dtype) if torch.is_tensor(x) and x.dtype in _CASTABLE else x


def autocast_off(fn: Callable) -> Callable:
    """Decorator of an op body (a block's forward or backward) whose first argument is a tensor:
    runs it with autocast off for that tensor's device, so that its matmuls run in the dtype of
    the operands it was given, also when autograd reaches its backward inside an autocast region.
    Costs one check per call outside autocast."""

    @functools.wraps(fn)
    def body(first, *args, **kwargs):
        device_type = first.device.type
        if not torch.is_autocast_enabled(device_type):
            return fn(first, *args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(first, *args, **kwargs)

    return body


def tf32_allowed() -> bool:
    """Whether float32 features use TF32 dot products in the Triton kernels: ``DS_INFCL_ALLOW_TF32``
    when set, else torch's rule for a float32 matmul (``torch.backends.cuda.matmul.allow_tf32``,
    true under ``torch.set_float32_matmul_precision("high")`` or ``"medium"``)."""
    pinned = settings.get("DS_INFCL_ALLOW_TF32")
    if pinned is not None:
        return pinned
    return bool(torch.backends.cuda.matmul.allow_tf32)


def precision_key(tensors) -> bool:
    """What decides the kernels' dot products beyond the tensors' dtypes: whether TF32 is allowed
    where any of ``tensors`` (``None`` entries skipped) is float32. Part of the key of a cached
    CUDA graph, which must not replay TF32 kernels after TF32 was turned off (or the reverse); one
    read of the setting per call, however many tensors."""
    return any(t is not None and t.dtype == torch.float32 for t in tensors) and tf32_allowed()
