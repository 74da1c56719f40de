"""``batch.grad_cache: "auto"`` (issue 37): the hybrid step, whose first K chunks keep the graph
of their first forward and whose other chunks are replayed, equals GradCache on the DeepSpeed
engine: 2 CPU ranks (gloo), 3 chunks per rank, 3 SGD steps with momentum (the update is
proportional to the gradient, so equal parameters after 3 steps mean equal gradients at each),
dropout in the towers (the kept chunks draw their masks once, the replayed ones under their saved
RNG state), the learnable scale, SigLIP's scale and bias, ZeRO-2 and ZeRO-3 (its step that
gathers the parameters once, and its per-chunk path through ZeRO-3's hooks, where a kept chunk's
graph is back-propagated after the other chunks' forwards), float32 and bf16. Every run's losses
and parameters must equal GradCache's run bit for bit on CPU.
"""

import pytest

from tests.train import harness as h

pytestmark = pytest.mark.slow

DROPOUT = ['task.args={"dropout": 0.1}']
SIGLIP = ["loss.impl=siglip", "loss.init_logit_bias=-2.0"]
CHUNKS = ["batch.chunk_size=4", "batch.verify_replay=true"]  # 12 per rank: 3 chunks
HOOKS = ["batch.gather_params=false"]  # ZeRO-3's per-chunk path

# name: (DeepSpeed config, bf16, run-config settings, the kept chunks to compare with GradCache)
CASES = {
    "z2_fp32": ("zero2.json", False, DROPOUT, [0, 1, 3, None]),  # None: "auto" without keep_chunks
    "z3_fp32": ("zero3.json", False, DROPOUT, [1, 3]),
    "z3_fp32_hooks": ("zero3.json", False, DROPOUT + HOOKS, [1, 2, 3]),
    "z2_bf16": ("zero2.json", True, DROPOUT, [2]),
    "z3_bf16": ("zero3.json", True, DROPOUT, [1]),
    "z3_bf16_hooks": ("zero3.json", True, DROPOUT + HOOKS, [2]),
    "sg_z2": ("zero2.json", False, DROPOUT + SIGLIP, [1]),
    "sg_z3_hooks": ("zero3.json", False, DROPOUT + SIGLIP + HOOKS, [2]),
}


def _kept_name(case: str, kept) -> str:
    return f"{case}_auto" if kept is None else f"{case}_keep{kept}"


def _jobs():
    jobs = []
    for case, (ds, bf16, sets, kepts) in CASES.items():
        ds_set = h.SGD + [f"bf16.enabled={'true' if bf16 else 'false'}"]
        base = h.COMMON + CHUNKS + sets
        jobs.append(h.job(f"{case}_gc", ds, ds_set, base + ["batch.grad_cache=true"]))
        for kept in kepts:
            extra = [] if kept is None else [f"batch.keep_chunks={kept}"]
            jobs.append(h.job(_kept_name(case, kept), ds, ds_set, base + ["batch.grad_cache=auto"] + extra))
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grad_cache_auto")
    h.run_jobs(h.write_jobs(out, _jobs(), "two_ranks.json"), 2)
    return out


@pytest.mark.parametrize("case,kept", [(c, k) for c, (_, _, _, kepts) in CASES.items() for k in kepts])
def test_hybrid_equals_grad_cache(runs, case, kept):
    ref, got = runs / f"{case}_gc", runs / _kept_name(case, kept)
    assert h.summary(got)["losses"] == h.summary(ref)["losses"]
    ref_params, got_params = h.params(ref), h.params(got)
    assert h.max_abs_diff(ref_params, got_params) == 0.0
    # The loss parameters trained (their gradient counted once per step, as GradCache counts it).
    names = ("loss.logit_scale", "loss.logit_bias") if case.startswith("sg") else ("loss.logit_scale",)
    for name in names:
        assert name in ref_params
    s = h.summary(got)
    want = 3 if kept is None else kept  # "auto" on CPU keeps every chunk
    assert s["num_chunks"] == 3 and s["kept_chunks"] == want
    assert s["replayed_fraction"] == pytest.approx((3 - want) / 3)
    assert h.summary(ref)["kept_chunks"] == 0 and h.summary(ref)["replayed_fraction"] == 1.0


def test_auto_on_cpu_keeps_every_chunk_and_says_so(runs):
    log = (runs / "two_ranks.log").read_text()
    assert ("batch.grad_cache auto: 3 of 3 chunks per step keep their graph, 0 replayed (on cpu there is no device "
            "memory to measure; set batch.keep_chunks to bound the memory the kept graphs take)") in log
    assert "batch.grad_cache auto: 1 of 3 chunks per step keep their graph, 2 replayed (batch.keep_chunks)" in log
