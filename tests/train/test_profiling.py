"""``logging.profile_step`` and ``ds_infcl.train.profiling``: the kernel split and the files."""

import json
import os

import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.profiling import kernel_category, profiled, summarize_kernels


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_NNT", "matmul"),
    ("ncclDevKernel_AllGather_RING_LL", "collective"),
    ("pytorch_flash::flash_fwd_kernel", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("_lse_fwd_kernel", "loss kernels"),
    ("triton_poi_fused_add_mul_0", "compiled (inductor)"),
    ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", "other"),
])
def test_kernel_categories(name, category):
    assert kernel_category(name) == category


def test_summary_sums_and_idle():
    s = summarize_kernels({"gemm_a": 600.0, "gemm_b": 200.0, "ncclKernel": 100.0}, wall_s=0.002)
    assert s["kernel_ms"] == pytest.approx(0.9)
    assert s["idle_fraction"] == pytest.approx(0.55)
    assert s["kernel_ms_by_category"] == {"matmul": pytest.approx(0.8), "collective": pytest.approx(0.1)}
    # kernels overlapping on two streams can exceed the wall time: idle is clipped, never negative
    assert summarize_kernels({"gemm": 5000.0}, wall_s=0.001)["idle_fraction"] == 0.0


def test_profiled_writes_files_on_cpu(tmp_path):
    x = torch.randn(64, 64)
    with profiled(str(tmp_path), "cpu step", torch.device("cpu")) as summary:
        (x @ x).sum()
    assert {"trace.json", "ops.txt", "summary.json"} <= set(os.listdir(tmp_path))
    assert "aten::mm" in (tmp_path / "ops.txt").read_text()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["label"] == "cpu step" and saved["wall_ms"] > 0 and saved["kernel_ms"] == 0.0
    assert summary["wall_ms"] == saved["wall_ms"]


def test_profile_step_outside_the_run_is_a_config_error():
    raw = {"train": {"num_steps": 3}, "batch": {"global_batch_size": 8},
           "logging": {"profile_step": 4}}
    with pytest.raises(ConfigError, match="logging.profile_step: 4 is not a step of this run"):
        run_config_from_dict(raw)


def test_a_run_profiles_the_step_it_is_told(tmp_path):
    from tests.train.harness import one_run

    out = one_run({
        "task": {"name": "synthetic"}, "batch": {"global_batch_size": 16, "grad_cache": True, "chunk_size": 8},
        "train": {"num_steps": 3}, "logging": {"progress_bar": False, "tensorboard": False, "profile_step": 2},
        "checkpoint": {"at_end": False}, "eval": {"at_end": False}, "output_dir": str(tmp_path)},
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 0}})
    assert out["steps"] == 3, out
    files = set(os.listdir(tmp_path / "profile"))
    assert {"trace.json", "ops.txt", "summary.json"} <= files
    assert json.loads((tmp_path / "profile" / "summary.json").read_text())["label"] == "step 2"
    assert "profile step 2 (rank 0): wall" in out["output"]
