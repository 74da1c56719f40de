"""``python -m ds_infcl.bench.check_cost`` on the CPU: every variant runs and is timed, the profile
names the loss's functions, and bad sizes are refused."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ds_infcl.bench.check_cost", *args], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=300)


def test_cpu_run_times_every_variant_and_profiles():
    out = _run("--batch", "24", "--dim", "8", "--rounds", "2", "--calls", "2", "--profile")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(re.findall(r"^\| (\w+) \| ([0-9.]+) \| - \|$", out.stdout, re.M))
    assert sorted(rows) == sorted(["sig_off", "sig_default", "sig_queued", "sig_eager_check", "sig_fwd_off",
                                   "sig_fwd_default", "nce_off", "nce_default"]), out.stdout
    assert all(float(ms) > 0 for ms in rows.values())
    assert "not a measurement" in out.stdout
    assert out.stdout.count("==== cProfile") == 2 and "siglip" in out.stdout


def test_bad_sizes_are_refused():
    out = _run("--batch", "0")
    assert out.returncode == 2 and "must be positive" in out.stderr
