"""The ``Task`` base class is the engine's whole view of a task: built-in tasks subclass it, its
defaults cover every optional method, and ``get_task`` wraps a plug-in object that only has the
methods (the documented contract) or says to subclass ``Task`` when the required ones are missing."""

import sys
import types

import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.tasks.base import Task, as_task, build_loss, get_task
from ds_infcl.train.config import LossConfig


class _Towers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def encode_query(self, x):
        return self.lin(x)

    def encode_key(self, x):
        return self.lin(x)


class DuckTask:
    """Not a Task subclass: only the required methods, plus a data report and an export."""

    name = "duck"

    def __init__(self, scale=2.0):
        self.scale = scale
        self.exported = None

    def build_towers(self):
        return _Towers()

    def batches(self, **kwargs):
        yield {}

    def data_report(self):
        return {"skipped": 3}

    def save_pretrained(self, folder, towers, logit_scale):
        self.exported = folder


class NoBatches:
    def build_towers(self):
        return _Towers()


@pytest.fixture()
def plugin_module(monkeypatch):
    module = types.ModuleType("plugin_tasks_for_test")
    module.DuckTask, module.NoBatches = DuckTask, NoBatches
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_builtin_tasks_subclass_task():
    from ds_infcl.tasks.base import _LAZY_TASKS, _import_attr

    for name, path in _LAZY_TASKS.items():
        assert issubclass(_import_attr(path, "task.name"), Task), name


def test_task_defaults_cover_every_optional_method():
    task = Task()
    assert task.evaluate(None, 1) == {} and task.state_dict() == {} and task.data_report() == {}
    assert task.load_state_dict({"x": 1}) is None
    assert task.model_flops_per_sample() is None and task.sample_index_bound() is None
    assert task.can_export() is False
    with pytest.raises(NotImplementedError, match=r"Task.batches\(\) is not implemented"):
        task.batches(rank=0, world_size=1, local_batch_size=1, start_step=0, seed=0)


def test_a_duck_typed_plugin_is_wrapped_with_the_defaults(plugin_module):
    task = get_task(f"{plugin_module}:DuckTask", {"scale": 3.0})
    assert isinstance(task, Task) and task.name == "duck" and task.scale == 3.0
    assert task.data_report() == {"skipped": 3}  # its own
    assert task.evaluate(None, 1) == {} and task.state_dict() == {} and task.model_flops_per_sample() is None
    assert task.can_export()
    task.save_pretrained("folder", None, None)
    assert task.task.exported == "folder"
    loss = build_loss(task, LossConfig(impl="infcl", backend="torch"))  # Task's loss, the base defaults
    assert loss.symmetric is True and as_task(task) is task


def test_a_plugin_without_the_required_methods_is_told_to_subclass_task(plugin_module):
    with pytest.raises(ConfigError, match=r"without a batches\(\) method; subclass ds_infcl.tasks.base.Task"):
        get_task(f"{plugin_module}:NoBatches")
