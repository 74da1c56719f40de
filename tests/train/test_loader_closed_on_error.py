"""A step that raises stops the task's batch stream before the error leaves ``train()``: a caller
that catches the error (a benchmark loop, a notebook) would otherwise keep the loader's worker
processes and its prefetch or device-decode thread alive with the traceback."""

import subprocess
import sys
import textwrap

from tests.train import harness as h

SCRIPT = textwrap.dedent("""
    import json, sys
    from ds_infcl.train.config import run_config_from_dict
    from ds_infcl.train.loop import train
    from tests.train.nan_task import ClosingNanTask
    cfg = run_config_from_dict({
        "task": {"name": "tests.train.nan_task:ClosingNanTask"},
        "batch": {"global_batch_size": 16}, "train": {"num_steps": 4},
        "logging": {"progress_bar": False}, "checkpoint": {"at_end": False}, "eval": {"at_end": False},
        "output_dir": sys.argv[1]})
    ds = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 0}}
    try:
        train(cfg, ds)
    except ValueError as err:
        held = err  # the traceback (and its frames) still alive here
        print(json.dumps({"error": str(held)[:80], "closed": ClosingNanTask.closed}))
""")


def test_a_failed_step_closes_the_batch_stream(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], env=h.env(), cwd=h.REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    assert '"closed": true' in line and "step 2" in line, line
