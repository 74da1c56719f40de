"""The tasks' data counts in their evaluation metrics are integers and global (issue "Long runs
that survive", item 6): the CLIP task's ``bad_samples`` was this rank's count as a float, printed
next to ``bad_image`` summed over the ranks; the retrieval task's ``malformed_records`` a float."""

import json
import warnings

import pytest

from ds_infcl.data import BadSampleTally
from tests.ring.ring_harness import spawn


def _clip_task_with_counts(counts):
    from ds_infcl.tasks.clip import ClipTask

    task = object.__new__(ClipTask)  # only what evaluate() and data_report() read
    task.tally = BadSampleTally()
    for reason, n in counts.items():
        task.tally.add(reason, n)
    task.heldout_shards, task._heldout, task.damaged_caption_shards = None, None, []
    return task


def _clip_counts(rank, world, payload):
    task = _clip_task_with_counts({"bad_image": rank + 1, "missing_caption": 2 * rank})
    task._rank = rank
    return task.evaluate(None, step=1), task.data_report()


@pytest.mark.slow
def test_clip_bad_samples_are_an_integer_summed_over_the_ranks():
    results = spawn(_clip_counts, 2, None, timeout=120)
    for metrics, _ in results:
        assert metrics == {"bad_samples": 1 + 2 + 0 + 2} and type(metrics["bad_samples"]) is int, metrics
    # the same number as the sum of data_report's reasons over the ranks (what the engine logs)
    summed = {}
    for _, report in results:
        for reason, n in report.items():
            summed[reason] = summed.get(reason, 0) + n
    assert sum(summed.values()) == results[0][0]["bad_samples"]


def test_clip_bad_samples_in_one_process():
    metrics = _clip_task_with_counts({"bad_image": 2}).evaluate(None, step=1)
    assert metrics == {"bad_samples": 2} and type(metrics["bad_samples"]) is int


def test_retrieval_malformed_records_are_an_integer(tmp_path):
    from ds_infcl.tasks.base import get_task

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"query": f"q {i}", "pos": [f"p {i}"]}) + "\n" for i in range(4))
                    + "{bad json\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        task = get_task("retrieval", {"data": str(path)})
    metrics = task.evaluate(None, step=1)  # no held-out queries: the counts only
    assert metrics == {"malformed_records": 1} and type(metrics["malformed_records"]) is int
    assert task.data_report()["malformed_records"] == 1
