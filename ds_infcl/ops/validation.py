"""Input checks shared by every loss path: a clear ``ValueError`` instead of a silent NaN or a hang.

Everything here is local (no communication). The cross-rank check of dims, dtypes and sizes lives
in ``ds_infcl.ring`` (a small metadata exchange on every call, which also carries each rank's
local structure errors so that a bad input on one rank raises on every rank instead of hanging);
so does the all-gather of every rank's verdict on its value checks that a default distributed call
reads after its forward is queued (``ds_infcl.ring.agree_on_value_checks``, with
``checks_read_after_launch(agree=True)`` here).
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from ds_infcl.ops.infonce_graph import outputs_intact

__all__ = ["SUPPORTED_DTYPES", "DeferredChecks", "check_inputs", "check_values",
           "check_features", "check_labels", "check_label_bounds", "check_scale", "check_tile_size",
           "deferred_value_checks", "checks_read_after_launch", "pending_checks"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def _check_feature_structure(query: torch.Tensor, key: torch.Tensor, allow_empty: bool) -> None:
    for name, t in (("query", query), ("key", key)):
        if not torch.is_tensor(t):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [batch, feature_dim], got {_describe(t)}; "
                "flatten extra dimensions before the loss"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} has dtype {t.dtype}; supported dtypes are float32, bfloat16, float16"
            )
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query and key feature dims differ: query {_describe(query)}, key {_describe(key)}; "
            "project both towers to the same embedding size"
        )
    if query.dtype != key.dtype:
        raise ValueError(
            f"query and key dtypes differ: query {query.dtype}, key {key.dtype}; "
            "cast both to the same dtype"
        )
    if query.device != key.device:
        raise ValueError(f"query is on {query.device} but key is on {key.device}")
    if query.shape[1] == 0:
        raise ValueError(f"feature dim is 0 (query {_describe(query)}); it must be at least 1")
    if not allow_empty:
        for name, t in (("query", query), ("key", key)):
            if t.shape[0] == 0:
                raise ValueError(f"{name} is empty ({_describe(t)}); the batch needs at least 1 row")


def _check_label_structure(labels: Optional[torch.Tensor], num_queries: int, num_keys: int) -> None:
    if labels is None:
        if num_keys < num_queries:
            raise ValueError(
                f"without labels query i's positive is key i, which needs at least as many keys as "
                f"queries; got {num_queries} queries and {num_keys} keys: pass labels"
            )
        return
    if not torch.is_tensor(labels):
        raise ValueError(f"labels must be a torch.Tensor of int64, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != num_queries:
        raise ValueError(
            f"labels must have shape [{num_queries}] (one per query), got {tuple(labels.shape)}"
        )


def _scale_value_error(value: float, name: str = "scale") -> Optional[str]:
    if not (value == value and abs(value) != float("inf")):
        return f"{name} must be finite, got {value}"
    return None


def _check_scale_structure(scale: Union[float, int, torch.Tensor], name: str = "scale") -> None:
    if torch.is_tensor(scale):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
        if not scale.dtype.is_floating_point:
            raise ValueError(f"a {name} tensor must be floating point, got {scale.dtype}")
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        msg = _scale_value_error(float(scale), name)
        if msg:
            raise ValueError(msg)
    else:
        raise ValueError(f"{name} must be a float or a tensor, got {type(scale).__name__}")


def check_values(
    query: Optional[torch.Tensor],
    key: Optional[torch.Tensor],
    scale,
    labels: Optional[torch.Tensor],
    num_keys: int,
    check_finite: bool,
    bias=None,
) -> None:
    """The checks that read tensor values (``labels`` in ``[0, num_keys)``, a finite tensor scale
    and bias, and with ``check_finite`` finite features), with a single device-to-host copy for
    all of them (each readback drains the GPU queue, so a loss call makes at most one).

    :func:`check_inputs` runs them after the structure checks. A loss op called from a region that
    ``torch.compile`` traces runs them inside itself instead (``check_inputs(..., values=False)``
    there): reading a value back while tracing would need a guard on data, whereas inside the op
    they run at every call and raise the same errors.

    Inside :func:`deferred_value_checks` the checks are queued instead of read (on a GPU: no
    readback, so the host does not wait for the kernels before them) and raised later by
    :meth:`DeferredChecks.raise_if_failed`, on every device alike; a call with labels still reads
    at once unless the block's caller vouches for them (``labels_checked``): a label out of range
    would index past the keys before a queued check was read.
    """
    segments = _segments(query, key, scale, labels, check_finite, bias)
    if not segments:
        return
    _submit(segments, _value_vector(segments, query, key, scale, labels, bias),
                  _Context(_rows(query), _rows(key), scale, bias, num_keys), reads_labels=labels is not None)


def _submit(segments: Segments, values: torch.Tensor, context: "_Context", reads_labels: bool = False,
            staged=None) -> None:
    """The host's side of :func:`check_values`, for the value vector ``values`` of ``segments``
    (however it was computed, e.g. in a loss's CUDA graph by ``ds_infcl.ops.pass_check.PassCheck``): queued in a
    :func:`deferred_value_checks` or :func:`checks_read_after_launch` block, else read now.
    ``staged``: ``(host, event, token)`` of a ``PassCheck``, the vector's sum already on its
    way to pinned memory."""
    pending = _PENDING.get()
    if pending is not None and (not reads_labels or pending.labels_checked):
        pending.add(segments, values, context, staged)
        return
    _raise_for(_read(segments, values.cpu()), context)


# One segment of the vector of _value_vector: (name, length).
Segments = List[Tuple[str, int]]


def _segments(query, key, scale, labels, check_finite: bool, bias) -> Segments:
    """The segments of the vector that :func:`check_values` reads (empty: nothing to read): each
    row's largest ``|value|`` of ``query`` and ``key`` (with ``check_finite``), the tensor ``scale``
    and ``bias`` (with ``check_finite``; a CPU tensor always), the labels' min and max."""
    segments: Segments = []
    if check_finite:
        segments += [(name, t.shape[0]) for name, t in (("query", query), ("key", key)) if t is not None and t.numel()]
    for name, value in (("scale", scale), ("bias", bias)):
        if torch.is_tensor(value) and (check_finite or value.device.type == "cpu"):
            segments.append((name, value.numel()))
    if labels is not None and labels.numel():
        segments += [("labels_min", 1), ("labels_max", 1)]
    return segments


def _value_vector(segments: Segments, query, key, scale, labels, bias) -> torch.Tensor:
    """The float64 vector of ``segments`` on the features' device: a row's largest ``|value|`` is
    NaN or Inf exactly where the row holds one (one reduction per tensor), the labels' bounds are
    exact in float64. A handful of kernels and one copy, since at small batches the host's launches
    are the cost of the call; no host read (what a CUDA graph may capture)."""
    tensors = {"query": query, "key": key, "scale": scale, "bias": bias}
    parts: List[torch.Tensor] = []
    for name, _ in segments:
        if name in ("query", "key"):
            parts.append(torch.linalg.vector_norm(tensors[name].detach(), ord=float("inf"), dim=1))
        elif name in ("scale", "bias"):
            parts.append(tensors[name].detach().reshape(-1))
    if segments[-1][0] == "labels_max":
        parts += [bound.reshape(1) for bound in torch.aminmax(labels)]
    device = parts[0].device
    values = torch.empty(sum(n for _, n in segments), dtype=torch.float64, device=device)
    return torch.cat([p.to(device) for p in parts], out=values)


def _finite_part(segments: Segments) -> int:
    """How many leading values of the vector must be finite (all but the labels' bounds, last)."""
    return sum(n for name, n in segments if not name.startswith("labels"))


def _read(segments: Segments, values: torch.Tensor) -> Dict[str, int]:
    """The host's reading of a (CPU) value vector: name -> rows (or values) not finite, or the
    label bound. One sum tells that all is finite (in float64 a sum of finite values of any dtype
    here cannot overflow; a NaN or Inf makes it non-finite); the counts only when not."""
    all_finite = math.isfinite(float(values[:_finite_part(segments)].sum()))
    got, start = {}, 0
    for name, n in segments:
        part = values[start:start + n]
        start += n
        if name.startswith("labels"):
            got[name] = int(part[0])
        elif not all_finite:
            got[name] = int((~torch.isfinite(part)).sum())
    return got


def _rows(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else int(t.shape[0])


@dataclass
class _Context:
    """What the messages of :func:`check_values` name: the rows of the features (not the features:
    a queued check must not keep them alive), the scale and bias, the number of keys."""

    query_rows: Optional[int]
    key_rows: Optional[int]
    scale: object
    bias: object
    num_keys: int


def _raise_for(got: Dict[str, int], ctx: _Context) -> None:
    """The ``ValueError`` of the first failed check in ``got`` (name -> count or label bound)."""
    for name, rows in (("query", ctx.query_rows), ("key", ctx.key_rows)):
        bad = got.get(name, 0)
        if bad:
            raise ValueError(
                f"{name} has {bad} of {rows} rows with NaN or Inf values; "
                "check the encoder (fp16 overflow, a bad sample, a diverged step)"
            )
    if got.get("scale", 0):
        raise ValueError(_scale_value_error(float(ctx.scale.detach())))
    if got.get("bias", 0):
        raise ValueError(f"bias must be finite, got {float(ctx.bias.detach())}")
    if "labels_min" in got:
        check_label_bounds(got["labels_min"], got["labels_max"], ctx.num_keys)


def check_label_bounds(lo: int, hi: int, num_keys: int) -> None:
    """``ValueError`` unless labels from ``lo`` to ``hi`` index ``num_keys`` local keys."""
    if lo < 0 or hi >= num_keys:
        raise ValueError(
            f"labels must lie in [0, {num_keys}) (indices into the local keys); "
            f"got values from {lo} to {hi}"
        )


class DeferredChecks:
    """The value checks of the loss calls inside :func:`deferred_value_checks`, queued on their
    device to be read once the step has finished, with its other values (the trainer reads a
    step's loss one step late; a readback inside the step would make the host wait for the
    forward in every step).

    ``labels_checked``: the caller knows the labels of the block's loss calls are in range, so
    their check is queued too (else a call with labels reads at once). The trainer vouches with
    ``Batch.labels_known_in_range``: the default labels are made on the device, and a task's host
    labels are checked in ``Batch.loss_kwargs`` before the copy.
    """

    def __init__(self, labels_checked: bool = False) -> None:
        self.labels_checked = labels_checked
        self._entries: List[Tuple[Segments, torch.Tensor, _Context]] = []

    def add(self, segments: Segments, values: torch.Tensor, context: _Context, staged=None) -> None:
        self._entries.append((segments, values, context))

    def failed(self) -> Optional[torch.Tensor]:
        """A 0-dim device tensor, nonzero when a queued check failed; ``None`` when nothing is
        queued. Reads nothing."""
        flags = [_failed_flag(segments, values, ctx.num_keys) for segments, values, ctx in self._entries]
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack(flags).sum()

    def raise_if_failed(self) -> None:
        """Read the queued checks (after the kernels that made them have finished: no wait) and
        raise the ``ValueError`` of the first that failed, as :func:`check_values` would have."""
        for segments, values, ctx in self._entries:
            _raise_for(_read(segments, values.cpu()), ctx)


def _failed_flag(segments: Segments, values: torch.Tensor, num_keys: int) -> torch.Tensor:
    """On the device: 1 when any check of one :func:`check_values` call failed, else 0."""
    finite = _finite_part(segments)
    bad = (~torch.isfinite(values[:finite])).any()
    if finite < values.numel():  # the labels' min and max follow
        bad = bad | (values[finite] < 0) | (values[finite + 1] >= num_keys)
    return bad.long()


_PENDING: ContextVar[Optional[Union[DeferredChecks, "_ReadAfterLaunch", "_AgreedAfterLaunch"]]] = ContextVar("ds_infcl_deferred_checks", default=None)


@contextlib.contextmanager
def deferred_value_checks(labels_checked: bool = False) -> Iterator[DeferredChecks]:
    """Queue the value checks of the loss calls in the block instead of reading them: yields the
    :class:`DeferredChecks` to read after the block's kernels have run (calls with labels only
    with ``labels_checked``, see there). The trainer wraps each step in it
    (``Trainer.forward_backward_step``)."""
    pending = DeferredChecks(labels_checked)
    token = _PENDING.set(pending)
    try:
        yield pending
    finally:
        _PENDING.reset(token)


class _ReadAfterLaunch:
    """The value checks of one loss call inside :func:`checks_read_after_launch`: each is copied to
    the host as soon as it is computed, without a wait, and read when the call has queued its
    kernels. A call with labels still reads at once (``labels_checked`` false)."""

    labels_checked = False

    def __init__(self) -> None:
        self._entries: list = []

    def add(self, segments: Segments, values: torch.Tensor, context: _Context, staged=None) -> None:
        whole = staged is None and values.is_cuda
        if whole:
            host = values.to("cpu", non_blocking=True)  # into pinned memory, queued
            event = torch.cuda.Event()
            event.record()
            staged = (host, event, None)
        self._entries.append((segments, values, context, staged, whole))

    def raise_if_failed(self) -> None:
        for segments, values, ctx, staged, whole in self._entries:
            if staged is None:  # (on the CPU)
                _raise_for(_read(segments, values), ctx)
                continue
            host, event, token = staged
            if whole:
                event.synchronize()  # waits for the copy only, queued before the call's kernels
                _raise_for(_read(segments, host), ctx)
            elif outputs_intact(token):  # a PassCheck's sum, in a buffer no later replay has written
                event.synchronize()  # waits for the check's kernels only, queued before the loss's
                if not math.isfinite(host.item()):
                    _raise_for(_read(segments, values.cpu()), ctx)
            else:  # (one loss call per block: no later replay of its graph before the read)
                raise RuntimeError("ds_infcl: a loss call's input check was overwritten by another call of the "
                                   "same CUDA graph before it was read; please report this")


class _AgreedAfterLaunch:
    """The value checks of one distributed loss call inside ``checks_read_after_launch(agree=True)``:
    queued on the device, then agreed by every rank of the group in the call's first collective
    after its layout exchange (``ds_infcl.ring.agree_on_value_checks``: this rank's verdict by
    :meth:`flag`, every rank's back through :meth:`agreed`), and read when the call has queued its
    forward. Every rank raises together: a rank whose check failed its own ``ValueError``, the
    others one that names it. A call with labels still reads at once (``labels_checked`` false):
    then the verdict it sends is 0."""

    labels_checked = False

    def __init__(self) -> None:
        self._queued = DeferredChecks()  # (this rank's checks: queued, and read only when they failed)
        self._agreed = None  # (every rank's verdict on the host, its copy's event or None, this rank)

    def add(self, segments: Segments, values: torch.Tensor, context: _Context, staged=None) -> None:
        self._queued.add(segments, values, context)

    def flag(self, device: torch.device) -> torch.Tensor:
        """``[1]`` int64 on ``device``: nonzero where a queued check of this rank failed, else 0 (no
        read)."""
        failed = self._queued.failed()
        if failed is None:
            return torch.zeros(1, dtype=torch.int64, device=device)
        return failed.reshape(1).to(device)

    def agreed(self, flags: torch.Tensor, rank: int) -> None:
        """``flags [W]``: every rank's :meth:`flag` in rank order (one all-gather), copied to the host
        without a wait; ``rank`` is this rank's place in it."""
        event = None
        if flags.is_cuda:
            flags = flags.to("cpu", non_blocking=True)  # into pinned memory, queued
            event = torch.cuda.Event()
            event.record()
        self._agreed = (flags, event, rank)

    def raise_if_failed(self) -> None:
        if self._agreed is None:  # (every loss path that asks for agreement posts it)
            raise RuntimeError("ds_infcl: a distributed loss call queued its input checks without agreeing on "
                               "them with the other ranks; please report this")
        flags, event, rank = self._agreed
        if event is not None:
            event.synchronize()  # waits for the all-gather of verdicts, queued before the loss's kernels
        failed = [r for r, bad in enumerate(flags.tolist()) if bad]
        if rank in failed:
            self._queued.raise_if_failed()
        if failed:
            raise ValueError(f"rank(s) {failed} of the process group rejected their local inputs (their own "
                             "error says why); the loss stops on every rank")


@contextlib.contextmanager
def checks_read_after_launch(enabled: bool = True, agree: bool = False):
    """One loss call's value checks (finite features, scale and bias) read after the call has
    queued its forward, not before. Read first, the host would wait for the GPU's whole queue to
    drain before it launched the loss's first kernel; read after, it waits for the copy of the
    check only, which the GPU reaches while the host launches the forward. The failed check raises
    the same ``ValueError`` when the block ends, before the loss is returned; the kernels queued on
    the bad features are left to finish. A no-op when not ``enabled`` or inside
    :func:`deferred_value_checks` (the trainer reads them later still).

    ``agree``: a call over a group of several ranks, whose loss path agrees on the checks with the
    other ranks before it launches its own kernels (``_AgreedAfterLaunch``), so that every rank
    raises together. Yields what the loss path hands to ``ds_infcl.ring.agree_on_value_checks``
    (``None`` when the block is a no-op: then the path must not agree, and tells the other ranks so
    in its layout exchange)."""
    if not enabled or _PENDING.get() is not None:
        yield None
        return
    pending = _AgreedAfterLaunch() if agree else _ReadAfterLaunch()
    token = _PENDING.set(pending)
    try:
        yield pending if agree else None
    finally:
        _PENDING.reset(token)
    pending.raise_if_failed()


def pending_checks():
    """Where the value checks of a loss call go now: a :class:`DeferredChecks`, a read after launch,
    or ``None`` (read at once)."""
    return _PENDING.get()


def check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, int, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    check_labels: bool = True,
    check_finite: bool = True,
    allow_empty: bool = False,
    bias: Optional[Union[float, int, torch.Tensor]] = None,
    values: bool = True,
) -> None:
    """All checks of a loss call: :func:`check_features`, :func:`check_scale` and (if
    ``check_labels``) :func:`check_labels`, with one device-to-host copy for the value checks,
    and none at all when ``check_finite`` is false and no labels are given.

    A tensor scale (and a tensor ``bias``, SigLIP's) is checked for NaN/Inf with the features
    (``check_finite``); on a CPU tensor always. ``values=False`` checks only the structure
    (shapes, dtypes, devices): the caller then runs :func:`check_values` (inside its op).
    """
    _check_feature_structure(query, key, allow_empty)
    _check_scale_structure(scale)
    if bias is not None:
        _check_scale_structure(bias, "bias")
    if check_labels:
        _check_label_structure(labels, query.shape[0], key.shape[0])
    if values:
        check_values(query, key, scale, labels if check_labels else None, key.shape[0], check_finite, bias)


def check_features(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    check_finite: bool = True,
    allow_empty: bool = False,
) -> None:
    """Check that ``query [b, c]`` and ``key [m, c]`` can be contrasted.

    Raises:
        ValueError: not tensors, not 2-D, feature dims or dtypes that differ, unsupported dtype,
            empty inputs (unless ``allow_empty``), or rows with NaN/Inf (the count is given).
    """
    _check_feature_structure(query, key, allow_empty)
    check_values(query, key, None, None, key.shape[0], check_finite)


def check_labels(labels: Optional[torch.Tensor], num_queries: int, num_keys: int) -> None:
    """Check ``labels [b]``: integer indices of each query's positive among the local keys."""
    _check_label_structure(labels, num_queries, num_keys)
    check_values(None, None, None, labels, num_keys, False)


def check_scale(scale: Union[float, int, torch.Tensor]) -> None:
    """Check that the scale (``1 / temperature``) is a finite number or a one-element tensor."""
    _check_scale_structure(scale)
    check_values(None, None, scale, None, 0, True)


def check_tile_size(tile_size) -> None:
    """``tile_size`` is ``None`` (the device default) or a positive integer (the tile edge of the
    torch backend); anything else would tile nothing and return ``-inf`` statistics."""
    if tile_size is None:
        return
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(
            f"tile_size must be a positive integer (the tile edge of the torch backend) or None for the "
            f"device default, got {tile_size!r}"
        )
