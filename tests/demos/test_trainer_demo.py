"""The demo's run configs pass the trainer's validation and the cross-check with their DeepSpeed
JSON for 2 ranks (the digits demo itself runs in the README's `make demo`, not in the suite), and a
short synthetic demo runs twice in one folder."""

import json
import os

import pytest

from ds_infcl.train.cli import main as train_main
from ds_infcl.demos.trainer import TASKS, demo_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_demo_configs_validate(task, tmp_path, capsys):
    d = TASKS[task]
    if task == "digits":  # the demo writes its digits folder before the run (data only by name or path)
        from ds_infcl.tasks.clip import ensure_digits_shards

        ensure_digits_shards(str(tmp_path / "digits"))
    cfg = demo_run_config(str(tmp_path / "out"), d["steps"], d["global_batch_size"], d["chunk_size"], "infcl",
                          task, str(tmp_path / "digits"), d["eval_every"])
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    argv = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", d["ds_config"]), "--config", str(path),
            "--check", "--world-size", "2"]
    for kv in d["ds_set"]:
        argv += ["--ds-set", kv]
    assert train_main(argv) == 0
    assert "global batch 256" in capsys.readouterr().out


def test_unknown_demo_task():
    with pytest.raises(ValueError, match="unknown demo task 'nope'"):
        demo_run_config("out", 1, 2, None, "infcl", "nope")


def test_the_demo_runs_again_in_the_same_folder(tmp_path, capsys):
    """A second ``make demo`` starts a new run over the first one's checkpoints (the trainer refuses
    a fresh start there unless told), and ``--resume`` of the finished run trains nothing."""
    from ds_infcl.demos.trainer import main

    args = ["--task", "synthetic", "--num-ranks", "1", "--steps", "2", "--global-batch-size", "16",
            "--chunk-size", "8", "--output-dir", str(tmp_path / "demo")]
    assert main(args) == 0
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    assert main(args + ["--resume"]) == 0
    assert "nothing to train" in capsys.readouterr().out
