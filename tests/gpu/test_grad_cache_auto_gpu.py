"""``batch.grad_cache: "auto"`` on a CUDA GPU (issue 37):

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_grad_cache_auto_gpu.py

1. The hybrid step (stand-in engine, Triton loss, dropout, fp32 and bf16 towers, SigLIP) against
   GradCache: the same loss and gradients; the first kept chunk's bytes are measured.
2. The trainer on one GPU (DeepSpeed, bf16, ZeRO-2 and ZeRO-3 with and without the gathered
   step, the CLIP benchmark's tiny towers with dropout): "auto" measures its first step, keeps
   every chunk of a tiny model (the log says so), trains as GradCache does (parameters after 3 SGD
   steps), and a memory budget below the measured peak falls back to GradCache (0 kept).
"""

import json
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.tasks.synthetic import SyntheticTask  # noqa: E402
from ds_infcl.train.steps import grad_cache_step  # noqa: E402
from tests.train import harness as h  # noqa: E402
from tests.train.test_steps import FakeEngine, _model  # noqa: E402

DEVICE = torch.device("cuda")


def _step(batch, kept, dtype, siglip):
    model, _ = _model(dropout=0.2, siglip=siglip)
    model.to(DEVICE, dtype)
    engine = FakeEngine(model, 4)
    torch.manual_seed(3)
    torch.cuda.manual_seed(3)
    result = grad_cache_step(engine, batch, 13, DEVICE, verify_replay=True, num_kept=kept)
    return result, engine


@pytest.mark.parametrize("siglip", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_equals_grad_cache_on_the_gpu(dtype, siglip):
    batch = next(SyntheticTask().batches(rank=0, world_size=1, local_batch_size=50, start_step=0, seed=0))
    batch = batch.map(lambda t: t.pin_memory())  # 4 chunks: 13, 13, 13, 11
    ref, ref_engine = _step(batch, 0, dtype, siglip)
    for kept in (1, 3, 4):
        got, engine = _step(batch, kept, dtype, siglip)
        assert got.num_kept == kept and got.kept_bytes is not None and got.kept_bytes > 0
        assert float(got.loss) == pytest.approx(float(ref.loss), rel=1e-6)
        for name, g in ref_engine.step_grads.items():
            torch.testing.assert_close(engine.step_grads[name].float(), g.float(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"kept {kept}, {name}: {m}")


CASES = {"z2": ("zero2.json", []), "z3": ("zero3.json", []), "z3_hooks": ("zero3.json", ["batch.gather_params=false"])}


def test_trainer_measures_keeps_and_matches_grad_cache(tmp_path):
    common = ["batch.global_batch_size=64", "batch.chunk_size=16", "train.num_steps=3", "logging.progress_bar=false",
              "logging.tensorboard=false", "checkpoint.at_end=false", "eval.at_end=false", "task.name=bench_clip",
              'task.args={"arch": "tiny"}']
    jobs = []
    for name, (ds, extra) in CASES.items():
        ds_set = h.SGD + ["bf16.enabled=true"]
        jobs.append(h.job(f"{name}_gc", ds, ds_set, common + extra + ["batch.grad_cache=true"]))
        jobs.append(h.job(f"{name}_auto", ds, ds_set, common + extra + ["batch.grad_cache=auto"]))
    jobs.append(h.job("z2_budget", "zero2.json", h.SGD + ["bf16.enabled=true"],
                      common + ["batch.grad_cache=auto", "batch.memory_budget_gib=0.001"]))
    path = h.write_jobs(tmp_path, jobs)
    log = h.run_jobs_on_gpu(path, timeout=900)
    print("\n".join(line for line in log.splitlines() if "grad_cache auto" in line))
    assert "batch.grad_cache auto: the first step keeps 1 of 4 chunks to measure its memory" in log
    assert "batch.grad_cache auto: 4 of 4 chunks per step keep their graph, 0 replayed from now on" in log
    assert "batch.grad_cache auto: 0 of 4 chunks per step keep their graph, 4 replayed from now on" in log
    for name in CASES:
        ref, got = tmp_path / f"{name}_gc", tmp_path / f"{name}_auto"
        assert h.summary(got)["kept_chunks"] == 4 and h.summary(ref)["kept_chunks"] == 0
        assert h.summary(got)["losses"] == pytest.approx(h.summary(ref)["losses"], rel=1e-3)
        a, b = h.params(ref), h.params(got)
        for k in a:  # bf16 modules: one rounding of the same float32 update apart at most
            torch.testing.assert_close(b[k], a[k], rtol=2e-2, atol=2e-3, msg=lambda m: f"{name} {k}: {m}")
    budget = json.loads((tmp_path / "z2_budget" / "summary.json").read_text())
    assert budget["kept_chunks"] == 0 and budget["replayed_fraction"] == 1.0
