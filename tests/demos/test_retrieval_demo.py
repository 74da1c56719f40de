"""The chatterbot demo end to end on the tiny random model (the real one runs from the README)."""

import json
import os

import pytest
import torch

from tests.adapters.test_retrieval_common import make_tiny_model_dir


def test_demo_pipeline_on_tiny_model(tmp_path):
    from ds_infcl.adapters.retrieval import positive_id_matrix
    from ds_infcl.demos.retrieval import run_demo

    out = str(tmp_path / "demo")
    result = run_demo(out, model_path=make_tiny_model_dir(str(tmp_path / "tiny")), steps=1, chunk_size=256,
                      max_seq_length=16, log=lambda *_: None)
    assert result["global_batch_size"] > 500 and result["corpus_size"] > 500
    assert result["before"] != result["after"]  # the weights moved
    for key, value in result["after"].items():  # the saved folder reproduces the metrics
        assert result["reloaded"][key] == pytest.approx(value, abs=1e-3), key
    saved = json.load(open(os.path.join(out, "demo_metrics.json")))
    assert saved["global_batch_size"] == result["global_batch_size"]
    assert "global batch" in open(os.path.join(out, "README.md")).read().lower()

    ids = positive_id_matrix([["a", "b"], ["c"]])
    assert ids.shape == (2, 2) and ids[1, 0] == ids[1, 1] and ids[0, 0] != ids[0, 1]
