"""The retrieval benchmark (``ds_infcl.bench.retrieval``): importing it changes no environment
variable, and its CPU smoke run on a tiny model measures all three losses, whose values agree
(Inf-CL's exact loss against sentence-transformers' CachedMNRL and MNRL on the same batch)."""

import csv
import os
import subprocess
import sys

import pytest

from tests.adapters.test_retrieval_common import make_tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_sets_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["PYTHONPATH"] = ROOT
    code = ("import os; before = dict(os.environ); import ds_infcl.bench.retrieval; "
            "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cpu_smoke_run_measures_every_loss(tmp_path, monkeypatch):
    from ds_infcl.bench import retrieval

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model = make_tiny_model_dir(str(tmp_path / "model"))
    out = tmp_path / "rows.csv"
    common = ["--device", "cpu", "--dtype", "fp32", "--model-path", model, "--mini-batch-size", "5",
              "--query-tokens", "6", "--doc-tokens", "9", "--steps", "1", "--warmup", "0", "--out", str(out)]
    # One loss per run, so that each starts from the model on disk (a run's optimizer steps move
    # the model the next configuration of the same run measures); the rows are appended.
    for flag in ("--batches", "--baseline-batches", "--mnrl-batches"):
        sizes = {f: ["12"] if f == flag else [] for f in ("--batches", "--baseline-batches", "--mnrl-batches")}
        retrieval.main(common + [x for f, v in sizes.items() for x in [f] + v])
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # main set it (the model is read from disk only)
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["loss"], r["global_batch"], r["status"], r["device"]) for r in rows] == [
        ("infcl", "12", "ok", "cpu"), ("cached_mnrl", "12", "ok", "cpu"), ("mnrl", "12", "ok", "cpu")]
    values = [float(r["loss_value"]) for r in rows]
    # Same generated batch and model for each loss; the CSV rounds to 5 decimals.
    assert values[1] == pytest.approx(values[0], abs=2e-5) and values[2] == pytest.approx(values[0], abs=2e-5)
