"""``deferred_value_checks``: inside the block the loss's value checks (NaN/Inf rows, a finite
scale and bias, labels in range) are queued instead of read, and ``raise_if_failed`` raises
exactly the error the same call raises outside the block. The trainer wraps every step in it so
that a step never waits for its forward on the host (``tests/train/test_lr_schedule.py`` checks the
step named in a run; ``tests/gpu/test_step_syncs_gpu.py`` that no read is left on a GPU)."""

import pytest
import torch

from ds_infcl.loss import contrastive_loss, siglip_loss
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
