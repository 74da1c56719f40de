"""Checkpoint files without a process group: the RNG file loads with ``weights_only=True`` (no code
runs from a file a run reads) and restores every stream; ``resolve_resume`` follows only complete
checkpoints (the completion record is written last) and still reads an older layout."""

import json
import random

import numpy as np
import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.train.checkpoint import RECORD, check_world_size, resolve_resume, rng_state, set_rng


def test_rng_file_loads_with_weights_only_and_restores_every_stream(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # a cached Gaussian in NumPy's state
    path = tmp_path / "rng.pt"
    torch.save(rng_state(torch.device("cpu")), path)
    expected = (random.random(), float(np.random.randn()), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng(torch.load(path, weights_only=True), torch.device("cpu"))
    got = (random.random(), float(np.random.randn()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def _tag(d, step, complete=True, **record):
    tag = d / f"step{step:08d}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    if complete:
        (tag / RECORD).write_text(json.dumps({"tag": tag.name, "step": step, **record}))
    return tag


def test_resume_follows_complete_checkpoints_only(tmp_path):
    d = tmp_path / "ckpt"
    _tag(d, 4)
    half = _tag(d, 8, complete=False)
    (d / "latest").write_text("step00000004")
    assert resolve_resume("auto", str(d)) == (str(d), "step00000004")
    # A pointer to a tag without its record (a rewrite cut short): the newest complete one.
    (d / "latest").write_text("step00000008")
    assert resolve_resume("auto", str(d)) == (str(d), "step00000004")
    with pytest.raises(ConfigError, match="was not completed"):
        resolve_resume(str(half), str(d))
    assert resolve_resume("auto", str(tmp_path / "none")) is None


def test_resume_reads_checkpoints_of_an_older_version(tmp_path):
    d = tmp_path / "old"
    _tag(d, 4, complete=False)
    (d / "latest").write_text("step00000004")
    assert resolve_resume("auto", str(d)) == (str(d), "step00000004")
    assert resolve_resume(str(d / "step00000004"), str(d)) == (str(d), "step00000004")


def test_world_size_and_batch_checked_before_loading(tmp_path):
    d = tmp_path / "ckpt"
    _tag(d, 4, world_size=2, zero_stage=2, global_batch_size=64)
    check_world_size(str(d), "step00000004", 2, 2, 64)
    with pytest.raises(ConfigError, match="written by 2 ranks under ZeRO stage 2"):
        check_world_size(str(d), "step00000004", 4, 2, 64)
    with pytest.raises(ConfigError, match="set batch.global_batch_size=64"):
        check_world_size(str(d), "step00000004", 2, 2, 128)
    _tag(d, 8, world_size=2, zero_stage=0, global_batch_size=64)
    check_world_size(str(d), "step00000008", 1, 0, 64)  # nothing sharded: another world size is fine
