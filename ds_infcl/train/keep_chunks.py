"""``batch.grad_cache: "auto"``: how many chunks of a step keep the graph of their first forward.

GradCache (``grad_cache: true``) encodes every chunk twice: once without gradients (pass 1) and
once more with them (pass 3), a third more tower work than a plain step, which it pays even where
the activations of the whole local batch would fit. ``"auto"`` runs the hybrid of
``ds_infcl.train.steps``: the first K chunks keep their pass-1 graph (no second forward), the
other chunks are replayed. The loss, the gradients and the micro-steps are GradCache's whatever K
is; only the work and the memory change. K is:

- ``batch.keep_chunks`` when given (0 = GradCache, the number of chunks = no replay);
- on CPU without it: every chunk (no device memory to measure; the plain step's work, one
  micro-step per chunk). Set ``batch.keep_chunks`` to bound the host memory;
- on CUDA without it: measured on the run's first step, which keeps one chunk (so that step
  holds one chunk's activations beside pass 2's loss; a run at the edge of memory that fails
  there runs with ``keep_chunks: 0``, which is GradCache). That step
  reports the bytes the kept chunk held (``StepResult.kept_bytes``: ``memory_allocated`` around
  its forward, plus its inputs), and the step's peak (``max_memory_allocated``, with one chunk
  kept through passes 1-3, so pass 2's loss is in it) bounds every later step's: each more kept
  chunk adds at most its bytes to that peak. From the second step on

      K = min(num_chunks, 1 + floor((limit - peak) / kept_bytes)),  0 if peak > limit

  with ``limit`` = ``batch.memory_budget_gib`` if given, else the memory this process can
  allocate (the device's free memory plus what torch's caching allocator holds) less a safety
  margin of ``SAFETY_FRACTION`` of the device (fragmentation, the varying sizes of later
  batches). Every rank takes the smallest K of all ranks (the ZeRO-3 path's collectives follow
  the order of forwards and backwards, which K sets).

The decision is logged once: at start how K is chosen, and on CUDA after the measuring step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["KeepChunks", "kept_from_memory", "SAFETY_FRACTION"]

SAFETY_FRACTION = 0.10
_GIB = 2**30


def kept_from_memory(num_chunks: int, kept_bytes: int, peak_bytes: int, limit_bytes: float) -> int:
    """K from one measured step that kept one chunk (see the module docstring): the most chunks
    whose graphs fit ``limit_bytes`` on top of that step's peak."""
    if peak_bytes > limit_bytes:
        return 0
    if kept_bytes <= 0:
        return num_chunks
    return int(min(num_chunks, 1 + (limit_bytes - peak_bytes) // kept_bytes))


def _min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` of all ranks (a collective: every rank calls it at the same step)."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
        return int(t.item())
    return value


class KeepChunks:
    """The number of kept chunks of each step of a GradCache run (``grad_cache`` true or "auto").

    ``num_kept()`` before each step; ``observe(result)`` after each (on CUDA without
    ``keep_chunks`` the first one is the measuring step, and ``observe`` is then a collective).

    Args:
        batch: the run config's ``batch`` section.
        num_chunks: chunks per step of this rank.
        device: where the towers run.
        log: a line on rank 0's stdout.
        min_over_ranks: ``(value, device) -> the smallest value of all ranks``.
    """

    def __init__(self, batch, num_chunks: int, device: torch.device, log: Callable[[str], None] = print,
                 min_over_ranks: Callable[[int, torch.device], int] = _min_over_ranks):
        self.num_chunks, self.device, self.log = num_chunks, device, log
        self.budget_gib: Optional[float] = batch.memory_budget_gib
        self._min_over_ranks = min_over_ranks
        self.measuring = False
        if batch.grad_cache is True:
            self.kept = 0
        elif batch.keep_chunks is not None:
            if batch.keep_chunks > num_chunks:  # resolve_deepspeed_config says it first
                from ds_infcl.errors import ConfigError

                raise ConfigError(f"batch.keep_chunks: {batch.keep_chunks} exceeds the {num_chunks} chunks of a step")
            self.kept = batch.keep_chunks
            log(f"batch.grad_cache auto: {self._split()} (batch.keep_chunks)")
        elif device.type != "cuda":
            self.kept = num_chunks
            unused = "; batch.memory_budget_gib is not used there" if self.budget_gib else ""
            log(f"batch.grad_cache auto: {self._split()} (on {device.type} there is no device memory to "
                f"measure; set batch.keep_chunks to bound the memory the kept graphs take{unused})")
        else:
            self.kept, self.measuring = min(1, num_chunks), True
            log(f"batch.grad_cache auto: the first step keeps 1 of {num_chunks} chunks to measure its memory; "
                "the number kept from the second step on is logged after it")

    def _split(self) -> str:
        return (f"{self.kept} of {self.num_chunks} chunks per step keep their graph, "
                f"{self.num_chunks - self.kept} replayed")

    def num_kept(self) -> int:
        """Chunks the next step keeps."""
        return self.kept

    def observe(self, result) -> None:
        """After a step (``StepResult``): on the measuring step, decide K for the steps after it."""
        if not self.measuring:
            return
        self.measuring = False
        device = self.device
        peak = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        if self.budget_gib:
            limit, why = self.budget_gib * _GIB, f"batch.memory_budget_gib {self.budget_gib:g}"
        else:
            usable = free + torch.cuda.memory_reserved(device)
            limit = usable - SAFETY_FRACTION * total
            why = (f"{usable / _GIB:.1f} GiB this process can allocate less a {SAFETY_FRACTION:.0%} margin of the "
                   f"{total / _GIB:.0f} GiB device")
        kept_bytes = int(result.kept_bytes or 0)
        mine = kept_from_memory(self.num_chunks, kept_bytes, peak, limit)
        self.kept = self._min_over_ranks(mine, device)
        self.log(f"batch.grad_cache auto: {self._split()} from now on (one kept chunk held "
                 f"{kept_bytes / _GIB:.2f} GiB; the measuring step peaked at {peak / _GIB:.2f} GiB with one kept; "
                 f"limit {limit / _GIB:.1f} GiB: {why}; this rank alone would keep {mine}, all ranks take the "
                 "smallest)")
