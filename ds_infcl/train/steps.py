"""One optimizer step on the DeepSpeed engine: uncached, or GradCache mapped onto micro-steps.

**Uncached** (``gradient_accumulation_steps == 1``): encode this rank's whole local batch, compute
the global loss, ``engine.backward(loss)``, ``engine.step()``.

**GradCache** (DESIGN.md section 5; ``gradient_accumulation_steps`` = number of chunks):

1. Encode the local batch chunk by chunk without gradients, saving the RNG state before each
   chunk (dropout must draw the same masks in pass 3). Only the chunk being encoded is on the
   device (the batch itself stays in, possibly pinned, CPU memory); the features of the whole
   local batch stay on the device.
2. Compute the global loss once from the cached features and detached copies of the loss's own
   parameters (``logit_scale``; SigLIP's ``logit_bias`` too), and its gradients ``dL/dq``,
   ``dL/dk`` and ``dL/dp`` for those parameters with ``torch.autograd.grad``.
   Nothing here touches a parameter, so ZeRO's gradient hooks do not fire.
3. For chunk ``i``: restore its RNG state, re-encode it with gradients and back-propagate the
   surrogate ``sum(q_i * dL/dq_i) + sum(k_i * dL/dk_i) [+ sum_p p * dL/dp]`` as one
   DeepSpeed micro-step: ``engine.backward(surrogate, scale_wrt_gas=False)`` (the cached gradients
   are already the exact gradient of the global loss, so DeepSpeed's ``1/gas`` scaling is undone),
   then ``engine.step()`` (an optimizer step only at the accumulation boundary, after the last
   chunk). The parameter terms carry ``dL/dp`` in the last chunk and 0 in the others: the
   loss parameters' gradients are counted once per step, while every micro-step still gives every parameter
   a gradient (ZeRO sees one backward per micro-step and the same set of gradients each time).

**The hybrid** (``grad_cache: "auto"``, ``num_kept`` = K of ``ds_infcl.train.keep_chunks``): in
pass 1 the first K chunks are encoded *with* gradients and their features keep the autograd graph
(their detached copies join the cached features); the other chunks are encoded without, as above.
Pass 2 is unchanged. Pass 3 takes the chunks in the same order: for a kept chunk the same
surrogate is formed from its kept features (model mode ``"kept_surrogate"``) and back-propagated
through the kept graph, as one micro-step, with no second forward; the others are replayed. The
micro-steps, their order and every value are those of GradCache: a kept chunk's first forward
starts from the RNG state GradCache saves for it and draws the same dropout masks its replay
would, and the RNG ends where pass 1 left it either way. K = 0 is GradCache; K = the number of
chunks replays none (the plain step's work, still one micro-step per chunk). The kept graphs hold
their activations from pass 1 until their micro-step in pass 3, alongside pass 2's loss.

**Copies on a side stream** (``copy_stream``, the run config's ``data.copy_stream``): on CUDA,
passes 1 and 3 take their chunks from a ``ChunkFeed``, which copies chunk ``i + 1`` from pinned
host memory on a dedicated copy stream while chunk ``i``'s kernels run on the current stream, so
that host-to-device copies and compute overlap (with every copy on the current stream, the copy of
chunk ``i + 1`` would wait for chunk ``i``'s kernels).

Summed over chunks, the gradient of every parameter is the gradient of the loss over the whole
local batch, the same as the uncached step; DeepSpeed's data-parallel mean then gives the exact
global-batch gradient (the loss implementations keep that contract, DESIGN.md section 3.1).
Precision: cached feature gradients are kept in float32; with fp16 the loss of pass 2 runs on
float32 copies of the features so that ``dL/dq`` (of order ``1/B``) does not underflow before
DeepSpeed's loss scaling applies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ds_infcl.ops.validation import DeferredChecks
from ds_infcl.train.model import loss_with_params
from ds_infcl.tasks.base import Batch

__all__ = [
    "StepResult", "uncached_step", "grad_cache_step", "move_batch", "ChunkFeed", "copy_stream_of",
    "get_rng_state", "set_rng_state", "seed_all", "place_batch",
]


@dataclass
class StepResult:
    """What a step did: its loss (a 0-dim tensor where the step ran: reading it with ``float``
    waits for the step's kernels, so the trainer reads it one step late, ``train/inflight.py``),
    the DeepSpeed micro-steps it ran, the chunks of the local batch
    and how many kept the graph of their first forward (``grad_cache: "auto"``; the plain step's
    one chunk counts as kept, GradCache keeps none), and on CUDA the bytes the first kept chunk
    held (``ds_infcl.train.keep_chunks`` sizes the hybrid with it), and the loss's input checks,
    queued on the device to be read with the loss (``ds_infcl.ops.validation.DeferredChecks``)."""

    loss: torch.Tensor
    num_micro_steps: int
    num_chunks: int = 1
    num_kept: int = 1
    kept_bytes: Optional[int] = None
    input_checks: Optional[DeferredChecks] = None

    @property
    def replayed_fraction(self) -> float:
        """Share of the local batch whose forward ran a second time (GradCache's replay)."""
        return (self.num_chunks - self.num_kept) / self.num_chunks


def seed_all(seed: int) -> None:
    """Python's, torch's and (if installed) numpy's RNG seeded from ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def place_batch(batch: Batch, device: torch.device, offload: bool, pin_memory) -> Batch:
    """Data offload (``data.offload``, ``data.pin_memory``): keep the local batch on the host
    (pinned on CUDA) for chunk-by-chunk copies, or (``offload`` false) move all of it to the
    device now."""
    if device.type != "cuda":
        return batch
    if not offload:
        return batch.map(lambda t: t.to(device, non_blocking=True))
    if pin_memory in ("auto", True):  # (a task that decodes on the device hands over device tensors)
        batch = batch.map(lambda t: t.pin_memory() if t.device.type == "cpu" else t)
    return batch


def get_rng_state(device: torch.device):
    """CPU and (if ``device`` is CUDA) device RNG states."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def move_batch(batch: Batch, device: torch.device) -> Batch:
    """The batch's inputs on ``device`` (asynchronous copies from pinned memory)."""
    if device.type == "cpu":
        return batch
    return batch.map(lambda t: t.to(device, non_blocking=True))


_COPY_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def copy_stream_of(device: torch.device) -> "torch.cuda.Stream":
    """The side stream that ``ChunkFeed`` copies on for the CUDA ``device``: one per device,
    created on first use and reused by every later step (streams are a limited resource; a new
    one per step would also defeat the allocator's per-stream block pools)."""
    if device.type != "cuda":
        raise ValueError(f"copy_stream_of: {device} is not a CUDA device; the feed copies on a side stream only on CUDA")
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        stream = _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class ChunkFeed:
    """The chunks of a step on ``device``, in order, each copied one chunk ahead on a side stream.

    Iterating yields ``move_batch(chunks[i], device)`` for ``i = 0, 1, ...``. On CUDA with
    ``copy_stream`` true, the copy of chunk ``i + 1`` is issued on ``copy_stream_of(device)``
    *before* chunk ``i`` is handed over, so it runs while the consumer's kernels for chunk ``i``
    run on the current stream. Stream safety (PyTorch's "CUDA semantics" notes, "CUDA streams"):

    - at each copy the side stream first waits for the current stream, so the copy is ordered
      after all work queued so far (memory that work freed is safe to write);
    - when chunk ``i`` is handed over, the current stream waits on an event recorded right after
      chunk ``i``'s copy (not on the whole side stream, which by then also holds chunk ``i + 1``'s);
    - every device tensor the feed made gets ``record_stream(current stream)``: it was allocated
      on the side stream, and the caching allocator must not hand its memory to a later copy
      before the current stream's kernels that read it have run.

    Tensors already on the device (a task that decodes on the device) are passed through
    untouched; host tensors that are not pinned are still copied correctly (``non_blocking``
    copies from pageable memory are synchronous for the host, so they do not overlap). On CPU, or
    with ``copy_stream`` false, the feed is ``move_batch`` on the current stream, chunk by chunk.

    Memory: one chunk ahead, so the inputs of two chunks are on the device at a time (the
    consumer should drop its reference to a chunk before asking for the next one); the caching
    allocator may keep a third chunk's blocks, which it reuses only once the current stream has
    run the kernels that read them.

    Args:
        chunks: the host chunks (``Batch.chunks``).
        device: where the towers run.
        copy_stream: copy on the side stream (CUDA only); false copies on the current stream.
    """

    def __init__(self, chunks: Sequence[Batch], device: torch.device, copy_stream: bool = True):
        self.chunks = chunks
        self.device = device
        self.stream: Optional["torch.cuda.Stream"] = (
            copy_stream_of(device) if copy_stream and device.type == "cuda" else None
        )

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[Batch]:
        if self.stream is None:
            for chunk in self.chunks:
                yield move_batch(chunk, self.device)
            return
        ahead = self._issue(self.chunks[0]) if len(self.chunks) else None
        for i in range(len(self.chunks)):
            current, ahead = ahead, None
            if i + 1 < len(self.chunks):
                ahead = self._issue(self.chunks[i + 1])  # before chunk i's kernels are queued
            chunk = self._hand_over(*current)
            del current
            yield chunk
            del chunk

    def _issue(self, chunk: Batch):
        """Queue ``chunk``'s copies on the side stream; return the moved batch, the tensors the
        copies made and the event recorded after them."""
        made: List[torch.Tensor] = []

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu":
                return t  # already on the device: nothing to copy, nothing to protect
            out = t.to(self.device, non_blocking=True)
            made.append(out)
            return out

        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            moved = chunk.map(move)
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, made, done

    def _hand_over(self, moved: Batch, made: List[torch.Tensor], done: "torch.cuda.Event") -> Batch:
        """Order the current stream after the copies of ``moved`` and tie its tensors' memory to
        the current stream; return it."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in made:
            t.record_stream(current)
        return moved


def _loss_kwargs(engine, batch: Batch, device: torch.device):
    return batch.loss_kwargs(device, sample_index=getattr(engine.module.loss, "needs_sample_index", False))


def uncached_step(engine, batch: Batch, device: torch.device) -> StepResult:
    """Encode the local batch, backward the global loss, step (one micro-step)."""
    chunk = move_batch(batch, device)
    loss, _, _ = engine("loss", chunk.query_inputs, chunk.key_inputs, _loss_kwargs(engine, batch, device))
    engine.backward(loss)
    engine.step()
    return StepResult(loss.detach(), 1)


def _feature_gradients(loss_module, query, key, loss_kwargs, names, values):
    """The loss and its gradients for the features and the loss parameters ``names`` (leaves
    made from ``values``)."""
    leaf_dtype = torch.float32 if query.dtype == torch.float16 else query.dtype
    q = query.detach().to(leaf_dtype).requires_grad_(True)
    k = key.detach().to(leaf_dtype).requires_grad_(True)
    params = {
        name: nn.Parameter(v.detach().to(torch.float32 if query.dtype == torch.float16 else v.dtype))
        for name, v in zip(names, values)
    }
    with torch.enable_grad():
        loss = loss_with_params(loss_module, params, q, k, **loss_kwargs)
        grads = torch.autograd.grad(loss, [q, k, *params.values()])
    return loss.detach(), grads[0].float(), grads[1].float(), tuple(g.float() for g in grads[2:])


def grad_cache_step(
    engine,
    batch: Batch,
    chunk_size: int,
    device: torch.device,
    *,
    verify_replay: bool = False,
    gather_params: bool = False,
    copy_stream: bool = True,
    num_kept: int = 0,
) -> StepResult:
    """One GradCache step: ``ceil(len(batch) / chunk_size)`` micro-steps (see module docstring).

    Args:
        engine: the DeepSpeed engine wrapping a ``ContrastiveModel``; its
            ``gradient_accumulation_steps`` must equal the number of chunks.
        batch: this rank's local batch (CPU; pinned when CUDA is used).
        chunk_size: queries per chunk.
        device: where the towers run.
        verify_replay: check that pass 3 reproduces pass 1's features (RNG replay); raises
            ``RuntimeError`` if not.
        gather_params: ZeRO-3 only: gather every parameter once for the step and run the
            chunks outside ZeRO-3's module hooks, one micro-step per step
            (``ds_infcl.train.zero3_gather``; ``batch.gather_params``).
        copy_stream: on CUDA, copy the next chunk on a side stream while the current one is
            encoded (``ChunkFeed``; ``data.copy_stream``); false copies each chunk on the current
            stream right before its forward. No effect on CPU.
        num_kept: the hybrid of ``grad_cache: "auto"`` (``ds_infcl.train.keep_chunks``): the
            first ``num_kept`` chunks are encoded with gradients in pass 1 and keep their graph,
            which pass 3 back-propagates without a second forward; 0 is GradCache, the number of
            chunks replays none. Every rank must pass the same number (the ZeRO-3 path's
            collectives follow the order of forwards and backwards).
    """
    chunks = batch.chunks(chunk_size)
    gas = engine.gradient_accumulation_steps()
    if len(chunks) != gas:
        raise RuntimeError(
            f"GradCache: {len(chunks)} chunks but gradient_accumulation_steps is {gas}; the DeepSpeed "
            "config must be resolved with resolve_deepspeed_config"
        )
    if not 0 <= num_kept <= len(chunks):
        raise ValueError(f"GradCache: num_kept must be in [0, {len(chunks)}] (the chunks of the step), got {num_kept}")
    if gather_params:
        return _grad_cache_gathered(engine, batch, chunks, device, verify_replay, copy_stream, num_kept)

    # Passes 1 and 2: features chunk by chunk (the first num_kept with their graphs); the loss
    # and its gradients once.
    cache = _passes_1_and_2(engine, engine, batch, chunks, device, copy_stream, num_kept)
    # Pass 3: one DeepSpeed micro-step per chunk, kept or replayed.
    for i, surrogate in enumerate(_surrogates(cache, engine, chunks, device, copy_stream, verify_replay)):
        if i == len(chunks) - 1 and not engine.is_gradient_accumulation_boundary():
            raise RuntimeError("GradCache: the last chunk is not at DeepSpeed's accumulation boundary")
        engine.backward(surrogate, scale_wrt_gas=False)
        del surrogate
        engine.step()
    set_rng_state(cache.rng_after, device)
    return StepResult(cache.loss.detach(), len(chunks), len(chunks), num_kept, cache.kept_bytes)


@dataclass
class _Cache:
    """What passes 1 and 2 leave for pass 3: the RNG state before each chunk and after the last,
    the features, the loss, its gradients for the features and the loss parameters (``zero_p``:
    zeros of the latter, for every chunk but the last), each chunk's first query, the kept
    chunks' features with their graphs (``None`` once handed to pass 3) and the device bytes the
    first kept chunk held (CUDA only)."""

    rng_states: List[Tuple]
    rng_after: Tuple
    query: torch.Tensor
    key: torch.Tensor
    loss: torch.Tensor
    grad_q: torch.Tensor
    grad_k: torch.Tensor
    grad_p: Tuple[torch.Tensor, ...]
    zero_p: Tuple[torch.Tensor, ...]
    starts: List[int]
    keys_per_query: int
    kept: List[Optional[Tuple[torch.Tensor, torch.Tensor]]]
    kept_bytes: Optional[int]

    def gradients(self, i: int, n: int, num_chunks: int):
        """The cached gradients of chunk ``i`` (``n`` queries) of ``num_chunks``: its features'
        and the loss parameters' (``dL/dp`` in the last chunk, zeros in the others)."""
        start, kpq = self.starts[i], self.keys_per_query
        return (self.grad_q[start : start + n], self.grad_k[start * kpq : (start + n) * kpq],
                self.grad_p if i == num_chunks - 1 else self.zero_p)

    def replay(self, call, chunk: Batch, i: int, num_chunks: int, device: torch.device,
               verify_replay: bool) -> torch.Tensor:
        """Re-encode chunk ``i`` of ``num_chunks`` (``chunk``: its inputs, already on the device, from
        the ``ChunkFeed``) under its saved RNG state (``call``: the engine, or the bare module under
        gathered parameters) and return its surrogate (see the module docstring)."""
        n, start, kpq = len(chunk), self.starts[i], self.keys_per_query
        set_rng_state(self.rng_states[i], device)
        surrogate, q, k = call("surrogate", chunk.query_inputs, chunk.key_inputs, None, *self.gradients(i, n, num_chunks))
        if verify_replay:
            _check_replay(i, q, self.query[start : start + n], k, self.key[start * kpq : (start + n) * kpq])
        return surrogate

    def kept_surrogate(self, call, i: int, num_chunks: int) -> torch.Tensor:
        """The surrogate of kept chunk ``i`` through the graph of its first forward (no forward)."""
        q, k = self.kept[i]
        self.kept[i] = None  # the backward of the surrogate frees the graph; nothing else holds it
        return call("kept_surrogate", q, k, None, *self.gradients(i, len(q), num_chunks))


def _surrogates(cache: _Cache, call, chunks, device: torch.device, copy_stream: bool,
                verify_replay: bool) -> Iterator[torch.Tensor]:
    """Pass 3's surrogates in chunk order: the kept chunks' (the first ones) through their graphs,
    then the other chunks re-encoded under their saved RNG states, fed by a ``ChunkFeed``. The
    caller back-propagates each before asking for the next (one graph alive at a time beyond
    the kept ones not yet reached)."""
    num_kept = len(cache.kept)
    for i in range(num_kept):
        with torch.enable_grad():
            surrogate = cache.kept_surrogate(call, i, len(chunks))
        yield surrogate
        del surrogate
    for j, chunk in enumerate(ChunkFeed(chunks[num_kept:], device, copy_stream)):
        with torch.enable_grad():
            surrogate = cache.replay(call, chunk, num_kept + j, len(chunks), device, verify_replay)
        del chunk
        yield surrogate
        del surrogate


def _input_bytes(chunk: Batch) -> int:
    total = [0]

    def add(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    chunk.map(add)
    return total[0]


def _pass_1(call, chunks, device: torch.device, copy_stream: bool, num_kept: int):
    """Every chunk's features (``call``: the engine, or the bare module under gathered
    parameters), fed by a ``ChunkFeed`` (one chunk on the device, the next one on its way), the
    RNG state before each: the first ``num_kept`` chunks with gradients, their features kept with
    their graphs, the others without. On CUDA, the bytes the first kept chunk's graph, features
    and inputs hold (``memory_allocated`` around its forward, plus its inputs)."""
    rng_states: List[Tuple] = []
    q_parts, k_parts, kept = [], [], []
    kept_bytes = None
    for i, dev in enumerate(ChunkFeed(chunks, device, copy_stream)):
        rng_states.append(get_rng_state(device))
        if i < num_kept:
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            with torch.enable_grad():
                q, k = call("encode", dev.query_inputs, dev.key_inputs)
            if before is not None and i == 0:
                kept_bytes = torch.cuda.memory_allocated(device) - before + _input_bytes(dev)
            kept.append((q, k))
            q, k = q.detach(), k.detach()
        else:
            with torch.no_grad():
                q, k = call("encode", dev.query_inputs, dev.key_inputs)
        del dev
        q_parts.append(q)
        k_parts.append(k)
    return rng_states, q_parts, k_parts, kept, kept_bytes


def _passes_1_and_2(engine, call, batch: Batch, chunks, device: torch.device, copy_stream: bool,
                    num_kept: int = 0) -> _Cache:
    """Pass 1 (``_pass_1``), then pass 2: the global loss and its gradients for the features and
    the loss parameters, once."""
    rng_states, q_parts, k_parts, kept, kept_bytes = _pass_1(call, chunks, device, copy_stream, num_kept)
    with torch.no_grad():
        loss_params = call("loss_params")
    rng_after = get_rng_state(device)
    query, key = torch.cat(q_parts), torch.cat(k_parts)
    del q_parts, k_parts
    model = engine.module
    loss, grad_q, grad_k, grad_p = _feature_gradients(
        model.loss, query, key, _loss_kwargs(engine, batch, device), model.loss_param_names, loss_params
    )
    starts = [0]
    for ch in chunks[:-1]:
        starts.append(starts[-1] + len(ch))
    return _Cache(rng_states, rng_after, query, key, loss, grad_q, grad_k, grad_p,
                  tuple(torch.zeros_like(g) for g in grad_p), starts, batch.keys_per_query, kept, kept_bytes)


def _grad_cache_gathered(engine, batch: Batch, chunks, device: torch.device, verify_replay: bool,
                         copy_stream: bool, num_kept: int) -> StepResult:
    """The GradCache step under ZeRO-3 with the parameters gathered once (see
    ``ds_infcl.train.zero3_gather``): passes 1 and 3 on the bare module outside ZeRO-3's hooks,
    the chunks' gradients (kept or replayed) summed in float32 buffers, then handed to the engine
    in the step's one micro-step (``"gradients"`` mode), still under the gathered parameters, so
    that ZeRO-3 reduce-scatters each gradient once."""
    import deepspeed

    from ds_infcl.train.zero3_gather import GradientBuffers, module_hooks_off

    model = engine.module
    params = list(model.parameters())
    buffers = GradientBuffers(params)
    with module_hooks_off(engine), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        cache = _passes_1_and_2(engine, model, batch, chunks, device, copy_stream, num_kept)
        for surrogate in _surrogates(cache, model, chunks, device, copy_stream, verify_replay):
            buffers.add(surrogate)
            del surrogate
        # The step's one micro-step, at the accumulation boundary (DeepSpeed's documented manual
        # accumulation: set before the forward; it stays set, as every step of the run takes this
        # path). The parameters are still gathered, so each AccumulateGrad sees full shapes and
        # ZeRO-3's gradient hooks reduce-scatter as in a plain backward.
        engine.set_gradient_accumulation_boundary(True)
        given = engine("gradients", None, None, None, None, None, buffers.sums)
        engine.backward(given, scale_wrt_gas=False)
        del given
        buffers.sums = []
    engine.step()
    set_rng_state(cache.rng_after, device)
    return StepResult(cache.loss.detach(), 1, len(chunks), num_kept, cache.kept_bytes)


def _check_replay(i, q, q_cached, k, k_cached) -> None:
    for name, a, b in (("query", q, q_cached), ("key", k, k_cached)):
        if not torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6):
            err = (a.float() - b.float()).abs().max().item()
            raise RuntimeError(
                f"GradCache replay mismatch in chunk {i}: re-encoded {name} features differ from "
                f"the cached ones by up to {err:.3g}; the towers are not deterministic under a "
                "restored RNG state (non-deterministic kernels, or RNG drawn outside torch)"
            )
