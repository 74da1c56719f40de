"""CPU side of ``ds_infcl.ops.infonce_graph``: the setting is checked at import, and nothing is
graphed off CUDA (the replays themselves: tests/gpu/test_infonce_graph_gpu.py)."""

import os
import subprocess
import sys

import torch

from ds_infcl.loss import contrastive_loss
from ds_infcl.ops import infonce_graph as ig


def _import_error(**env):
    r = subprocess.run([sys.executable, "-c", "import ds_infcl.ops.infonce_graph"], env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    return r.stderr


def test_bad_settings_stop_the_import():
    assert "DS_INFCL_CUDA_GRAPH must be auto, 1 or 0, got 'yes'" in _import_error(DS_INFCL_CUDA_GRAPH="yes")
    assert ("DS_INFCL_CUDA_GRAPH_MAX_LOGITS must be a positive integer, got '8k'"
            in _import_error(DS_INFCL_CUDA_GRAPH_MAX_LOGITS="8k"))
    assert ("DS_INFCL_CUDA_GRAPH_GATHER_MAX_LOGITS must be a positive integer, got '0'"
            in _import_error(DS_INFCL_CUDA_GRAPH_GATHER_MAX_LOGITS="0"))


def test_cpu_calls_are_never_graphed(monkeypatch):
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "1")
    q = torch.randn(8, 16, requires_grad=True)
    k = torch.randn(8, 16, requires_grad=True)
    for _ in range(3):
        contrastive_loss(q, k, 5.0, symmetric=True).backward()
    assert not ig._GRAPHS and not ig._SEEN
