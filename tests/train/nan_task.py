"""A plug-in task for the error tests: the synthetic task whose query tower returns NaN from its
second training call on (a diverged step, as a user would see it). Calls without gradients (the
trainer's one-off FLOP count before step 1) do not count."""

import torch
from torch import nn

from ds_infcl.tasks.synthetic import SyntheticTask


class _NanAfterFirst(nn.Module):
    def __init__(self, towers):
        super().__init__()
        self.towers = towers
        self.calls = 0

    def encode_query(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
        out = self.towers.encode_query(x)
        return out * float("nan") if self.calls > 1 else out

    def encode_key(self, x):
        return self.towers.encode_key(x)


class NanTask(SyntheticTask):
    def build_towers(self):
        return _NanAfterFirst(super().build_towers())


class ClosingNanTask(NanTask):
    """NanTask whose batch stream records whether it was closed (a loader's workers and threads
    stop in such a ``finally``), for the test that a failed step stops the loader at once."""

    closed = False

    def batches(self, **kwargs):
        try:
            yield from super().batches(**kwargs)
        finally:
            ClosingNanTask.closed = True


class _NanGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite), NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class _NanGradAfterFirst(_NanAfterFirst):
    def encode_query(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
        out = self.towers.encode_query(x)
        return _NanGradient.apply(out) if self.calls > 1 else out


class NanGradTask(SyntheticTask):
    """From its second training step on, the query tower's gradients are NaN while the loss is finite."""

    def build_towers(self):
        return _NanGradAfterFirst(super().build_towers())
