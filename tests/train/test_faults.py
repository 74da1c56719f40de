"""Faults with bounded ends (issue 13), on 2 CPU ranks with gloo, each case bounded in time:

- a rank killed mid-step (SIGKILL): the launcher and the other rank end within seconds, non-zero,
  and no process of the job is left;
- a rank that stops answering (SIGSTOP; ranks started as separate processes, as two nodes'
  launchers would): the other rank ends after ``dist.timeout_s`` with a message, not never;
- a kill during a checkpoint write: ``--resume auto`` continues from the previous complete
  checkpoint with the losses of an uninterrupted run;
- a resume on another number of ranks under ZeRO-2 is refused before anything is loaded; under
  ZeRO-0 it continues the same global batch and data position.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.train import harness as h

pytestmark = pytest.mark.slow
ZERO2 = str(h.REPO / "ds_configs" / "zero2_fp32.json")
ZERO0 = str(h.REPO / "ds_configs" / "zero0.json")


def _config(tmp_path, num_steps, **sections):
    return h.write_run_config(tmp_path, num_steps, **sections)


def _launch(cfg_path, ds_config=ZERO2, ranks=2, extra=(), log=None, env=None):
    return h.launch_train(cfg_path, ds_config, log, extra=extra, ranks=ranks, env_extra=env)


def _rank_process(launcher_pid, rank):
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if f"--local_rank={rank}" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of rank {rank} under the launcher")


def test_a_killed_rank_ends_the_job_within_seconds(tmp_path):
    cfg = _config(tmp_path, 100000)
    log = open(tmp_path / "job.log", "w")
    proc = _launch(cfg, log=log)
    try:
        h.wait_for_steps(tmp_path / "run", 3, proc, "the fault")
        job = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        victim = _rank_process(proc.pid, 1)
        t0 = time.time()
        victim.send_signal(signal.SIGKILL)
        rc = h.wait(proc, 60)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "job.log").read_text()
    assert rc not in (0, -9) and elapsed < 30, (rc, elapsed, text[-3000:])
    # The survivor says why it ends; the launcher then ends the job (DeepSpeed's launcher kills
    # every rank as soon as one exits non-zero).
    assert "rank 0: lost contact with the other ranks" in text and "Killing subprocess" in text
    time.sleep(1)
    left = [pid for pid in job if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"processes left behind: {left}"


def test_a_rank_that_stops_answering_ends_the_others_after_dist_timeout(tmp_path):
    # Two ranks started separately (two nodes' launchers): nothing kills the survivor for it.
    cfg = _config(tmp_path, 100000, dist={"timeout_s": 8})
    port = h.free_port()
    procs = []
    for rank in range(2):
        env = {**h.env(), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO2,
                                       "--config", str(cfg)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=h.REPO, start_new_session=True))
    try:
        h.wait_for_steps(tmp_path / "run", 3, procs[0], "the fault")
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        rc = h.wait(procs[0], 90)
        elapsed = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = (tmp_path / "rank0.log").read_text()
    assert rc == 1, (rc, text[-3000:])
    assert elapsed < 8 + 30, elapsed  # dist.timeout_s plus the set-down, not an endless wait
    assert "rank 0: lost contact with the other ranks" in text and "dist.timeout_s=8" in text


def test_a_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path):
    ckpt = {"every_steps": 4, "at_end": False, "keep_last": 0}
    reference = _config(tmp_path / "ref", 12, checkpoint=ckpt) if (tmp_path / "ref").mkdir() is None else None
    with open(tmp_path / "ref.log", "w") as log:
        assert h.wait(_launch(reference, log=log), 300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    expected = {int(r["step"]): float(r["loss"]) for r in h.metrics_rows(tmp_path / "ref" / "run")}

    cfg = _config(tmp_path, 12, checkpoint=ckpt)
    with open(tmp_path / "killed.log", "w") as log:
        rc = h.wait(_launch(cfg, log=log, env={"DS_INFCL_TEST_KILL_IN_CHECKPOINT": "8"}), 300)
    assert rc != 0
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert (ckpt_dir / "latest").read_text() == "step00000004"  # the pointer never saw step 8
    assert (ckpt_dir / "step00000008").is_dir() and not (ckpt_dir / "step00000008" / "ds_infcl_checkpoint.json").exists()
    # An explicit path to the half-written tag is refused; auto takes the previous complete one.
    cli = [sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO2, "--config", str(cfg)]
    bad = subprocess.run(cli + ["--resume", str(ckpt_dir / "step00000008")], env=h.env(), cwd=h.REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "was not completed" in bad.stderr, bad.stderr[-2000:]
    with open(tmp_path / "resumed.log", "w") as log:
        rc = h.wait(_launch(cfg, log=log, extra=["--resume"]), 300)
    text = (tmp_path / "resumed.log").read_text()
    assert rc == 0 and "resumed from" in text and "step00000004 at step 4" in text, text[-3000:]
    got = {int(r["step"]): float(r["loss"]) for r in h.metrics_rows(tmp_path / "run")}
    assert sorted(got) == list(range(1, 13))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert (ckpt_dir / "latest").read_text() == "step00000012"


def test_resume_on_another_number_of_ranks(tmp_path):
    # ZeRO-2 shards the optimizer state per rank: a 2-rank checkpoint on 1 rank is refused at once.
    cfg = _config(tmp_path, 4, checkpoint={"every_steps": 0, "at_end": True})
    with open(tmp_path / "two.log", "w") as log:
        assert h.wait(_launch(cfg, log=log), 300) == 0, (tmp_path / "two.log").read_text()[-3000:]
    more = _config(tmp_path, 8, checkpoint={"every_steps": 0, "at_end": True})
    one = subprocess.run([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO2, "--config", str(more),
                          "--resume"], env=h.env(), cwd=h.REPO, capture_output=True, text=True, timeout=120)
    assert one.returncode == 2, one.stdout[-2000:] + one.stderr[-2000:]
    assert "written by 2 ranks under ZeRO stage 2" in one.stderr and "Resume on 2 ranks" in one.stderr


def test_resume_on_one_rank_under_zero0_keeps_the_global_batch(tmp_path):
    # No sharded state: the same global batch continues on 1 rank at the same data position, with
    # the losses of an uninterrupted 2-rank run (up to the reduction order of 2 vs 1 ranks).
    lr = ['optimizer={"type": "SGD", "params": {"lr": 0.1}}', "scheduler=null", "zero_allow_untested_optimizer=true",
          "bf16.enabled=false"]  # float32: 1 and 2 ranks then differ only in summation order
    sets = [x for s in lr for x in ("--ds-set", s)]
    ref_cfg = _config(tmp_path / "ref", 8) if (tmp_path / "ref").mkdir() is None else None
    with open(tmp_path / "ref.log", "w") as log:
        assert h.wait(_launch(ref_cfg, ds_config=ZERO0, extra=sets, log=log), 300) == 0
    expected = {int(r["step"]): float(r["loss"]) for r in h.metrics_rows(tmp_path / "ref" / "run")}
    first = _config(tmp_path, 4, checkpoint={"at_end": True})
    with open(tmp_path / "two.log", "w") as log:
        assert h.wait(_launch(first, ds_config=ZERO0, extra=sets, log=log), 300) == 0
    rest = _config(tmp_path, 8, checkpoint={"at_end": True})
    one = subprocess.run([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO0, "--config", str(rest),
                          "--resume", *sets], env=h.env(), cwd=h.REPO, capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    assert "world size changed (2 -> 1)" in one.stdout
    got = {int(r["step"]): float(r["loss"]) for r in h.metrics_rows(tmp_path / "run")}
    assert sorted(got) == list(range(1, 9))
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
