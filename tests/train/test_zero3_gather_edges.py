"""The ZeRO-3 gathered GradCache step (``batch.gather_params``) where its hooks bookkeeping meets
other engine use: evaluation through ZeRO-3's hooks between gathered steps, and a single chunk
(``gradient_accumulation_steps`` 1). Each against ZeRO-3's own per-chunk path
(``gather_params=false``) on 2 gloo ranks, SGD (an update proportional to the gradient)."""

import pytest

from tests.train import harness as h

GC = ["loss.impl=test_gather", "batch.grad_cache=true", "batch.verify_replay=true"]
EVAL = ["eval.every_steps=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("z3edges")
    jobs = []
    for gather in ("true", "false"):
        base = h.COMMON + GC + [f"batch.gather_params={gather}"]
        jobs.append(h.job(f"eval_{gather}", "zero3.json", h.SGD + ["bf16.enabled=false"],
                          base + ["batch.chunk_size=4"] + EVAL))
        jobs.append(h.job(f"one_{gather}", "zero3.json", h.SGD + ["bf16.enabled=false"],
                          base + ["batch.chunk_size=12"]))  # 24 over 2 ranks: one chunk of 12
    h.run_jobs(h.write_jobs(out, jobs), 2)
    return out


@pytest.mark.parametrize("case", ["eval", "one"])
def test_gathered_step_matches_zero3_per_chunk_path(runs, case):
    gathered, hooks = runs / f"{case}_true", runs / f"{case}_false"
    assert h.summary(gathered)["losses"] == pytest.approx(h.summary(hooks)["losses"], rel=1e-5)
    assert h.max_abs_diff(h.params(gathered), h.params(hooks)) < 2e-6
    if case == "eval":  # evaluated after every step, through ZeRO-3's hooks, with the same results
        rows = (gathered / "eval.csv").read_text().splitlines()
        assert len(rows) == 4 and rows == (hooks / "eval.csv").read_text().splitlines()
