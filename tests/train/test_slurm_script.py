"""launch/slurm.sbatch without a cluster: stub ``scontrol``, ``srun`` and ``deepspeed`` on PATH
show the hostfile it writes and the launcher command every node runs (node rank, no ssh, master)."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "slurm.sbatch"


def _stub(bin_dir: pathlib.Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def _env(tmp_path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _stub(bin_dir, "scontrol", 'echo gpu-a01; echo gpu-a02\n')
    # srun: run the task once per node, as SLURM would, with that node's SLURM_NODEID.
    _stub(bin_dir, "srun", 'while [[ "$1" != bash ]]; do shift; done\n'
                           'for id in 0 1; do SLURM_NODEID=$id "$@" || exit $?; done\n')
    _stub(bin_dir, "deepspeed", 'echo "deepspeed $*"\n')
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_NODELIST="gpu-a[01-02]", SLURM_JOB_ID="42", GPUS_PER_NODE="8",
               HOSTFILE=str(tmp_path / "hostfile"))
    env.update(extra)
    return env


def test_every_node_runs_its_launcher(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "launch/example_run.json", "ds_configs/zero3.json", "--resume"],
                          env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hostfile").read_text() == "gpu-a01 slots=8\ngpu-a02 slots=8\n"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("deepspeed ")]
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert f"--no_ssh --node_rank {rank}" in line
        assert "--master_addr gpu-a01 --master_port 29500" in line
        assert line.endswith("--module ds_infcl.train --deepspeed_config ds_configs/zero3.json "
                             "--config launch/example_run.json --resume")


def test_dry_run_and_outside_an_allocation(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "launch/example_run.json"], env=_env(tmp_path, DRY_RUN="1"),
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "MASTER_ADDR=gpu-a01" in proc.stdout and "--kill-on-bad-exit=1" in proc.stdout
    env = _env(tmp_path)
    del env["SLURM_JOB_NODELIST"]
    proc = subprocess.run(["bash", str(SCRIPT), "launch/example_run.json"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not inside a SLURM allocation" in proc.stderr


def test_sigterm_before_the_time_limit_stops_the_step_and_requeues(tmp_path):
    """SLURM's --signal=B:TERM@120 reaches the batch script only: it passes SIGTERM to srun (which
    forwards it to every node's launcher) and requeues the job once the step has ended."""
    import signal
    import time

    assert "#SBATCH --signal=B:TERM@" in SCRIPT.read_text() and "#SBATCH --requeue" in SCRIPT.read_text()
    env = _env(tmp_path)
    log = tmp_path / "calls"
    _stub(tmp_path / "bin", "scontrol", f'[[ "$1" == requeue ]] && echo "scontrol $*" >> {log}\n'
                                        'echo gpu-a01; echo gpu-a02\n')
    # srun: a step that runs until it gets SIGTERM, then ends as the ranks do (128 + 15).
    _stub(tmp_path / "bin", "srun", f'trap \'echo "srun got TERM" >> {log}; exit 143\' TERM\n'
                                    f'echo started >> {log}\nwhile true; do sleep 0.1; done\n')
    proc = subprocess.Popen(["bash", str(SCRIPT), "launch/example_run.json", "ds_configs/zero2.json", "--resume"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (log.exists() and "started" in log.read_text()):
        assert time.time() - t0 < 30 and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert log.read_text().splitlines()[1:] == ["srun got TERM", "scontrol requeue 42"]
    assert "the ranks stop at their next step boundary" in err
