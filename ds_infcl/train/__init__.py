"""DeepSpeed training of contrastive models: the only package that imports deepspeed.

- ``config``: the run config (validated, cross-checked with the DeepSpeed JSON).
- ``ds_config``: the DeepSpeed JSON: resolution against the run config, checks of its blocks.
- ``model``: towers + ``ContrastiveLoss`` in one module for ``deepspeed.initialize``.
- ``steps``: the uncached step and GradCache on DeepSpeed micro-steps.
- ``optim``: the DeepSpeed JSON's optimizer on every accelerator (CPU substitutes).
- ``trainer``: the run as the ``Trainer`` class (``train_step``, ``maybe_eval``,
  ``maybe_checkpoint``, ``close``); ``loop.train`` is its one-call form.
- ``checkpoint``, ``metrics``, ``export``: the components the trainer owns (checkpoints, logs and
  FLOP counts, the final parameters and model export); ``cli``: ``python -m ds_infcl.train``.
- ``dist``: process group set-up, timeouts, clean exits.
- ``ds_sync_free``: DeepSpeed's gradient-norm mask and ZeRO-1/2 clip without host waits (the trainer
  installs them before ``deepspeed.initialize``).

This package is the engine: it runs any task through the interface of ``ds_infcl.tasks.base``
and imports no task module, demo or benchmark (``tests/test_layout.py``). Tasks live in
``ds_infcl.tasks``, demos in ``ds_infcl.demos``, the engine benchmark in ``ds_infcl.bench.engine``.

Importing this package does not import deepspeed; ``train`` does.
"""

from ds_infcl.train.config import ConfigError, RunConfig, load_run_config
from ds_infcl.train.ds_config import resolve_deepspeed_config
from ds_infcl.tasks.base import Batch, Task, available_tasks, get_task, register_task

__all__ = [
    "Batch",
    "ConfigError",
    "RunConfig",
    "Task",
    "available_tasks",
    "get_task",
    "load_run_config",
    "register_task",
    "resolve_deepspeed_config",
    "train",
]


def train(*args, **kwargs):
    """``ds_infcl.train.loop.train`` (imported lazily: it imports deepspeed)."""
    from ds_infcl.train.loop import train as _train

    return _train(*args, **kwargs)
