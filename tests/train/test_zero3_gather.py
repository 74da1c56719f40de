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


def test_a_zero3_engine_without_parameter_offload_is_an_error():
    with pytest.raises(RuntimeError, match="parameter_offload"):
        zero3_gather.decide("auto", _Engine(offload=False), CPU, True)


def test_buffers_sum_chunks_and_hooks_add_them_once():
    lin = nn.Linear(3, 2)
    x1, x2, x3 = torch.randn(4, 3), torch.randn(5, 3), torch.randn(2, 3)
    buffers = zero3_gather.GradientBuffers(list(lin.parameters()))
    buffers.add(lin(x1).square().sum())
    buffers.add(lin(x2).sin().sum())
    assert lin.weight.grad is None  # autograd.grad: nothing accumulated into .grad
    with zero3_gather.added_to_gradients(buffers):
        lin(x3).cos().sum().backward()
    ref = nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    (ref(x1).square().sum() + ref(x2).sin().sum() + ref(x3).cos().sum()).backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    lin.zero_grad(set_to_none=True)
    lin(x3).cos().sum().backward()  # the hooks are gone after the context
    ref.zero_grad(set_to_none=True)
    ref(x3).cos().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


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
