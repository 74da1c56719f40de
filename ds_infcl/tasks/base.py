"""The task interface the trainer runs, its registry, and the batch container.

The engine (``ds_infcl.train``) imports this module and no task module: built-in tasks are named
here by import path and loaded on first use. A task joins data and models (CLIP image-text, dense
retrieval, the synthetic task of ``ds_infcl.tasks.synthetic``). The trainer knows nothing else about the model or the data:

- ``build_towers()`` returns an ``nn.Module`` with ``encode_query(inputs) -> [n, c]`` and
  ``encode_key(inputs) -> [m, c]``. The trainer wraps it with the ``ContrastiveLoss`` module (which
  owns the logit scale) into one model for ``deepspeed.initialize``.
- ``loss_defaults()`` gives the task's loss settings (symmetric, scale init, learnable); the run
  config's ``loss`` section overrides them; ``build_loss`` may return another loss module (the
  retrieval loss with false-negative masking) that keeps the same contract.
- ``batches(...)`` yields one ``Batch`` per optimizer step: this rank's share of the global batch,
  on CPU, every example tagged with its *global sample index* (FastCLIP's per-sample state and
  exact resumption both need it). Batches must be a deterministic function of the step and the
  rank so that ``start_step`` resumes exactly; streaming tasks may instead keep a position in
  ``state_dict``/``load_state_dict`` (saved with every checkpoint).
- ``evaluate(encoder, step)`` (optional) runs on every rank (ZeRO-3 forwards are collective) and
  returns metrics; ``encoder.encode_query(inputs)`` / ``encoder.encode_key(inputs)`` run the
  trained towers without gradients.

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

    def resolved_labels(self) -> torch.Tensor:
        if self.labels is not None:
            return self.labels
        return torch.arange(len(self), dtype=torch.long) * self.keys_per_query

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

    def loss_kwargs(self, device: torch.device, sample_index: bool = False) -> Dict[str, Any]:
        """``labels`` and ``loss_inputs`` (and ``sample_index`` for losses that declare
        ``needs_sample_index``, FastCLIP's) on ``device``: the keyword arguments of the loss."""
        out = {"labels": self.resolved_labels().to(device)}
        if sample_index:
            out["sample_index"] = self.sample_index.to(device)
        out.update(tree_map(lambda t: t.to(device), dict(self.loss_inputs)))
        return out


class Task:
    """Base class of trainable tasks; see the module docstring for the contract."""

    name: str = "task"

    def build_towers(self) -> nn.Module:
        raise NotImplementedError

    def loss_defaults(self) -> Dict[str, Any]:
        """Default ``ContrastiveLoss`` keyword arguments (``symmetric``, ``init_logit_scale``,
        ``max_logit_scale``, ``learnable_scale``)."""
        return {"symmetric": True}

    def build_loss(self, loss_config) -> nn.Module:
        """The loss module: ``ContrastiveLoss`` from ``loss_defaults()`` overridden by the run
        config's ``loss`` section (``loss_config``, a ``LossConfig``). Override to use another
        module; the trainer needs ``forward(query, key, labels, **batch.loss_inputs)`` returning
        the global loss, a ``group`` attribute (set to the engine's data-parallel group) and the
        scale, if learnable, as the ``nn.Parameter`` ``logit_scale``."""
        from ds_infcl.loss import ContrastiveLoss, available_fastclip_losses

        if loss_config.impl == "siglip":
            # SigLIP's own defaults (scale 10, bias -10); the task's InfoNCE defaults do not apply.
            from ds_infcl.loss import SigLIPLoss

            kwargs = {key: getattr(loss_config, key) for key in ("init_logit_scale", "max_logit_scale")
                      if getattr(loss_config, key) is not None}
            if loss_config.init_logit_bias is not None:
                kwargs["init_logit_bias"] = loss_config.init_logit_bias
            if loss_config.learnable_scale is not None:
                kwargs["learnable"] = loss_config.learnable_scale
            return SigLIPLoss(backend=loss_config.backend, tile_size=loss_config.tile_size, **kwargs)
        if loss_config.impl in available_fastclip_losses():
            from ds_infcl.loss import build_fastclip_loss

            args = dict(loss_config.args)
            args["num_samples"] = fastclip_num_samples(self, loss_config)
            return build_fastclip_loss(
                loss_config.impl, backend=loss_config.backend, tile_size=loss_config.tile_size, **args
            )
        if getattr(loss_config, "matryoshka_dims", None):
            from ds_infcl.errors import ConfigError

            raise ConfigError(f"loss.matryoshka_dims: task {getattr(self, 'name', type(self).__name__)!r} does not "
                              "support it (the retrieval task does)")
        defaults = getattr(self, "loss_defaults", None)
        kwargs = dict(defaults()) if callable(defaults) else {}
        for key in ("symmetric", "init_logit_scale", "max_logit_scale", "learnable_scale"):
            value = getattr(loss_config, key)
            if value is not None:
                kwargs[key] = value
        return ContrastiveLoss(
            impl=loss_config.impl, backend=loss_config.backend, tile_size=loss_config.tile_size, **kwargs
        )

    def batches(
        self, *, rank: int, world_size: int, local_batch_size: int, start_step: int, seed: int
    ) -> Iterator[Batch]:
        raise NotImplementedError

    def sample_index_bound(self) -> Optional[int]:
        """One more than the largest global sample index ``batches`` can yield (the size of the
        per-sample tables of FastCLIP's losses), or ``None`` when the task cannot tell."""
        return None

    def evaluate(self, encoder, step: int) -> Dict[str, float]:
        return {}

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


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
    ``"package.module:ClassOrFactory"`` (anything with the methods of ``Task``).

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
    for method in ("build_towers", "batches"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(f"task.name: {name!r} built a {type(task).__name__} without a {method}() method")
    return task


def as_batch(item: Any) -> Batch:
    """A task's batch as a ``Batch``: tasks that do not import the trainer (adapters) yield dicts
    with the same fields."""
    if isinstance(item, Batch):
        return item
    if isinstance(item, dict):
        return Batch(**item)
    raise TypeError(f"a task's batches() must yield Batch objects or dicts, got {type(item).__name__}")


def fastclip_num_samples(task: Any, loss_config) -> int:
    """``num_samples`` of a FastCLIP loss: ``loss.args.num_samples`` checked against the task's
    ``sample_index_bound()``, or that bound when the config leaves it out.

    Raises:
        ConfigError: the given value is below what the data's indices need (the message says which
            value to set), or neither the config nor the task gives one.
    """
    from ds_infcl.errors import ConfigError

    given = loss_config.args.get("num_samples")
    bound_fn = getattr(task, "sample_index_bound", None)
    bound = bound_fn() if callable(bound_fn) else None
    if given is None:
        if bound is None:
            raise ConfigError(
                f"loss.args.num_samples: loss.impl {loss_config.impl!r} keeps state per sample index and "
                f"task {getattr(task, 'name', type(task).__name__)!r} cannot tell how many there are; set it "
                "to one more than the largest global sample index of the training data"
            )
        return int(bound)
    if bound is not None and given < bound:
        raise ConfigError(
            f"loss.args.num_samples: {given} is too small for this data: its global sample indices run up to "
            f"{bound - 1} (they number the whole data set, held-out samples included); set "
            f"loss.args.num_samples to {bound} or leave it out to take it from the data"
        )
    return int(given)


def build_loss(task: Any, loss_config) -> nn.Module:
    """``task.build_loss(loss_config)`` if the task has it, else ``Task.build_loss`` (a
    ``ContrastiveLoss`` from the task's ``loss_defaults()`` and the run config)."""
    if callable(getattr(task, "build_loss", None)):
        return task.build_loss(loss_config)
    return Task.build_loss(task, loss_config)


def available_tasks() -> Tuple[str, ...]:
    return tuple(sorted(set(_TASKS) | set(_LAZY_TASKS)))
