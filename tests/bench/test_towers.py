"""``bench.towers``: kernels sorted into matrix products, attention and the rest; a clear error
without a GPU."""

from types import SimpleNamespace

import pytest
import torch

from ds_infcl.bench import towers


def test_kernel_kinds_sorts_by_name():
    events = [
        SimpleNamespace(key="nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", self_device_time_total=300.0),
        SimpleNamespace(key="sm90_xmma_gemm_bf16bf16_bf16f32", self_device_time_total=100.0),
        SimpleNamespace(key="cudnn_generated_fort_native_sdpa_sm90_flash_bprop", self_device_time_total=50.0),
        SimpleNamespace(key="void at::native::vectorized_elementwise_kernel<8>", self_device_time_total=25.0),
        SimpleNamespace(key="aten::mm", self_device_time_total=0.0),  # CPU-side op: no device time
    ]
    assert towers.kernel_kinds(events) == {"matmul": 400.0, "attention": 50.0, "other": 25.0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_needs_cuda(capsys):
    with pytest.raises(SystemExit):
        towers.main(["--chunk", "8"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
