"""DeepSpeed training of contrastive models: the only package that imports deepspeed.

- ``config``: the run config (validated, cross-checked with the DeepSpeed JSON).
- ``task``: the ``Task`` interface adapters implement, its registry, the synthetic task.
- ``model``: towers + ``ContrastiveLoss`` in one module for ``deepspeed.initialize``.
- ``steps``: the uncached step and GradCache on DeepSpeed micro-steps.
- ``optim``: the DeepSpeed JSON's optimizer on every accelerator (CPU substitutes).
- ``checkpoint``, ``metrics``, ``loop``, ``cli``: the run itself (``python -m ds_infcl.train``).
- ``demo``: the 2-rank CPU demo behind ``make demo``.

Importing this package does not import deepspeed; ``train`` does.
"""

from ds_infcl.train.config import ConfigError, RunConfig, load_run_config, resolve_deepspeed_config
from ds_infcl.train.task import Batch, SyntheticTask, Task, available_tasks, get_task, register_task

__all__ = [
    "Batch",
    "ConfigError",
    "RunConfig",
    "SyntheticTask",
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
