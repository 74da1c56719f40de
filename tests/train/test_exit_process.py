"""``exit_process`` runs the cleanups of ``ds_infcl.exits.at_exit`` (``os._exit`` skips ``atexit``), each once, last
registered first, keeps its exit code when one of them fails, and a plain interpreter exit runs
them too."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
from ds_infcl.exits import at_exit
from ds_infcl.train.dist import exit_process

log = open(sys.argv[1], "a")
def note(what):
    log.write(what + "\\n")
    log.flush()
def fail():
    raise OSError("gone already")

at_exit(note, "first")
at_exit(fail)
at_exit(note, "last")
if sys.argv[2] == "exit_process":
    exit_process(3)
sys.exit(3)
"""


def _run(tmp_path, how):
    log = tmp_path / f"{how}.log"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(log), how], env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=120)
    return out, log.read_text().split()


def test_exit_process_runs_the_cleanups_once_in_reverse(tmp_path):
    out, calls = _run(tmp_path, "exit_process")
    assert out.returncode == 3, out.stderr
    assert calls == ["last", "first"], calls
    assert "exit cleanup" in out.stderr and "fail" in out.stderr and "gone already" in out.stderr, out.stderr


def test_interpreter_exit_runs_them_too(tmp_path):
    out, calls = _run(tmp_path, "sys.exit")
    assert out.returncode == 3, out.stderr
    assert calls == ["last", "first"], calls
