"""The step protocol in one process, on a stand-in for the DeepSpeed engine (fast, no launcher):
GradCache equals the uncached step (towers with dropout, the logit scale counted once, hard
negatives, extra loss inputs), the RNG replay check, and the 1/gas scaling switched off."""

import math

import pytest
import torch
from torch import nn

from ds_infcl.loss import ContrastiveLoss, SigLIPLoss
from ds_infcl.train.model import ContrastiveModel, loss_with_params
from ds_infcl.train.steps import grad_cache_step, uncached_step
from ds_infcl.tasks.base import Batch
from ds_infcl.tasks.synthetic import SyntheticTask


class FakeEngine:
    """What the steps use of ``DeepSpeedEngine``: call, backward (with 1/gas scaling), step at the
    accumulation boundary, the boundary query. Gradients accumulate in ``.grad``; ``step`` records
    them and zeroes them, as the engine's optimizer step would."""

    def __init__(self, module, gas):
        self.module, self.gas, self.micro_steps = module, gas, 0
        self.step_grads = None
        self.backward_calls = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self):
        return self.gas

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss, scale_wrt_gas=True):
        self.backward_calls += 1
        (loss / self.gas if scale_wrt_gas else loss).backward()

    def step(self):
        if self.is_gradient_accumulation_boundary():
            self.step_grads = {n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None}
            self.module.zero_grad(set_to_none=True)
        self.micro_steps += 1


def _model(dropout=0.0, symmetric=True, seed=0, siglip=False):
    torch.manual_seed(seed)
    task = SyntheticTask(dropout=dropout)
    loss = SigLIPLoss(init_logit_bias=-2.0) if siglip else ContrastiveLoss(symmetric=symmetric, impl="infcl")
    return ContrastiveModel(task.build_towers(), loss), task


def _grads(engine_factory, batch, chunk, dropout=0.0, dtype=torch.float32, siglip=False):
    model, _ = _model(dropout, siglip=siglip)
    model.to(dtype)
    engine = engine_factory(model)
    torch.manual_seed(123)
    if chunk is None:
        result = uncached_step(engine, batch, torch.device("cpu"))
    else:
        result = grad_cache_step(engine, batch, chunk, torch.device("cpu"), verify_replay=True)
    return result, engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 7, 20])
def test_grad_cache_equals_uncached(chunk, dtype):
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=20, start_step=0, seed=0))
    ref, ref_engine = _grads(lambda m: FakeEngine(m, 1), batch, None, dtype=dtype)
    num_chunks = math.ceil(20 / chunk)
    got, engine = _grads(lambda m: FakeEngine(m, num_chunks), batch, chunk, dtype=dtype)
    assert engine.backward_calls == num_chunks and got.num_micro_steps == num_chunks
    assert float(got.loss) == pytest.approx(float(ref.loss), rel=1e-6 if dtype == torch.float32 else 1e-2)
    for name, g in ref_engine.step_grads.items():
        got_g = engine.step_grads[name].float()
        if dtype == torch.float32:
            torch.testing.assert_close(got_g, g.float(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:  # bf16 gradients (summed over up to 20 chunks in bf16 here): compare as vectors
            assert (got_g - g.float()).norm() <= 3e-2 * g.float().norm() + 1e-6, name
    # The scale's gradient is counted once per step, not once per chunk.
    assert ref_engine.step_grads["loss.logit_scale"].abs().item() > 1e-4


@pytest.mark.parametrize("chunk", [1, 7])
def test_grad_cache_equals_uncached_siglip(chunk):
    # SigLIP: the loss owns two parameters (scale and bias); GradCache carries both gradients once.
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=20, start_step=0, seed=0))
    ref, ref_engine = _grads(lambda m: FakeEngine(m, 1), batch, None, siglip=True)
    num_chunks = math.ceil(20 / chunk)
    got, engine = _grads(lambda m: FakeEngine(m, num_chunks), batch, chunk, siglip=True)
    assert float(got.loss) == pytest.approx(float(ref.loss), rel=1e-6)
    assert set(engine.step_grads) == set(ref_engine.step_grads)
    for name, g in ref_engine.step_grads.items():
        torch.testing.assert_close(engine.step_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name in ("loss.logit_scale", "loss.logit_bias"):
        assert ref_engine.step_grads[name].abs().item() > 1e-4


def test_dropout_is_replayed_exactly():
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=12, start_step=0, seed=0))
    # Chunked with dropout: equal to the uncached step only in distribution, but the replay check
    # (pass 3 features == pass 1 features) holds exactly, and the RNG continues as after pass 1.
    model, _ = _model(dropout=0.5)
    engine = FakeEngine(model, 3)
    torch.manual_seed(7)
    grad_cache_step(engine, batch, 4, torch.device("cpu"), verify_replay=True)
    after = torch.rand(1)
    torch.manual_seed(7)
    with torch.no_grad():
        for ch in batch.chunks(4):
            model("encode", ch.query_inputs, ch.key_inputs)
    assert torch.equal(after, torch.rand(1))


class _Flaky(nn.Module):
    """A tower whose output changes between calls without using torch's RNG."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 16)
        self.calls = 0

    def encode_query(self, x):
        self.calls += 1
        return self.lin(x) * (1 + 0.1 * self.calls)

    def encode_key(self, x):
        return self.lin(x)


def test_replay_mismatch_is_an_error():
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=8, start_step=0, seed=0))
    engine = FakeEngine(ContrastiveModel(_Flaky(), ContrastiveLoss()), 2)
    with pytest.raises(RuntimeError, match=r"GradCache replay mismatch in chunk 0: re-encoded query features differ"):
        grad_cache_step(engine, batch, 4, torch.device("cpu"), verify_replay=True)


def test_chunk_count_must_match_accumulation_steps():
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=8, start_step=0, seed=0))
    model, _ = _model()
    with pytest.raises(RuntimeError, match=r"2 chunks but gradient_accumulation_steps is 3"):
        grad_cache_step(FakeEngine(model, 3), batch, 4, torch.device("cpu"))


class _MaskedLoss(ContrastiveLoss):
    """A loss module with an extra input (like the retrieval loss's key ids)."""

    def forward(self, query, key, labels=None, weight=None):
        return super().forward(query, key, labels) * weight


def test_hard_negatives_and_loss_inputs():
    torch.manual_seed(0)
    task = SyntheticTask()
    towers = task.build_towers()
    g = torch.Generator().manual_seed(1)
    b, kpq = 6, 3
    batch = Batch(query_inputs=torch.randn(b, 32, generator=g), key_inputs=torch.randn(b * kpq, 32, generator=g),
                  sample_index=torch.arange(b), keys_per_query=kpq, loss_inputs={"weight": torch.tensor(0.5)})
    assert batch.resolved_labels().tolist() == [0, 3, 6, 9, 12, 15]

    def run(chunk, gas):
        model = ContrastiveModel(
            towers=_copy(towers), loss=_MaskedLoss(symmetric=False, impl="infcl"))
        engine = FakeEngine(model, gas)
        if chunk is None:
            return uncached_step(engine, batch, torch.device("cpu")), engine
        return grad_cache_step(engine, batch, chunk, torch.device("cpu"), verify_replay=True), engine

    ref, ref_engine = run(None, 1)
    got, engine = run(2, 3)
    assert float(got.loss) == pytest.approx(float(ref.loss), rel=1e-6)
    for name, grad in ref_engine.step_grads.items():
        torch.testing.assert_close(engine.step_grads[name], grad, rtol=1e-4, atol=1e-6)


def _copy(module):
    import copy

    return copy.deepcopy(module)


def test_loss_with_params_swaps_and_restores():
    loss = ContrastiveLoss()
    q, k = torch.randn(5, 8), torch.randn(5, 8)
    leaf = nn.Parameter(torch.tensor(1.0))
    value = loss_with_params(loss, {"logit_scale": leaf}, q, k, labels=None)
    (grad,) = torch.autograd.grad(value, [leaf])
    assert grad.abs() > 0 and loss.logit_scale.grad is None
    assert isinstance(loss.logit_scale, nn.Parameter) and loss.logit_scale is not leaf
    with torch.no_grad():
        loss.logit_scale.fill_(1.0)
    torch.testing.assert_close(value, loss(q, k))


def test_zero_dim_logit_scale_becomes_shape_one():
    model, _ = _model()
    assert model.loss.logit_scale.shape == (1,)
    assert model("logit_scale").item() == pytest.approx(math.log(1 / 0.07), rel=1e-6)


def test_fastclip_loss_through_both_steps():
    """FastCLIP (per-sample state, its own temperature update inside forward, sample indices from
    the batch): one GradCache step equals one uncached step, and the state is updated once."""
    from ds_infcl.train.config import LossConfig
    from ds_infcl.tasks.base import build_loss

    task = SyntheticTask(num_samples=40)
    batch = next(task.batches(rank=0, world_size=1, local_batch_size=12, start_step=3, seed=0))
    assert batch.sample_index.tolist() == list(range(36, 40)) + list(range(0, 8))
    cfg = LossConfig(impl="fastclip_v3", args={"num_samples": 40, "steps_per_epoch": 4})

    def run(chunk):
        torch.manual_seed(0)
        model = ContrastiveModel(task.build_towers(), build_loss(task, cfg))
        engine = FakeEngine(model, 1 if chunk is None else 12 // chunk)
        if chunk is None:
            result = uncached_step(engine, batch, torch.device("cpu"))
        else:
            result = grad_cache_step(engine, batch, chunk, torch.device("cpu"), verify_replay=True)
        return result, engine, model.loss

    ref, ref_engine, ref_loss = run(None)
    got, engine, loss = run(4)
    assert float(got.loss) == pytest.approx(float(ref.loss), rel=1e-5)
    assert int(loss.num_updates) == int(ref_loss.num_updates) == 1
    torch.testing.assert_close(loss.log_u1, ref_loss.log_u1)
    assert loss.temperature == pytest.approx(ref_loss.temperature, rel=1e-6)
    for name, g in ref_engine.step_grads.items():
        torch.testing.assert_close(engine.step_grads[name], g, rtol=1e-4, atol=1e-6)


def _hybrid(batch, chunk, kept, dropout=0.0, dtype=torch.float32, siglip=False):
    model, _ = _model(dropout, siglip=siglip)
    model.to(dtype)
    engine = FakeEngine(model, math.ceil(len(batch) / chunk))
    torch.manual_seed(123)
    result = grad_cache_step(engine, batch, chunk, torch.device("cpu"), verify_replay=True, num_kept=kept)
    return result, engine, torch.rand(1)  # the RNG after the step


@pytest.mark.parametrize("siglip", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kept", [1, 2, 3])
def test_kept_chunks_equal_grad_cache_exactly(kept, dtype, siglip):
    # grad_cache "auto"'s hybrid (issue 37): 20 queries in chunks of 7 (7, 7, 6), the first
    # `kept` encoded once with their graphs. Dropout: a kept chunk draws its masks once from the
    # state GradCache saves for it, so the loss, every gradient (the scale and SigLIP's bias
    # counted once) and the RNG afterwards are GradCache's, bit for bit.
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=20, start_step=0, seed=0))
    ref, ref_engine, ref_rng = _hybrid(batch, 7, 0, dropout=0.3, dtype=dtype, siglip=siglip)
    got, engine, rng = _hybrid(batch, 7, kept, dropout=0.3, dtype=dtype, siglip=siglip)
    assert (got.num_chunks, got.num_kept, got.num_micro_steps) == (3, kept, 3)
    assert got.replayed_fraction == pytest.approx((3 - kept) / 3) and ref.replayed_fraction == 1.0
    assert engine.backward_calls == 3 and float(got.loss) == float(ref.loss) and torch.equal(rng, ref_rng)
    assert set(engine.step_grads) == set(ref_engine.step_grads)
    for name, g in ref_engine.step_grads.items():
        assert torch.equal(engine.step_grads[name], g), name
    assert ref_engine.step_grads["loss.logit_scale"].abs().item() > 1e-4


def test_kept_chunks_encode_once():
    # The kept chunks' forward runs once, the replayed ones' twice.
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=12, start_step=0, seed=0))
    model, _ = _model()
    calls = []
    model.towers.query_tower.register_forward_hook(lambda m, i, o: calls.append(len(i[0])))
    grad_cache_step(FakeEngine(model, 3), batch, 4, torch.device("cpu"), num_kept=2)
    assert len(calls) == 3 + 1
    with pytest.raises(ValueError, match=r"num_kept must be in \[0, 3\]"):
        grad_cache_step(FakeEngine(model, 3), batch, 4, torch.device("cpu"), num_kept=4)


def test_kept_chunks_with_hard_negatives_and_loss_inputs():
    torch.manual_seed(0)
    towers = SyntheticTask().build_towers()
    g = torch.Generator().manual_seed(1)
    b, kpq = 7, 3
    batch = Batch(query_inputs=torch.randn(b, 32, generator=g), key_inputs=torch.randn(b * kpq, 32, generator=g),
                  sample_index=torch.arange(b), keys_per_query=kpq, loss_inputs={"weight": torch.tensor(0.5)})

    def run(kept):
        model = ContrastiveModel(towers=_copy(towers), loss=_MaskedLoss(symmetric=False, impl="infcl"))
        engine = FakeEngine(model, 4)
        return grad_cache_step(engine, batch, 2, torch.device("cpu"), num_kept=kept), engine

    ref, ref_engine = run(0)
    for kept in (1, 4):
        got, engine = run(kept)
        assert float(got.loss) == float(ref.loss)
        for name, grad in ref_engine.step_grads.items():
            assert torch.equal(engine.step_grads[name], grad), name
