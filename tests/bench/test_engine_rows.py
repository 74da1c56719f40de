"""``bench.engine``'s cases of ours without launching DeepSpeed: the run config each impl spec
writes (``+compile``, ``+auto``, ``--set``), and the row and table built from what the run leaves
(the chunk "auto" chose, samples/s per GPU, MFU)."""

import csv
import json
import os

import pytest

from ds_infcl.bench import engine, launching


class _FakeProc:
    """Stands in for the launched ``deepspeed`` process: reads the case's run.json and writes what
    the trainer would (run_config.json with the chunk resolved, summary.json)."""

    def __init__(self, cmd, **kwargs):
        run_path = cmd[cmd.index("--config") + 1]
        with open(run_path) as f:
            run = json.load(f)
        self.run = run
        out = run["output_dir"]
        resolved = json.loads(json.dumps(run))
        if resolved["batch"]["chunk_size"] == "auto":
            resolved["batch"]["chunk_size"] = 256
        with open(os.path.join(out, "run_config.json"), "w") as f:
            json.dump(resolved, f)
        # Step times as a compiled run gives them: the first compiles, the second is still slow,
        # the rest run at 4,000 samples/s.
        batch, steps = run["batch"]["global_batch_size"], run["train"]["num_steps"]
        with open(os.path.join(out, "metrics.csv"), "w") as f:
            f.write("step,loss,step_time_s\n")
            for step in range(1, steps + 1):
                f.write(f"{step},1.0,{ {1: 9.0, 2: 2 * batch / 4000}.get(step, batch / 4000)}\n")
        with open(os.path.join(out, "summary.json"), "w") as f:
            kept = {True: 0, "auto": 3}[run["batch"]["grad_cache"]]
            json.dump({"samples_per_s": 4000.0, "peak_mem_mib": 2048.0, "mfu": 0.2512, "num_chunks": 8,
                       "kept_chunks": kept, "hfu": 0.2512 * (3 + (8 - kept) / 8) / 3}, f)
        self.pid = 0

    def wait(self, timeout=None):
        return 0


def test_impl_options_reach_the_run_config_and_the_table(monkeypatch, tmp_path):
    monkeypatch.setattr(launching.subprocess, "Popen", _FakeProc)
    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "2 x Fake GPU", "mem_gib": 80.0})
    engine.main(["--num-gpus", "2", "--no-search", "--throughput-batch", "8192", "--chunk-size", "512",
                 "--impls", "infcl", "infcl+compile+auto", "--set", "model.compile_mode=max-autotune-no-cudagraphs",
                 "--out", str(tmp_path)])
    plain = json.loads((tmp_path / "infcl_tp_8192" / "run.json").read_text())
    both = json.loads((tmp_path / "infcl_compile_auto_tp_8192" / "run.json").read_text())
    assert plain["loss"]["impl"] == "infcl" and plain["batch"]["chunk_size"] == 512
    assert plain["model"] == {"compile_mode": "max-autotune-no-cudagraphs"}
    assert both["loss"]["impl"] == "infcl" and both["batch"]["chunk_size"] == "auto"
    assert both["model"] == {"compile": "blocks", "compile_mode": "max-autotune-no-cudagraphs"}
    table = (tmp_path / "results.md").read_text()
    assert "| infcl | 2 | 8192 | 512 | 0/8 | ok | 2000.0 |  | 25.1% | 33.5% | 2.048 | 2.0 |" in table
    assert "| infcl+compile+auto | 2 | 8192 | 256 | 0/8 | ok | 2000.0 |  | 25.1% | 33.5% | 2.048 | 2.0 |" in table


def test_the_rate_leaves_out_the_warm_up_steps_as_openclips_loop_does(monkeypatch, tmp_path):
    # OpenCLIP's step (bench.openclip_step) times its steps after 2 warm-up steps; ours are timed
    # after --warmup (2 by default) from the trainer's per-step device times, not the run's own
    # rate (every step but the first), and MFU follows the rate.
    monkeypatch.setattr(launching.subprocess, "Popen", _FakeProc)
    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "1 x Fake GPU", "mem_gib": 80.0})
    for warmup, sps, mfu in ((2, "4000.0", "25.1%"), (1, "3000.0", "18.8%"), (0, "215.3", "1.4%")):
        out = tmp_path / f"w{warmup}"
        engine.main(["--num-gpus", "1", "--no-search", "--throughput-batch", "512", "--chunk-size", "512",
                     "--steps", "4", "--warmup", str(warmup), "--impls", "infcl", "--out", str(out)])
        # warm-up 1: 3 steps of (0.256 + 0.128 + 0.128) s; warm-up 0: 4 x 512 in 9.512 s
        table = (out / "results.md").read_text()
        assert f"| infcl | 1 | 512 | 512 | 0/8 | ok | {sps} |  | {mfu} |" in table
        assert f"ours timed over the steps after its first {warmup} of 4 (per-step device times)" in table
    with pytest.raises(SystemExit):
        engine.main(["--steps", "2", "--warmup", "2", "--impls", "infcl", "--out", str(tmp_path / "x")])


def test_grad_cache_auto_by_option_or_set_is_named_in_the_rows(monkeypatch, tmp_path):
    # Issue 37: "+gcauto" and --set batch.grad_cache=auto (the string "auto", not a boolean) both
    # run the hybrid, and its rows say so: the name, the kept chunks, HFU beside MFU.
    monkeypatch.setattr(launching.subprocess, "Popen", _FakeProc)
    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "1 x Fake GPU", "mem_gib": 80.0})
    engine.main(["--num-gpus", "1", "--no-search", "--throughput-batch", "4096", "--chunk-size", "512",
                 "--impls", "infcl+gcauto", "--out", str(tmp_path / "a")])
    engine.main(["--num-gpus", "1", "--no-search", "--throughput-batch", "4096", "--chunk-size", "512",
                 "--impls", "infcl", "--set", "batch.grad_cache=auto", "--out", str(tmp_path / "b")])
    for out, case in ((tmp_path / "a", "infcl_gcauto_tp_4096"), (tmp_path / "b", "infcl_tp_4096")):
        assert json.loads((out / case / "run.json").read_text())["batch"]["grad_cache"] == "auto"
        table = (out / "results.md").read_text()
        assert "| infcl+gcauto | 1 | 4096 | 512 | 3/8 | ok | 4000.0 |  | 25.1% | 30.3% | 1.024 | 2.0 |" in table
        with open(out / "results.csv") as f:
            row = next(csv.DictReader(f))
        assert row["impl"] == "infcl+gcauto" and row["kept"] == "3/8" and float(row["hfu"]) == pytest.approx(0.3035, abs=1e-4)


def test_gpu_selection_follows_cuda_visible_devices(monkeypatch):
    # The deepspeed launcher ignores CUDA_VISIBLE_DEVICES once --num_gpus is given, so the
    # benchmark turns it into --include (two benchmarks side by side on one host).
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launching._gpu_selection(2) == ["--num_gpus", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert launching._gpu_selection(1) == ["--include", "localhost:1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert launching._gpu_selection(2) == ["--include", "localhost:2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(SystemExit, match="names 1 GPU"):
        launching._gpu_selection(2)


def test_decoder_rows_give_tokens_per_gpu(monkeypatch, tmp_path):
    # bench_decoder rows: tokens/s per GPU = samples/s x the task's tokens per example / GPUs.
    monkeypatch.setattr(launching.subprocess, "Popen", _FakeProc)
    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "4 x Fake GPU", "mem_gib": 80.0})
    engine.main(["--num-gpus", "4", "--no-search", "--throughput-batch", "16384", "--chunk-size", "64",
                 "--task", "bench_decoder", "--task-args", '{"arch": "qwen2-7b", "seq_len": 256, "num_negatives": 1}',
                 "--impls", "infcl", "--out", str(tmp_path)])
    row = next(csv.DictReader(open(tmp_path / "results.csv")))
    assert float(row["tokens_per_s_per_gpu"]) == 4000.0 * 768 / 4
    assert "| infcl | 4 | 16384 | 64 | 0/8 | ok | 1000.0 | 768000 | 25.1% |" in (tmp_path / "results.md").read_text()


class _Clock:
    """Records when each fake process ran and on which GPUs (``--include`` for ours, the
    environment's ``CUDA_VISIBLE_DEVICES`` for OpenCLIP's)."""

    def __init__(self):
        import threading

        self.runs, self.lock, self.openclip_warmups = [], threading.Lock(), []

    def popen(self, cmd, env=None, **kwargs):
        import time

        clock = self

        class Proc:
            pid = 0

            def __init__(self):
                if "--config" in cmd:  # ours, through the deepspeed launcher
                    _FakeProc(cmd)
                    self.side, self.gpus = "ours", cmd[cmd.index("--include") + 1]
                else:  # ds_infcl.bench.openclip_step
                    out = cmd[cmd.index("--out") + 1]
                    clock.openclip_warmups.append(cmd[cmd.index("--warmup") + 1])
                    with open(os.path.join(out, "summary.json"), "w") as f:
                        json.dump({"samples_per_s_per_gpu": 3000.0, "step_time_s": 0.17, "peak_mem_gib": 38.8,
                                   "mfu": 0.3}, f)
                    self.side, self.gpus = "openclip", env["CUDA_VISIBLE_DEVICES"]
                self.start = time.time()

            def wait(self, timeout=None):
                time.sleep(0.3)
                with clock.lock:
                    clock.runs.append((self.side, self.gpus, self.start, time.time()))
                return 0

        return Proc()


def test_side_by_side_runs_ours_and_openclip_at_once_on_their_own_gpus(monkeypatch, tmp_path):
    # The comparison ran ours on one GPU while OpenCLIP ran on the other: --side-by-side
    # does that in one command and prints one table (its header names the split).
    clock = _Clock()
    monkeypatch.setattr(launching.subprocess, "Popen", clock.popen)
    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "2 x Fake GPU", "mem_gib": 80.0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    engine.main(["--num-gpus", "1", "--no-search", "--arch", "vit-b-16", "--throughput-batch", "512", "2048",
                 "--chunk-size", "512", "--impls", "infcl+gcauto", "openclip_step", "--openclip-modes", "compile",
                 "--openclip-batches", "512", "--openclip-accum-batches", "2048", "--openclip-accum-micro", "512",
                 "--side-by-side", "--warmup", "3", "--out", str(tmp_path)])
    assert clock.openclip_warmups == ["3", "3"]  # OpenCLIP's step leaves as many steps untimed as ours
    ours = [r for r in clock.runs if r[0] == "ours"]
    theirs = [r for r in clock.runs if r[0] == "openclip"]
    assert len(ours) == 2 and len(theirs) == 2
    assert {r[1] for r in ours} == {"localhost:2"} and {r[1] for r in theirs} == {"3"}
    assert ours[0][2] < theirs[0][3] and theirs[0][2] < ours[0][3]  # the first cases overlapped in time
    table = (tmp_path / "results.md").read_text()
    assert "side by side: ours on GPU(s) 2 while OpenCLIP ran on GPU(s) 3" in table
    assert "| infcl+gcauto | 512 | 4000.0 | openclip_step compiled | 3000.0 | 1.33x |" in table


def test_side_by_side_refuses_too_few_gpus_or_no_peer(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit, match="needs 2 x --num-gpus = 4 GPUs"):
        engine.main(["--num-gpus", "2", "--no-search", "--impls", "infcl", "openclip_step", "--side-by-side",
                     "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        engine.main(["--num-gpus", "1", "--no-search", "--impls", "infcl", "--side-by-side", "--out", str(tmp_path)])
