"""CUDA graphs for the single-device fused losses at small sizes (issue 17).

Below ~10k rows an isolated call of the fused loss is bound by the host, not the GPU: at
b = m = 8,192, c = 512 the GPU works 0.71 ms per forward + backward (H100, docs/kernels.md) while
Python, autograd and ~10 Triton launches take the host 1.2-1.4 ms. Where a shape repeats, each pass
of the call is replayed from one CUDA graph instead (``run_graphed``): the host then issues a few
copies and one replay per pass. The single-device InfoNCE
(``ds_infcl.ops.infonce.InfoNCEFunction``) and SigLIP (``ds_infcl.ops.siglip.SigLIPFunction``)
each take two graphs per shape: the forward, which starts with the default call's input checks
(``ds_infcl.ops.pass_check.PassCheck``), and the backward, which reads the forward's copies of the
inputs in place; calls with and without the checks keep graphs of their own. The distributed gather paths
(``ds_infcl.loss.ring_fused``, ``ds_infcl.loss.siglip``) replay their local kernels the same way,
between their collectives, which stay outside the graphs: the rules, settings and cache below
are theirs too.

How:

- A call becomes a candidate when the Triton backend runs it on the current CUDA device, nothing
  is being captured already (a caller's own ``torch.cuda.graph`` records the eager kernels),
  torch.compile is not tracing, and, with ``DS_INFCL_CUDA_GRAPH=auto`` (the default), ``b m`` is
  at most ``DS_INFCL_CUDA_GRAPH_MAX_LOGITS`` (2^28: 16,384 x 16,384; the GPU's work of such a call is about
  2.7 ms on an H200, beyond which the host's ~1.5 ms hide behind it anyway).
  The gather path's calls have their own limit, ``DS_INFCL_CUDA_GRAPH_GATHER_MAX_LOGITS`` (2^29:
  16,384 queries against 32,768 gathered keys): their host work (the collectives, autograd, the
  composition of the shares) is larger, and on 2 H200s at 16,384 rows per GPU the graphs took a
  call from 5.0-5.1 to 4.6-4.9 ms (docs/distributed.md).
  ``DS_INFCL_CUDA_GRAPH=1`` graphs every size, ``0`` none.
- The first call of a shape runs eagerly (it compiles the kernels); the second captures both
  passes, on static inputs, with the same kernels and tiles as the eager call, so the results are
  bitwise the eager ones; every later call replays.
- Each replay copies its inputs into the static buffers and clones its outputs (except those a
  caller borrows, ``run_graphed(borrow=...)``: read before the next replay, on the same stream,
  or held in a ``Borrowed``, which copies them just before a replay would overwrite them),
  so calls may interleave freely (two forwards, then their two backwards). The backward skips the input copies
  when no other replay of the graph ran since its forward (the buffers still hold its inputs).
  A pass's graph reads the previous pass's copies of the inputs in place while these hold
  the call's (``inputs_of``; a version per graph, bumped by its replays and by any copy into its
  buffers, tells when they may not).
- At most ``MAX_GRAPHS`` graphs are kept (12: the single-device loss takes two per shape, four
  where calls with and without the checks mix, the gather path up to five: its forward (two with the early own block), the statistics' merge,
  and its backward's two blocks), for the first shapes that repeat; later shapes run eagerly (capturing again and again
  would cost more than it saves). Each holds its static inputs and outputs and its memory pool
  (``bench.ring``'s extra memory of the default call at 8,192 x 8,192, c = 512, on one H100: 0.219
  GiB, against 0.516 GiB for OpenCLIP's ``ClipLoss``). The backward's graph does not share its
  forward's pool: a replay of one would then overwrite the other's borrowed outputs unseen by the
  versions above. ``clear_graphs()`` frees them.
- Replays run on the current stream, like the eager kernels. Calls of one shape from several
  streams at once would share the static buffers: use ``DS_INFCL_CUDA_GRAPH=0`` there.
"""

from __future__ import annotations

import collections
import warnings
from typing import Callable, Optional

import torch

from ds_infcl import settings
from ds_infcl.ops.precision import precision_key

__all__ = ["GraphedCall", "Borrowed", "graph_eligible", "run_graphed", "outputs_intact", "inputs_of", "clear_graphs",
           "CUDA_GRAPH", "MAX_LOGITS", "GATHER_MAX_LOGITS", "MAX_GRAPHS"]


CUDA_GRAPH = settings.get("DS_INFCL_CUDA_GRAPH")  # checked at import
MAX_LOGITS = settings.get("DS_INFCL_CUDA_GRAPH_MAX_LOGITS")
GATHER_MAX_LOGITS = settings.get("DS_INFCL_CUDA_GRAPH_GATHER_MAX_LOGITS")
MAX_GRAPHS = 12

_SEEN: "collections.Counter" = collections.Counter()
_GRAPHS: dict = {}
_FAILED: set = set()


def clear_graphs() -> None:
    """Drop every captured graph and the shapes seen (frees their buffers and pools)."""
    _SEEN.clear()
    _GRAPHS.clear()
    _FAILED.clear()
    _OWNERS.clear()


def _eligible(tensor: torch.Tensor, backend: str, logits: int, max_logits: Optional[int] = None) -> bool:
    """Whether a call on ``tensor``'s device with ``logits`` (``b m``) may replay from a graph
    (under ``auto``: ``logits <= max_logits``, default ``MAX_LOGITS``)."""
    mode = settings.check("DS_INFCL_CUDA_GRAPH", CUDA_GRAPH)
    if mode == "0" or backend != "triton" or not tensor.is_cuda or tensor.device.index != torch.cuda.current_device():
        return False  # (a tensor on another device than the current one: its kernels, eagerly)
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return False
    return mode == "1" or logits <= (MAX_LOGITS if max_logits is None else max_logits)


def _warm_up(device: torch.device, run) -> None:
    """``run()`` once on a side stream before a capture (lazy allocations, cuBLAS handles)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)


def _lookup(k, build, what: Callable[[], str]):
    """The cached graph of key ``k``, built by ``build()`` on the key's second sighting; ``None``
    (run eagerly) before that, or when capturing it failed once. ``what()`` names it in the
    warning (formatted only then: an f-string of the key on every call cost the host ~20 us)."""
    graphed = _GRAPHS.get(k)
    if graphed is not None:
        return graphed
    if k in _FAILED:
        return None
    if len(_SEEN) > 1024:  # shapes that keep changing: start counting afresh
        _SEEN.clear()
    _SEEN[k] += 1
    if _SEEN[k] < 2:
        return None
    if len(_GRAPHS) >= MAX_GRAPHS:
        settings.warn_once("cuda_graph_cache_full", (
            f"ds_infcl: {what()} repeats but runs eagerly, not from a CUDA graph: the cache holds its "
            f"MAX_GRAPHS = {MAX_GRAPHS} graphs already (the first shapes that repeated), so timings of later "
            "shapes include the host's launch work; clear_graphs() frees the cache, DS_INFCL_CUDA_GRAPH=0 "
            "turns the graphs off (and silences this)"))
        return None
    try:
        graphed = build()
    except RuntimeError as e:  # e.g. a kernel this CUDA/driver cannot capture: eager for this shape
        _FAILED.add(k)
        warnings.warn(f"ds_infcl: capturing {what()} in a CUDA graph failed ({e}); this shape runs eagerly "
                      "(DS_INFCL_CUDA_GRAPH=0 turns the graphs off)", settings.FastPathWarning)
        return None
    _GRAPHS[k] = graphed
    return graphed


def graph_eligible(query: torch.Tensor, key: torch.Tensor, backend: str) -> bool:
    """Whether a single-device InfoNCE call of these inputs may replay from a CUDA graph (never
    while torch.compile traces: the compiled caller then runs the custom ops)."""
    return _eligible(query, backend, query.shape[0] * key.shape[0])


class GraphedCall:
    """``fn(*args)`` (tensors or ``None`` in, a tuple of tensors or ``None`` out) captured in one
    CUDA graph on static copies of its arguments; each call copies its arguments in, replays, and
    clones the outputs (so the results outlive the next replay). The arguments at the indices in
    ``static`` are captured as they are, not copied, where they are another graph's buffers (its
    inputs or outputs, or views of them: addresses that stay, ``_owned``); others are copied like
    the rest. A call copies into any argument buffer only when it gets another tensor there, and
    a copy into another graph's buffer counts as a change of that graph (its ``version``), so
    that a token taken before tells the change (``outputs_intact``, ``inputs_of``).
    Outputs that are not CUDA tensors (``None``, a pinned host buffer that the graph fills, an
    event it records: ``torch.cuda.Event(external=True)``) come back as they are, never cloned.
    ``fn`` must not write into its arguments."""

    def __init__(self, fn, args, static=()):
        dev = next(a.device for a in args if a is not None)
        self.static = frozenset(i for i in static if args[i] is not None and _owned(args[i]))
        # The graphs whose buffers it reads in place: its copies of the arguments hold a call's
        # only while theirs do too (inputs_of).
        self.sources = tuple({id(o): o for o in (_owner(args[i]) for i in sorted(self.static))}.values())
        self.args = [None if a is None else (a.detach() if i in self.static else a.detach().clone())
                     for i, a in enumerate(args)]
        _warm_up(dev, lambda: fn(*self.args))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = fn(*self.args)
        self.replays = 0
        self.version = 0  # bumped by every replay and every copy into its buffers by another graph's call
        self.before_change: list = []  # called, once, before the next such change (``Borrowed``)
        # Outputs that are not device tensors (a pinned host buffer the graph writes, an event it
        # records) come back as they are, never cloned.
        self.kept = frozenset(i for i, o in enumerate(self.out) if not (torch.is_tensor(o) and o.is_cuda))
        for t in [a for i, a in enumerate(self.args) if i not in self.static] + list(self.out):
            if torch.is_tensor(t) and t.is_cuda:
                _OWNERS[_storage(t)] = self

    def __call__(self, *args, borrow=()):
        self.changing()
        dsts, srcs = [], []
        for i, (dst, src) in enumerate(zip(self.args, args)):
            if dst is not None and dst.data_ptr() != src.data_ptr():
                dsts.append(dst)
                srcs.append(src)
                owner = _owner(dst) if i in self.static else None
                if owner is not None:
                    owner.changing()
        if dsts:  # one call for all the copies: at small sizes the host's launches are the cost
            torch._foreach_copy_(dsts, srcs)
        self.graph.replay()
        self.replays += 1
        kept = self.kept
        return tuple(o if (i in kept or i in borrow) else o.clone() for i, o in enumerate(self.out))

    def changing(self) -> None:
        """About to write its buffers (a replay, or a copy into them by another graph's call):
        runs the ``before_change`` calls (stream-ordered before the write) and bumps ``version``."""
        if self.before_change:
            calls, self.before_change = self.before_change, []
            for fn in calls:
                fn()
        self.version += 1


class Borrowed:
    """Outputs borrowed from a ``run_graphed(borrow=..., token=True)`` call (``token``) that stay
    valid for as long as they are ``needed``: copied only if the graph is about to overwrite them
    before that (copy on write, ``GraphedCall.before_change``), not on every call. ``tensors``
    holds them (the graph's buffers, or the copies); eager outputs are held as they are.

    ``needed``: a ``weakref.ref`` that dies when the outputs are no longer needed. An autograd
    Function passes one to a tensor it saves for its backward and nowhere else: autograd frees it
    after the backward, unless the graph is retained for another.
    """

    __slots__ = ("tensors", "_live", "_needed")

    def __init__(self, token, tensors: tuple, needed: Optional[Callable[[], object]] = None) -> None:
        self.tensors = tensors
        self._live = token is not None
        self._needed = needed
        if self._live:
            if not outputs_intact(token):
                raise RuntimeError("Borrowed: the graph's outputs were overwritten before they were borrowed")
            token[0].before_change.append(self._copy)

    def _copy(self) -> None:
        if self._live and (self._needed is None or self._needed() is not None):
            self.tensors = tuple(None if t is None else t.clone() for t in self.tensors)
        self._live = False


_OWNERS: dict = {}  # storage address -> the GraphedCall whose input or output buffer it is


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: the key of ``_OWNERS`` (a view finds its base's graph)."""
    return t.untyped_storage().data_ptr()


def _owner(t: torch.Tensor):
    """The kept graph whose buffer ``t`` is (or is a view of), else ``None``."""
    return _OWNERS.get(_storage(t))


def _owned(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a kept graph's buffer: an address that stays while it is kept."""
    return _owner(t) is not None


def run_graphed(tag: str, fn, args, *, options, logits: int, backend: str, max_logits: Optional[int] = None,
                borrow=(), static=(), token: bool = False):
    """``fn(*args)``, replayed from a CUDA graph where the shapes repeat (the rules of the module
    doc, ``logits`` standing for ``b m``, at most ``max_logits`` under ``auto``, default
    ``MAX_LOGITS``); ``tag`` and ``options`` (hashable) name the computation. The outputs whose
    indices are in ``borrow`` come back as the graph's own buffers, not copies: the caller must be
    done with them (stream-ordered, on the current stream) before the next call of this
    computation. The arguments whose indices are in ``static`` are buffers the caller passes
    again and again (another computation's borrowed outputs or its copies of its inputs,
    ``inputs_of``): the graph reads them in place (``GraphedCall``). With ``token``, returns
    ``(outputs, token)``: ``outputs_intact(token)`` tells later whether borrowed outputs still
    hold this call's values (no replay of the graph since), ``inputs_of(token)`` gives its copies
    of the arguments while they hold them.
    Used by the distributed gather path (``ds_infcl.loss.ring_fused``) around its local kernels,
    between its collectives."""
    graphed = None
    if _eligible(next(a for a in args if a is not None), backend, logits, max_logits):
        k = (tag, options, precision_key(args)) + tuple(None if a is None else (tuple(a.shape), a.dtype, a.device)
                                                        for a in args)
        graphed = _lookup(k, lambda: GraphedCall(fn, args, static), lambda: f"{tag} {k[3:]}")
    out = fn(*args) if graphed is None else graphed(*args, borrow=borrow)
    if not token:
        return out
    if graphed is None:
        return out, None
    return out, (graphed, graphed.version, tuple(o.version for o in graphed.sources))


def outputs_intact(token) -> bool:
    """Whether the borrowed outputs of the ``run_graphed(token=True)`` call that returned ``token``
    still hold its values: eager outputs always do; a graph's, until its next replay (or another
    graph's call copies into its buffers)."""
    return token is None or token[0].version == token[1]


def inputs_of(token) -> Optional[list]:
    """The graph's copies of the arguments of the ``run_graphed(token=True)`` call that returned
    ``token``, while they still hold them: no replay since, of the graph and of those whose buffers
    it reads in place (``static``), and no copy into them; ``None`` for an eager call or once
    they may not. Another graph may read them in place (``run_graphed(static=...)``)."""
    if token is None or not outputs_intact(token) or tuple(o.version for o in token[0].sources) != token[2]:
        return None
    return token[0].args
