"""``bench.engine``'s cases of ours without launching DeepSpeed: the run config each impl spec
writes (``+compile``, ``+auto``, ``--set``), and the row and table built from what the run leaves
(the chunk "auto" chose, samples/s per GPU, MFU)."""

import csv
import json
import os

import pytest

from ds_infcl.bench import engine


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
        with open(os.path.join(out, "summary.json"), "w") as f:
            kept = {True: 0, "auto": 3}[run["batch"]["grad_cache"]]
            json.dump({"samples_per_s": 4000.0, "peak_mem_mib": 2048.0, "mfu": 0.2512, "num_chunks": 8,
                       "kept_chunks": kept, "hfu": 0.2512 * (3 + (8 - kept) / 8) / 3}, f)
        self.pid = 0

    def wait(self, timeout=None):
        return 0


def test_impl_options_reach_the_run_config_and_the_table(monkeypatch, tmp_path):
    monkeypatch.setattr(engine.subprocess, "Popen", _FakeProc)
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


def test_grad_cache_auto_by_option_or_set_is_named_in_the_rows(monkeypatch, tmp_path):
    # Issue 37: "+gcauto" and --set batch.grad_cache=auto (the string "auto", not a boolean) both
    # run the hybrid, and its rows say so: the name, the kept chunks, HFU beside MFU.
    monkeypatch.setattr(engine.subprocess, "Popen", _FakeProc)
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
    assert engine._gpu_selection(2) == ["--num_gpus", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert engine._gpu_selection(1) == ["--include", "localhost:1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert engine._gpu_selection(2) == ["--include", "localhost:2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(SystemExit, match="names 1 GPU"):
        engine._gpu_selection(2)


def test_decoder_rows_give_tokens_per_gpu(monkeypatch, tmp_path):
    # bench_decoder rows: tokens/s per GPU = samples/s x the task's tokens per example / GPUs.
    monkeypatch.setattr(engine.subprocess, "Popen", _FakeProc)
    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "4 x Fake GPU", "mem_gib": 80.0})
    engine.main(["--num-gpus", "4", "--no-search", "--throughput-batch", "16384", "--chunk-size", "64",
                 "--task", "bench_decoder", "--task-args", '{"arch": "qwen2-7b", "seq_len": 256, "num_negatives": 1}',
                 "--impls", "infcl", "--out", str(tmp_path)])
    row = next(csv.DictReader(open(tmp_path / "results.csv")))
    assert float(row["tokens_per_s_per_gpu"]) == 4000.0 * 768 / 4
    assert "| infcl | 4 | 16384 | 64 | 0/8 | ok | 1000.0 | 768000 | 25.1% |" in (tmp_path / "results.md").read_text()
