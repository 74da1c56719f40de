"""A fast path of the ops that cannot be used says so once per process, with the reason
(``ds_infcl.settings.FastPathWarning``): the Gluon kernels on a Hopper GPU whose Triton has no
usable Gluon, and a repeated shape that finds the CUDA-graph cache full. CPU tests: the GPU's
capability and Gluon's availability are patched."""

import types
import warnings

import pytest
import torch

from ds_infcl import settings
from ds_infcl.ops import gluon_lse_kernels, infonce_graph, triton_lse


@pytest.fixture
def fresh(monkeypatch):
    """A process that has warned nothing yet."""
    monkeypatch.setattr(settings, "_WARNED", set())


def _features(dtype=torch.bfloat16):
    """A stand-in for a [128, 64] CUDA tensor (16-byte aligned rows), for ``_use_gluon``."""
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(128, 64),
                                 element_size=lambda: torch.tensor([], dtype=dtype).element_size(),
                                 data_ptr=lambda: 0)


@pytest.fixture
def hopper_without_gluon(monkeypatch, fresh):
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(triton_lse, "_interpreting", lambda: False)
    monkeypatch.setattr(gluon_lse_kernels, "AVAILABLE", False)
    monkeypatch.setattr(gluon_lse_kernels, "UNAVAILABLE_WHY", "ImportError: cannot import name 'gluon'")
    monkeypatch.setattr(triton_lse, "_GLUON_FAILED", {})
    monkeypatch.delenv("DS_INFCL_GLUON", raising=False)
    return capability


def test_gluon_unavailable_on_hopper_says_so_once(hopper_without_gluon):
    q = k = _features()
    with pytest.warns(settings.FastPathWarning) as caught:
        assert triton_lse._use_gluon(q, k, "backward") is False
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("ds_infcl: the Gluon kernels are not used on this Hopper GPU: this Triton (")
    assert "ImportError: cannot import name 'gluon'" in message
    assert message.endswith("the Triton kernels run instead (set DS_INFCL_GLUON=0 to silence)")
    with warnings.catch_warnings():  # once per process: the forward's check and later calls are quiet
        warnings.simplefilter("error")
        assert triton_lse._use_gluon(q, k, "forward") is False
        assert triton_lse._use_gluon(q, k, "backward") is False


@pytest.mark.parametrize("case", ["gluon=0", "not hopper", "float32", "gluon available elsewhere"])
def test_gluon_says_nothing_where_it_would_not_run_anyway(hopper_without_gluon, monkeypatch, case):
    q = k = _features(torch.float32 if case == "float32" else torch.bfloat16)
    if case == "gluon=0":
        monkeypatch.setenv("DS_INFCL_GLUON", "0")
    elif case == "not hopper":
        hopper_without_gluon["value"] = (8, 0)
    elif case == "gluon available elsewhere":
        q = k = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert triton_lse._use_gluon(q, k, "backward") is False


def test_gluon_required_is_still_an_error(hopper_without_gluon, monkeypatch):
    monkeypatch.setenv("DS_INFCL_GLUON", "1")
    with pytest.raises(RuntimeError, match="DS_INFCL_GLUON=1, but the Gluon backward cannot run: this Triton"):
        triton_lse._use_gluon(_features(), _features(), "backward")


def test_a_full_graph_cache_says_so_once(monkeypatch, fresh):
    infonce_graph.clear_graphs()
    monkeypatch.setattr(infonce_graph, "MAX_GRAPHS", 2)
    built = []

    def lookup(shape):
        return infonce_graph._lookup(shape, lambda: built.append(shape) or f"graph {shape}",
                                     lambda: f"the InfoNCE of shape {shape}")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for shape in ("a", "b", "c"):  # first sightings: eager, no graph yet
                assert lookup(shape) is None
            assert lookup("a") == "graph a" and lookup("b") == "graph b"  # second sightings: captured
            assert lookup("a") == "graph a"  # replayed
        with pytest.warns(settings.FastPathWarning) as caught:
            assert lookup("c") is None  # repeats, but the cache is full
        assert len(caught) == 1
        message = str(caught[0].message)
        assert message.startswith("ds_infcl: the InfoNCE of shape c repeats but runs eagerly, not from a CUDA graph: "
                                  "the cache holds its MAX_GRAPHS = 2 graphs already")
        assert "clear_graphs()" in message and "DS_INFCL_CUDA_GRAPH=0" in message
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert lookup("c") is None and lookup("d") is None and lookup("d") is None
        assert built == ["a", "b"]
    finally:
        infonce_graph.clear_graphs()
