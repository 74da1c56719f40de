"""The GradCache chunk feed on a CUDA GPU (issue 16; skipped without CUDA):

    python -m pytest -q -s tests/gpu/test_chunk_feed_gpu.py

``ChunkFeed`` copies chunk ``i + 1`` on a side stream while chunk ``i`` is consumed on the current
stream. Checked here against ``move_batch`` (the copy on the current stream): the chunks bit for
bit; the copies on another stream than the kernels (the stream objects, and the CUDA streams of
the memcpy and kernel records of a profiler trace); a copy that really completes while the current
stream is still busy; a GradCache-like sequence and ``grad_cache_step`` itself with the feed on
and off; a stress loop that frees and overwrites device memory between chunks, which a missing
event wait or ``record_stream`` would corrupt. (Overlap is shown, not timed: timings belong to
benchmarks.)
"""

import json
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from ds_infcl.loss import ContrastiveLoss  # noqa: E402
from ds_infcl.tasks.base import Batch  # noqa: E402
from ds_infcl.tasks.synthetic import SyntheticTask  # noqa: E402
from ds_infcl.train.model import ContrastiveModel  # noqa: E402
from ds_infcl.train.steps import ChunkFeed, copy_stream_of, grad_cache_step, move_batch  # noqa: E402
from tests.train.test_steps import FakeEngine  # noqa: E402

DEV = torch.device("cuda")


def _pinned_batch(b, dim=64, kpq=1, seed=0, device_key=False):
    """A host batch of pinned tensors of several dtypes (a nest, as the tasks hand over); with
    ``device_key`` the keys are already on the device (the clip task's ``decode: "gpu"``)."""
    g = torch.Generator().manual_seed(seed)
    query = {
        "x": torch.randn(b, dim, generator=g).pin_memory(),
        "half": torch.randn(b, 7, generator=g).to(torch.bfloat16).pin_memory(),
        "ids": [torch.randint(0, 1000, (b, 5), generator=g).pin_memory(),
                torch.randint(0, 255, (b, 3, 4), generator=g).to(torch.uint8).pin_memory()],
    }
    key = torch.randn(b * kpq, dim, generator=g)
    key = key.to(DEV) if device_key else key.pin_memory()
    return Batch(query_inputs=query, key_inputs=key, sample_index=torch.arange(b), keys_per_query=kpq)


def _leaves(batch):
    out = []

    def walk(t):
        if torch.is_tensor(t):
            out.append(t)
        elif isinstance(t, dict):
            for v in t.values():
                walk(v)
        elif isinstance(t, (list, tuple)):
            for v in t:
                walk(v)

    walk(batch.query_inputs)
    walk(batch.key_inputs)
    return out


@pytest.mark.parametrize("device_key", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, 16])
def test_feed_equals_move_batch(chunk_size, device_key):
    batch = _pinned_batch(13, kpq=2, device_key=device_key)
    chunks = batch.chunks(chunk_size)
    refs = [move_batch(c, DEV) for c in chunks]
    got = list(ChunkFeed(chunks, DEV))
    torch.cuda.synchronize()
    assert len(got) == len(refs) == math.ceil(13 / chunk_size)
    for i, (g, r, c) in enumerate(zip(got, refs, chunks)):
        for a, b, host in zip(_leaves(g), _leaves(r), _leaves(c)):
            assert a.device.type == "cuda" and a.dtype == b.dtype and a.shape == b.shape, i
            assert torch.equal(a, b), i
            if host.device.type == "cuda":
                assert a is host  # a device tensor passes through untouched
    # Host tensors that are not pinned: still correct (only not overlapped).
    plain = batch.map(lambda t: t.cpu().clone())
    for g, r in zip(ChunkFeed(plain.chunks(chunk_size), DEV), refs):
        for a, b in zip(_leaves(g), _leaves(r)):
            assert torch.equal(a, b)


def test_one_side_stream_per_device_not_the_current_one():
    feed = ChunkFeed(_pinned_batch(4).chunks(2), DEV)
    assert feed.stream is not None and feed.stream == copy_stream_of(DEV)
    assert feed.stream != torch.cuda.current_stream(DEV)
    assert ChunkFeed([], DEV).stream is feed.stream  # created once, reused by every step
    assert copy_stream_of(torch.device("cuda", torch.cuda.current_device())) is feed.stream
    assert ChunkFeed([], DEV, copy_stream=False).stream is None


def test_next_copy_completes_while_the_current_stream_is_busy():
    # Chunk 1's copy is queued before chunk 0 is handed over, so it does not wait for the work
    # queued for chunk 0: with the current stream held by a ~0.5 s sleep kernel, the side stream
    # finishes the copy while the sleep is still running.
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available")
    batch = _pinned_batch(64, dim=4096)
    torch.cuda.synchronize()  # nothing earlier left on the current stream
    feed = iter(ChunkFeed(batch.chunks(16), DEV))
    x0 = next(feed)
    torch.cuda._sleep(1_000_000_000)  # chunk 0's "compute" (cycles; ~0.5 s at ~2 GHz)
    busy = torch.cuda.Event()
    busy.record()
    copy_stream_of(DEV).synchronize()  # chunk 1's copy (and nothing queued after the sleep)
    assert not busy.query(), "the next chunk's copy waited for the current stream's kernels"
    x1 = next(feed)
    torch.cuda.synchronize()
    assert torch.equal(x0.query_inputs["x"].cpu(), batch.query_inputs["x"][:16])
    assert torch.equal(x1.query_inputs["x"].cpu(), batch.query_inputs["x"][16:32])


def _trace_streams(tmp_path, copy_stream):
    """CUDA stream ids of the host-to-device memcpy records and of the kernel records in a
    profiler trace of a feed whose chunks are each followed by a matmul."""
    from torch.profiler import ProfilerActivity, profile

    batch = _pinned_batch(32, dim=1024)
    w = torch.randn(1024, 1024, device=DEV)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for chunk in ChunkFeed(batch.chunks(8), DEV, copy_stream):
            chunk.query_inputs["x"] @ w
        torch.cuda.synchronize()
    path = tmp_path / f"trace_{copy_stream}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    memcpy = {e["args"]["stream"] for e in events
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and "stream" in e.get("args", {})}
    kernels = {e["args"]["stream"] for e in events
               if e.get("cat") == "kernel" and "stream" in e.get("args", {})}
    return memcpy, kernels


def test_profiler_memcpy_on_another_stream_than_the_kernels(tmp_path):
    memcpy, kernels = _trace_streams(tmp_path, copy_stream=False)
    if not memcpy or not kernels:
        pytest.skip("the profiler trace has no CUDA memcpy/kernel records (CUPTI unavailable)")
    assert memcpy & kernels, (memcpy, kernels)  # the control: copies on the compute stream
    memcpy, kernels = _trace_streams(tmp_path, copy_stream=True)
    assert memcpy and not (memcpy & kernels), (memcpy, kernels)
    print(f"\nmemcpy HtoD streams {sorted(memcpy)}, kernel streams {sorted(kernels)}")


def test_grad_cache_like_sequence_same_with_and_without_feed():
    # Pass 1 (no grad) and pass 3 (grad, backward per chunk) of a small two-layer model, with a
    # heavy matmul on the current stream between chunks; the compute runs on the current stream
    # either way, so features and gradients must be bit for bit equal.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(DEV)
    heavy = torch.randn(4096, 4096, device=DEV)
    g = torch.Generator().manual_seed(1)
    batch = Batch(query_inputs=torch.randn(96, 512, generator=g).pin_memory(),
                  key_inputs=torch.randn(96, 512, generator=g).pin_memory(), sample_index=torch.arange(96))
    chunks = batch.chunks(16)

    def run(copy_stream):
        model.zero_grad(set_to_none=True)
        feats, sink = [], torch.zeros((), device=DEV)
        with torch.no_grad():
            for ch in ChunkFeed(chunks, DEV, copy_stream):
                feats.append(model(ch.query_inputs) + model(ch.key_inputs))
                sink += (heavy @ heavy).mean()
        cached = torch.cat(feats)
        for i, ch in enumerate(ChunkFeed(chunks, DEV, copy_stream)):
            out = model(ch.query_inputs) + model(ch.key_inputs)
            (out * cached[i * 16 : (i + 1) * 16]).sum().backward()
            sink += (heavy @ heavy).mean()
        torch.cuda.synchronize()
        return cached, [p.grad.clone() for p in model.parameters()], sink

    on, on_grads, on_sink = run(True)
    off, off_grads, off_sink = run(False)
    assert torch.equal(on, off)
    assert torch.equal(on_sink, off_sink)
    for a, b in zip(on_grads, off_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [8, 13])
def test_grad_cache_step_same_with_and_without_copy_stream(chunk):
    # The real step on a stand-in engine (tests/train/test_steps.py): towers with dropout (the
    # CUDA RNG replay), the pure-torch loss; loss, gradients and the RNG after the step agree.
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=40, start_step=0, seed=0))
    batch = batch.map(lambda t: t.pin_memory())
    num_chunks = math.ceil(40 / chunk)

    def run(copy_stream):
        torch.manual_seed(0)
        towers = SyntheticTask(dropout=0.2).build_towers()
        model = ContrastiveModel(towers, ContrastiveLoss(symmetric=True, impl="vanilla")).to(DEV)
        engine = FakeEngine(model, num_chunks)
        torch.manual_seed(123)
        torch.cuda.manual_seed(123)
        result = grad_cache_step(engine, batch, chunk, DEV, verify_replay=True, copy_stream=copy_stream)
        after = torch.rand(3, device=DEV)
        torch.cuda.synchronize()
        return result, engine.step_grads, after

    on, on_grads, on_after = run(True)
    off, off_grads, off_after = run(False)
    assert float(on.loss) == pytest.approx(float(off.loss), rel=1e-6, abs=1e-7)
    assert torch.equal(on_after, off_after)
    assert set(on_grads) == set(off_grads) and on_grads
    for name, g in off_grads.items():
        torch.testing.assert_close(on_grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("busy", [False, True])
def test_stress_frees_and_overwrites_between_chunks(busy):
    # Large chunks (16 MiB each), read right after they are handed over (a missing event wait
    # reads a copy in flight) or after a long kernel (``busy``: the reads run late, after the feed
    # has already queued the next copies into memory the allocator may recycle); between chunks
    # the consumer frees its chunk and allocates, overwrites and frees device memory of the same
    # size. Every chunk read on the device must equal the host chunk.
    num, rows, dim = 12, 1024, 4096
    g = torch.Generator().manual_seed(5)
    host = torch.randn(num * rows, dim, generator=g).pin_memory()
    batch = Batch(query_inputs=host, key_inputs=host[:, :8].contiguous().pin_memory(),
                  sample_index=torch.arange(num * rows))
    chunks = batch.chunks(rows)
    heavy = torch.randn(2048, 2048, device=DEV)
    for rep in range(3):
        sums, copies = [], []
        for i, ch in enumerate(ChunkFeed(chunks, DEV)):
            x = ch.query_inputs
            del ch
            if busy:
                for _ in range(4):
                    heavy = torch.tanh(heavy @ heavy * 1e-3)
            copies.append((x[:: 97] * 1).cpu() if i % 3 == 0 else (x[:: 97] * 1))
            sums.append(x.double().sum())
            del x
            junk = torch.empty(rows, dim, device=DEV).fill_(float("nan"))
            junk.mul_(2.0)
            del junk
        torch.cuda.synchronize()
        for i in range(num):
            ref = host[i * rows : (i + 1) * rows]
            assert torch.equal(copies[i].cpu(), ref[:: 97]), (rep, i)
            # (float64 sums in another order: equal up to rounding; stale data would be far off)
            assert math.isclose(sums[i].item(), ref.double().sum().item(), rel_tol=1e-9, abs_tol=1e-6), (rep, i)
