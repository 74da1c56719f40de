"""launch/simulate_two_nodes.sh on a GPU machine, without GPUs: stub ``python`` (reports CUDA and a
GPU count) and ``deepspeed`` (records its arguments, the hostfile and the NCCL environment) on PATH
show that each simulated node gets its own GPUs and that NCCL is sent over loopback sockets. (The
CPU branch runs for real in tests/train/test_engine_multirank.py; the GPU branch ran on 2 x H100,
docs/launching.md.)"""

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "simulate_two_nodes.sh"


def _run(tmp_path, gpus: int, slots: int = 1, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in *device_count*) echo "$FAKE_GPUS";; *is_available*) exit 0;; *) exit 1;; esac\n')
    (bin_dir / "deepspeed").write_text(
        "#!/usr/bin/env bash\n"
        'hostfile=$2\n'
        '{ echo "deepspeed $*"; echo "hostfile: $(tr "\\n" ";" < "$hostfile")"; '
        'echo "nccl: $NCCL_SOCKET_IFNAME $NCCL_P2P_DISABLE $NCCL_SHM_DISABLE"; } >> "$CALLS"\n')
    for name in ("python", "deepspeed"):
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_GPUS=str(gpus),
               SLOTS=str(slots), CALLS=str(log))
    for key in ("NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        env.pop(key, None)
    env.update(extra)
    proc = subprocess.run(["bash", str(SCRIPT), "launch/two_nodes_check.json", "ds_configs/zero2.json", "--resume"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    return proc, (log.read_text() if log.exists() else "")


def test_each_node_its_own_gpus_and_nccl_over_loopback(tmp_path):
    proc, calls = _run(tmp_path, gpus=2)
    assert proc.returncode == 0, proc.stderr
    launches = [line for line in calls.splitlines() if line.startswith("deepspeed ")]
    assert len(launches) == 2
    for line in launches:
        assert "--include node0:0@node1:1 --no_ssh" in line
        assert "--master_addr 127.0.0.1 --master_port 29531" in line
        assert line.endswith("--module ds_infcl.train --deepspeed_config ds_configs/zero2.json "
                             "--config launch/two_nodes_check.json --resume")
    assert sorted(int(line.split("--node_rank ")[1].split()[0]) for line in launches) == [0, 1]
    assert calls.count("hostfile: node0 slots=2;node1 slots=2;") == 2
    assert calls.count("nccl: lo 1 1") == 2


def test_two_ranks_per_node_and_user_nccl_settings(tmp_path):
    proc, calls = _run(tmp_path, gpus=4, slots=2, NCCL_P2P_DISABLE="0", NCCL_SHM_DISABLE="0")
    assert proc.returncode == 0, proc.stderr
    assert calls.count("--include node0:0,1@node1:2,3") == 2
    assert calls.count("nccl: lo 0 0") == 2


def test_too_few_gpus_is_an_error(tmp_path):
    proc, calls = _run(tmp_path, gpus=2, slots=2)
    assert proc.returncode == 2 and "need 4 GPUs, this machine has 2" in proc.stderr
    assert calls == ""
