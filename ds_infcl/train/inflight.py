"""Steps in flight: the trainer reads a step's values (loss, gradient norm, logged scale) one
step late, so the host never waits for the GPU to drain between steps.

A host read of a device value (``float(loss)``) waits for every kernel queued before it. Read at
the end of each step, as the trainer did until 2026-11-28 (with a ``torch.cuda.synchronize``
around each step for its timing), it empties the GPU's queue; the GPU then idles while the host
runs the start of the next step (the data, the first launches) and wherever the host is slower
than the GPU (DeepSpeed's per-parameter work in the optimizer step: a norm per gradient, the
update of the bf16 weights). Without the read, the host runs ahead during the forward and
backward, whose kernels take longer than their launches, and the host-heavy stretches use up
that lead instead of idling the GPU. That is how OpenCLIP's loop runs (it reads the loss only
to log it).

So at the end of each step the trainer stages the step's values: one ``torch.stack`` of them on
the device, an asynchronous copy to pinned host memory and a CUDA event, all queued after the
step. It then launches the next step and only after that settles the previous one: the event's
``synchronize`` waits for that step's kernels alone while the next step's are queued behind
them. A read of a tensor instead (``.item()``, ``.tolist()``) would queue its copy after the next
step and wait for it too.

Settling a step runs the trainer's callback with its values and its time. On CUDA that is the
device's time between the event of the step before (or the clock's start: the first launch
after the device was idle) and this step's event (``Event.elapsed_time``): the step's kernels
and any idle gap before them while the host was still launching, so the steps' times add up to
the run's time whether the GPU or the host is the slower side. It does not depend on when the
host reads the step. A host clock at the settle would: a step whose launch waits for the GPU
(a host read inside the step) is settled only after the next launch returned, so the step
after it, settled right away at the end of a run, got the time of its last kernels alone (a
2-step decoder benchmark on an H200 reported 0.002 s steps and 150,000% MFU).

Everything is settled (``settle()``) before an evaluation, a checkpoint, a stop and the end of
the run, so a checkpoint is written only after every step before it was checked (a non-finite
loss or an applied non-finite gradient norm raises, naming its step), and the metrics rows match
the steps done. A non-finite step is therefore found one step late: the step after it has run
(and been applied) by then, which no checkpoint ever holds.

On the CPU nothing is asynchronous: a launch runs the step to its end, so each step is settled
right after its own launch (``lag`` 0; a lag would charge step N+1's compute to step N, and give
the step before a forced settle no time at all).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import torch

from ds_infcl.ops.validation import DeferredChecks

__all__ = ["Launched", "InFlight", "check_finite_values", "copy_to_host"]

Number = Union[float, int]


@dataclass
class Launched:
    """A step whose kernels are queued: its number, what ``forward_backward_step`` returned (its
    ``loss`` a 0-dim tensor), the staged values (see ``InFlight.stage``) and anything the caller
    wants back at the settle (``extra``: the lr it ran at, ...)."""

    step: int
    result: Any
    names: List[str]
    staged: Optional[torch.Tensor]
    event: Optional["torch.cuda.Event"]
    known: Dict[str, Optional[Number]]
    extra: Dict[str, Any] = field(default_factory=dict)

    def values(self) -> Dict[str, Optional[float]]:
        """The staged values as floats (after the event: the caller synchronized it)."""
        out = dict(self.known)
        if self.staged is not None:
            out.update(zip(self.names, self.staged.tolist()))
        return out


def copy_to_host(t: torch.Tensor, timing: bool = False):
    """``(copy, event)``: ``t`` copied to pinned host memory, queued after the kernels before it,
    and the CUDA event after the copy (read the copy after ``event.synchronize()``, which waits
    for those kernels alone; ``timing``: an event ``elapsed_time`` can measure from); a host
    tensor is its own copy, with no event."""
    if t.device.type != "cuda":
        return t, None
    copy = t.to("cpu", non_blocking=True)  # pinned
    event = torch.cuda.Event(enable_timing=timing)
    event.record()
    return copy, event


def check_finite_values(step: int, loss: float, grad_norm: Optional[float], applied: bool,
                        input_checks: Optional[DeferredChecks] = None) -> None:
    """Stop on a failed input check of the step's loss (``input_checks``, queued on the device by
    ``ds_infcl.ops.validation.deferred_value_checks``: NaN/Inf features, ...), a non-finite loss,
    or a non-finite gradient norm that DeepSpeed applied.

    With bf16, DeepSpeed's own overflow check (``bf16.check_grad_overflow``, on by default) tests
    every gradient tensor for NaN/Inf one by one at each optimizer step and skips the update when
    one is found; that loop costs tens of milliseconds of host time per step (measured on an H100,
    docs/training.md), so the shipped bf16 configs turn it off. Then a non-finite gradient is
    applied; the global gradient norm DeepSpeed computes at every step anyway (ZeRO 1/2, with or
    without clipping; a NaN norm reported as inf) tells, and the run stops here with the step
    named instead of training on from broken weights. ZeRO-3 skips such an update itself whatever
    the setting (``applied`` is then false: nothing to stop). An engine that reports no norm
    (``grad_norm`` ``None``) leaves it to the loss check of the next step."""
    if input_checks is not None:
        try:
            input_checks.raise_if_failed()
        except ValueError as e:
            raise ValueError(f"step {step}: {e}") from e
    if not math.isfinite(loss):
        raise FloatingPointError(f"step {step}: loss is {loss}; stopping (lower the learning rate, check fp16 scaling)")
    if grad_norm is None or not applied or math.isfinite(grad_norm):
        return
    raise FloatingPointError(
        f"step {step}: the gradient norm is {grad_norm} and the update was applied (bf16.check_grad_overflow is "
        "false), so the weights may now hold NaN/Inf; stopping. Resume from the last checkpoint (--resume) with "
        "a lower learning rate, or set bf16.check_grad_overflow true in the DeepSpeed config to skip such steps")


class InFlight:
    """The launched steps not yet read, oldest first (see the module docstring).

    Args:
        device: where the steps run.
        on_settled: ``on_settled(launched, values, seconds)`` for each step in launch order.
    """

    def __init__(self, device: torch.device, on_settled: Callable[[Launched, Dict[str, Optional[float]], float], None]):
        self.device = device
        self.on_settled = on_settled
        self.pending: Deque[Launched] = collections.deque()
        self._last_done: Optional[float] = None  # host clock (CPU)
        self._last_event: Optional["torch.cuda.Event"] = None  # device clock (CUDA)
        self.lag = 1 if device.type == "cuda" else 0  # steps left in flight after a launch

    def settle_behind(self) -> None:
        """After a launch: read every step but the ``lag`` newest."""
        self.settle(keep=self.lag)

    def start_clock(self) -> None:
        """Before a launch: with nothing in flight (the first step, or the first after an
        evaluation or a checkpoint), wait for the device to be idle and start the clock there,
        so the next step's time holds no other work."""
        if self.pending:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._last_event = torch.cuda.Event(enable_timing=True)
            self._last_event.record()
        self._last_done = time.time()

    def stage(self, step: int, result: Any, values: Dict[str, Any], **extra: Any) -> Launched:
        """Queue the copy of ``values`` (0-dim tensors, numbers or ``None``) to the host after the
        step's kernels, and keep the step in flight."""
        names, tensors, known = [], [], {}
        for name, v in values.items():
            if torch.is_tensor(v):
                names.append(name)
                tensors.append(v.detach().reshape(()).float())
            else:
                known[name] = v
        staged, event = copy_to_host(torch.stack(tensors), timing=True) if tensors else (None, None)
        if event is None and self.device.type == "cuda":  # nothing to copy: the event still times the step
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        launched = Launched(step, result, names, staged, event, known, extra)
        self.pending.append(launched)
        return launched

    def settle(self, keep: int = 0) -> None:
        """Read the oldest steps until ``keep`` remain in flight; each goes to ``on_settled``."""
        while len(self.pending) > keep:
            launched = self.pending.popleft()
            device_seconds = None
            if launched.event is not None:
                launched.event.synchronize()
                if self._last_event is not None:
                    device_seconds = self._last_event.elapsed_time(launched.event) / 1000.0
                self._last_event = launched.event
            now = time.time()
            host_seconds = now - (self._last_done if self._last_done is not None else now)
            seconds = device_seconds if device_seconds is not None else host_seconds
            self._last_done = now
            self.on_settled(launched, launched.values(), seconds)
