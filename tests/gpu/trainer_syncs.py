"""Count the host synchronizations of the trainer's steady-state steps on a CUDA GPU, by source.

    python -m tests.gpu.trainer_syncs DS_CONFIG_JSON GRAD_CACHE
    torchrun --nproc_per_node 2 -m tests.gpu.trainer_syncs DS_CONFIG_JSON GRAD_CACHE

Runs the synthetic task (a 1-rank world without a launcher, or the launcher's ranks) for three warm-up steps, then four steps
under ``torch.cuda.set_sync_debug_mode("warn")``, and prints one JSON line ``TRAINER_SYNCS
{"steps": 4, "sources": {"<innermost ds_infcl or deepspeed frame>": count, ...}, "sync_free": true}``
(rank 0's). A synchronization is charged to the innermost frame of ds_infcl or DeepSpeed in its
stack. ``sync_free``: whether the trainer replaced DeepSpeed's gradient-norm mask and clip
(``ds_infcl/train/ds_sync_free.py``; their waits are then charged to that file if any remain).
"""

import collections
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch

from ds_infcl.train import ds_sync_free
from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.dist import exit_process
from ds_infcl.train.trainer import Trainer

STEPS = 4


def _source(stack) -> str:
    for frame in reversed(stack):
        path = frame.filename.replace(os.sep, "/")
        for root in ("ds_infcl/", "deepspeed/"):
            if root in path and "/tests/" not in path:
                return f"{root}{path.split(root, 1)[1]}:{frame.lineno} {frame.name}"
    return "other"


def count(ds_config: dict, grad_cache) -> dict:
    out = tempfile.mkdtemp()
    batch = {"global_batch_size": 256, "grad_cache": grad_cache, **({"chunk_size": 64} if grad_cache else {})}
    cfg = run_config_from_dict({
        "task": {"name": "synthetic", "args": {"input_dim": 64, "embed_dim": 32, "num_samples": 4096}},
        "batch": batch,
        "train": {"num_steps": 3 + STEPS + 1, "seed": 0}, "model": {"compile": False},
        "logging": {"every_steps": 2, "progress_bar": False, "tensorboard": False},
        "eval": {"at_end": False}, "checkpoint": {"every_steps": 0, "at_end": False, "export_final": False},
        "output_dir": out,
    })
    sources = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sources[_source(traceback.extract_stack()[:-1])] += 1

    with Trainer(cfg, ds_config) as trainer:
        for _ in range(3):
            trainer.train_step()
        previous = warnings.showwarning
        warnings.showwarning = record
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(STEPS):
                        trainer.train_step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            warnings.showwarning = previous
        trainer.inflight.settle()
    return {"steps": STEPS, "sources": dict(sources), "sync_free": ds_sync_free.installed()}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        ds = json.load(f)
    gc = json.loads(sys.argv[2])
    got = count(ds, gc)
    if os.environ.get("RANK", "0") == "0":
        print("TRAINER_SYNCS " + json.dumps(got), flush=True)
    exit_process(0)
