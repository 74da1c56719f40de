"""GradCache under ZeRO-3 without ZeRO-3's per-chunk cost: gather the parameters once per step.

Under ZeRO stage 3 every module's forward and backward runs inside DeepSpeed's hooks: fetch the
module's parameter partitions (an all-gather), trace the fetch order, release them after, and
reduce-scatter each parameter's gradient as soon as it is ready. A GradCache step of ``n`` chunks
pays that ``2n`` times per module (pass 1 and pass 3) and reduce-scatters every gradient ``n``
times. Measured on one H200 (ViT-B/16 CLIP, chunks of 256), a chunk's forward took 5x its ZeRO-2
time and the step ran at 0.40x ZeRO-2, with nothing even gathered from another GPU
(docs/bench/zero3_gradcache_h200_x2.md): the hooks, not the communication, are the cost.

``batch.gather_params`` (on by default where it fits, see ``decide``) runs the step as:

1. All parameters gathered once (``deepspeed.zero.GatheredParameters``), ZeRO-3's module hooks
   set aside (``module_hooks_off``): pass 1 encodes every chunk as a plain module would.
2. The loss and the feature gradients, as before (no parameter involved).
3. Every chunk re-encoded over the same gathered parameters, hooks still off; each chunk's
   surrogate is differentiated with ``torch.autograd.grad`` into float32 buffers (that runs no
   ``AccumulateGrad`` node, so ZeRO-3's gradient hooks do not fire: nothing is reduced yet).
4. The step's one DeepSpeed micro-step, at the accumulation boundary and still under the
   gathered parameters: the model's ``"gradients"`` mode returns a zero whose backward gives each
   parameter its buffer, so each parameter's ``AccumulateGrad`` receives the whole local batch's
   gradient and ZeRO-3 reduce-scatters it once, as for one uncached micro-step. No module runs
   inside ZeRO-3's hooks during the step; ``engine.step()`` updates after the parameters are
   released.

The gradient is the same sum as the per-chunk path's (float32 accumulation, so no less exact).
Costs: the whole model's parameters unpartitioned for the step (in their dtype) plus a float32
buffer per trainable parameter; ``decide`` turns it on where that fits a quarter of the device's
memory, and not with fp16 (LoRA: the buffers are the adapters' only). DeepSpeed's
``gradient_accumulation_steps`` stays the number of chunks (the config is the same either way); the step marks its one backward
as the boundary (``engine.set_gradient_accumulation_boundary``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["decide", "rule", "module_hooks_off", "GradientBuffers", "MEMORY_FRACTION"]

MEMORY_FRACTION = 0.25  # "auto": gathered parameters + float32 buffers within this share of the device
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _offload(engine):
    return getattr(getattr(engine, "optimizer", None), "parameter_offload", None)


def gather_bytes(model: nn.Module) -> int:
    """Bytes a gathered step holds beyond ZeRO-3's partitions: every parameter in full (its
    dtype) plus a float32 gradient buffer per trainable parameter."""
    total = 0
    for p in model.parameters():
        numel = int(getattr(p, "ds_numel", p.numel()))
        total += numel * p.element_size() + (4 * numel if p.requires_grad else 0)
    return total


def decide(setting, engine, device: torch.device, grad_cache: bool) -> Tuple[bool, str]:
    """Whether the GradCache step gathers the parameters once per step, and why (for the log):
    ``rule`` applied to the engine.

    ``setting``: ``batch.gather_params`` (``"auto"``, ``True``, ``False``).
    """
    stage = int(engine.zero_optimization_stage())
    if grad_cache and stage >= 3 and _offload(engine) is None:
        raise RuntimeError("batch.gather_params: the ZeRO-3 engine has no parameter_offload (DeepSpeed API changed?)")
    offload = getattr(engine, "zero_offload_param", lambda: None)()
    return rule(setting, grad_cache=grad_cache, stage=stage, fp16=bool(engine.fp16_enabled()),
                nvme_params=offload is not None and str(getattr(offload, "device", "")).endswith("nvme"),
                model=engine.module, device=device)


def rule(setting, *, grad_cache: bool, stage: int, fp16: bool, nvme_params: bool, model: nn.Module,
         device: torch.device) -> Tuple[bool, str]:
    """The decision behind ``batch.gather_params``, from the run's settings (the engine's, or the
    configs' before the engine exists: ``ds_infcl.train.chunk_auto`` budgets for the buffers).

    Only ZeRO stage 3 with GradCache has anything to gather; stages 0-2 keep their parameters whole
    already. ``"auto"`` gathers when ``gather_bytes(model)`` fits ``MEMORY_FRACTION`` of the
    device's memory (always on CPU, where ZeRO-3 only runs for tests), not with fp16 and not with
    parameters offloaded to NVMe. Raises ``ConfigError`` for ``True`` with fp16.
    """
    if not grad_cache or stage < 3:
        return False, "not ZeRO stage 3 with GradCache"
    if setting is False:
        return False, "batch.gather_params is false"
    if fp16:
        # The chunks' gradients would be computed outside DeepSpeed's loss scaling (fp16 cannot be
        # run on CPU, so this path is not verified there): keep ZeRO-3's own path.
        if setting is True:
            from ds_infcl.errors import ConfigError

            raise ConfigError("batch.gather_params: true is not supported with fp16; use bf16, or set it to \"auto\" or false")
        return False, "auto: fp16 keeps ZeRO-3's per-chunk path"
    if setting == "auto" and nvme_params:
        # Parameters swapped from NVMe come through a few pinned buffers; gathering all of them at
        # once is what the swapper is not built for.
        return False, "auto: parameters offloaded to NVMe keep ZeRO-3's per-chunk path"
    need = gather_bytes(model)
    if setting is True:
        return True, f"batch.gather_params is true ({need / 2**30:.2f} GiB per rank)"
    if device.type != "cuda":
        return True, f"auto: {need / 2**30:.2f} GiB per rank on {device.type}"
    total = torch.cuda.get_device_properties(device).total_memory
    fits = need <= MEMORY_FRACTION * total
    return fits, (
        f"auto: {need / 2**30:.2f} GiB per rank (the parameters gathered + float32 gradient buffers) "
        f"{'within' if fits else 'over'} {MEMORY_FRACTION:.0%} of {total / 2**30:.0f} GiB"
        + ("" if fits else "; set batch.gather_params true to force it")
    )


@contextmanager
def module_hooks_off(engine):
    """Set aside the forward hooks DeepSpeed's ZeRO-3 put on the engine's modules (fetch/release
    and the backward hooks they install); other hooks stay. Restored in order on exit. Only valid
    while every parameter is gathered (``GatheredParameters``)."""
    offload = _offload(engine)
    # Parameters ZeRO-3 prefetched during the previous micro-step and never used are still in
    # flight; the top module's own pre-forward hook (set aside below) would wait for and release
    # them, and GatheredParameters cannot re-partition a parameter in flight.
    offload.get_param_coordinator()._clean_inflight_param_registry()
    handles = list(getattr(offload, "forward_hooks", [])) + list(getattr(offload, "backward_hooks", []))
    if getattr(offload, "fwd_pre_hook", None) is not None:
        handles.append(offload.fwd_pre_hook)
    ours = {}
    for h in handles:
        for ref in (getattr(h, "hooks_dict_ref", None), *getattr(h, "extra_dict_ref", ())):
            d = ref() if callable(ref) else None
            if d is not None and h.id in d:
                ours.setdefault(id(d), (d, []))[1].append(h.id)
    saved = []
    for d, ids in ours.values():
        saved.append((d, list(d.items())))
        for i in ids:
            del d[i]
    try:
        yield
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)


class GradientBuffers:
    """Float32 sums of the trainable parameters' gradients over chunks (full shapes)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self.sums: List[Optional[torch.Tensor]] = [None] * len(self.params)

    def add(self, surrogate: torch.Tensor) -> None:
        """Add the gradients of ``surrogate`` with respect to the parameters."""
        grads = torch.autograd.grad(surrogate, self.params, allow_unused=True)
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self.sums[i] is None:
                self.sums[i] = g.float()
            else:
                self.sums[i].add_(g)
