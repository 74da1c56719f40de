"""The value checks of a call without labels, computed at the start of its own forward pass.

:class:`PassCheck` is what the single-device ``InfoNCEFunction`` and ``SigLIPFunction`` run for the
default call's checks (``ds_infcl.ops.validation.check_values`` of finite features, scale and bias):
inside the forward's CUDA graph where one replays, so that the check costs the host no launch of its
own, and read or queued by ``ds_infcl.ops.validation`` as any other value check.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds_infcl.ops.validation import DeferredChecks, _Context, _rows, _segments, _submit, _value_vector, pending_checks

__all__ = ["PassCheck"]


class PassCheck:
    """:func:`check_values` of a call without labels (finite features, scale and bias, on one
    device), computed at the start of the call's own forward pass: inside its CUDA graph where one
    replays (``ds_infcl.ops.infonce_graph.run_graphed``), so that the check costs the host no
    launch and no replay of its own. Read or queued as :func:`check_values` would.

    ``wrap(fn)`` is the pass to run instead of ``fn``: it returns ``(values, host, event)``
    followed by ``fn``'s outputs. ``values`` is the check's vector on the device; on a CUDA device
    ``host`` is a one-element pinned buffer that the pass fills with the vector's sum, right after
    the check's kernels and before ``fn``'s, and ``event`` is recorded there (an external event, a
    node of the graph), so that the host waits for the check only, not for the loss. The three
    come back as the graph's own buffers (``run_graphed(borrow=BORROW)``): ``submit(outputs,
    token)``, right after the call, reads or queues them (a queued vector is copied first) and
    returns ``fn``'s outputs.

    Example::

        check = PassCheck(query, key, scale, bias)
        out, token = run_graphed("tag", check.wrap(forward), args, borrow=PassCheck.BORROW, token=True, ...)
        loss, = check.submit(out, token)
    """

    BORROW = (0, 1, 2)
    OUTPUTS = 3  # the outputs wrap() puts before fn's

    def __init__(self, query: torch.Tensor, key: torch.Tensor, scale: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> None:
        self.segments = _segments(query, key, scale, None, True, bias)
        self.context = _Context(_rows(query), _rows(key), scale, bias, key.shape[0])
        self._stage: Optional[Tuple[torch.Tensor, torch.cuda.Event]] = None

    def wrap(self, fn, bias_at: Optional[int] = None):
        """``fn(*args)`` preceded by the check of ``args[0]`` (query), ``args[1]`` (key),
        ``args[2]`` (scale) and ``args[bias_at]`` (bias)."""
        segments = self.segments

        def checked(*args):
            values = _value_vector(segments, args[0], args[1], args[2], None,
                                   None if bias_at is None else args[bias_at])
            return (values,) + self._staged_sum(values) + tuple(fn(*args))

        return checked

    def _staged_sum(self, values: torch.Tensor):
        if not values.is_cuda:
            return None, None
        if self._stage is None:  # (made by the graph's warm-up run, before its capture)
            self._stage = (torch.empty(1, dtype=torch.float64, pin_memory=True), torch.cuda.Event(external=True))
        host, event = self._stage
        host.copy_(values.sum().reshape(1), non_blocking=True)  # (no labels: every value must be finite)
        event.record()
        return host, event

    def submit(self, outputs, token=None) -> tuple:
        """Queue or read the check of ``outputs`` (a ``wrap``ped pass's, ``token`` its
        ``run_graphed`` token); returns the pass's own outputs."""
        values, host, event = outputs[:self.OUTPUTS]
        if token is not None and isinstance(pending_checks(), DeferredChecks):
            values = values.clone()  # (read after later replays of the graph)
        _submit(self.segments, values, self.context, staged=None if host is None else (host, event, token))
        return tuple(outputs[self.OUTPUTS:])
