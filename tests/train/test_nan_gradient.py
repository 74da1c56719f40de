"""A NaN gradient with a finite loss: DeepSpeed applies it when its own overflow check is off
(``bf16.check_grad_overflow: false`` in the shipped configs), so the trainer stops at that step,
naming it and the way out, instead of training on from broken weights. DeepSpeed computes the
global gradient norm with and without clipping (ZeRO 1-3), and reports a NaN norm as inf."""

import re

import pytest

from tests.train.harness import one_run


def _run(tmp_path, num_steps, stage, check, clipping=True):
    cfg = {
        "task": {"name": "tests.train.nan_task:NanGradTask"}, "batch": {"global_batch_size": 16},
        "train": {"num_steps": num_steps}, "logging": {"progress_bar": False, "tensorboard": False},
        "checkpoint": {"at_end": False}, "eval": {"at_end": False}, "output_dir": str(tmp_path)}
    ds = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": stage}, "bf16": {"enabled": True, "check_grad_overflow": check}}
    if clipping:
        ds["gradient_clipping"] = 1.0
    return one_run(cfg, ds)


@pytest.mark.parametrize("stage, clipping", [(1, True), (2, True), (2, False)])
def test_an_applied_nan_gradient_stops_the_run_at_its_step(tmp_path, stage, clipping):
    out = _run(tmp_path, 4, stage, check=False, clipping=clipping)
    assert out["error"] == "FloatingPointError", out
    assert re.match(r"step 2: the gradient norm is (nan|inf) and the update was applied", out["message"]), out["message"]


@pytest.mark.parametrize("stage, check", [(2, True), (3, False)])
def test_a_skipped_update_lets_the_run_go_on(tmp_path, stage, check):
    """ZeRO 1/2 with ``check_grad_overflow: true``, and ZeRO-3 whatever it says: DeepSpeed skips
    the update (and logs it); the weights are intact, nothing to stop."""
    out = _run(tmp_path, 3, stage, check)
    assert out["steps"] == 3 and out["error"] is None, out
