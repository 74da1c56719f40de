"""The chunk feed of the GradCache step on CPU (issue 16): it is the identity there, yields the
chunks in order, and a step with ``copy_stream`` true equals one with it false bit for bit; the
run config's ``data.copy_stream``. The CUDA side (side stream, events, ``record_stream``) is tested
in tests/gpu/test_chunk_feed_gpu.py."""

import math

import pytest
import torch

from ds_infcl.tasks.base import Batch
from ds_infcl.tasks.synthetic import SyntheticTask
from ds_infcl.train.config import ConfigError, apply_overrides, run_config_from_dict
from ds_infcl.train.steps import ChunkFeed, copy_stream_of, grad_cache_step
from tests.train.test_steps import FakeEngine, _model

CPU = torch.device("cpu")


def _batch(b=11, kpq=2):
    g = torch.Generator().manual_seed(3)
    return Batch(
        query_inputs={"x": torch.randn(b, 5, generator=g), "ids": [torch.arange(b), torch.arange(b) * 2]},
        key_inputs=torch.randn(b * kpq, 4, generator=g),
        sample_index=torch.arange(b),
        keys_per_query=kpq,
    )


@pytest.mark.parametrize("copy_stream", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 4, 11, 20])
def test_feed_is_the_identity_on_cpu(copy_stream, chunk_size):
    batch = _batch()
    chunks = batch.chunks(chunk_size)
    feed = ChunkFeed(chunks, CPU, copy_stream)
    assert feed.stream is None and len(feed) == math.ceil(11 / chunk_size)
    got = list(feed)
    assert len(got) == len(chunks)
    for g, c in zip(got, chunks):
        assert g is c  # the very same chunks, in order: nothing copied on CPU
    # A feed can be iterated again (pass 1 and pass 3 each take their own).
    assert [len(c) for c in feed] == [len(c) for c in chunks]


def test_feed_of_no_chunks():
    assert list(ChunkFeed([], CPU)) == []


def test_copy_stream_of_needs_cuda():
    with pytest.raises(ValueError, match=r"cpu is not a CUDA device"):
        copy_stream_of(CPU)


def _config(data=None):
    raw = {"batch": {"global_batch_size": 8}, "train": {"num_steps": 1}}
    if data is not None:
        raw["data"] = data
    return run_config_from_dict(raw)


def test_copy_stream_config():
    assert _config().data.copy_stream is True
    assert _config({"copy_stream": False}).data.copy_stream is False
    assert _config({"copy_stream": True, "pin_memory": False}).data.copy_stream is True
    raw = {"batch": {"global_batch_size": 8}, "train": {"num_steps": 1}}
    assert run_config_from_dict(apply_overrides(raw, ["data.copy_stream=false"])).data.copy_stream is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"data.copy_stream: expected true/false, got "):
            _config({"copy_stream": bad})


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("chunk", [3, 5])
def test_grad_cache_step_same_with_and_without_copy_stream(chunk, dropout):
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=13, start_step=0, seed=0))
    num_chunks = math.ceil(13 / chunk)

    def run(copy_stream):
        model, _ = _model(dropout=dropout)
        engine = FakeEngine(model, num_chunks)
        torch.manual_seed(123)
        result = grad_cache_step(engine, batch, chunk, CPU, verify_replay=True, copy_stream=copy_stream)
        return result, engine, torch.rand(1)  # the RNG after the step too

    on, on_engine, on_after = run(True)
    off, off_engine, off_after = run(False)
    assert float(on.loss) == float(off.loss) and on.num_micro_steps == off.num_micro_steps == num_chunks
    assert torch.equal(on_after, off_after)
    assert set(on_engine.step_grads) == set(off_engine.step_grads) and on_engine.step_grads
    for name, g in off_engine.step_grads.items():
        assert torch.equal(on_engine.step_grads[name], g), name
