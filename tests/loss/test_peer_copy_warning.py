"""DS_INFCL_PEER_COPY=1 where the copy-engine transport cannot be set up: the process group's
all-gather carries the keys, and a ``FastPathWarning`` says why, once per process. CPU test: the
transport's set-up and its collectives are patched."""

import warnings

import pytest
import torch

from ds_infcl import settings
from ds_infcl.loss import peer_copy
from ds_infcl.ring import RingLayout
from ds_infcl.ring.groups import PerGroup

LAYOUT = RingLayout(world=2, rank=0, query_sizes=(4, 4), key_sizes=(4, 4), feature_dim=8, send_to=1, recv_from=1)


@pytest.fixture
def wanted(monkeypatch):
    monkeypatch.setattr(settings, "_WARNED", set())
    monkeypatch.setattr(peer_copy, "_TRANSPORTS", PerGroup())
    monkeypatch.setattr(peer_copy, "_wanted", lambda layout, device: True)
    state = {"same_host": True, "others_ok": True}
    monkeypatch.setattr(peer_copy, "_same_host", lambda group, device: state["same_host"])
    monkeypatch.setattr(peer_copy, "_agree", lambda ok, group, device: ok and state["others_ok"])
    return state


class _Transport:
    def __init__(self, group, device, symm):
        pass

    def _fit(self, rows, dtype):
        pass


def _failing(group, device, symm):
    raise RuntimeError("CUDA driver: symmetric memory is not supported on this device")


@pytest.mark.parametrize("case, reason", [
    ("fails here", "symmetric memory failed on this rank (RuntimeError: CUDA driver: symmetric memory is not "
                   "supported on this device)"),
    ("fails on another rank", "another rank of the group could not set up symmetric memory"),
    ("other hosts", "the ranks of the group are not all on one host"),
])
def test_an_unusable_transport_says_why_once(wanted, monkeypatch, case, reason):
    monkeypatch.setattr(peer_copy, "PeerKeys", _failing if case == "fails here" else _Transport)
    wanted["others_ok"] = case != "fails on another rank"
    wanted["same_host"] = case != "other hosts"
    group, cpu = object(), torch.device("cpu")
    with pytest.warns(settings.FastPathWarning) as caught:
        assert peer_copy.peer_keys(group, LAYOUT, cpu) is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("ds_infcl: DS_INFCL_PEER_COPY=1, but the copy-engine transport of the gather "
                              f"path's keys cannot be used: {reason}")
    assert message.endswith("the process group's all-gather carries the keys instead (set DS_INFCL_PEER_COPY=0 "
                            "to silence)")
    with warnings.catch_warnings():  # once per process: the group's later calls, another group
        warnings.simplefilter("error")
        assert peer_copy.peer_keys(group, LAYOUT, cpu) is None
        assert peer_copy.peer_keys(object(), LAYOUT, cpu) is None


def test_a_transport_that_sets_up_says_nothing(wanted, monkeypatch):
    monkeypatch.setattr(peer_copy, "PeerKeys", _Transport)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(peer_copy.peer_keys(object(), LAYOUT, torch.device("cpu")), _Transport)
