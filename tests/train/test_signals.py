"""Clean stops on signals (train/signals.py): SIGTERM, SIGINT or SIGHUP to the launcher, to a
rank, or the launcher's death stops every rank at one step boundary with a checkpoint there, and
leaves no process behind; ``--resume`` then continues with the losses of an uninterrupted run.
Also: ``keep_last`` after a resume from an earlier tag keeps the new checkpoint (a real run)."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ds_infcl.train.checkpoint import RECORD
from ds_infcl.train.signals import StopOnSignal, StopRun
from tests.train import harness as h

ZERO2 = str(h.REPO / "ds_configs" / "zero2_fp32.json")
slow = pytest.mark.slow
NO_SCHEDULE = ["--ds-set", "scheduler=null"]  # the runs below change train.num_steps between resumes


def test_handler_records_the_signal_and_restores():
    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal(grace_s=None).install()
    try:
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # an ignored SIGHUP stays ignored
        assert not stop.agree() and stop.requested() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested() == signal.SIGTERM  # the process is still here: only a flag was set
        assert stop.agree() and stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat (launcher and scheduler both) is ignored
        assert stop.requested() == signal.SIGTERM
    finally:
        stop.restore()
        signal.signal(signal.SIGHUP, hup)
    assert signal.getsignal(signal.SIGTERM) == before
    assert StopRun(signal.SIGTERM, 7, "step00000007").exit_code == 143


def _config(directory, num_steps, **checkpoint):
    return h.write_run_config(directory, num_steps, checkpoint=checkpoint)


def _launch(cfg_path, log, extra=(), ranks=2):
    return h.launch_train(cfg_path, ZERO2, log, extra=[*NO_SCHEDULE, *extra], ranks=ranks)


def _job_after_steps(run_dir, n, proc):
    """The job's processes (launcher and ranks) once ``n`` steps are logged."""
    h.wait_for_steps(run_dir, n, proc, "the signal")
    return [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]


def _alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(pids, proc, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        proc.poll()
        if not _alive(pids):
            return time.time() - t0
        time.sleep(0.2)
    return None


def _finish(proc, pids):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)


def _signal_the_job(tmp_path, log_name, send):
    """Start an endless 2-rank run, call ``send(proc, pids)`` (the launcher's process; its pid and
    its descendants') once 3 steps are logged, and wait up to 30 s for every process to end.
    Returns (launcher process, pids, seconds until all were gone or None, the log's text)."""
    cfg = _config(tmp_path, 100000)
    with open(tmp_path / log_name, "w") as log:
        proc = _launch(cfg, log)
        pids = []
        try:
            pids = _job_after_steps(tmp_path / "run", 3, proc)
            send(proc, pids)
            gone_after = _wait_gone(pids, proc)
        finally:
            _finish(proc, pids)
    return proc, pids, gone_after, (tmp_path / log_name).read_text()


def _saved_step(ckpt_dir):
    tag = (ckpt_dir / "latest").read_text()
    return json.loads((ckpt_dir / tag / RECORD).read_text())["step"], tag


@slow
def test_sigterm_to_the_launcher_saves_at_the_step_and_resume_continues(tmp_path):
    """Today's main: SIGTERM to ``deepspeed`` ends it alone; both ranks go on training, orphaned."""
    sigterm = lambda proc, pids: proc.send_signal(signal.SIGTERM)  # noqa: E731
    proc, pids, gone_after, text = _signal_the_job(tmp_path, "stopped.log", sigterm)
    assert gone_after is not None, f"processes left 30 s after SIGTERM: {_alive(pids)}\n{text[-3000:]}"
    step, tag = _saved_step(tmp_path / "run" / "checkpoints")
    assert f"stopped by SIGTERM at step {step}, checkpoint {tag}" in text, text[-3000:]
    assert len(h.metrics_rows(tmp_path / "run")) == step  # it stopped at the step it saved

    more = _config(tmp_path, step + 3)
    with open(tmp_path / "resumed.log", "w") as log:
        rc = h.wait(_launch(more, log, extra=["--resume"]), 300)
    assert rc == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    reference = _config(tmp_path / "ref", step + 3)
    with open(tmp_path / "ref.log", "w") as log:
        assert h.wait(_launch(reference, log), 300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    resumed = h.summary(tmp_path / "run")
    expected = h.summary(tmp_path / "ref" / "run")
    assert resumed["start_step"] == step and len(resumed["losses"]) == 3
    assert resumed["losses"] == pytest.approx(expected["losses"][step:], rel=1e-5, abs=1e-6)


@slow
@pytest.mark.parametrize("target,sig", [("rank1", signal.SIGTERM), ("rank0", signal.SIGHUP),
                                        ("launch", signal.SIGKILL)])
def test_a_signal_to_a_rank_or_the_launchers_death_stops_every_rank_with_a_checkpoint(tmp_path, target, sig):
    """A signal to one rank stops both at one step (they agree at each step boundary); SIGKILL of
    ``deepspeed.launcher.launch`` reaches the ranks as SIGTERM (PR_SET_PDEATHSIG)."""
    def send(proc, pids):
        procs = [psutil.Process(p) for p in pids[1:]]
        if target == "launch":
            victim = next(p for p in procs if "deepspeed.launcher.launch" in " ".join(p.cmdline()))
        else:
            victim = next(p for p in procs if f"--local_rank={target[-1]}" in " ".join(p.cmdline()))
        victim.send_signal(sig)

    proc, pids, gone_after, text = _signal_the_job(tmp_path, "job.log", send)
    assert gone_after is not None, f"processes left 30 s after the signal: {_alive(pids)}\n{text[-3000:]}"
    step, tag = _saved_step(tmp_path / "run" / "checkpoints")
    name = "SIGTERM" if sig == signal.SIGKILL else signal.Signals(sig).name
    assert f"stopped by {name} at step {step}, checkpoint {tag}" in text, text[-3000:]
    if target != "launch":
        assert proc.returncode == 128 + sig  # the ranks' status, through both launcher processes


@slow
def test_keep_last_after_a_resume_from_an_earlier_tag_keeps_the_new_checkpoint(tmp_path):
    """Today's main ordered tags by name: resumed from step 4 of a run that had reached 12, with
    keep_last 1, it deleted the step-6 checkpoint it had just written, and rewrote the other run's
    step 8."""
    cfg = _config(tmp_path, 12, every_steps=4)
    run = [sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO2, *NO_SCHEDULE]
    first = subprocess.run(run + ["--config", str(cfg)], env=h.env(), cwd=h.REPO, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    ckpt = tmp_path / "run" / "checkpoints"
    record_8 = (ckpt / "step00000008" / RECORD).read_text()
    more = _config(tmp_path, 8, every_steps=2, keep_last=1)
    second = subprocess.run(run + ["--config", str(more), "--resume", str(ckpt / "step00000004")], env=h.env(),
                            cwd=h.REPO, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    tags = sorted(t for t in os.listdir(ckpt) if t.startswith("step"))
    # The first run's tags untouched; the second's step 8 beside the first's, its step 6 pruned.
    assert tags == ["step00000004", "step00000008", "step00000008-2", "step00000012"]
    assert (ckpt / "step00000008" / RECORD).read_text() == record_8
    assert (ckpt / "latest").read_text() == "step00000008-2"
    from ds_infcl.train.checkpoint import resolve_resume

    assert resolve_resume("auto", str(ckpt)) == (str(ckpt), "step00000008-2")
