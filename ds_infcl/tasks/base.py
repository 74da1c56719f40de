"""The task interface the trainer runs, its registry, and the batch container.

The engine (``ds_infcl.train``) imports this module and no task module: built-in tasks are named
here by import path and loaded on first use. A task joins data and models (CLIP image-text, dense
retrieval, the synthetic task of ``ds_infcl.tasks.synthetic``). The trainer knows nothing else about the model or the data:

- ``build_towers()`` returns an ``nn.Module`` with ``encode_query(inputs) -> [n, c]`` and
  ``encode_key(inputs) -> [m, c]``. The trainer wraps it with the ``ContrastiveLoss`` module (which
  owns the logit scale) into one model for ``deepspeed.initialize``.
- ``loss_defaults()`` gives the task's loss settings (symmetric, scale init, learnable); the run
  config's ``loss`` section overrides them; ``build_loss`` hands both to the one loss factory,
  ``ds_infcl.loss.build_loss(loss.impl, ...)``, where every implementation registered how its
  module is built (the retrieval task asks it for its loss with false-negative masking).
- ``batches(...)`` yields one ``Batch`` per optimizer step: this rank's share of the global batch,
  on CPU, every example tagged with its *global sample index* (FastCLIP's per-sample state and
  exact resumption both need it). Batches must be a deterministic function of the step and the
  rank so that ``start_step`` resumes exactly; streaming tasks may instead keep a position in
  ``state_dict``/``load_state_dict`` (saved with every checkpoint).
- ``evaluate(encoder, step)`` runs on every rank (ZeRO-3 forwards are collective) and
  returns metrics; ``encoder.encode_query(inputs)`` / ``encoder.encode_key(inputs)`` run the
  trained towers without gradients.
- ``Task`` gives defaults the engine calls unconditionally: ``evaluate`` (no metrics),
  ``state_dict`` / ``load_state_dict``, ``data_report``, ``model_flops_per_sample`` (``None``: the
  engine counts them), ``recomputed_forward_fraction`` (0: no activation checkpointing),
  ``save_pretrained`` with ``can_export`` (no export), ``sample_index_bound``.
  Tasks subclass it; ``get_task`` wraps an object that only has the methods (``as_task``).

Register a task with ``@register_task("name")`` on a factory ``factory(**args) -> Task``; the run
config selects it with ``task.name`` and passes ``task.args``; ``task.module`` names a module to
import first (where the registration lives).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ds_infcl.ops.validation import check_label_bounds

__all__ = [
    "Batch",
    "Task",
    "register_task",
    "get_task",
    "available_tasks",
    "as_batch",
    "build_loss",
    "tree_map",
    "check_only",
    "checking",
    "fastclip_num_samples",
    "as_task",
    "loss_config_settings",
]


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor in a nest of dicts, lists and tuples."""
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return tree


@dataclass
class Batch:
    """This rank's share of one step's global batch.

    Attributes:
        query_inputs: tensor or nest of tensors whose first dim is the ``b`` queries.
        key_inputs: nest whose first dim is ``b * keys_per_query`` keys, grouped by query (the
            keys of query i are rows ``i*kpq .. (i+1)*kpq - 1``, positive first by convention).
        sample_index: ``[b]`` int64 global index of each query example.
        labels: ``[b]`` index of each query's positive among the local keys; ``None`` means
            ``arange(b) * keys_per_query``.
        keys_per_query: keys per query (1, or 1 + hard negatives).
        loss_inputs: extra keyword arguments of the loss module's forward for the whole local
            batch (e.g. ``key_ids`` / ``positive_ids`` for false-negative masking); moved to the
            device, never chunked.
    """

    query_inputs: Any
    key_inputs: Any
    sample_index: torch.Tensor
    labels: Optional[torch.Tensor] = None
    keys_per_query: int = 1
    loss_inputs: Dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def resolved_labels(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The labels, or (none given) query i's positive at key ``i * keys_per_query``, made
        on ``device``."""
        if self.labels is not None:
            return self.labels
        return torch.arange(len(self), dtype=torch.long, device=device) * self.keys_per_query

    def slice(self, start: int, stop: int) -> "Batch":
        """Queries ``start:stop`` and their keys (labels are not sliced: they index the whole
        local key set and are only used by the loss)."""
        kpq = self.keys_per_query
        return replace(
            self,
            query_inputs=tree_map(lambda t: t[start:stop], self.query_inputs),
            key_inputs=tree_map(lambda t: t[start * kpq : stop * kpq], self.key_inputs),
            sample_index=self.sample_index[start:stop],
        )

    def chunks(self, chunk_size: int):
        """Consecutive ``slice``s of at most ``chunk_size`` queries."""
        return [self.slice(i, min(i + chunk_size, len(self))) for i in range(0, len(self), chunk_size)]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        """Apply ``fn`` to every input tensor (pinning, moving to the device)."""
        return replace(
            self,
            query_inputs=tree_map(fn, self.query_inputs),
            key_inputs=tree_map(fn, self.key_inputs),
        )

    @property
    def labels_known_in_range(self) -> bool:
        """Whether ``loss_kwargs`` hands the loss labels known to index the local keys: the
        default ones (made on the device), or a task's host labels, which it checks on the host
        before the copy (free there). The trainer then lets the loss queue its own label check
        with the others (``ds_infcl.ops.validation.deferred_value_checks``) instead of reading it
        before any kernel indexes the keys with them."""
        return self.labels is None or self.labels.device.type == "cpu"

    def loss_kwargs(self, device: torch.device, sample_index: bool = False) -> Dict[str, Any]:
        """``labels`` and ``loss_inputs`` (and ``sample_index`` for losses that declare
        ``needs_sample_index``, FastCLIP's) on ``device``: the keyword arguments of the loss."""
        labels = self.resolved_labels(device)
        if self.labels is not None and self.labels_known_in_range and labels.numel():
            check_label_bounds(int(labels.min()), int(labels.max()), len(self) * self.keys_per_query)
        out = {"labels": _to_device(labels, device)}
        if sample_index:
            out["sample_index"] = _to_device(self.sample_index, device)
        out.update(tree_map(lambda t: _to_device(t, device), dict(self.loss_inputs)))
        return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU through pinned memory without blocking: a
    copy from pageable memory waits for every kernel queued before it (the host would then wait
    for the step's forward in the middle of every step)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Task:
    """Base class of trainable tasks; see the module docstring for the contract.

    Subclasses implement ``build_towers`` and ``batches``; every other method has a default that
    the engine relies on (it calls each of them unconditionally)."""

    name: str = "task"

    def build_towers(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_towers() is not implemented")

    def batches(
        self, *, rank: int, world_size: int, local_batch_size: int, start_step: int, seed: int
    ) -> Iterator[Batch]:
        raise NotImplementedError(f"{type(self).__name__}.batches() is not implemented")

    def loss_defaults(self) -> Dict[str, Any]:
        """Default ``ContrastiveLoss`` keyword arguments (``symmetric``, ``init_logit_scale``,
        ``max_logit_scale``, ``learnable_scale``)."""
        return {"symmetric": True}

    def build_loss(self, loss_config) -> nn.Module:
        """The loss module ``ds_infcl.loss.build_loss`` makes for ``loss_config.impl`` (the run
        config's ``loss`` section, a ``LossConfig``) from ``loss_defaults()`` overridden by the
        config. Override to check the config against the task (then call this) or to use another
        module; the trainer needs ``forward(query, key, labels, **batch.loss_inputs)`` returning
        the global loss, a ``group`` attribute (set to the engine's data-parallel group) and the
        scale, if learnable, as the ``nn.Parameter`` ``logit_scale``."""
        from ds_infcl.loss import build_loss as build_loss_module

        return build_loss_module(loss_config.impl, defaults=self.loss_defaults(), **self._loss_context(),
                                 **loss_config_settings(loss_config))

    def check_loss(self, loss_config) -> None:
        """What ``build_loss`` would refuse in the config, found without building the loss (``--check``):
        FastCLIP's ``loss.args.num_samples`` against ``sample_index_bound()``."""
        from ds_infcl.loss import check_loss

        check_loss(loss_config.impl, defaults=self.loss_defaults(), **self._loss_context(),
                   **loss_config_settings(loss_config))

    def _loss_context(self) -> Dict[str, Any]:
        return {"sample_index_bound": self.sample_index_bound, "owner": self.name}

    def sample_index_bound(self) -> Optional[int]:
        """One more than the largest global sample index ``batches`` can yield (the size of the
        per-sample tables of FastCLIP's losses), or ``None`` when the task cannot tell."""
        return None

    def evaluate(self, encoder, step: int) -> Dict[str, float]:
        """Metrics of the trained towers (run on every rank); none by default."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """Extra data position saved in every checkpoint (the step is saved anyway)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def data_report(self) -> Dict[str, int]:
        """This rank's data counts (samples skipped, examples unused, ...), summed over the ranks
        into the run's summary."""
        return {}

    def model_flops_per_sample(self) -> Optional[float]:
        """Training FLOPs of one example, or ``None``: the engine counts them on the first batch."""
        return None

    def recomputed_forward_fraction(self) -> float:
        """The share of the towers' forward FLOPs that the backward runs again (activation
        checkpointing: about 1.0 when every block is recomputed); 0 by default. Counted in the
        hardware FLOPs utilization (``hfu``), not in the model FLOPs."""
        return 0.0

    def can_export(self) -> bool:
        """Whether ``save_pretrained`` writes a model folder (a subclass that overrides it does)."""
        return type(self).save_pretrained is not Task.save_pretrained

    def save_pretrained(self, folder: str, towers: nn.Module, logit_scale: torch.Tensor, **extra) -> None:
        """Write the trained model to ``folder`` (``checkpoint.export_final``); no export by default."""
        return None


def loss_config_settings(loss_config) -> Dict[str, Any]:
    """The run config's ``loss`` section as ``ds_infcl.loss.build_loss`` keyword arguments (fields a
    config object does not have count as unset)."""
    keys = ("backend", "tile_size", "symmetric", "init_logit_scale", "max_logit_scale", "learnable_scale",
            "init_logit_bias", "matryoshka_dims", "matryoshka_weights", "args")
    return {key: getattr(loss_config, key, None) for key in keys}


class _DuckTask(Task):
    """A task object that does not subclass ``Task`` (the documented plug-in contract allows it),
    given the ``Task`` interface: its own methods where it has them, ``Task``'s defaults elsewhere."""

    _FORWARDED = ("build_towers", "batches", "loss_defaults", "build_loss", "check_loss", "sample_index_bound",
                  "evaluate", "state_dict", "load_state_dict", "data_report", "model_flops_per_sample",
                  "recomputed_forward_fraction", "save_pretrained")

    def __init__(self, task: Any):
        self.task = task
        self.name = getattr(task, "name", type(task).__name__)
        for method in self._FORWARDED:
            own = getattr(task, method, None)
            if callable(own):
                setattr(self, method, own)
        self._exports = callable(getattr(task, "save_pretrained", None))

    def can_export(self) -> bool:
        return self._exports

    def __getattr__(self, name: str):  # the wrapped task's other attributes (tests, demos)
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


_CHECKING = [False]


@contextlib.contextmanager
def check_only():
    """Tasks built inside validate everything a run would read and write nothing (``--check``):
    built-in data that is not on disk yet is not generated, no cache file is written."""
    previous = _CHECKING[0]
    _CHECKING[0] = True
    try:
        yield
    finally:
        _CHECKING[0] = previous


def checking() -> bool:
    """True while a task is built by ``--check`` (see ``check_only``)."""
    return _CHECKING[0]


_TASKS: Dict[str, Callable[..., Task]] = {}


def register_task(name: str):
    """Decorator: register a task factory under ``name``."""

    def deco(factory):
        if name in _TASKS and _TASKS[name] is not factory:
            raise ValueError(f"task {name!r} is already registered")
        _TASKS[name] = factory
        return factory

    return deco


# Tasks that live in other packages, imported on first use: name -> "module:attribute".
_LAZY_TASKS = {
    "synthetic": "ds_infcl.tasks.synthetic:SyntheticTask",
    "clip": "ds_infcl.tasks.clip:ClipTask",
    "bench_clip": "ds_infcl.tasks.bench:BenchClipTask",
    "bench_decoder": "ds_infcl.tasks.bench_decoder:BenchDecoderTask",
    "retrieval": "ds_infcl.tasks.retrieval:RetrievalTask",
    "open_clip": "ds_infcl.tasks.open_clip:OpenClipTask",
}


def _import_attr(path: str, key: str):
    from ds_infcl.errors import ConfigError

    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {e}") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def get_task(name: str, args: Optional[Dict[str, Any]] = None, module: Optional[str] = None) -> Task:
    """Build a task: a registered name, a built-in adapter name (``clip``), or an import path
    ``"package.module:ClassOrFactory"`` (a ``Task`` subclass, or an object with its
    ``build_towers`` and ``batches`` methods: wrapped, ``Task``'s defaults for the rest).

    Raises:
        ConfigError: the module does not import, the name is unknown (valid names listed), or the
            factory rejects ``args`` (the key is named ``task.args``).
    """
    from ds_infcl.errors import ConfigError

    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"task.module: cannot import {module!r}: {e}") from None
    if name in _TASKS:
        factory = _TASKS[name]
    elif name in _LAZY_TASKS:
        factory = _import_attr(_LAZY_TASKS[name], "task.name")
    elif ":" in name:
        factory = _import_attr(name, "task.name")
    else:
        raise ConfigError(
            f"task.name: unknown task {name!r}; choose one of {list(available_tasks())} or give "
            "an import path 'package.module:Class'"
        )
    try:
        task = factory(**(args or {}))
    except TypeError as e:
        raise ConfigError(f"task.args: {e}") from None
    return as_task(task, name)


def as_task(task: Any, name: str = "task") -> Task:
    """``task`` as a ``Task``: itself if it subclasses ``Task``, else wrapped (an object with the
    methods of the plug-in contract; those it lacks get ``Task``'s defaults).

    Raises:
        ConfigError: ``task`` has no ``build_towers()`` or no ``batches()``; the message says to
            subclass ``ds_infcl.tasks.base.Task``.
    """
    from ds_infcl.errors import ConfigError

    if isinstance(task, Task):
        return task
    for method in ("build_towers", "batches"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(f"task.name: {name!r} built a {type(task).__name__} without a {method}() method; "
                              "subclass ds_infcl.tasks.base.Task and implement build_towers() and batches()")
    return _DuckTask(task)


def as_batch(item: Any) -> Batch:
    """A task's batch as a ``Batch``: tasks that do not import the trainer (adapters) yield dicts
    with the same fields."""
    if isinstance(item, Batch):
        return item
    if isinstance(item, dict):
        return Batch(**item)
    raise TypeError(f"a task's batches() must yield Batch objects or dicts, got {type(item).__name__}")


def fastclip_num_samples(task: Any, loss_config) -> int:
    """``num_samples`` of a FastCLIP loss for ``task`` (``ds_infcl.loss.fastclip_num_samples``:
    ``loss.args.num_samples`` checked against the task's ``sample_index_bound()``, or that bound).

    Raises:
        ConfigError: the value is too small for the data (the message names the value to set), or
            neither the config nor the task gives one.
    """
    from ds_infcl.loss import fastclip_num_samples as num_samples
    from ds_infcl.loss.factory import loss_settings

    task = as_task(task)
    return num_samples(loss_settings(loss_config.impl, **task._loss_context(), **loss_config_settings(loss_config)))


def build_loss(task: Any, loss_config) -> nn.Module:
    """``task.build_loss(loss_config)`` (``Task.build_loss`` unless the task overrides it)."""
    return as_task(task).build_loss(loss_config)


def available_tasks() -> Tuple[str, ...]:
    return tuple(sorted(set(_TASKS) | set(_LAZY_TASKS)))
