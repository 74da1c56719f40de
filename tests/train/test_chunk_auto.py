"""``batch.chunk_size: "auto"``: the candidates, the probe's walk over them under a memory budget,
the choice shared by all ranks, the engine-memory estimate, and the probe on CPU with a real task."""

import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.train.chunk_auto import (
    ChunkTiming,
    candidate_chunks,
    choose_chunk,
    engine_extra_bytes,
    probe_chunks,
    resolve_auto_chunk,
    run_dtype,
)
from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.ds_config import resolve_deepspeed_config


def _cfg(**batch):
    return run_config_from_dict({"batch": {"global_batch_size": 64, "grad_cache": True, "chunk_size": "auto", **batch},
                                 "train": {"num_steps": 1}, "logging": {"tensorboard": False}})


def test_candidates():
    assert candidate_chunks(16384) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert candidate_chunks(24) == [1, 2, 4, 8, 24]  # the whole local batch as one chunk too
    assert candidate_chunks(3000) == [1, 2, 4, 8]  # 3000 = 8 x 375: powers of two that divide it
    assert candidate_chunks(1) == [1]
    with pytest.raises(ValueError, match="local_batch must be >= 1"):
        candidate_chunks(0)


def _fake_measure(limit, speed, calls):
    """Chunks above ``limit`` run out of memory; peak memory = chunk (bytes)."""
    def measure(c):
        calls.append(c)
        return ChunkTiming(c, samples_per_s=speed(c), peak_bytes=c, oom=c > limit)
    return measure


def test_probe_walks_up_until_a_chunk_does_not_fit():
    calls = []
    out = probe_chunks(candidate_chunks(4096), _fake_measure(10**9, lambda c: c, calls), lambda t: t.peak_bytes <= 512)
    assert calls == [64, 128, 256, 512, 1024]  # from 64 up, stops at the first that does not fit
    assert [t.fits for t in out] == [True, True, True, True, False]
    calls.clear()
    out = probe_chunks(candidate_chunks(4096), _fake_measure(256, lambda c: c, calls), lambda t: True)
    assert calls == [64, 128, 256, 512] and out[-1].oom and not out[-1].fits


def test_probe_walks_down_when_the_first_does_not_fit():
    calls = []
    out = probe_chunks(candidate_chunks(4096), _fake_measure(16, lambda c: c, calls), lambda t: True)
    assert calls == [64, 32, 16]
    assert choose_chunk([out]) == 16
    calls.clear()
    probe_chunks(candidate_chunks(24), _fake_measure(10**9, lambda c: c, calls), lambda t: True)
    assert calls == [24]  # nothing at or above 64: start at the largest


def test_choose_fastest_on_every_rank_preferring_larger_within_tolerance():
    r0 = [ChunkTiming(64, 100.0, fits=True), ChunkTiming(128, 200.0, fits=True), ChunkTiming(256, 205.0, fits=True),
          ChunkTiming(512, 300.0, fits=False)]
    assert choose_chunk([r0]) == 256  # 512 does not fit; 256 is the fastest
    r0[2].samples_per_s = 195.0
    assert choose_chunk([r0]) == 256  # within 3% of the fastest (200): the larger chunk
    r0[2].samples_per_s = 150.0
    assert choose_chunk([r0]) == 128
    r1 = [ChunkTiming(64, 100.0, fits=True), ChunkTiming(128, 50.0, fits=True)]  # a slow rank, 256 not probed
    assert choose_chunk([r0, r1]) == 64  # the slowest rank decides; only chunks every rank probed
    r1[0].fits = r1[1].fits = False
    assert choose_chunk([r0, r1]) is None


def test_engine_estimate_and_dtype():
    zero2 = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}, "bf16": {"enabled": True}}
    assert run_dtype(zero2) == torch.bfloat16 and run_dtype({"fp16": {"enabled": True}}) == torch.float16
    assert run_dtype({"bf16": {"enabled": False}}) == torch.float32
    # features 100 x 2 rows x 8 dims x (2 + 12) bytes, optimizer 1000 params x 16 / 4 ranks, bucket 1000 x 2
    assert engine_extra_bytes(1000, 100, 2, 8, torch.bfloat16, zero2, 4) == 100 * 2 * 8 * 14 + 4000 + 2000
    assert engine_extra_bytes(1000, 100, 2, 8, torch.float32, {}, 4) == 100 * 2 * 8 * 16 + 8000


def test_config_keys_and_check_path():
    assert _cfg().batch.chunk_size == "auto" and _cfg(memory_budget_gib=40).batch.memory_budget_gib == 40.0
    with pytest.raises(ConfigError, match=r"batch.chunk_size: 'big' is not allowed; give an integer >= 1 or \"auto\""):
        _cfg(chunk_size="big")
    with pytest.raises(ConfigError, match=r"batch.memory_budget_gib: only used with batch.chunk_size \"auto\""):
        _cfg(chunk_size=8, memory_budget_gib=10)
    with pytest.raises(ConfigError, match=r"batch.memory_budget_gib: must be > 0"):
        _cfg(memory_budget_gib=0)
    # --check (no probe): the largest chunk "auto" could pick
    ds, layout = resolve_deepspeed_config(_cfg(), {}, 2)
    assert layout.micro_batch_size == 32 and ds["gradient_accumulation_steps"] == 1


def test_resolve_on_cpu_with_the_synthetic_task():
    cfg = run_config_from_dict({"batch": {"global_batch_size": 256, "grad_cache": True, "chunk_size": "auto"},
                                "task": {"name": "synthetic", "args": {"dropout": 0.1}},
                                "train": {"num_steps": 1}, "logging": {"tensorboard": False}})
    lines, gathered = [], []

    def gather(mine):
        gathered.append(mine)
        return [mine]

    out = resolve_auto_chunk(cfg, {}, 2, 0, torch.device("cpu"), lines.append, gather=gather)
    assert cfg.batch.chunk_size == "auto"  # the caller's config is not changed
    assert out.batch.chunk_size in (64, 128)  # local batch 128: candidates probed from 64 up
    assert [t.chunk for t in gathered[0]] == [64, 128] and all(t.samples_per_s > 0 for t in gathered[0])
    assert f"batch.chunk_size auto -> {out.batch.chunk_size} (local batch 128, torch.float32, CPU" in lines[-1]

    # a rank on which nothing fits: every rank gets the same error
    def gather_nothing_fits(mine):
        return [mine, [ChunkTiming(t.chunk, 1.0, peak_bytes=2**40, fits=False) for t in mine]]

    with pytest.raises(ConfigError, match=r"batch.chunk_size: \"auto\" found no chunk among \[1, 2, 4, 8, 16, 32, 64, 128\]"):
        resolve_auto_chunk(cfg, {}, 2, 0, torch.device("cpu"), lines.append, gather=gather_nothing_fits)
    assert resolve_auto_chunk(cfg, {}, 3, 0, torch.device("cpu"), lines.append) is cfg  # 256 / 3: left to the layout check
