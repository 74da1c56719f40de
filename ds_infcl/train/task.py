"""Moved to ``ds_infcl.tasks.base`` (and the synthetic task to ``ds_infcl.tasks.synthetic``); this
name keeps ``from ds_infcl.train.task import Task`` and ``task.module`` paths working."""

from ds_infcl.tasks.base import *  # noqa: F401,F403
from ds_infcl.tasks.base import Batch, Task, as_batch, available_tasks, build_loss, get_task, register_task, tree_map  # noqa: F401
from ds_infcl.tasks.synthetic import SyntheticTask  # noqa: F401
