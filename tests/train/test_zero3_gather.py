"""``batch.gather_params``: when the ZeRO-3 GradCache step gathers the parameters once per step.
(The step itself is checked against one process and against ZeRO-3's per-chunk path in
tests/train/test_engine_multirank.py and tests/tasks/test_retrieval.py, LoRA decoder included.)"""

import pytest
import torch
from torch import nn

from ds_infcl.errors import ConfigError
from ds_infcl.train import zero3_gather


class _Engine:
    def __init__(self, stage=3, fp16=False, offload=True):
        self.module = nn.Linear(10, 10)
        self.module.weight.requires_grad_(False)  # frozen: no float32 buffer (LoRA's base weights)
        self._stage, self._fp16 = stage, fp16
        self.optimizer = type("Opt", (), {"parameter_offload": object() if offload else None})()

    def zero_optimization_stage(self):
        return self._stage

    def fp16_enabled(self):
        return self._fp16


CPU = torch.device("cpu")


def test_gather_bytes_counts_parameters_and_trainable_buffers():
    engine = _Engine()
    # weight 100 fp32 (frozen: no buffer), bias 10 fp32 + a float32 buffer
    assert zero3_gather.gather_bytes(engine.module) == 100 * 4 + 10 * 4 + 10 * 4


@pytest.mark.parametrize("stage,grad_cache", [(2, True), (3, False), (0, True)])
def test_nothing_to_gather_outside_zero3_grad_cache(stage, grad_cache):
    on, why = zero3_gather.decide(True, _Engine(stage=stage), CPU, grad_cache)
    assert not on and "ZeRO stage 3" in why


def test_auto_true_false_and_fp16():
    assert zero3_gather.decide("auto", _Engine(), CPU, True)[0]
    assert zero3_gather.decide(True, _Engine(), CPU, True)[0]
    assert not zero3_gather.decide(False, _Engine(), CPU, True)[0]
    on, why = zero3_gather.decide("auto", _Engine(fp16=True), CPU, True)
    assert not on and "fp16" in why
    with pytest.raises(ConfigError, match="fp16"):
        zero3_gather.decide(True, _Engine(fp16=True), CPU, True)


def test_auto_keeps_zero3s_path_for_nvme_parameter_offload():
    engine = _Engine()
    engine.zero_offload_param = lambda: type("Off", (), {"device": "nvme"})()
    on, why = zero3_gather.decide("auto", engine, CPU, True)
    assert not on and "NVMe" in why
    assert zero3_gather.decide(True, engine, CPU, True)[0]  # forced: the user's call
    engine.zero_offload_param = lambda: type("Off", (), {"device": "cpu"})()
    assert zero3_gather.decide("auto", engine, CPU, True)[0]


def test_a_zero3_engine_without_parameter_offload_is_an_error():
    with pytest.raises(RuntimeError, match="parameter_offload"):
        zero3_gather.decide("auto", _Engine(offload=False), CPU, True)


def test_buffers_sum_chunks_and_the_gradients_mode_hands_them_over():
    from ds_infcl.train.model import ContrastiveModel

    class Towers(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(3, 2), nn.Linear(3, 2)
            self.k.bias.requires_grad_(False)

        def encode_query(self, x):
            return self.q(x)

        def encode_key(self, x):
            return self.k(x)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.logit_scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, q, k, **kw):
            return (self.logit_scale * q * k).sum()

    model = ContrastiveModel(Towers(), Loss())
    model.loss.logit_scale.requires_grad_(False)
    x = [torch.randn(n, 3) for n in (4, 5, 2)]
    fns = [lambda t: t.square().sum(), lambda t: t.sin().sum(), lambda t: t.cos().sum()]
    buffers = zero3_gather.GradientBuffers(list(model.parameters()))
    for xi, f in zip(x, fns):
        q, k = model("encode", xi, xi)
        buffers.add(f(q) + f(k))
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: nothing in .grad yet
    model("gradients", param_grads=buffers.sums).backward()
    ref = ContrastiveModel(Towers(), Loss())
    ref.load_state_dict(model.state_dict())
    ref.towers.k.bias.requires_grad_(False)
    ref.loss.logit_scale.requires_grad_(False)
    total = 0
    for xi, f in zip(x, fns):
        q, k = ref("encode", xi, xi)
        total = total + f(q) + f(k)
    total.backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, r.grad, msg=name)
    with pytest.raises(ValueError, match="trainable parameters"):
        model("gradients", param_grads=buffers.sums[:1])


def test_module_hooks_off_sets_aside_only_deepspeeds_hooks():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    calls = []
    ds = model[0].register_forward_pre_hook(lambda m, a: calls.append("ds"))
    user = model[0].register_forward_pre_hook(lambda m, a: calls.append("user"))
    top = model.register_forward_pre_hook(lambda m, a: calls.append("top"))

    class _Coord:
        def _clean_inflight_param_registry(self):
            calls.append("clean")

    offload = type("Off", (), {"forward_hooks": [ds], "backward_hooks": [], "fwd_pre_hook": top,
                               "get_param_coordinator": lambda self: _Coord()})()
    engine = type("E", (), {"optimizer": type("O", (), {"parameter_offload": offload})()})()
    with zero3_gather.module_hooks_off(engine):
        model(torch.randn(1, 2))
    assert calls == ["clean", "user"]
    calls.clear()
    model(torch.randn(1, 2))
    assert calls == ["top", "ds", "user"]  # restored, in their order
