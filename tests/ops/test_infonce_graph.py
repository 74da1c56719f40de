"""CPU side of ``ds_infcl.ops.infonce_graph``: the setting is checked at import, and nothing is
graphed off CUDA (the replays themselves: tests/gpu/test_infonce_graph_gpu.py)."""

import os
import subprocess
import sys
import weakref

import pytest
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


class _Graph:
    """A stand-in for a kept ``GraphedCall``'s bookkeeping (``changing`` is the real method):
    ``out`` plays its output buffers, which a replay overwrites."""

    def __init__(self):
        self.before_change, self.version = [], 0
        self.out = (torch.arange(4.0), torch.arange(3.0))

    def replay(self, value):
        ig.GraphedCall.changing(self)
        for t in self.out:
            t.fill_(value)

    def token(self):
        return (self, self.version, ())


def test_borrowed_outputs_are_copied_only_before_they_are_overwritten():
    g = _Graph()
    first = ig.Borrowed(g.token(), g.out)  # e.g. a forward's LSE vectors, read by its backward
    assert first.tensors[0] is g.out[0]  # no copy yet
    g.replay(7.0)  # another call of the graph comes first: the first call's values were copied
    assert first.tensors[0] is not g.out[0]
    assert torch.equal(first.tensors[0], torch.arange(4.0)) and torch.equal(first.tensors[1], torch.arange(3.0))
    second = ig.Borrowed(g.token(), g.out, needed=weakref.ref(torch.empty(0)))  # its backward ran: never copied
    g.replay(8.0)
    assert second.tensors[0] is g.out[0] and not g.before_change
    g.replay(9.0)  # a copy only once
    assert torch.equal(first.tensors[0], torch.arange(4.0))
    # needed: the weak reference of a tensor the backward saves (dead once autograd frees it)
    marker = torch.empty(0)
    kept = ig.Borrowed(g.token(), g.out, needed=weakref.ref(marker))
    dropped = ig.Borrowed(g.token(), g.out, needed=weakref.ref(torch.empty(0)))
    g.replay(10.0)
    assert torch.equal(kept.tensors[0], torch.full((4,), 9.0)) and kept.tensors[0] is not g.out[0]
    assert dropped.tensors[0] is g.out[0]  # nobody needed them any more: not copied
    del marker
    eager = ig.Borrowed(None, (torch.ones(2), None))  # eager outputs: held as they are
    assert eager.tensors[1] is None and torch.equal(eager.tensors[0], torch.ones(2))
    with pytest.raises(RuntimeError, match="overwritten before they were borrowed"):
        ig.Borrowed((g, g.version - 1, ()), g.out)  # a stale token
