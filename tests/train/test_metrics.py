"""Metrics outputs on rank 0: CSV, TensorBoard event files (read back with TensorBoard's own
reader), DeepSpeed's monitors, and what a resume leaves in them."""

import csv

import pytest

from ds_infcl.train.metrics import MetricsLogger, format_metrics


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _row(step):
    return {"step": step, "loss": 10.0 - step, "logit_scale": 2.6, "scale": 13.5, "samples_per_s": 10.0}


def test_tensorboard_events_and_csv(tmp_path):
    log = MetricsLogger(str(tmp_path), enabled=True, progress_bar=False)
    log.log_train({"step": 1, "loss": 2.0, "logit_scale": 2.6, "samples_per_s": 10.0})
    log.log_eval(1, {"recall": 0.5})
    log.close()
    tb = _scalars(tmp_path)
    assert tb["train/loss"] == [(1, 2.0)] and tb["eval/recall"] == [(1, 0.5)]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1].startswith("1,2.0,2.6")


def test_resume_keeps_each_step_once(tmp_path):
    # A run logs steps 1-6, its last checkpoint is at step 4, it is resumed there and logs 5-8:
    # the CSV and the TensorBoard events read as one uninterrupted run (issue 13, item 11).
    first = MetricsLogger(str(tmp_path), enabled=True, progress_bar=False)
    for step in range(1, 7):
        first.log_train(_row(step))
    first.close()
    resumed = MetricsLogger(str(tmp_path), enabled=True, progress_bar=False, start_step=4)
    for step in range(5, 9):
        resumed.log_train({**_row(step), "loss": 100.0 + step})
    resumed.close()
    tb = _scalars(tmp_path)["train/loss"]
    assert [s for s, _ in tb] == list(range(1, 9))
    assert dict(tb)[5] == 105.0 and dict(tb)[4] == 6.0
    with open(tmp_path / "metrics.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(1, 9))


class _Monitor:
    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events.extend(events)


def test_deepspeed_monitor_receives_the_same_scalars(tmp_path):
    mon = _Monitor()
    log = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False, progress_bar=False, monitor=mon)
    log.log_train(_row(3))
    log.log_eval(3, {"recall": 0.25})
    log.close()
    assert ("Train/loss", 7.0, 3) in mon.events and ("Eval/recall", 0.25, 3) in mon.events
    # other ranks, or a monitor DeepSpeed left disabled, get nothing
    off = _Monitor()
    off.enabled = False
    MetricsLogger(str(tmp_path / "r1"), enabled=False, monitor=mon).log_train(_row(4))
    MetricsLogger(str(tmp_path / "r2"), enabled=True, tensorboard=False, progress_bar=False, monitor=off).log_train(_row(4))
    assert all(step == 3 for _, _, step in mon.events) and off.events == []


def test_format_metrics_counts_are_integers():
    assert format_metrics({"num_images": 359.0, "top1": 0.5}) == "num_images=359, top1=0.5000"


def test_integer_counts_read_the_same_in_the_log_the_csv_and_the_summary(tmp_path, capsys):
    """A task's counts (``malformed_records``, ``bad_samples``) are integers: they used to print
    as ``malformed_records=1.0000`` in the log and ``1.0`` in summary.json."""
    import json

    metrics = {"malformed_records": 1, "bad_samples": 3, "recall@1": 0.25}
    assert format_metrics(metrics) == "bad_samples=3, malformed_records=1, recall@1=0.2500"
    log = MetricsLogger(str(tmp_path), enabled=True, progress_bar=False, tensorboard=False)
    log.log_eval(2, metrics)
    log.close()
    rows = list(csv.DictReader(open(tmp_path / "eval.csv")))
    assert rows == [{"step": "2", "bad_samples": "3", "malformed_records": "1", "recall@1": "0.25"}]
    assert json.loads(json.dumps(metrics)) == {"malformed_records": 1, "bad_samples": 3, "recall@1": 0.25}
    assert format_metrics({"flag": True}) == "flag=1.0000"  # a bool is not a count


def test_a_run_honours_deepspeeds_csv_monitor(tmp_path):
    # The DeepSpeed JSON's csv_monitor block, as a user sets it: DeepSpeed's own lr events and the
    # run's scalars (Train/loss per optimizer step) land in its folder.
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = {
        "task": {"name": "synthetic", "args": {"input_dim": 16, "embed_dim": 8}},
        "batch": {"global_batch_size": 16},
        "train": {"num_steps": 3},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "eval": {"at_end": False},
        "checkpoint": {"at_end": False, "export_final": False},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    monitor = 'csv_monitor={"enabled": true, "output_path": "%s", "job_name": "job"}' % (tmp_path / "mon")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", os.path.join(root, "ds_configs", "zero2_fp32.json"),
         "--config", str(tmp_path / "run.json"), "--ds-set", monitor],
        capture_output=True, text=True, timeout=300, env=env, cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    job = tmp_path / "mon" / "job"
    with open(job / "Train_loss.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        ours = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [float(r["loss"]) for r in rows] == [float(r["loss"]) for r in ours]
    assert (job / "Train_Samples_lr.csv").is_file()  # DeepSpeed's own event


def test_model_flops_and_mfu_are_logged(tmp_path):
    # Issue 16: model FLOPs utilization beside samples/s, per step and in the summary. The
    # synthetic towers are two MLPs 16 -> 64 -> 8: one example's forward is 2 * (16*64 + 64*8)
    # FLOPs per tower, its training 3x that. (The count restores the RNG: the resume tests, whose
    # resumed run counts at another step than the uninterrupted one, would see any drift.)
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = {
        "task": {"name": "synthetic", "args": {"input_dim": 16, "embed_dim": 8, "dropout": 0.1}},
        "batch": {"global_batch_size": 16},
        "train": {"num_steps": 3},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False, "peak_tflops": 0.5},
        "eval": {"at_end": False},
        "checkpoint": {"at_end": False, "export_final": False},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=root)
    cmd = [sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", os.path.join(root, "ds_configs", "zero2_fp32.json"),
           "--config", str(tmp_path / "run.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model_flops_per_sample"] == 3 * 2 * 2 * (16 * 64 + 64 * 8)
    assert summary["model_tflops_per_gpu"] == pytest.approx(
        summary["model_flops_per_sample"] * summary["samples_per_s"] / 1e12)
    assert summary["mfu"] == pytest.approx(summary["model_tflops_per_gpu"] / 0.5)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(float(r["mfu"]) == pytest.approx(float(r["model_tflops_per_gpu"]) / 0.5) for r in rows)
    assert "MFU" in proc.stdout and "HFU" in proc.stdout
    # Issue 37: the plain step replays nothing, so its hardware FLOPs are its model FLOPs.
    assert summary["hfu"] == pytest.approx(summary["mfu"]) and summary["replayed_fraction"] == 0.0
    assert all(float(r["hfu"]) == pytest.approx(float(r["mfu"])) for r in rows)
    # The hybrid of grad_cache "auto" with 1 of 4 chunks kept replays 3/4 of the batch's forward:
    # HFU = MFU x (3 + 3/4) / 3 (GradCache, all 4 replayed: x 4/3).
    cfg["batch"].update(grad_cache="auto", chunk_size=4, keep_chunks=1)
    cfg["output_dir"] = str(tmp_path / "hybrid")
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "batch.grad_cache auto: 1 of 4 chunks per step keep their graph, 3 replayed (batch.keep_chunks)" in proc.stdout
    hybrid = json.loads((tmp_path / "hybrid" / "summary.json").read_text())
    assert hybrid["kept_chunks"] == 1 and hybrid["replayed_fraction"] == 0.75
    assert hybrid["hfu"] == pytest.approx(hybrid["mfu"] * 3.75 / 3)
    with open(tmp_path / "hybrid" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(float(r["hfu"]) == pytest.approx(float(r["mfu"]) * 3.75 / 3) for r in rows)
    assert [r["kept_chunks"] for r in rows] == ["1", "1", "1"]
    del cfg["batch"]["grad_cache"], cfg["batch"]["chunk_size"], cfg["batch"]["keep_chunks"]
    # Without a known peak (CPU) the MFU column stays empty.
    cfg["logging"]["peak_tflops"] = None
    cfg["output_dir"] = str(tmp_path / "run2")
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert again["mfu"] is None and again["losses"] == summary["losses"]
