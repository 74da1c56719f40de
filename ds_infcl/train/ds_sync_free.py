"""DeepSpeed's ZeRO-1/2 gradient norm, clip and backward bookkeeping without host waits and with
less host work: ``install()`` swaps four functions of DeepSpeed 0.19 for versions that compute
the same values on the device.

The trainer launches each step before it reads the step before (``train/inflight.py``), so the
host can run ahead of the GPU. Inside DeepSpeed's ZeRO-1/2 optimizer step, three reads made the
host wait for the step's backward to finish, in every step. ``tests/gpu/trainer_syncs.py``
counted them with ZeRO-1/2 in bf16 on DeepSpeed 0.19.8:

- ``deepspeed.runtime.utils.mask_nan_or_inf_with_val_inplace`` sets a non-finite gradient norm to
  the sentinel -1 at the end of ``get_grad_norm_direct`` (also ZeRO-3's offload norm and
  ``get_global_norm_of_tensors``). It built its -1.0 with ``torch.tensor(-1.0, device=...)``, a
  copy from pageable host memory that waits for the queue. It then filled with that 0-dim device
  tensor, and ``masked_fill_`` reads such a value on the host. The replacement fills with the
  Python float -1.0.
- ``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` clips an invalid norm (non-finite, or the -1
  sentinel) as if it were +inf. It found an invalid norm with ``is_invalid_grad_norm``, a
  ``bool`` of a device tensor. The replacement chooses with ``torch.where`` on the device, and
  the combined scale stays a device tensor.

While the host waited, the GPU's queue ran dry, so the GPU then idled through the host's own
part of the optimizer step (DeepSpeed's Python, a kernel launch per tensor) and the next step's
first launches. At small per-GPU batches, where a step's kernels are short, that idle time is a
large share of the step. Measured on one H200 (ViT-B/16 CLIP at 512, ZeRO-1, 2026-11-28): 2,515.5
samples/s with ``DS_INFCL_SYNC_FREE=0``, 2,862.4 with the replacements, 1.14x
(docs/bench/sync_free_ab_h200_2026-11-28_eighteenth.log).

Two more replacements cut host work that the GPU waits for at small per-GPU batches, where the
host, not the GPU, sets the pace (a profile of ViT-B/16 at 512 on one GPU charged the device's idle
time to these two frames first; ``logging.profile_step``):

- ``DeepSpeedZeroOptimizer.get_grad_norm_direct`` made, per gradient, a float64 copy, a
  ``vector_norm`` and a ``.to(device)``: three kernels and their Python for each of a CLIP
  model's ~400 tensors. The replacement takes one ``torch._foreach_norm`` (float64, as DeepSpeed's
  ``get_norm_dtype``) over the same selection; the same float64 sum gives the same float32 norm.
- ``count_used_parameters_in_backward`` (bound in ``stage_1_and_2``; ZeRO-3 keeps its own) runs
  at the first gradient hook of every backward, before the rest of the backward is launched. It
  made each leaf parameter's gradient accumulator anew (a ``view_as`` under ``enable_grad``); the
  replacement keeps them (and makes one again where torch would: ``param.data`` of another dtype
  or device), so the same nodes are counted.

Only known code is replaced. DeepSpeed must be 0.19.x, and each original's source text must be
the one these replacements were written from (``KNOWN_SOURCES``: DeepSpeed 0.19.8's; the mask is
the same text from 0.19.0). Anything else is left as is, and one log line says so. The earlier
0.19 releases (0.19.0 to 0.19.5) have a clip without the check, which reads nothing on the host.
``DS_INFCL_SYNC_FREE=0`` leaves DeepSpeed as is (for A/B runs: the results are the same).

Not replaced: the ZeRO-3 step still reads ``is_invalid_grad_norm`` of the norm to skip the step,
and its ``get_grad_norm_direct`` still copies its -1.0 from host memory inline. An fp16 step (or
``check_grad_overflow``) reads the norm or the overflow flag, because the read decides whether
the step is skipped. The CPU-offload norms are summed on the host.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import re
import sys
import textwrap
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ds_infcl import settings

__all__ = ["install", "installed", "mask_nan_or_inf_with_val_inplace", "unscale_and_clip_grads",
           "KNOWN_SOURCES", "source_hash"]

KNOWN_MINOR = (0, 19)
# sha256 (first 16 hex digits) of each replaced function's source, dedented, as DeepSpeed 0.19.8
# has it (``source_hash``). A function whose source differs is left as is.
KNOWN_SOURCES = {
    "mask_nan_or_inf_with_val_inplace": "9728853d4df6cd69",
    "unscale_and_clip_grads": "92a57088034fcd50",
    "get_grad_norm_direct": "8e1ffafc3841f46a",
    "count_used_parameters_in_backward": "7646250b6fbfc3c9",
}
# The modules that bind the mask under its name (``grep -rn mask_nan_or_inf_with_val_inplace`` in
# DeepSpeed 0.19.8); any other loaded deepspeed module that holds it is found by ``_mask_owners``.
MASK_MODULES = ("deepspeed.runtime.utils", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3")

_originals: Dict[Tuple[object, str], Callable] = {}  # (module or class, name) -> the function replaced there
# A leaf parameter's gradient accumulator, with the dtype and device it was made for (torch makes a
# new one when ``param.data`` changes either); ``count_used_parameters_in_backward`` reuses it.
_GRAD_NODES = WeakIdKeyDictionary()


def mask_nan_or_inf_with_val_inplace(input, device=None, val=-1.):
    """Set every NaN or +-Inf element of ``input`` to -1.0, in place, with no host read.

    DeepSpeed's version filled with ``torch.tensor(-1.0, device=device)``: a pageable copy, and a
    0-dim tensor value that ``masked_fill_`` reads on the host. Like it, this fills -1.0 whatever
    ``val`` says (every DeepSpeed caller passes the default) and needs no ``device``.
    """
    input.masked_fill_(input.isnan().logical_or(input.isinf()), -1.0)


def _inf_if_invalid(norm, device):
    """``norm``, or +inf where it is invalid (non-finite or negative: the -1 sentinel), as
    DeepSpeed's clip decides with ``is_invalid_grad_norm``. For a tensor the choice is a
    ``torch.where`` on its device. Any invalid element makes every element +inf, as the original's
    ``.any()`` does. A Python float stays on the host, as in the original."""
    if torch.is_tensor(norm):
        invalid = (~torch.isfinite(norm) | (norm < 0)).any()
        return torch.where(invalid, torch.full_like(norm, math.inf), norm)
    if math.isfinite(float(norm)) and not norm < 0:
        return norm
    return torch.full((), math.inf, dtype=torch.float, device=device)


def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` without the host read of the norm: the
    grads (flat tensors, or lists of sub-partitions) are multiplied in place by
    ``1 / combined_scale``, with ``combined_scale = max(1, (norm / loss_scale + 1e-6) / clip_grad)
    * loss_scale`` when clipping is on (an invalid norm counts as +inf, so its grads become 0 or
    NaN), else ``loss_scale``. Nothing to do when ``clip_grad == 0`` and ``loss_scale == 1``.
    The same operations in the same order as DeepSpeed 0.19.8's, so the same bits."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined_scale = self.loss_scale
    if self.clip_grad > 0.:
        clip_norm = _inf_if_invalid(total_norm, self.device)
        # the norm is in fact norm * loss_scale
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale
    inverse = 1. / combined_scale  # once, not per tensor: the same value, fewer launches
    for grad in grad_groups_flat:
        for g in (grad if isinstance(grad, list) else [grad]):
            g.data.mul_(inverse)


def _deepspeed_own(name: str) -> Callable:
    """DeepSpeed's own ``DeepSpeedZeroOptimizer.<name>``, also where it is replaced."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return _originals.get((DeepSpeedZeroOptimizer, name), vars(DeepSpeedZeroOptimizer)[name])


def get_grad_norm_direct(self, gradients, params, norm_type=2):
    """``DeepSpeedZeroOptimizer.get_grad_norm_direct`` (ZeRO-1/2's gradient norm) with one
    ``torch._foreach_norm`` over the gradients of the partition instead of a ``vector_norm``, a
    float64 copy and a ``.to(device)`` per gradient: a few kernel launches instead of three per
    parameter (the selection below is the only per-parameter Python left). The same selection (padding, pipeline-replicated and
    model-parallel duplicates left out), the same float64 accumulation (``get_norm_dtype``), the
    same all-reduces and the same mask of a non-finite result. Where no gradient is left, the zero
    is made on the device (DeepSpeed's ``torch.tensor(0.0).to(device)`` is a pageable copy). Other
    norms than the 2-norm go to DeepSpeed's own function."""
    if float(norm_type) != 2.0:
        return _deepspeed_own("get_grad_norm_direct")(self, gradients, params, norm_type)
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    grads = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            grads.append(g)
    if grads:
        with torch.no_grad():  # as DeepSpeed's ``g.data``, without a detach per gradient
            norms = torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())
        total_norm = torch.stack(norms).to(self.device).pow(2.0).sum().float()
    else:
        total_norm = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
    total_norm = total_norm.pow(1. / 2.0)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


def count_used_parameters_in_backward(parameters) -> int:
    """DeepSpeed's count of the ``parameters`` whose gradient the running backward will compute
    (ZeRO-1/2 call it at the first gradient hook of every backward). The original finds each leaf
    parameter's gradient accumulator anew with a ``view_as`` under ``enable_grad`` (an autograd
    node made and dropped per parameter, per backward); this keeps the accumulator of each
    parameter and makes it again only where torch would have replaced it (``param.data`` of
    another dtype or device). The same nodes, so the same count."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    seen = set()
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        leaf = param.grad_fn is None  # its node is its accumulator, which can be kept
        kept = _GRAD_NODES.get(param) if leaf else None
        if kept is not None and kept[1:] == (param.dtype, param.device):
            node = kept[0]
        else:
            with torch.enable_grad():
                node = _get_grad_fn_or_grad_acc(param)
            if leaf:
                _GRAD_NODES[param] = (node, param.dtype, param.device)
        seen.add(node)
    return int(sum(map(torch._C._will_engine_execute_node, seen)))


def source_hash(fn: Callable) -> Optional[str]:
    """sha256 (first 16 hex digits) of ``fn``'s dedented source; ``None`` where there is none."""
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _minor(version: str) -> Optional[Tuple[int, int]]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _mask_owners(original: Callable) -> List[object]:
    """Every loaded deepspeed module that binds ``original`` as ``mask_nan_or_inf_with_val_inplace``
    (the modules of ``MASK_MODULES`` imported first)."""
    for name in MASK_MODULES:
        importlib.import_module(name)
    loaded = sorted((name, module) for name, module in list(sys.modules.items())
                    if module is not None and name.split(".")[0] == "deepspeed")
    return [module for _, module in loaded if getattr(module, "mask_nan_or_inf_with_val_inplace", None) is original]


def _targets() -> List[Tuple[str, List[Tuple[object, str]], Callable, Callable]]:
    """``(name, [(owner, attribute), ...], original, replacement)`` for each replaced function."""
    import deepspeed.runtime.utils as ds_utils
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    mask = ds_utils.mask_nan_or_inf_with_val_inplace
    methods = [(name, [(DeepSpeedZeroOptimizer, name)], DeepSpeedZeroOptimizer.__dict__.get(name), globals()[name])
               for name in ("unscale_and_clip_grads", "get_grad_norm_direct")]
    count = "count_used_parameters_in_backward"  # ZeRO-1/2's binding only (ZeRO-3 keeps its own)
    return [("mask_nan_or_inf_with_val_inplace", [(m, "mask_nan_or_inf_with_val_inplace") for m in _mask_owners(mask)],
             mask, mask_nan_or_inf_with_val_inplace)] + methods + [
        (count, [(stage_1_and_2, count)], getattr(stage_1_and_2, count), count_used_parameters_in_backward)]


def installed() -> bool:
    """Whether the replacements are in place in this process."""
    return bool(_originals)


def _restore() -> None:
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def install(log: Optional[Callable[[str], None]] = None) -> bool:
    """Replace DeepSpeed's gradient-norm mask (in every module that binds it) and
    ``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` by this module's versions, where DeepSpeed
    is 0.19.x and each original is the known code (``KNOWN_SOURCES``). Idempotent; the one line
    of ``log`` says what was replaced or why nothing was. ``DS_INFCL_SYNC_FREE=0`` puts back
    DeepSpeed's own functions. Returns whether any replacement is in place."""
    say = log or (lambda msg: None)
    if not settings.get("DS_INFCL_SYNC_FREE"):
        _restore()
        say("DS_INFCL_SYNC_FREE=0: DeepSpeed's gradient-norm mask and ZeRO-1/2 clip left as is (host waits included)")
        return False
    if _originals:
        return True
    import deepspeed

    version = deepspeed.__version__
    if _minor(version) != KNOWN_MINOR:
        say(f"DeepSpeed {version} left as is: train/ds_sync_free.py replaces the gradient-norm code of "
            f"DeepSpeed {KNOWN_MINOR[0]}.{KNOWN_MINOR[1]}.x only (its host waits stay)")
        return False
    done, left = [], []
    for name, owners, original, replacement in _targets():
        if source_hash(original) != KNOWN_SOURCES[name]:
            left.append(name)
            continue
        for owner, attribute in owners:
            _originals[(owner, attribute)] = original
            setattr(owner, attribute, replacement)
        done.append(name)
    msg = f"DeepSpeed {version}: " + (f"{', '.join(done)} replaced by versions without host waits and with less host work "
                                       "(train/ds_sync_free.py)" if done else "nothing replaced")
    say(msg + (f"; left as is, not the known code: {', '.join(left)}" if left else ""))
    return bool(done)
