"""``batch.chunk_size: "auto"`` under ZeRO-3 with the parameters gathered once per step
(``batch.gather_params``): the engine estimate the probe adds to its peak must include the step's
float32 gradient buffers (4 bytes a trainable parameter, in no other term: the probe's towers keep
their gradients in their own dtype), or a chunk chosen near the budget runs out of memory."""

import torch
from torch import nn

from ds_infcl.train.chunk_auto import engine_extra_bytes, gathers_params
from ds_infcl.train.config import run_config_from_dict

ZERO3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


def _cfg(gather):
    return run_config_from_dict({"batch": {"global_batch_size": 64, "grad_cache": True, "chunk_size": "auto",
                                           "gather_params": gather},
                                 "train": {"num_steps": 1}, "logging": {"tensorboard": False}})


def test_gathered_step_buffers_are_in_the_engine_estimate():
    plain = engine_extra_bytes(1000, 100, 2, 8, torch.bfloat16, ZERO3, 4)
    assert engine_extra_bytes(1000, 100, 2, 8, torch.bfloat16, ZERO3, 4, gather_params=True) == plain + 4 * 1000
    zero2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    assert engine_extra_bytes(1000, 100, 2, 8, torch.bfloat16, zero2, 4, gather_params=True) == \
        engine_extra_bytes(1000, 100, 2, 8, torch.bfloat16, zero2, 4)


def test_which_runs_gather():
    model, cpu = nn.Linear(4, 4), torch.device("cpu")
    assert gathers_params(_cfg("auto"), ZERO3, model, cpu)  # as zero3_gather.decide on CPU
    assert gathers_params(_cfg(True), ZERO3, model, cpu)
    assert not gathers_params(_cfg(False), ZERO3, model, cpu)
    assert not gathers_params(_cfg("auto"), {"zero_optimization": {"stage": 2}}, model, cpu)
    assert not gathers_params(_cfg("auto"), {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}, model, cpu)
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert not gathers_params(_cfg("auto"), nvme, model, cpu) and gathers_params(_cfg(True), nvme, model, cpu)
