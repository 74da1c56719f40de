"""The steps in flight (``ds_infcl.train.inflight``): values read in launch order, one step late,
timed from settle to settle; the finite checks name the step; the stop vote of one rank reads the
flag when asked; on CUDA a step's time is the device's. (The GPU side, that nothing in the trainer waits for the device between steps, is
``tests/gpu/test_step_syncs_gpu.py``.)"""

import math
import time

import pytest
import torch

from ds_infcl.train.inflight import InFlight, check_finite_values
from ds_infcl.train.signals import StopOnSignal

CPU = torch.device("cpu")


def _flight():
    seen = []
    flight = InFlight(CPU, lambda launched, values, seconds: seen.append((launched.step, values, seconds, launched.extra)))
    return flight, seen


def test_steps_settle_in_launch_order_one_step_late():
    flight, seen = _flight()
    flight.start_clock()
    for step in (1, 2, 3):
        flight.stage(step, None, {"loss": torch.tensor(float(step)), "grad_norm": torch.tensor([0.5 * step])}, lr=step)
        flight.settle(keep=1)
        assert [s for s, *_ in seen] == list(range(1, step))  # the newest stays in flight
    flight.settle()
    assert [s for s, *_ in seen] == [1, 2, 3] and not flight.pending
    assert [v for _, v, _, _ in seen] == [{"loss": 1.0, "grad_norm": 0.5}, {"loss": 2.0, "grad_norm": 1.0},
                                          {"loss": 3.0, "grad_norm": 1.5}]
    assert [e["lr"] for *_, e in seen] == [1, 2, 3]


def test_on_the_cpu_a_step_settles_right_after_its_launch():
    # Nothing runs asynchronously there: a lag would time step N with step N+1's compute.
    flight, seen = _flight()
    assert flight.lag == 0
    flight.start_clock()
    flight.stage(1, None, {"loss": torch.tensor(1.0)})
    flight.settle_behind()
    assert [s for s, *_ in seen] == [1] and not flight.pending


def test_numbers_and_none_pass_through_and_tensors_are_read():
    flight, seen = _flight()
    flight.start_clock()
    flight.stage(7, None, {"loss": torch.tensor(2.5, dtype=torch.bfloat16), "grad_norm": None, "logit_scale": 1.25})
    flight.settle()
    assert seen[0][1] == {"loss": 2.5, "grad_norm": None, "logit_scale": 1.25}
    flight.stage(8, None, {"loss": 3.0, "grad_norm": None})  # nothing on a device: nothing staged
    flight.settle()
    assert seen[1][1] == {"loss": 3.0, "grad_norm": None}


def test_a_step_is_timed_from_the_settle_before_it():
    flight, seen = _flight()
    flight.start_clock()
    time.sleep(0.05)
    flight.stage(1, None, {"loss": torch.tensor(1.0)})
    flight.settle()
    time.sleep(0.02)  # after everything settled, the clock restarts at the next launch
    flight.start_clock()
    flight.stage(2, None, {"loss": torch.tensor(1.0)})
    time.sleep(0.03)
    flight.stage(3, None, {"loss": torch.tensor(1.0)})
    flight.start_clock()  # something in flight: the clock runs on
    time.sleep(0.04)
    flight.settle()
    (_, _, first, _), (_, _, second, _), (_, _, third, _) = seen
    assert first >= 0.05 and 0.03 <= second < 0.05 + 0.04 and third < 0.01


class _DeviceClock:
    """A stand-in for ``torch.cuda.Event`` on a device clock the test moves by hand (ms)."""

    now = 0.0

    def __init__(self, enable_timing=False):
        self.timing, self.at = enable_timing, None

    def record(self):
        self.at = _DeviceClock.now

    def synchronize(self):
        assert self.at is not None

    def elapsed_time(self, end):
        assert self.timing and end.timing, "elapsed_time needs events made with enable_timing=True"
        return end.at - self.at


def test_on_cuda_a_step_is_timed_by_the_device_not_by_when_the_host_reads_it(monkeypatch):
    # A step whose launch waits for the GPU (a host read inside it) is read only after the next
    # launch returned; the step after it, read at once at the end, must still get its whole time.
    monkeypatch.setattr(torch.cuda, "Event", _DeviceClock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    seen = []
    flight = InFlight(torch.device("cuda"), lambda launched, values, seconds: seen.append((launched.step, seconds)))
    assert flight.lag == 1
    _DeviceClock.now = 10.0
    flight.start_clock()
    _DeviceClock.now = 110.0  # step 1 ends on the device 100 ms later
    flight.stage(1, None, {"loss": torch.tensor(1.0)})
    flight.settle_behind()
    assert seen == []  # one step in flight
    _DeviceClock.now = 360.0  # the launch of step 2 ran to its end: 250 ms
    flight.stage(2, None, {"loss": torch.tensor(1.0), "grad_norm": None})
    flight.settle_behind()  # step 1, read late
    time.sleep(0.02)
    flight.settle()  # step 2 at once: the host clock would give it ~0
    assert [s for s, _ in seen] == [1, 2]
    assert [t for _, t in seen] == [pytest.approx(0.1), pytest.approx(0.25)]
    _DeviceClock.now = 400.0
    flight.stage(3, None, {"grad_norm": None})  # nothing to copy: still timed on the device
    flight.settle()
    assert seen[-1] == (3, pytest.approx(0.04))


@pytest.mark.parametrize("loss, norm, applied, pattern", [
    (float("nan"), 1.0, True, r"step 5: loss is nan"),
    (1.0, math.inf, True, r"step 5: the gradient norm is inf and the update was applied"),
    (1.0, math.nan, True, r"step 5: the gradient norm is nan"),
])
def test_non_finite_values_name_the_step(loss, norm, applied, pattern):
    with pytest.raises(FloatingPointError, match=pattern):
        check_finite_values(5, loss, norm, applied)


@pytest.mark.parametrize("norm, applied", [(math.inf, False), (None, True), (3.0, True)])
def test_finite_or_skipped_steps_pass(norm, applied):
    check_finite_values(5, 1.0, norm, applied)


def test_a_settle_that_raises_leaves_the_later_steps_in_flight():
    flight = InFlight(CPU, lambda launched, values, seconds: check_finite_values(launched.step, values["loss"], None, True))
    flight.start_clock()
    flight.stage(1, None, {"loss": torch.tensor(float("inf"))})
    flight.stage(2, None, {"loss": torch.tensor(1.0)})
    with pytest.raises(FloatingPointError, match="step 1"):
        flight.settle()
    assert [launched.step for launched in flight.pending] == [2]


def test_one_rank_vote_reads_the_flag_when_asked():
    stop = StopOnSignal(0, grace_s=None)
    vote = stop.vote()
    stop._mine = 15  # a signal between the vote and its read (the handler sets this)
    assert vote.agreed() and stop.signum == 15
    stop._mine = 0
    stop.signum = 0
    assert not stop.vote().agreed() and stop.signum == 0
