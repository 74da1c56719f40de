"""launch/bench_7b.sh without GPUs: a stub ``python3`` records the engine command that the script
starts in its own session; the command is one the engine accepts (its impls, the decoder task's
arguments), the run's files come back to $OUT, and ``wait`` finds the finished run."""

import json
import os
import pathlib
import subprocess

from ds_infcl.bench import engine
from ds_infcl.tasks.base import get_task

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "bench_7b.sh"


def test_start_runs_one_engine_command_in_the_background(tmp_path):
    stub = tmp_path / "python3"
    stub.write_text("#!/usr/bin/env bash\n"
                    "if [ \"$1\" = -m ] && [ \"$2\" = pip ]; then echo 'peft 0.21.0'; exit 0; fi\n"
                    f"printf '%s\\n' \"$@\" > {tmp_path}/argv; echo '[bench] fake row'; "
                    "echo '| fake |' > \"${@: -1}/results.md\"\n")
    stub.chmod(0o755)
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    env = dict(os.environ, PYTHON=str(stub), BENCH7B_DIR=str(run_dir), WAIT="60", OUT=str(out))
    proc = subprocess.run(["bash", str(SCRIPT), "start"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[bench_7b] done (engine exit 0)" in proc.stdout and "[bench] fake row" in proc.stdout
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["-m", "ds_infcl.bench.engine"]
    impls = argv[argv.index("--impls") + 1:argv.index("--throughput-batch")]
    assert impls == ["infcl+lora+ckptauto+chunk8", "st_cached", "infcl+chunk64"]
    for impl in impls:
        if impl != "st_cached":
            engine.parse_impl(impl)
    task_args = json.loads(argv[argv.index("--task-args") + 1])
    assert task_args == {"arch": "qwen2-7b", "seq_len": 256, "num_negatives": 1, "init_device": "cuda"}
    get_task("bench_decoder", dict(task_args, init_device="cpu"))  # the task takes its arguments
    assert argv[argv.index("--throughput-batch") + 1] == "16384" and argv[argv.index("--num-gpus") + 1] == "4"
    assert argv[argv.index("--steps") + 1] == "1" and argv[argv.index("--warmup") + 1] == "0"  # the one step timed
    assert argv[argv.index("--out") + 1] == str(run_dir)
    assert (out / "results.md").read_text() == "| fake |\n" and (out / "engine.log").exists()
    again = subprocess.run(["bash", str(SCRIPT), "wait"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "[bench_7b] done" in again.stdout and "| fake |" in again.stdout
