"""Tasks: what joins data and models for the engine (one module per task).

- ``base``: the ``Task`` interface, the ``Batch`` container and the task registry (the only module
  of this package the engine imports).
- ``synthetic``: two tiny MLP towers on generated pairs (``task.name: synthetic``).
- ``clip``: CLIP image-text on webdataset shards (``clip``), ``open_clip``: OpenCLIP models on
  the same data, ``bench``: ViT-B/16-size CLIP towers on random inputs (``bench_clip``).
- ``retrieval``: dense retrieval with sentence-transformers / Hugging Face encoders (``retrieval``).

Tasks import adapters and data, never the engine, a demo or a benchmark; they are loaded by name
on first use (``get_task("clip")``) or by import path (``"package.module:Class"``).
"""

from ds_infcl.tasks.base import Batch, Task, as_batch, available_tasks, build_loss, get_task, register_task, tree_map

__all__ = ["Batch", "Task", "as_batch", "available_tasks", "build_loss", "get_task", "register_task", "tree_map"]
