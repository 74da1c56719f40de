"""``model.compile``: blocks compiled in place give eager's features and gradients, keep their
parameter names, replay dropout under GradCache, and train to the same losses in the trainer.

Inductor compiles CPU kernels with a C++ compiler: without one these tests skip, saying so."""

import copy
import json
import os
import shutil
import types

import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.loss import ContrastiveLoss
from ds_infcl.tasks.base import Batch
from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.model import ContrastiveModel, compile_blocks, compile_encoders, compile_towers, find_blocks
from ds_infcl.train.steps import grad_cache_step
from tests.train import harness
from tests.train.blocks_task import BlockTowers
from tests.train.test_steps import FakeEngine

_CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
needs_cxx = pytest.mark.skipif(not _CXX, reason="torch.compile on CPU (inductor) needs a C++ compiler (g++/clang++); none found")


def _towers(dropout=0.0, seed=0):
    # the shapes of BlocksTask's towers in the trainer test, chunk 16: its graphs come from the cache
    torch.manual_seed(seed)
    return BlockTowers(input_dim=32, width=32, embed_dim=16, num_blocks=2, dropout=dropout)


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_find_blocks_outermost_lists_only():
    towers = _towers()
    towers.query_tower.blocks[0].inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # inside a block
    names = [n for n, _ in find_blocks(towers)]
    assert names == ["query_tower.blocks.0", "query_tower.blocks.1", "key_tower.blocks.0", "key_tower.blocks.1"]
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_compile_towers_errors_and_no_op():
    off = types.SimpleNamespace(compile=False, compile_mode="default")
    on = types.SimpleNamespace(compile="blocks", compile_mode="default")
    towers = _towers()
    assert compile_towers(towers, off, 3) is towers
    assert all(b._compiled_call_impl is None for _, b in find_blocks(towers))
    with pytest.raises(ConfigError, match=r"model.compile: not supported with ZeRO stage 3"):
        compile_towers(towers, on, 3)
    with pytest.raises(ConfigError, match=r"no nn.ModuleList of blocks to compile"):
        compile_towers(torch.nn.Sequential(torch.nn.Linear(2, 2)), on, 2)
    # "towers": the two encode methods, on this instance only, once; the blocks stay as they are.
    whole = types.SimpleNamespace(compile="towers", compile_mode="default")
    lines = []
    assert compile_towers(towers, whole, 2, log=lines.append) is towers
    assert "encode_query" in vars(towers) and "encode_key" in vars(towers)
    assert all(b._compiled_call_impl is None for _, b in find_blocks(towers))
    assert "encode_query" not in vars(_towers())
    assert lines == ["model.compile: towers compiled whole (torch.compile dynamic=False, mode 'default'): "
                     "BlockTowers.encode_query, .encode_key; the first step includes the compilation"]
    compiled_query = towers.encode_query
    assert compile_encoders(towers) == [] and towers.encode_query is compiled_query  # not wrapped twice
    with pytest.raises(ConfigError, match=r"model.compile: not supported with ZeRO stage 3"):
        compile_towers(_towers(), whole, 3)


def test_compile_refuses_liger_patched_towers_at_load_and_at_build():
    # Liger 0.8.5's kernels inside compiled blocks crashed an H200 (illegal memory access,
    # 2026-11-28): refused before anything is built (the task's liger arg, what --check runs) and
    # when the towers carry apply_liger's mark (any task that patched them).
    from ds_infcl.adapters.decoder_step import LIGER_MARK
    from ds_infcl.train.preflight import check_compile

    on = types.SimpleNamespace(compile="blocks", compile_mode="default")
    off = types.SimpleNamespace(compile=False, compile_mode="default")
    with pytest.raises(ConfigError, match=r"model.compile with the task's liger: true: .*Set one of them false"):
        check_compile(on, 2, "cpu", {"arch": "qwen2-1.5b", "liger": True})
    check_compile(off, 2, "cpu", {"liger": True})
    towers = _towers()
    setattr(towers.key_tower.blocks[1], LIGER_MARK, ["rms_norm"])
    with pytest.raises(ConfigError, match=r"liger: true"):
        compile_towers(towers, on, 2)
    assert all(b._compiled_call_impl is None for _, b in find_blocks(towers))  # refused before compiling
    assert compile_towers(towers, off, 2) is towers


def test_config_keys():
    base = {"batch": {"global_batch_size": 8}, "train": {"num_steps": 1}}
    for value in (False, True, "blocks", "towers"):
        assert run_config_from_dict({**base, "model": {"compile": value}}).model.compile == value
    with pytest.raises(ConfigError, match=r"model.compile: 'model' is not allowed"):
        run_config_from_dict({**base, "model": {"compile": "model"}})
    with pytest.raises(ConfigError, match=r"model.compile_mode: 'fast' is not allowed"):
        run_config_from_dict({**base, "model": {"compile_mode": "fast"}})
    # The CUDA-graph modes failed at step 1 on a GPU (per-block graphs overwrite outputs still in
    # use): refused when the config is read, naming the modes that work.
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ConfigError, match=rf"model.compile_mode: '{mode}' captures .* Use 'default' or "
                                              r"'max-autotune-no-cudagraphs'"):
            run_config_from_dict({**base, "model": {"compile": "blocks", "compile_mode": mode}})
    for mode in ("default", "max-autotune-no-cudagraphs"):
        assert run_config_from_dict({**base, "model": {"compile_mode": mode}}).model.compile_mode == mode


def _compile(towers, setting):
    names = compile_blocks(towers) if setting == "blocks" else compile_encoders(towers)
    assert names == (["query_tower.blocks.0", "query_tower.blocks.1", "key_tower.blocks.0", "key_tower.blocks.1"]
                     if setting == "blocks" else ["encode_query", "encode_key"])


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("setting", ["blocks", "towers"])
def test_compiled_towers_match_eager_and_replay_dropout(setting):
    eager = _towers()
    compiled = copy.deepcopy(eager)
    keys = list(compiled.state_dict())
    graphs = _unique_graphs()
    _compile(compiled, setting)
    assert list(compiled.state_dict()) == keys  # checkpoints keep their keys
    x = torch.randn(16, 32)
    out = {}
    for name, towers in (("eager", eager), ("compiled", compiled)):
        with torch.no_grad():
            q0 = towers.encode_query(x)
        q, k = towers.encode_query(x), towers.encode_key(x.flip(0))
        (q * torch.linspace(-1, 1, 16)).sum().add((k ** 2).sum()).backward()
        torch.testing.assert_close(q0, q.detach())  # pass 1 (no gradients) and pass 3 agree
        out[name] = (q.detach(), k.detach(), {n: p.grad.clone() for n, p in towers.named_parameters()})
    assert _unique_graphs() > graphs  # compiled for real, not a silent eager fallback
    torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["compiled"][1], out["eager"][1], rtol=1e-5, atol=1e-6)
    for n, g in out["eager"][2].items():
        torch.testing.assert_close(out["compiled"][2][n], g, rtol=1e-4, atol=1e-6, msg=n)

    # Evaluation (the "encode_query"/"encode_key" modes) runs the blocks eagerly: a new batch
    # shape compiles nothing and gives eager's features.
    graphs = _unique_graphs()
    wrapped = ContrastiveModel(compiled, ContrastiveLoss(symmetric=True, impl="infcl"))
    with torch.no_grad():
        feats = wrapped("encode_key", None, x[:5])
        torch.testing.assert_close(feats, eager.encode_key(x[:5]), rtol=1e-5, atol=1e-6)
    assert _unique_graphs() == graphs

    # Dropout inside compiled blocks: a restored RNG state gives the same masks with and without
    # gradients (GradCache's pass 1 vs pass 3), so the replay check of a GradCache step passes.
    towers = _towers(dropout=0.3)
    _compile(towers, setting)
    model = ContrastiveModel(towers, ContrastiveLoss(symmetric=True, impl="infcl"))
    batch = Batch(query_inputs=torch.randn(32, 32), key_inputs=torch.randn(32, 32), sample_index=torch.arange(32))
    state = torch.get_rng_state()
    with torch.no_grad():
        q1 = model.encode_query(batch.query_inputs[:16])
    torch.set_rng_state(state)
    q3 = model.encode_query(batch.query_inputs[:16])
    assert torch.equal(q1, q3.detach())
    assert not torch.equal(q1, model.encode_query(batch.query_inputs[:16]).detach())  # fresh masks differ
    engine = FakeEngine(model, gas=2)
    grad_cache_step(engine, batch, 16, torch.device("cpu"), verify_replay=True)  # raises on a mismatch
    assert engine.step_grads is not None


@pytest.mark.slow
@needs_cxx
def test_trainer_compiled_equals_eager_and_auto_chunk(tmp_path):
    """One process, ZeRO-2 fp32: eager, compiled blocks, whole compiled towers and chunk "auto"
    (eager: its chunks would each compile new shapes) train to the same losses; "auto" writes its choice into the run config."""
    common = harness.COMMON + ["task.name=tests.train.blocks_task:BlocksTask", "batch.grad_cache=true",
                               "batch.global_batch_size=128"]
    jobs = [
        harness.job("eager", "zero2_fp32.json", harness.SGD, common + ["batch.chunk_size=16"]),
        harness.job("compiled", "zero2_fp32.json", harness.SGD, common + ["batch.chunk_size=16", "model.compile=true"]),
        harness.job("towers", "zero2_fp32.json", harness.SGD, common + ["batch.chunk_size=16", "model.compile=towers"]),
        harness.job("auto", "zero2_fp32.json", harness.SGD, common + ["batch.chunk_size=auto"]),
    ]
    harness.run_jobs(harness.write_jobs(tmp_path, jobs), 1)
    summaries = {j["name"]: json.loads((tmp_path / j["name"] / "summary.json").read_text()) for j in jobs}
    log = (tmp_path / "jobs.log").read_text()
    assert "model.compile: 4 blocks compiled" in log and "batch.chunk_size auto -> " in log
    chosen = json.loads((tmp_path / "auto" / "run_config.json").read_text())["batch"]["chunk_size"]
    assert chosen in (64, 128)  # the candidates probed for a local batch of 128 (from 64 up)
    assert "batch.chunk_size auto: chunk 64:" in log and "batch.chunk_size auto: chunk 128:" in log
    # The blocks really run compiled in the trainer: the no-grad pass and the chunk with gradients
    # each give a graph. (The FLOP count's dispatch mode once made dynamo skip the blocks for good,
    # so the "compiled" run was eager with the same losses.)
    for name in ("compiled", "towers"):
        graphs = json.loads((tmp_path / name / "dynamo.json").read_text())["unique_graphs"]
        assert graphs >= 2, (name, graphs)
    assert "model.compile: towers compiled whole" in log
    assert json.loads((tmp_path / "eager" / "dynamo.json").read_text())["unique_graphs"] == 0
    for name in ("compiled", "towers", "auto"):
        assert summaries[name]["losses"] == pytest.approx(summaries["eager"]["losses"], rel=1e-5, abs=1e-6), name
        eager = torch.load(tmp_path / "eager" / "params.pt")
        other = torch.load(tmp_path / name / "params.pt")
        assert set(other) == set(eager)
        for k, v in eager.items():
            torch.testing.assert_close(other[k], v, rtol=1e-4, atol=1e-5, msg=f"{name}: {k}")
