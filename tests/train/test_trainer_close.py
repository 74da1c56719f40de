"""``Trainer.close`` runs however the run ends: a step that raises, in a caller that catches the
error (a benchmark loop, a notebook), leaves no progress watchdog running. The watchdog exists with
more than one rank only, so the run has two (the deepspeed launcher on gloo)."""

import json
import subprocess

from tests.train import harness as h

SCRIPT = """
import json, os, sys, threading
from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.dist import exit_process, shutdown
from ds_infcl.train.loop import train

rank = int(os.environ["RANK"])
out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
cfg = run_config_from_dict({
    "task": {"name": "tests.train.nan_task:ClosingNanTask"},
    "batch": {"global_batch_size": 16}, "train": {"num_steps": 4},
    "logging": {"progress_bar": False}, "checkpoint": {"at_end": False}, "eval": {"at_end": False},
    "dist": {"timeout_s": 600}, "output_dir": out})
ds = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
      "zero_optimization": {"stage": 0}}
try:
    train(cfg, ds)
    error = None
except ValueError as err:
    held = err  # the traceback (and its frames, the trainer's among them) still alive here
    error = str(held)[:80]
for thread in threading.enumerate():
    if thread.name == "ds_infcl-watchdog":
        thread.join(timeout=10)  # a stopped watchdog ends within one wait
alive = [t.name for t in threading.enumerate() if t.name == "ds_infcl-watchdog" and t.is_alive()]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"error": error, "watchdogs": alive}, f)
shutdown()
exit_process(0)
"""


def test_a_failed_step_stops_the_watchdog(tmp_path):
    script = tmp_path / "fail_then_look.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    out.mkdir()
    cmd = [str(h.DEEPSPEED), "--num_gpus", "2", "--master_port", str(h.free_port()), str(script), str(out)]
    with open(tmp_path / "launch.log", "w") as log:
        rc = h.wait(h.start(cmd, log), 600)
    assert rc == 0, (tmp_path / "launch.log").read_text()[-4000:]
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["error"] is not None and "step 2" in seen["error"], seen
        assert seen["watchdogs"] == [], f"rank {rank}: a watchdog still runs after the failed step: {seen}"
