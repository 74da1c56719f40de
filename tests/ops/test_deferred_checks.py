"""``deferred_value_checks``: inside the block the loss's value checks (NaN/Inf rows, a finite
scale and bias, labels in range) are queued instead of read, and ``raise_if_failed`` raises
exactly the error the same call raises outside the block. The trainer wraps every step in it so
that a step never waits for its forward on the host. Outside it, a call on one device reads its
checks once its forward is queued (``checks_read_after_launch``) (``tests/train/test_lr_schedule.py`` checks the
step named in a run; ``tests/gpu/test_step_syncs_gpu.py`` that no read is left on a GPU)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_infcl.loss import contrastive_loss, lse, siglip_loss
from ds_infcl.ops import validation
from ds_infcl.ops.validation import check_features, deferred_value_checks
from ds_infcl.tasks.base import Batch


def _features(b=6, m=None, c=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(m or b, c, generator=g), dim=1)
    return q, k


def _error_outside(fn):
    with pytest.raises(ValueError) as outside:
        fn()
    return str(outside.value)


def _nan_rows(t, rows):
    t = t.clone()
    t[rows, 0] = float("nan")
    return t


CASES = {
    "nan query rows": lambda q, k: contrastive_loss(_nan_rows(q, [1, 4]), k, 10.0),
    "inf key row": lambda q, k: contrastive_loss(q, _nan_rows(k, [0]).nan_to_num(nan=float("inf")), 10.0),
    "nan scale tensor": lambda q, k: contrastive_loss(q, k, torch.tensor(float("nan"))),
    "nan query rows, labels vouched for": lambda q, k: contrastive_loss(_nan_rows(q, [2]), k, 10.0,
                                                                         labels=torch.tensor([0, 1, 2, 3, 4, 5])),
    "siglip nan bias": lambda q, k: siglip_loss(q, k, 10.0, bias=torch.tensor(float("inf"))),
    "siglip nan query": lambda q, k: siglip_loss(_nan_rows(q, [5]), k, 10.0, bias=-10.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failed_check_is_queued_and_raises_the_same_error_later(case):
    q, k = _features()
    call = CASES[case]
    expected = _error_outside(lambda: call(q, k))
    with deferred_value_checks(labels_checked=True) as checks:
        call(q, k)  # no error inside the block: nothing was read
    assert int(checks.failed()) == 1
    with pytest.raises(ValueError) as later:
        checks.raise_if_failed()
    assert str(later.value) == expected


@pytest.mark.parametrize("labels", [[0, 1, 2, 3, 4, 6], [0, 1, 2, 3, -1, 5]])
def test_labels_not_vouched_for_are_read_at_once(labels):
    # A label out of range would index past the keys before a queued check was read.
    q, k = _features()
    call = lambda: contrastive_loss(q, k, 10.0, labels=torch.tensor(labels))  # noqa: E731
    expected = _error_outside(call)
    with deferred_value_checks() as checks:
        with pytest.raises(ValueError) as inside:
            call()
    assert str(inside.value) == expected and checks.failed() is None


def test_good_calls_queue_checks_that_pass():
    q, k = _features(b=5, m=10)
    scale = torch.tensor(12.0, requires_grad=True)
    with deferred_value_checks(labels_checked=True) as checks:
        loss = contrastive_loss(q, k, scale, labels=torch.tensor([0, 2, 4, 6, 9]))
        siglip_loss(q, k[:5], scale, bias=torch.tensor(-10.0))
    assert int(checks.failed()) == 0
    checks.raise_if_failed()  # nothing to raise
    outside = contrastive_loss(q, k, scale, labels=torch.tensor([0, 2, 4, 6, 9]))
    assert torch.equal(loss, outside)  # the checks do not change the loss


def test_the_first_failed_call_of_several_is_the_one_raised():
    q, k = _features()
    with deferred_value_checks() as checks:
        contrastive_loss(q, k, 10.0)
        check_features(q, _nan_rows(k, [2, 3]))
        contrastive_loss(_nan_rows(q, [0]), k, 10.0)
    assert int(checks.failed()) == 2
    with pytest.raises(ValueError, match=r"key has 2 of 6 rows with NaN or Inf"):
        checks.raise_if_failed()


def test_nothing_queued_outside_the_block_and_no_checks_means_none():
    q, k = _features()
    with deferred_value_checks() as checks:
        pass
    assert checks.failed() is None
    with pytest.raises(ValueError, match="query has 1 of 6 rows"):
        contrastive_loss(_nan_rows(q, [3]), k, 10.0)  # after the block: at once again


def test_a_batch_checks_its_host_labels_before_they_reach_the_device():
    # The trainer's loss reads its own label check only after the step; a task's labels out of
    # range must stop the step before a kernel indexes the keys with them.
    batch = Batch(query_inputs=torch.zeros(3, 2), key_inputs=torch.zeros(6, 2), sample_index=torch.arange(3),
                  labels=torch.tensor([0, 2, 6]), keys_per_query=2)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 6\) \(indices into the local keys\); "
                                         r"got values from 0 to 6"):
        batch.loss_kwargs(torch.device("cpu"))
    batch.labels = torch.tensor([1, 2, 5])
    assert batch.loss_kwargs(torch.device("cpu"))["labels"].tolist() == [1, 2, 5]
    assert batch.labels_known_in_range  # so the trainer may queue the loss's own label check
    batch.labels = torch.tensor([1, 2, 5], device="meta")  # a task's labels already on a device: not checked here
    assert not batch.labels_known_in_range
    assert Batch(query_inputs=torch.zeros(3, 2), key_inputs=torch.zeros(6, 2), sample_index=torch.arange(3),
                 keys_per_query=2).loss_kwargs(torch.device("cpu"))["labels"].tolist() == [0, 2, 4]


class _OpLog(TorchDispatchMode):
    """Logs the aten ops that run, with ``"read"`` where a value check is read (``_raise_for``)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops = []
        read = validation._raise_for
        monkeypatch.setattr(validation, "_raise_for", lambda got, ctx: (self.ops.append("read"), read(got, ctx)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def forwards_before_read(self):
        """The loss's forward ops (``ds_infcl::infonce_forward``, ``lse_forward``,
        ``siglip_forward``: the kernels) that ran before the checks were read."""
        assert "read" in self.ops, self.ops
        return sum(op.endswith("_forward") for op in self.ops[:self.ops.index("read")])


STANDALONE = {
    "contrastive_loss": lambda q, k, **kw: contrastive_loss(q, k, 10.0, **kw),
    "siglip_loss": lambda q, k, **kw: siglip_loss(q, k, 10.0, bias=-10.0, **kw),
    "lse": lambda q, k, **kw: lse(q, k, 10.0, exclude_positive="labels" in kw, **kw),
}


@pytest.mark.parametrize("name", sorted(STANDALONE))
def test_a_standalone_call_reads_its_checks_after_queuing_its_forward(name, monkeypatch):
    # Outside a trainer step, one device: the checks are read once the loss's forward is queued
    # (a read first would make the host wait for the GPU to drain before the loss's first kernel),
    # and the call still raises the same error before it returns.
    q, k = _features(b=7, m=7, c=8)
    call = STANDALONE[name]
    with _OpLog(monkeypatch) as log:
        call(q, k)  # good features: the read passes
    assert log.forwards_before_read() >= 1
    with _OpLog(monkeypatch) as log:
        with pytest.raises(ValueError, match=r"query has 2 of 7 rows with NaN or Inf values"):
            call(_nan_rows(q, [1, 5]), k)
    assert log.forwards_before_read() >= 1
    # Labels out of range would index past the keys: read before the forward.
    with _OpLog(monkeypatch) as log:
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 7\)"):
            call(q, k, labels=torch.tensor([0, 1, 2, 3, 4, 5, 7]))
    assert log.forwards_before_read() == 0
    # Inside a trainer step the checks stay queued to its end: no read in the call at all.
    with deferred_value_checks() as checks:
        call(_nan_rows(q, [1]), k)
    assert int(checks.failed()) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_dtype_limits_pass_and_every_kind_of_non_finite_row_counts(dtype):
    # The check reduces each row to its largest |value| and sums those in float64: the largest
    # finite values of the dtype must not read as an overflow, and NaN, +Inf and -Inf each count.
    big = torch.finfo(dtype).max
    q = torch.full((6, 8), big, dtype=dtype)
    q[:, ::2] = -big
    check_features(q, q.clone())
    q[1, 3], q[2, 0], q[4, 7] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"^query has 3 of 6 rows with NaN or Inf values"):
        check_features(q, q[:2].clone().nan_to_num())
    with deferred_value_checks() as checks:
        check_features(q[:2].clone().nan_to_num(), q)
    assert int(checks.failed()) == 1
    with pytest.raises(ValueError, match=r"^key has 3 of 6 rows with NaN or Inf values"):
        checks.raise_if_failed()
